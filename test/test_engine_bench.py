"""engine_bench's parts that need no real weights: its decode-rate clock, the llama.cpp log it
parses, the headline it writes, and its errors. The benchmark itself runs on real weights by hand
(docs/engines.md); its numbers are measurements, not assertions."""
from __future__ import annotations

import math

import pytest

from wisv_ros.cli import engine_bench as eb
from wisv_ros.sd.engines import load_lm

# The end of a real llama-speculative run (0.3.36 sources, this repo's build), timestamps kept.
SPEC_LOG = """\
0.07.725.854 I encoded  118 tokens in    3.667 seconds, speed:   32.178 t/s
0.07.725.868 I decoded   11 tokens in    1.459 seconds, speed:    7.539 t/s
0.07.725.874 I
0.07.725.879 I n_draft   = 4
0.07.725.885 I n_predict = 11
0.07.725.890 I n_drafted = 8
0.07.725.895 I n_accept  = 8
0.07.725.901 I accept    = 100.000%
"""


def test_the_llama_speculative_summary_is_parsed():
    assert eb.parse_speculative_log(SPEC_LOG) == {"decoded_tokens": 11, "decoded_s": 1.459, "prompt_tokens": 118,
                                                  "n_drafted": 8, "n_accept": 8}


def test_a_log_without_the_summary_is_not_a_result():
    assert eb.parse_speculative_log(SPEC_LOG.replace("n_accept", "n_acc")) is None
    assert eb.parse_speculative_log("E failed to initialize speculative decoding\n") is None


def test_sd_rates_after_the_prefill_count_every_token_but_the_first_rounds():
    target = load_lm("tiny-random:0:64", "torch", dtype="float32")
    drafter = load_lm("tiny-random:0:64:0.05", "torch", dtype="float32")
    prompts = [[1, 5, 9, 13, 2, 7], [3, 4, 8, 8, 1]]
    run = eb.sd_run(target, drafter, prompts, tokens=24, k=4)
    assert run["identical"] == 1.0  # float32 greedy SD is lossless
    assert run["aal"] > 1.0
    for key in ("sd_tokens_per_s", "sd_decode_tokens_per_s", "target_tokens_per_s", "target_decode_tokens_per_s"):
        assert run[key] > 0 and math.isfinite(run[key]), key
    again = eb.sd_run(target, drafter, prompts, tokens=24, k=2, reference=run["reference"])
    assert again["identical"] == 1.0 and math.isnan(again["target_tokens_per_s"])


def test_the_prefill_clock_skips_the_first_round():
    class Rec:
        def __init__(self, committed):
            self.committed = committed

    clock = eb._AfterPrefill()
    assert clock.tokens_and_seconds() == (0, 0.0)
    for c in (5, 3, 4):
        clock(Rec(c))
    n, sec = clock.tokens_and_seconds()
    assert n == 7 and sec >= 0


def test_headline_compares_the_best_sd_row_with_the_target_alone():
    rows = [
        {"engine": "-", "part": "bandwidth", "model": "-", "k": 0, "value": 16.0, "unit": "GB/s", "note": ""},
        {"engine": "llama_cpp", "part": "target_decode_rate", "model": "t", "k": 0, "value": 8.0, "unit": "", "note": ""},
        {"engine": "llama_cpp", "part": "decode_of_bound", "model": "t", "k": 0, "value": 0.72, "unit": "", "note": ""},
        {"engine": "llama_cpp", "part": "sd_decode_rate", "model": "p", "k": 4, "value": 10.0, "unit": "",
         "note": "min_confidence 0.6, AAL 3.50, identical 1.00, after the prompt"},
        {"engine": "llama_cpp", "part": "sd_decode_rate", "model": "p", "k": 8, "value": 9.0, "unit": "",
         "note": "min_confidence 0.0, AAL 5.00, identical 1.00, after the prompt"},
        {"engine": "llama.cpp tool", "part": "sd_decode_rate", "model": "p", "k": 4, "value": 6.0, "unit": "",
         "note": "llama-speculative, always K, acceptance 0.75, prompt tokens 118, after the prompt"},
    ]
    lines = eb.headline(rows)
    ours = next(line for line in lines if line.startswith("| llama_cpp "))
    assert "| 8.00 | 72% | 10.00 (K 4, min_confidence 0.6) | 1.25x |" in ours
    tool = next(line for line in lines if line.startswith("| llama.cpp tool "))
    assert "6.00 (K 4, llama-speculative" in tool and "0.75x" in tool


def test_missing_llama_tools_folder_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        eb.main(["--engines", "torch", "--llama-tools", str(tmp_path), "--out", str(tmp_path / "o")])
    assert "tools/build_llama_tools.sh" in capsys.readouterr().err
    assert eb.llama_tools_dir("off") is None


def test_reject_rows_sample_and_report_a_rate():
    target = load_lm("tiny-random:0:64", "torch", dtype="float32")
    drafter = load_lm("tiny-random:0:64:0.05", "torch", dtype="float32")
    run = eb.reject_run(target, drafter, [[1, 5, 9, 13, 2, 7]], tokens=24, k=4)
    assert run["decode_tokens_per_s"] > 0 and 1.0 <= run["aal"] <= 5.0
