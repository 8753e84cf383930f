"""tools/head_features.py: the feature screen's pieces (features, grouped folds, whitened PCA, models)."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from wisv_ros.eval.scoring import roc_auc

_spec = importlib.util.spec_from_file_location("head_features", Path(__file__).resolve().parents[1] / "tools" / "head_features.py")
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)


def test_features_read_the_record_and_the_token_text():
    r = {"topk": [0.6, 0.3, 0.05, 0.05], "p_draft": 0.05, "p_target": 0.6, "entropy": 0.9, "block_index": 3, "position": 250}
    f = hf.target_features(r)
    assert f[2] == pytest.approx(np.log(0.6 + 1e-6) - np.log(0.05 + 1e-6))
    assert f[6] == 2.0  # two top-8 tokens above the draft token
    assert f[7:] == [3, 2.5]
    assert hf.token_features(" 42") == [True, False, False, True, False, False]
    assert hf.token_features(" ") == [False, True, False, True, False, False]
    assert hf.token_features("+=") == [False, False, True, False, False, True]


def test_folds_keep_each_answer_in_one_fold_and_cover_all():
    groups = np.array([f"a{i // 7}" for i in range(70)], dtype=object)
    folds = hf.folds_by_group(groups, 5)
    assert sum(f.sum() for f in folds) == 70 and all(f.any() for f in folds)
    for g in np.unique(groups):
        assert sum(bool(f[groups == g].any()) for f in folds) == 1


def test_pca_whitens_the_training_rows_and_the_mlp_learns_a_signal():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(400, 20)) * np.linspace(5, 0.1, 20)).astype(np.float32)
    z = hf.pca(x, x, 4)
    assert z.shape == (400, 4)
    assert np.allclose(z.std(0), 1.0, atol=0.05) and np.abs(np.corrcoef(z.T) - np.eye(4)).max() < 0.05
    y = (x[:, 0] + 0.5 * rng.normal(size=400) > 0).astype(np.float32)
    for model in ("logistic", "mlp"):
        s = hf.fit_predict(model, x[:300], y[:300], x[300:])
        assert roc_auc(s, y[300:]) > 0.85, model
