"""A pool of KV slots: one preallocated key and value buffer per layer for N calls x L positions,
each call holding a slot, so that a batched round reads and writes every call's KV where it lies.

Why: with one transformers ``DynamicCache`` per call, a batched round had to copy every call's
whole KV into a fresh left-padded batch cache and the new slice back, O(context x calls) bytes
per step before any model work (16 calls at 2,048 tokens: 15-33x the per-token cost of
transformers' own static-cache batched ``generate`` on a small model). Here:

- a call's KV is a ``SlotSequence``: a slot of the pool and how many positions it holds;
  rolling back rejected drafts moves that length back (the stale positions are overwritten
  later and never attended meanwhile);
- a forward over several calls builds a ``SlotBatch`` (a transformers ``Cache`` over the pool):
  each layer writes each row's new keys and values at that row's own positions (calls in one
  batch are at different lengths) and hands attention the pool's rows for the batch up to the
  longest row: a view when the batch's slots are consecutive, a gather otherwise. The runner
  passes a per-row attention mask and per-row positions, so every row attends only to its own
  positions;
- the pool grows (more slots, more positions) by reallocation when a call needs it, never
  past ``max_bytes`` (slots x capacity x bytes per position): a call that would widen every
  slot past it moves its KV into an ordinary cache of its own instead (``SlotSequence.spill``)
  and goes on there, and a new call that finds no free slot within it gets an ordinary cache.
  A reallocation builds every new buffer before it swaps any: one that fails (out of memory)
  leaves the pool as it was and fails only the forward that asked. A slot goes back to the
  pool when its sequence is dropped, and the lowest free slot is taken next, so concurrent
  calls keep to the pool's first rows.

Kept prefixes (the prefix cache) are ordinary ``DynamicCache`` copies of a slot's first
positions (``SlotSequence.kept_copy``); a call starting from one gets a slot filled from it
(``SlotPool.fill``). Through transformers' own extension points (a ``Cache`` subclass and a 4D
mask), so every decoder-only model with plain full-attention layers runs on it unchanged.
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from ...decoding.engine import crop_to, cropped_length, to_device

__all__ = [
    "PoolFull",
    "PoolLayer",
    "SlotBatch",
    "SlotPool",
    "SlotSequence",
    "keep_cache_path",
    "slot_shapes",
]


def slot_shapes(config: Any) -> tuple[int, int, int] | None:
    """``(layers, kv_heads, head_dim)`` of a model whose layers are all plain full attention
    (the only kind a slot holds), else None (sliding windows, linear attention, MLA)."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not (isinstance(layers, int) and isinstance(heads, int) and isinstance(hidden, int)):
        return None
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and any(kind != "full_attention" for kind in kinds):
        return None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return layers, int(kv_heads), int(head_dim)


class SlotPool:
    """The KV of up to ``slots`` calls of ``capacity`` positions each, per layer
    ``[slots, kv_heads, capacity, head_dim]``; both grow on demand (by doubling)."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 4,
        capacity: int = 256,
        max_bytes: int | None = None,
    ) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.max_bytes = max_bytes
        """The most the buffers may hold: no new slot is handed out past it (``acquire``
        answers None: the call gets an ordinary cache) and no slot widened past it (the call
        that needs more moves to a cache of its own, ``SlotSequence.spill``). None: no
        bound."""
        self._initial = (slots, capacity)
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._in_use: set[int] = set()
        self._released: collections.deque[int] = collections.deque()
        self.shrinks = True
        """Whether an idle pool that a burst grew goes back to its first size (not while a
        runner's forwards run compiled over it: each size is compiled anew)."""
        self.lock = threading.RLock()
        """Held by whatever reads or writes the buffers (a forward over slots included): two
        runtimes may share one model, each from its own worker thread, and a reallocation in
        one must not swap the buffers under the other's forward."""

    @property
    def slots(self) -> int:
        """Slots allocated (none until the first call takes one)."""
        return int(self.keys[0].shape[0]) if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def position_bytes(self) -> int:
        """Bytes one position of one slot takes over every layer (keys and values)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * size

    def fits(self, slots: int, capacity: int) -> bool:
        """Whether buffers of ``slots`` x ``capacity`` stay within ``max_bytes``."""
        return self.max_bytes is None or slots * capacity * self.position_bytes <= self.max_bytes

    def can_hold(self, length: int) -> bool:
        """Whether every slot can hold ``length`` positions now or after growing within
        ``max_bytes``."""
        return length <= self.capacity or self.fits(self.slots, self._grown(length))

    def _grown(self, length: int) -> int:
        capacity = max(self.capacity, 1)
        while capacity < length:
            capacity *= 2
        return capacity

    def _allocate(self, slots: int, capacity: int) -> None:
        """(Re)allocate the buffers with room for ``slots`` x ``capacity``, keeping contents.
        Every new buffer is made and filled before any is swapped in: a failure (out of
        memory) leaves the pool as it was."""
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        old = list(zip(self.keys, self.values, strict=True))
        keys_made: list[torch.Tensor] = []
        values_made: list[torch.Tensor] = []
        for index in range(self.layers):
            keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            values = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old:
                held_k, held_v = old[index]
                n = min(held_k.shape[0], slots)
                length = min(held_k.shape[2], capacity)
                keys[:n, :, :length] = held_k[:n, :, :length]
                values[:n, :, :length] = held_v[:n, :, :length]
            keys_made.append(keys)
            values_made.append(values)
        self.keys, self.values = keys_made, values_made
        self.capacity = capacity

    def acquire(self) -> SlotSequence | None:
        """An empty sequence in the lowest free slot (the pool doubles its slots when none is
        free); None when doubling would pass ``max_bytes``. A pool with no slot in use that a
        burst grew goes back to its first size first: its memory returns between bursts."""
        self._reap()
        with self.lock:
            grown = (self.slots, self.capacity) != self._initial
            if not self._in_use and grown and (self.shrinks or not self.keys):
                self.keys, self.values = [], []  # idle, or never used: its first size
                self._allocate(*self._initial)
            free = next((s for s in range(self.slots) if s not in self._in_use), None)
            if free is None:
                if not self.fits(self.slots * 2, self.capacity):
                    return None
                free = self.slots
                self._allocate(self.slots * 2, self.capacity)
            self._in_use.add(free)
        return SlotSequence(self, free)

    def ensure(self, length: int) -> None:
        """Room for ``length`` positions in every slot; ``PoolFull`` where that would pass
        ``max_bytes`` (the runner moves such a call to a cache of its own first)."""
        with self.lock:
            if not self.keys:
                self._allocate(*self._initial)
            if length > self.capacity:
                capacity = self._grown(length)
                if not self.fits(self.slots, capacity):
                    msg = (
                        f"{self.slots} KV slots of {capacity} positions would take "
                        f"{self.slots * capacity * self.position_bytes} bytes, over the "
                        f"pool's bound of {self.max_bytes}"
                    )
                    raise PoolFull(msg)
                self._allocate(self.slots, capacity)

    def _release(self, slot: int) -> None:
        """Queued: a sequence may be dropped on any thread, inside any forward."""
        self._released.append(slot)

    def _reap(self) -> None:
        with self.lock:
            while self._released:
                self._in_use.discard(self._released.popleft())

    @torch.inference_mode()  # the buffers are inference tensors once grown in a forward
    def fill(self, sequence: SlotSequence, source: Any, start: int = 0) -> None:
        """Write what ``source`` (an ordinary transformers cache) holds from position ``start``
        on into ``sequence``'s slot, which holds the positions before it (an empty slot: all
        of them); the slot then holds as many positions as ``source``."""
        end = int(source.get_seq_length())
        if end <= start:
            return
        with self.lock:
            self.ensure(end)
            for index, layer in enumerate(source.layers):
                held: Any = layer
                self.keys[index][sequence.slot, :, start:end] = held.keys[0, :, start:end]
                self.values[index][sequence.slot, :, start:end] = held.values[0, :, start:end]
        sequence.length = end

    def copy_of(self, sequence: SlotSequence, length: int) -> DynamicCache:
        """An ordinary cache holding a copy of a slot's first ``length`` positions."""
        out = DynamicCache()
        if length:
            with self.lock:
                for index in range(self.layers):
                    keys = self.keys[index][sequence.slot : sequence.slot + 1, :, :length]
                    values = self.values[index][sequence.slot : sequence.slot + 1, :, :length]
                    out.update(keys.clone(), values.clone(), index)
        return out


class PoolFull(RuntimeError):
    """Growing the slots would pass the pool's ``max_bytes``."""


class SlotSequence:
    """One call's KV in a ``SlotPool``: its slot and how many positions it holds. Behaves as
    the decoding core expects of a cache (``get_seq_length``, ``crop`` with transformers'
    negative convention, ``copy.deepcopy``); the prefix cache keeps ``kept_copy()``.

    A call that outgrows what the pool may hold moves its KV into an ordinary cache of its
    own (``spill``): the sequence then stands for that cache (``own``), which the runner's
    forwards use as any ordinary cache, and its slot goes back to the pool."""

    __slots__ = ("__weakref__", "_length", "own", "pool", "slot")

    def __init__(self, pool: SlotPool, slot: int) -> None:
        self.pool = pool
        self.slot = slot
        self._length = 0
        self.own: DynamicCache | None = None
        """The call's KV once it left the pool (``spill``); None while it holds a slot."""

    @property
    def length(self) -> int:
        return int(self.own.get_seq_length()) if self.own is not None else self._length

    @length.setter
    def length(self, value: int) -> None:
        if self.own is not None:
            raise ValueError("a spilled sequence's length is its own cache's")
        self._length = value

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        if self.own is not None:
            held = self.length
            keep = cropped_length(held, max_length)
            if keep is not None:
                self.own.crop(keep - held)  # transformers' caches take a negative crop
            return
        keep = cropped_length(self._length, max_length)
        if keep is not None:
            self._length = keep

    def spill(self) -> DynamicCache:
        """Move this call's KV out of the pool into an ordinary cache of its own (its slot is
        freed): a call longer than the pool may hold goes on there instead of widening every
        slot."""
        if self.own is None:
            own = self.pool.copy_of(self, self._length)
            self.own = own
            self.pool._release(self.slot)
        return self.own

    def kept_copy(self) -> DynamicCache:
        if self.own is not None:
            return copy.deepcopy(self.own)
        return self.pool.copy_of(self, self._length)

    @torch.inference_mode()  # the buffers are inference tensors once grown in a forward
    def keep_path(self, start: int, path: list[int]) -> None:
        """After a token tree written from position ``start`` (its root), keep the root and
        the accepted ``path`` (nodes), moved to follow one another
        (``Runner.keep_path``)."""
        if self.own is not None:
            keep_cache_path(self.own, start, path)
            return
        rows = [start + 1 + node for node in path]
        if rows != list(range(start + 1, start + 1 + len(rows))):
            index = to_device(rows, self.pool.device)
            with self.pool.lock:
                for held in (*self.pool.keys, *self.pool.values):
                    moved = held[self.slot, :, index]
                    held[self.slot, :, start + 1 : start + 1 + len(rows)] = moved
        self.crop(start + 1 + len(rows))

    @torch.inference_mode()  # the buffers are inference tensors once grown in a forward
    def __deepcopy__(self, memo: dict[int, Any]) -> SlotSequence:
        twin = self.pool.acquire() if self.own is None else None
        if twin is None:  # the pool is full (or this call left it): an ordinary copy
            return self.kept_copy()  # type: ignore[return-value]
        with self.pool.lock:
            for held in (*self.pool.keys, *self.pool.values):
                held[twin.slot, :, : self.length] = held[self.slot, :, : self.length]
        twin.length = self.length
        return twin

    def __del__(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None and getattr(self, "own", None) is None:
            pool._release(self.slot)


class PoolLayer(CacheLayerMixin):
    """One layer of a ``Cache`` over a ``SlotPool``'s buffers for one forward (a ``SlotBatch``,
    or a compiled forward's view of the pool's first slots): each subclass's ``update`` writes
    the new keys and values where their rows belong and returns the keys and values attended;
    nothing is allocated here."""

    is_sliding = False

    def __init__(self, pool: SlotPool, index: int) -> None:
        super().__init__()
        self.pool = pool
        self.index = index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def get_max_length(self) -> int:
        return self.pool.capacity


class _SlotLayer(PoolLayer):
    """One layer of a ``SlotBatch``: writes each row's new keys and values at its own positions
    and returns the batch's rows of the pool up to the longest row."""

    is_compileable = False

    def __init__(self, batch: SlotBatch, index: int) -> None:
        super().__init__(batch.pool, index)
        self.batch = batch

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, pool = self.batch, self.batch.pool
        # key_states: [B, kv_heads, widest, head_dim] -> written as [B, widest, kv_heads, dim]
        # at (slot_b, position_b + j) for every row b and new token j.
        keys, values = pool.keys[self.index], pool.values[self.index]
        keys[batch.slot_index, :, batch.position_index] = key_states.transpose(1, 2)
        values[batch.slot_index, :, batch.position_index] = value_states.transpose(1, 2)
        if batch.consecutive is not None:
            first = batch.consecutive
            rows = slice(first, first + len(batch.slots))
            return keys[rows, :, : batch.kv_length], values[rows, :, : batch.kv_length]
        return (
            keys[batch.slot_tensor, :, : batch.kv_length],
            values[batch.slot_tensor, :, : batch.kv_length],
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.batch.kv_length, 0

    def get_seq_length(self) -> int:
        return min(self.batch.starts)


class SlotBatch(Cache):
    """The ``Cache`` a model sees for one forward over several slots: row ``b`` feeds
    ``counts[b]`` new tokens (right-padded to ``widest``) after ``sequences[b]``'s positions."""

    def __init__(self, pool: SlotPool, sequences: Sequence[SlotSequence], widest: int) -> None:
        self.pool = pool
        self.slots = [s.slot for s in sequences]
        self.starts = [s.length for s in sequences]
        self.kv_length = max(self.starts) + widest
        pool.ensure(self.kv_length)
        device = pool.device
        self.slot_tensor = to_device(self.slots, device)
        start = to_device(self.starts, device)
        offsets = torch.arange(widest, dtype=torch.long, device=device)
        self.position_index = start[:, None] + offsets[None, :]  # [B, widest]
        self.slot_index = self.slot_tensor[:, None].expand(-1, widest)  # [B, widest]
        first = self.slots[0]
        self.consecutive = (
            first if self.slots == list(range(first, first + len(self.slots))) else None
        )
        super().__init__(layers=[_SlotLayer(self, i) for i in range(pool.layers)])

    def __deepcopy__(self, memo: dict[int, Any]) -> SlotBatch:  # pragma: no cover - never kept
        raise TypeError("a SlotBatch lives for one forward; keep the calls' SlotSequences")


@torch.inference_mode()
def keep_cache_path(cache: Cache, start: int, path: list[int]) -> None:
    """A transformers cache keeps a tree's accepted path by moving its rows in every layer."""
    rows = [start + 1 + node for node in path]
    if rows != list(range(start + 1, start + 1 + len(rows))):
        index = torch.tensor(rows, dtype=torch.long)
        for layer in cache.layers:
            for name in ("keys", "values"):
                held = getattr(layer, name)
                moved = held.index_select(2, index.to(held.device))
                held[:, :, start + 1 : start + 1 + len(rows)] = moved
    crop_to(cache, start + 1 + len(rows))
