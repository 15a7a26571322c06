"""A transformers runner's calls' KV (``Sequences``): a slot of the runner's pool where it has
one and a slot is free (``slots``), else an ordinary transformers cache; what the prefix cache
keeps of either, and a token tree's accepted path kept in place."""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from .kernels import available_memory
from .slots import SlotPool, SlotSequence, keep_cache_path, slot_shapes
from .views import ModelView

__all__ = ["Sequences"]


class Sequences:
    """The sequence side of ``ModelRunner``: the caches its calls hold and the operations the
    decoding core asks of them (``decoding.engine.Runner``)."""

    def __init__(self, view: ModelView, slots: bool) -> None:
        self.view = view
        shapes = slot_shapes(view.model.config) if slots else None
        self.pool: SlotPool | None = None
        """The pool of KV slots the calls hold; None: each call has an ordinary cache."""
        if shapes is not None and view.body is not None:
            layers, kv_heads, head_dim = shapes
            self.pool = SlotPool(
                layers,
                kv_heads,
                head_dim,
                dtype=view.dtype,
                device=view.device,
                max_bytes=_slot_budget(view.device),
            )

    def new(self) -> DynamicCache:
        """An empty cache: a slot of the pool where there is one and a slot is free, else an
        ordinary cache."""
        if self.pool is not None:
            sequence = self.pool.acquire()
            if sequence is not None:
                return sequence  # type: ignore[return-value]
        return self.view.dynamic_cache()

    def adopt(self, cache: DynamicCache) -> DynamicCache:
        """``cache`` (a kept prefix's private copy) as the kind of cache the calls use: copied
        into a slot where they hold slots."""
        if self.pool is None or not self.pool.can_hold(int(cache.get_seq_length())):
            return cache
        sequence = self.pool.acquire()
        if sequence is None:
            return cache
        self.pool.fill(sequence, cache)
        return sequence  # type: ignore[return-value]

    @staticmethod
    def kept(cache: DynamicCache, copied: bool) -> DynamicCache:
        """A slot's prefix is kept as an ordinary cache of its length (the pool's buffers stay
        the pool's), copied or not; an ordinary cache as a copy, or itself."""
        if isinstance(cache, SlotSequence):
            return cache.kept_copy()
        return copy.deepcopy(cache) if copied else cache

    @staticmethod
    def keep_path(cache: DynamicCache, start: int, path: list[int]) -> None:
        """A token tree's accepted path kept: in the slot, or by moving the cache's rows."""
        if isinstance(cache, SlotSequence):
            cache.keep_path(start, path)
        else:
            keep_cache_path(cache, start, path)


def _slot_budget(device: torch.device) -> int | None:
    """How much memory a runner's slot pool may grow to before new calls get ordinary caches:
    a quarter of what the machine has available (CUDA: half of the free device memory), None
    where that is not known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free) // 2
    available = available_memory()
    return available // 4 if available else None
