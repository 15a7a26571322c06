"""The runner's token-tree forwards: the tree's rows after a call's cache (or its slot), each
at its depth's position, seeing the cache and its own ancestors (``decoding.tree.tree_mask``)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from ...decoding.engine import to_device, token_rows
from ...decoding.proposal import row_depths
from ...decoding.tree import tree_mask
from .slots import SlotBatch, SlotSequence
from .state import RunnerState

__all__ = ["TreeForwards"]


class TreeForwards(RunnerState):
    """``ModelRunner``'s token-tree forwards (a part of it: ``state.RunnerState``)."""

    def _tree_forward(
        self, input_ids: list[int], cache: DynamicCache, parents: list[int]
    ) -> torch.Tensor:
        if len(parents) != len(input_ids):
            raise ValueError(f"a tree of {len(input_ids)} rows needs as many parents")
        if isinstance(cache, SlotSequence):
            return self._slot_tree_forward(input_ids, cache, parents)
        length = int(cache.get_seq_length())
        width = length + len(input_ids)
        implementation = getattr(self.model.config, "_attn_implementation", None) or "eager"
        dtype = self._dtype if implementation == "eager" else None  # eager adds; sdpa selects
        mask = tree_mask(parents, length, dtype, width)
        depths = row_depths(parents)
        kwargs: dict[str, Any] = {
            self._cache_kw: cache,
            "use_cache": True,
            "attention_mask": to_device(mask, self.device),
            "position_ids": to_device([[length + d for d in depths]], self.device),
            "cache_position": torch.arange(length, length + len(input_ids), device=self.device),
        }
        ids = token_rows([input_ids], len(input_ids), self.device)
        return self._finished(self.model(input_ids=ids, **kwargs).logits[0])

    def _slot_tree_forward(
        self, input_ids: list[int], cache: SlotSequence, parents: list[int]
    ) -> torch.Tensor:
        """A token tree after a slot: its rows written at the slot's next positions, each at
        its depth's position for the rotary embedding, seeing the slot's positions and its own
        ancestors (``tree.tree_mask``); ``SlotSequence.keep_path`` keeps the accepted path."""
        assert self._pool is not None
        length, rows = cache.length, len(input_ids)
        with self._pool.lock:  # no reallocation by another thread under this forward
            batch = SlotBatch(self._pool, [cache], rows)
            mask_dtype = self._mask_dtype()
            mask = tree_mask(parents, length, None if isinstance(mask_dtype, str) else mask_dtype)
            depths = row_depths(parents)
            kwargs: dict[str, Any] = {
                self._cache_kw: batch,
                "use_cache": True,
                "attention_mask": to_device(mask, self.device),
                "position_ids": to_device([[length + d for d in depths]], self.device),
            }
            ids = token_rows([input_ids], rows, self.device)
            logits = self.model(input_ids=ids, **kwargs).logits[0]
            cache.length += rows
        return self._finished(logits)
