"""A causal language model with one KV cache and one explicit rollback.

Everything that speculative decoding does to a model goes through three calls:

* ``feed(ids, n_logits)``  append tokens to the cache in one forward pass; return the logits of the
  last ``n_logits`` fed positions and the hidden states of every fed position;
* ``rollback(n_keep)``     forget every cached token after the first ``n_keep``;
* ``sync(ids)``            roll back to the longest prefix the cache shares with ``ids`` and return
                           the ids that still have to be fed (always at least one, so the caller gets
                           the logits that predict the next token).

Hidden states: ``Step.hidden[j]`` is the last-layer (post final norm) hidden state at fed position j,
i.e. the state from which the logits predicting token j+1 are computed. This is the *h* of the WISV
decision head. Any decoder layer can also be captured, after its self-attention sub-layer
(``post_attn``: the residual stream entering the MLP) or after the whole layer (``post_mlp``), for the
SwitchSD copy probe.

No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

__all__ = ["CacheSync", "CausalLM", "Step", "LAYER_KINDS"]

LAYER_KINDS = ("post_attn", "post_mlp")


@dataclasses.dataclass
class Step:
    """Output of one ``feed`` call.

    logits: [n_logits, vocab] float32, for the last ``n_logits`` fed positions.
    hidden: [n_fed, d_model] float32, last-layer hidden state at every fed position.
    layers: {(layer, kind): [n_fed, d_model]} for the captured layers.
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    layers: dict[tuple[int, str], torch.Tensor]


class CacheSync:
    """``sync`` over ``cached`` and ``rollback``: shared by the engines (``CausalLM``, ``LlamaCppLM``)."""

    cached: list[int]

    def rollback(self, n_keep: int) -> None:
        raise NotImplementedError

    def pending(self, ids: Sequence[int]) -> int:
        """How many of ``ids`` a ``sync`` would leave to feed (nothing is rolled back)."""
        n = 0
        limit = min(len(self.cached), len(ids) - 1)
        while n < limit and self.cached[n] == ids[n]:
            n += 1
        return len(ids) - n

    def sync(self, ids: Sequence[int]) -> list[int]:
        """Roll back to the longest common prefix of the cache and ``ids``; return ids left to feed.

        At least one id is always left to feed (the caller needs the logits after the last id).
        """
        if not ids:
            raise ValueError("sync() needs at least one token id")
        n = 0
        limit = min(len(self.cached), len(ids) - 1)
        while n < limit and self.cached[n] == ids[n]:
            n += 1
        self.rollback(n)
        return list(ids[n:])

    def prefill(self, ids: Sequence[int]) -> None:
        """Append ``ids`` to the cache when nothing of their pass is needed but the cache (a
        context fed ahead of its block). Engines that can skip the outputs do (``LlamaCppLM``)."""
        self.feed(list(ids), n_logits=1)


class CausalLM(CacheSync):
    """Wraps a Hugging Face causal LM (Llama, Qwen2, Gemma3 ...) with a KV cache and rollback.

    Args:
        model: a ``transformers`` ``*ForCausalLM`` in eval mode.
        tokenizer: its tokenizer (None for tiny random test models).
        capture: decoder layers to capture, as (layer index, kind) with kind in LAYER_KINDS.
    """

    def __init__(self, model, tokenizer=None, capture: Sequence[tuple[int, str]] = ()):
        self.model = model
        self.tokenizer = tokenizer
        self.cached: list[int] = []  # token ids whose keys/values are in the cache, in order
        self.forward_passes = 0
        self._captured: dict[tuple[int, str], torch.Tensor] = {}
        self._last_hidden: torch.Tensor | None = None
        self.capture = tuple(capture)
        base = model.model
        base.norm.register_forward_hook(self._hook_last_hidden)
        for layer, kind in self.capture:
            self._register_capture(base, layer, kind)
        self._new_cache()

    # ------------------------------------------------------------------ properties
    @property
    def hidden_size(self) -> int:
        return int(self.model.config.get_text_config().hidden_size)

    @property
    def vocab_size(self) -> int:
        """Width of the logits (may exceed the tokenizer's length: padded embedding tables)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers)

    def eos_ids(self) -> set[int]:
        """Token ids that end generation (generation config, model config and tokenizer)."""
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is None:
                continue
            ids.update([eos] if isinstance(eos, int) else list(eos))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # ------------------------------------------------------------------ cache
    def _new_cache(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        for layer in getattr(self.cache, "layers", []):
            # Sliding-window layers (Gemma 3) drop old states unless asked to keep them until the
            # next crop; rollback needs them.
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        self.cached = []

    def reset(self) -> None:
        """Forget everything (empty cache)."""
        self._new_cache()

    def _max_rollback(self) -> int:
        """How many tokens the cache can still remove (sliding-window layers keep a bounded past)."""
        limit = len(self.cached)
        for layer in getattr(self.cache, "layers", []):
            if getattr(layer, "is_sliding", False) and getattr(layer, "keys", None) is not None:
                window = layer.sliding_window
                if layer.cumulative_length >= window:
                    limit = min(limit, layer.keys.shape[-2] - (window - 1))
        return limit

    def rollback(self, n_keep: int) -> None:
        """Keep the first ``n_keep`` cached tokens and forget the rest (the one rollback of the project)."""
        if not 0 <= n_keep <= len(self.cached):
            raise ValueError(f"rollback(n_keep={n_keep}) outside [0, {len(self.cached)}]")
        if not self.cached:
            return  # empty cache (some cache layers fail on crop before their first update)
        n_remove = len(self.cached) - n_keep
        if n_remove > self._max_rollback():
            # A sliding-window cache forgot the states needed to go back that far: rebuild.
            keep = self.cached[:n_keep]
            self._new_cache()
            if keep:
                self.feed(keep, n_logits=1)
            return
        self.cache.crop(-n_remove)  # crop(0) also trims sliding-window layers back to the window
        del self.cached[n_keep:]

    # ------------------------------------------------------------------ forward
    def _hook_last_hidden(self, _module, _inputs, output) -> None:
        self._last_hidden = output[0] if isinstance(output, tuple) else output

    def _register_capture(self, base, layer: int, kind: str) -> None:
        if kind not in LAYER_KINDS:
            raise ValueError(f"capture kind '{kind}' is not one of {LAYER_KINDS}")
        if not 0 <= layer < len(base.layers):
            raise ValueError(f"capture layer {layer} outside [0, {len(base.layers) - 1}]")
        block = base.layers[layer]
        key = (layer, kind)
        if kind == "post_mlp":
            def hook(_m, _i, output):
                self._captured[key] = output[0] if isinstance(output, tuple) else output

            block.register_forward_hook(hook)
            return
        # post_attn: the residual stream after self-attention = the input of the MLP's pre-norm.
        # Llama/Qwen2: post_attention_layernorm; Gemma 3 normalises the attention output with
        # post_attention_layernorm *before* the residual add and has pre_feedforward_layernorm.
        norm = getattr(block, "pre_feedforward_layernorm", None) or block.post_attention_layernorm

        def pre_hook(_m, inputs):
            self._captured[key] = inputs[0]

        norm.register_forward_pre_hook(pre_hook)

    @torch.inference_mode()
    def feed(self, ids: Sequence[int], n_logits: int = 1, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None) -> Step:
        """Append ``ids`` to the cache in one forward pass.

        Returns logits [n_logits, V] for the last ``n_logits`` positions and hidden states of every
        fed position. ``attention_mask`` [1, 1, n, cached + n] (bool, True = attend) and
        ``position_ids`` [1, n] replace the causal mask and positions (tree verification).
        """
        if not ids:
            raise ValueError("feed() needs at least one token id")
        n_logits = max(1, min(n_logits, len(ids)))
        input_ids = torch.tensor([list(ids)], dtype=torch.long)
        self._captured.clear()
        out = self.model(
            input_ids=input_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=n_logits,
            **({"attention_mask": attention_mask} if attention_mask is not None else {}),
            **({"position_ids": position_ids} if position_ids is not None else {}),
        )
        self.cache = out.past_key_values
        self.cached.extend(int(i) for i in ids)
        self.forward_passes += 1
        return Step(
            logits=out.logits[0, -n_logits:].float(),
            hidden=self._last_hidden[0].float(),
            layers={k: v[0].float() for k, v in self._captured.items()},
        )
