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


def test_window_features_read_the_fly_window_and_refuse_searched_records():
    r = {"uid": "p:0", "agree_after": 9, "left": 20}
    assert hf.window_features(r) == [6, 1.0, 1.0]  # capped at the FLy window
    assert hf.window_features({**r, "agree_after": 1, "left": 3}) == [1, pytest.approx(1 / 3), 0.0]
    assert hf.window_features({**r, "agree_after": 2, "left": 2}) == [2, 1.0, 1.0]  # the block's end
    assert hf.window_features({**r, "agree_after": 0, "left": 0}) == [0, 0.0, 1.0]  # last token of a block
    with pytest.raises(ValueError, match="p:0: no agree_after"):
        hf.window_features({**r, "agree_after": None})


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


def test_after_states_are_the_target_state_after_the_draft_token():
    """Real weights (llama.cpp, Qwen2.5-Coder-0.5B): each record's state is the last row of a fresh
    feed of prompt + text[:position] + [draft token], whatever the records' order, for a searched
    path and for the target's own answer."""
    from wisv_ros.sd.llama_cpp_lm import LlamaCppLM

    with LlamaCppLM.from_gguf("qwen2.5-coder-0.5b-instruct", n_ctx=2048, threads=1, n_seq_max=2, n_sessions=2) as lm:
        ids = lm.tokenizer.encode("Tom has 3 apples and buys 4 more. How many apples does he have? He has 7 apples.")
        prompt, text = ids[:6], ids[6:]
        problems = {"p": {"prompt_ids": prompt, "generated_ids": text, "path_ids": text[:9] + [11] + text[10:]}}
        records = [{"uid": "p:1", "problem_id": "p", "position": 12, "draft_id": 17},
                   {"uid": "p:0", "problem_id": "p", "position": 3, "draft_id": 16},
                   {"uid": "p:2", "problem_id": "p", "position": 12, "draft_id": 18}]
        for searched in (False, True):
            got = hf.after_states(records, problems, lm, searched)
            answer = problems["p"]["path_ids" if searched else "generated_ids"]
            lm.use(1)
            for i, r in enumerate(records):
                lm.drop(1)
                want = lm.feed(prompt + answer[:r["position"]] + [r["draft_id"]], n_logits=1).hidden[-1].numpy()
                cos = float(got[i].astype(np.float32) @ want / np.linalg.norm(got[i].astype(np.float32)) / np.linalg.norm(want))
                assert cos > 0.999, (searched, r["uid"], cos)
            assert not np.allclose(got[0], got[2], atol=1e-2)  # another draft token, another state
        with pytest.raises(ValueError, match="past its answer"):
            hf.after_states([{"uid": "p:9", "problem_id": "p", "position": 99, "draft_id": 1}], problems, lm, False)


def test_down_states_are_the_target_state_down_its_own_continuation_of_the_swap():
    """Real weights (llama.cpp, Qwen2.5-Coder-0.5B): offset o's state is the last row of a fresh feed of
    prompt + text[:position] + [draft token] + the first o tokens of the target's greedy continuation
    from there (one-token decodes), for every record of the answer decoded side by side; offset 0 is
    ``after_states``."""
    from wisv_ros.sd.llama_cpp_lm import LlamaCppLM

    with LlamaCppLM.from_gguf("qwen2.5-coder-0.5b-instruct", n_ctx=2048, threads=1, n_seq_max=4, n_sessions=2) as lm:
        ids = lm.tokenizer.encode("Tom has 3 apples and buys 4 more. How many apples does he have? He has 7 apples.")
        prompt, text = ids[:6], ids[6:]
        problems = {"p": {"prompt_ids": prompt, "generated_ids": text, "path_ids": text}}
        records = [{"uid": "p:1", "problem_id": "p", "position": 12, "draft_id": 17},
                   {"uid": "p:0", "problem_id": "p", "position": 3, "draft_id": 16},
                   {"uid": "p:2", "problem_id": "p", "position": 12, "draft_id": 18}]
        offsets = (0, 3)
        got = hf.down_states(records, problems, lm, False, offsets=offsets, slots=2)
        assert got.shape == (3, 2, lm.hidden_size)
        after = hf.after_states(records, problems, lm, False)
        lm.use(1)
        for i, r in enumerate(records):
            context = prompt + text[:r["position"]] + [r["draft_id"]]
            lm.drop(1)
            cont = []
            for _ in range(max(offsets)):
                cont.append(int(lm.feed(context[len(lm.cached):] if not cont else cont[-1:], n_logits=1).logits[-1].argmax()))
            for k, o in enumerate(offsets):
                lm.drop(1)
                want = lm.feed(context + cont[:o], n_logits=1).hidden[-1].numpy()
                g = got[i, k].astype(np.float32)
                cos = float(g @ want / np.linalg.norm(g) / np.linalg.norm(want))
                assert cos > 0.999, (r["uid"], o, cos)
            a = after[i].astype(np.float32)
            assert float(a @ got[i, 0].astype(np.float32) / np.linalg.norm(a) / np.linalg.norm(got[i, 0].astype(np.float32))) > 0.999
        assert not np.allclose(got[0, 1], got[0, 0], atol=1e-2)  # three tokens on, another state
        with pytest.raises(ValueError, match="past its answer"):
            hf.down_states([{"uid": "p:9", "problem_id": "p", "position": 99, "draft_id": 1}], problems, lm, False, slots=2)
