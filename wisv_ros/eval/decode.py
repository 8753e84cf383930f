"""Target decodes and the teacher-forced passes that make a replay ``Trace`` (eval.replay).

* ``decode_batch``: the target's greedy continuations of many prompts at once (Hugging Face
  ``generate`` over a left-padded batch: on a CPU a batch of 16 costs little more than one
  sequence, because decoding is bound by reading the weights).
* ``teacher_force``: one drafter pass and (with a copy probe) one target pass over
  ``prompt + continuation``: the drafter's greedy token and probability after every prefix, and the
  probe's probability at every position.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from wisv_ros.eval.replay import Trace
from wisv_ros.sd.lm import CausalLM

__all__ = ["decode_batch", "teacher_force"]


class _StopRows:
    """A ``transformers`` stopping criterion per row: a row is done once ``stop(text)`` holds for
    its new tokens (the batch ends when every row is done)."""

    def __init__(self, tokenizer, width: int, stop: Callable[[str], bool]):
        self.tokenizer, self.width, self.stop = tokenizer, width, stop

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        new = input_ids[:, self.width:]
        return torch.tensor([self.stop(self.tokenizer.decode(row, skip_special_tokens=True)) for row in new.tolist()],
                            dtype=torch.bool)


@torch.inference_mode()
def decode_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: set[int], pad_id: int,
                 stop: Callable[[str], bool] | None = None, tokenizer=None) -> list[list[int]]:
    """Greedy continuations (cut after the first end-of-sequence id) of ``prompts`` in one batch;
    with ``stop`` and ``tokenizer``, a row also ends once the text of its new tokens satisfies
    ``stop`` (the caller cuts it at the first token that does)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p))
        mask[i, width - len(p):] = 1
    from transformers import StoppingCriteriaList

    criteria = StoppingCriteriaList([_StopRows(tokenizer, width, stop)]) if stop is not None and tokenizer is not None else None
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=sorted(eos_ids), pad_token_id=pad_id, temperature=None, top_p=None, top_k=None,
                         stopping_criteria=criteria)
    conts = []
    for row in out[:, width:].tolist():
        cut = []
        for tok in row:
            cut.append(tok)
            if tok in eos_ids:
                break
        conts.append(cut)
    return conts


@torch.inference_mode()
def teacher_force(drafter: CausalLM, prompt_ids: Sequence[int], target_ids: Sequence[int], *, id: str, dataset: str,
                  eos_ids: set[int], target: CausalLM | None = None, probe=None, text: str = "",
                  chunk: int = 256) -> Trace:
    """The replay ``Trace`` of one problem: ``drafter``'s greedy token and probability after every
    prefix ``prompt + target_ids[:i]``; with ``probe`` (a ``switchsd.probe.CopyProbe``) and a
    ``target`` capturing its layer, the probe's probability at every position."""
    seq = list(prompt_ids) + list(target_ids)
    n_p, n = len(prompt_ids), len(target_ids)
    drafter.reset()
    draft_ids: list[int] = []
    draft_prob: list[float] = []
    rows_needed = n + 1  # rows n_p-1 .. n_p+n-1 predict the token after each prefix
    done = 0
    while done < len(seq):  # chunks keep the [rows, vocab] logits small
        part = seq[done:done + chunk]
        first_row = max(n_p - 1 - done, 0)
        want = len(part) - first_row if first_row < len(part) else 0
        step = drafter.feed(part, n_logits=max(want, 1))
        if want > 0:
            logits = step.logits[-want:].float()
            prob = torch.softmax(logits, dim=-1)
            p, t = prob.max(dim=-1)
            draft_ids.extend(int(x) for x in t)
            draft_prob.extend(float(x) for x in p)
        done += len(part)
    draft_ids, draft_prob = draft_ids[-rows_needed:], draft_prob[-rows_needed:]
    probe_prob: list[float] = []
    if probe is not None:
        if target is None:
            raise ValueError("teacher_force: a probe needs the target (a CausalLM capturing the probe's layer)")
        key = (probe.layer, probe.kind)
        target.reset()
        rows = []
        for start in range(0, len(seq), chunk):
            step = target.feed(seq[start:start + chunk], n_logits=1)
            rows.append(step.layers[key].float().numpy())
        probe_prob = [float(x) for x in np.atleast_1d(probe.prob(np.concatenate(rows)))]
    return Trace(id=id, dataset=dataset, prompt_ids=list(prompt_ids), target_ids=list(target_ids), draft_ids=draft_ids,
                 draft_prob=draft_prob, eos_ids=sorted(eos_ids), probe_prob=probe_prob, text=text)
