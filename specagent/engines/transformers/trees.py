"""Token-tree forwards: the tree's rows after a call's cache (or its slot), each at its depth's
position, seeing the cache and its own ancestors (``decoding.tree.tree_mask``)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from ...decoding.engine import to_device, token_rows
from ...decoding.proposal import row_depths
from ...decoding.tree import tree_mask
from .slots import SlotBatch, SlotSequence
from .views import ModelView

__all__ = ["tree_forward"]


def tree_forward(
    view: ModelView, input_ids: list[int], cache: DynamicCache, parents: list[int]
) -> torch.Tensor:
    """Logits of every row of the tree ``input_ids`` (``parents``: each row's parent row, -1
    for the root) fed after ``cache``, unfinished (``ModelView.finished``)."""
    if len(parents) != len(input_ids):
        raise ValueError(f"a tree of {len(input_ids)} rows needs as many parents")
    if isinstance(cache, SlotSequence):
        return _slot_tree_forward(view, input_ids, cache, parents)
    length = int(cache.get_seq_length())
    width = length + len(input_ids)
    mask_dtype = view.mask_dtype
    mask = tree_mask(parents, length, None if isinstance(mask_dtype, str) else mask_dtype, width)
    depths = row_depths(parents)
    kwargs: dict[str, Any] = {
        view.cache_kw: cache,
        "use_cache": True,
        "attention_mask": to_device(mask, view.device),
        "position_ids": to_device([[length + d for d in depths]], view.device),
        "cache_position": torch.arange(length, length + len(input_ids), device=view.device),
    }
    ids = token_rows([input_ids], len(input_ids), view.device)
    return view.model(input_ids=ids, **kwargs).logits[0]


def _slot_tree_forward(
    view: ModelView, input_ids: list[int], cache: SlotSequence, parents: list[int]
) -> torch.Tensor:
    """A token tree after a slot: its rows written at the slot's next positions, each at its
    depth's position for the rotary embedding, seeing the slot's positions and its own
    ancestors (``tree.tree_mask``); ``SlotSequence.keep_path`` keeps the accepted path."""
    pool = cache.pool
    length, rows = cache.length, len(input_ids)
    with pool.lock:  # no reallocation by another thread under this forward
        batch = SlotBatch(pool, [cache], rows)
        mask_dtype = view.mask_dtype
        mask = tree_mask(parents, length, None if isinstance(mask_dtype, str) else mask_dtype)
        depths = row_depths(parents)
        kwargs: dict[str, Any] = {
            view.cache_kw: batch,
            "use_cache": True,
            "attention_mask": to_device(mask, view.device),
            "position_ids": to_device([[length + d for d in depths]], view.device),
        }
        ids = token_rows([input_ids], rows, view.device)
        logits = view.model(input_ids=ids, **kwargs).logits[0]
        cache.length += rows
    return logits
