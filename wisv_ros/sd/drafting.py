"""The robot half of speculative decoding: the drafter proposes a block of K tokens.

``Drafter.draft(k)`` proposes a ``DraftBlock`` of K tokens after the committed prefix, in the
*target* vocabulary, with the drafter hidden state that proposed each token;
``Drafter.commit(committed_ids)`` appends what the edge committed, and the drafter's cache catches up
lazily on its next forward pass.

Pairs with one tokenizer draft directly in the shared vocabulary. Pairs with different tokenizers
are aligned through text, as universal assisted generation does: the drafter continues its own
tokenisation of the committed text, its new text is re-tokenised with the target tokenizer, and each
target draft token gets the hidden state of the drafter token that covers its first character.

No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np
import torch

from wisv_ros.sd.acceptance import softmax_t
from wisv_ros.sd.lm import CausalLM

__all__ = ["DraftBlock", "Drafter", "encode_prompt", "pick_token", "same_vocabulary"]


@dataclasses.dataclass
class DraftBlock:
    """What the robot uploads each round.

    token_ids: K draft ids in the target vocabulary.
    hidden:    [K, d_drafter] float32, the drafter hidden state that proposed each draft token
               (aligned by character span for cross-tokenizer pairs).
    probs:     [K, V] the drafter's sampling distribution (rejection sampling only).
    prefix_length: committed target tokens before the block (prompt included).
    """

    token_ids: list[int]
    hidden: np.ndarray | None
    probs: torch.Tensor | None
    prefix_length: int
    draft_time_s: float = 0.0
    caught_up: int = 0  # committed tokens the drafter fed before drafting (its prompt, tokens made elsewhere)


def same_vocabulary(drafter_tok, target_tok) -> bool:
    """True when the two tokenizers map text to the same ids (drafting needs no text alignment)."""
    if drafter_tok is None or target_tok is None:
        return drafter_tok is None and target_tok is None
    return drafter_tok.get_vocab() == target_tok.get_vocab()


def encode_prompt(tokenizer, prompt: str | list[dict] | Sequence[int], chat: bool = True) -> list[int]:
    """Token ids of a prompt for one model.

    prompt: text, chat messages (``[{"role": "user", "content": ...}]``), or ids (used as they are).
    chat:   with text, wrap it as one user message and apply the model's chat template if it has one.
    Each side of a cross-tokenizer pair encodes the prompt with its own tokenizer and template.
    """
    if isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], (int, np.integer))):
        return [int(i) for i in prompt]
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; tiny random models take a list of ids")
    if isinstance(prompt, str) and not (chat and tokenizer.chat_template):
        ids = tokenizer(prompt, add_special_tokens=True).input_ids
        return [int(i) for i in ids]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if not tokenizer.chat_template:
        text = "\n".join(m["content"] for m in messages)
        return [int(i) for i in tokenizer(text, add_special_tokens=True).input_ids]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(i) for i in out]


def pick_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """Greedy (temperature 0) or sampled next token; returns (id, sampling distribution or None)."""
    if temperature <= 0:
        return int(logits.argmax()), None
    probs = softmax_t(logits, temperature)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


def _decode_tail(tok, context: Sequence[int], new: Sequence[int]) -> tuple[str, list[int]]:
    """Text of ``new`` ids continuing ``context`` and the end offset (in chars) of each new token.

    Decoding a few context tokens along with the new ones keeps leading spaces and multi-byte
    characters right. A trailing incomplete character (U+FFFD) is dropped.
    """
    window = list(context[-4:])
    head = tok.decode(window, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    ends = []
    text = ""
    for j in range(1, len(new) + 1):
        full = tok.decode(window + list(new[:j]), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        text = full[len(head):] if full.startswith(head) else tok.decode(list(new[:j]), skip_special_tokens=False)
        ends.append(len(text))
    stripped = text.rstrip("\ufffd")
    return stripped, [min(e, len(stripped)) for e in ends]


class Drafter:
    """The robot half: the drafter model, its cache and the committed prefix.

    Args:
        lm: the drafter.
        target_tokenizer: the target's tokenizer, for cross-tokenizer pairs (None when both models
            share one vocabulary).
        temperature: 0 drafts greedily; > 0 samples (rejection sampling needs the distributions).
        seed: seeds the drafter's sampling.
        min_confidence: end the block early after a token whose drafter probability is below this
            (0 = always draft K). Unsure tokens are rarely accepted, and each costs a drafter step.
    """

    def __init__(self, lm: CausalLM, target_tokenizer=None, temperature: float = 0.0, seed: int = 0,
                 min_confidence: float = 0.0):
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.lm = lm
        self.min_confidence = min_confidence
        self.target_tokenizer = target_tokenizer
        self.cross = target_tokenizer is not None and not same_vocabulary(lm.tokenizer, target_tokenizer)
        self.temperature = temperature
        self.generator = torch.Generator().manual_seed(seed)
        self.prompt_ids: list[int] = []  # drafter's own encoding of the prompt
        self.committed: list[int] = []  # target ids committed after the prompt
        self.target_prefix_length = 0  # committed target tokens, prompt included
        self._eos = lm.eos_ids()
        self._target_eos = None
        if self.cross:
            self._target_eos = target_tokenizer.eos_token_id

    def begin(self, prompt_ids: Sequence[int], target_prompt_length: int) -> None:
        """Start a request: ``prompt_ids`` in the drafter's vocabulary; the target's prompt length."""
        self.prompt_ids = list(prompt_ids)
        self.committed = []
        self.target_prefix_length = target_prompt_length

    def context_ids(self) -> list[int]:
        """The drafter-vocabulary ids of prompt + committed text."""
        if not self.cross:
            return self.prompt_ids + self.committed
        text = self.target_tokenizer.decode(self.committed, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        ids = self.lm.tokenizer(text, add_special_tokens=False).input_ids if text else []
        return self.prompt_ids + [int(i) for i in ids]

    def commit(self, committed_ids: Sequence[int]) -> None:
        """Append the tokens the edge committed this round (draft prefix + correction/bonus)."""
        self.committed.extend(int(i) for i in committed_ids)
        self.target_prefix_length += len(committed_ids)

    def draft(self, k: int) -> DraftBlock:
        """Propose K tokens (fewer if the drafter ends the answer) after the committed prefix."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        t0 = time.perf_counter()
        context = self.context_ids()
        todo = self.lm.sync(context)
        caught_up = len(todo) - 1  # the last committed token is fed with the first draft step in any case
        ids: list[int] = []
        hiddens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        # Cross-tokenizer: a couple of extra drafter tokens, since the two tokenisations of the same
        # text rarely have the same length.
        budget = k if not self.cross else k + 2
        while len(ids) < budget:
            step = self.lm.feed(todo, n_logits=1)
            tok, p = pick_token(step.logits[-1], self.temperature, self.generator)
            ids.append(tok)
            hiddens.append(step.hidden[-1])
            if p is not None:
                probs.append(p)
            todo = [tok]
            if tok in self._eos:
                break
            if self.min_confidence > 0:
                conf = float((p if p is not None else torch.softmax(step.logits[-1], -1))[tok])
                if conf < self.min_confidence:
                    break
            if self.cross:
                # Enough drafter text when it re-tokenises into more than K target tokens: the first
                # K of them are then complete.
                text, _ = _decode_tail(self.lm.tokenizer, context, ids)
                if len(self.target_tokenizer(text, add_special_tokens=False).input_ids) > k:
                    break
        if not self.cross:
            block_ids, hidden = ids, torch.stack(hiddens)
        else:
            block_ids, hidden = self._to_target(context, ids, hiddens, k)
        return DraftBlock(
            token_ids=block_ids,
            hidden=hidden.numpy().astype(np.float32, copy=False) if len(block_ids) else np.zeros((0, self.lm.hidden_size), np.float32),
            probs=torch.stack(probs) if probs else None,
            prefix_length=self.target_prefix_length,
            draft_time_s=time.perf_counter() - t0,
            caught_up=caught_up,
        )

    def _to_target(self, context, ids, hiddens, k) -> tuple[list[int], torch.Tensor]:
        """Re-tokenise drafter ids into target ids; align hidden states by character span."""
        ended = ids[-1] in self._eos
        body = ids[:-1] if ended else ids
        text, ends = _decode_tail(self.lm.tokenizer, context, body)
        enc = self.target_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True) if text else None
        t_ids = [int(i) for i in enc.input_ids] if enc is not None else []
        starts = [s for s, _ in enc.offset_mapping] if enc is not None else []
        out_ids, out_h = [], []
        for tid, start in zip(t_ids, starts):
            if len(out_ids) == k:
                break
            j = next((j for j, e in enumerate(ends) if e > start), len(ends) - 1)
            out_ids.append(tid)
            out_h.append(hiddens[max(j, 0)])
        if ended and len(out_ids) < k and self._target_eos is not None:
            out_ids.append(int(self._target_eos))
            out_h.append(hiddens[-1])
        if not out_ids:
            return [], torch.zeros((0, self.lm.hidden_size))
        return out_ids, torch.stack(out_h)
