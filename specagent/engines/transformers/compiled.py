"""Static KV caches and compiled single-token steps, switched on only where they measure faster.

A decoding step that feeds one token (every draft-model step, every plain step of the target)
runs the same small graph thousands of times per call. Two things can make it cheaper: a
preallocated ("static") KV cache that is written in place instead of grown by concatenation, and
``torch.compile`` of the forward over that cache (inductor fuses the elementwise work between
the matrix products; on CUDA, graph capture removes the launch overhead that dominates a small
model's step). Neither is a law. Measured on a 2-core AMD EPYC (AVX2, bf16 emulated;
``benchmarks/compiled_steps.py``), the bf16 0.5B Qwen draft's single-token step took 0.164 s
eager and 0.228 s compiled over a 2,048-slot static cache, the float32 1.5B target's 0.915 s
and 0.968 s, after 76 s and 101 s of compiling; a preallocated cache alone changed nothing.
So ``choose_compiled_step`` compiles, checks that the compiled step gives the eager step's
tokens, times both, keeps the compiled step only where it is clearly faster, and records the
decision per machine and model shape, so a machine where it loses never compiles again.

How it fits the rest of the core: a runner with a ``CompiledStep`` hands out static caches
(``StaticCache`` of ``STATIC_TOKENS`` slots) and runs single-token forwards over them compiled;
every other forward (prefills, verifications, batched rounds) runs eagerly over the same cache.
Static layers crop by moving their length back (the stale slots are overwritten, and the causal
mask hides them until then), which is what rolling back rejected drafts needs. A call that outgrows
its cache gets a larger one in place and runs eagerly from then on. The prefix cache keeps
static caches as ordinary ones cut to their length (``as_dynamic``), and a kept prefix is
copied into a static cache when a call starts from it (``fill_static``).

CUDA graphs (``mode="reduce-overhead"``) need the KV buffers at fixed addresses, one graph per
buffer; per-call caches give every call new addresses, so that needs a pool of cache slots
reused across calls. It is not built: no GPU was at hand to measure what it buys.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

__all__ = [
    "STATIC_TOKENS",
    "CompiledStep",
    "StaticKV",
    "StepChoice",
    "as_dynamic",
    "choose_compiled_step",
    "fill_static",
    "is_static",
]

STATIC_TOKENS = 2048
"""Slots of a static cache: one compiled graph serves every cache of this size. A call longer
than this grows its cache and runs eagerly from then on. A static cache holds all its slots
whatever the call's length (the float32 1.5B Qwen target: 117 MB, the bf16 0.5B draft: 25 MB),
the price of a step with fixed shapes. Every call of a runner with compiled steps gets one, so
which path a call's forwards take depends on the call alone, never on how many others run
(which a reproducible policy needs)."""
MIN_GAIN = 0.92
"""The compiled step is kept only where it takes less than this share of the eager step."""


class _Layer(StaticLayer):
    """A static layer whose buffers are not marked as fixed addresses: a marked address is part
    of the compiled graph's guards, so every call's new cache would compile again."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        self.keys = key_states.new_zeros((*shape, self.k_head_dim))
        self.values = value_states.new_zeros((*shape, self.v_head_dim))
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def grow(self, capacity: int) -> None:
        """Make room for ``capacity`` positions, keeping what is cached."""
        if capacity <= self.max_cache_len:
            return
        if self.is_initialized:
            grown = []
            for held in (self.keys, self.values):
                assert held is not None
                new = held.new_zeros((*held.shape[:2], capacity, held.shape[3]))
                new[:, :, : self.max_cache_len] = held
                grown.append(new)
            self.keys, self.values = grown
        self.max_cache_len = capacity


def is_static(cache: Any) -> bool:
    """Whether ``cache`` is a static cache made here (every layer a preallocated one)."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(isinstance(layer, _Layer) for layer in layers)


class StaticKV(StaticCache):
    """A static cache made here. The prefix cache keeps it as an ordinary cache cut to its
    length (``kept_copy``), not with all its slots."""

    def kept_copy(self) -> DynamicCache:
        return as_dynamic(self)


def new_static(config: Any, capacity: int) -> StaticCache | None:
    """A static cache of ``capacity`` slots for a model of ``config``; None for models with other
    layer types (sliding windows, linear attention), which keep dynamic caches."""
    cache = StaticKV(config=config, max_cache_len=capacity)
    if not all(type(layer) is StaticLayer for layer in cache.layers):
        return None
    cache.layers = [_Layer(max_cache_len=capacity) for _ in cache.layers]
    return cache


def ensure_room(cache: StaticCache, new_tokens: int) -> None:
    """Grow a static cache (doubling) so that ``new_tokens`` more positions fit."""
    needed = int(cache.get_seq_length()) + new_tokens
    layers: list[Any] = list(cache.layers)
    capacity = layers[0].max_cache_len
    if needed <= capacity:
        return
    while capacity < needed:
        capacity *= 2
    for layer in layers:
        layer.grow(capacity)


def as_dynamic(cache: Any) -> DynamicCache:
    """An ordinary cache holding a copy of what a static cache holds (its length, not its
    slots); other caches are deep-copied."""
    if not is_static(cache):
        return copy.deepcopy(cache)
    length = int(cache.get_seq_length())
    out = DynamicCache()
    for index, layer in enumerate(cache.layers):
        if layer.is_initialized and length:
            out.update(
                layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone(), index
            )
    return out


def fill_static(cache: StaticCache, source: DynamicCache) -> None:
    """Write what ``source`` (an ordinary cache) holds into an empty static cache."""
    length = int(source.get_seq_length())
    if length == 0:
        return
    ensure_room(cache, length)
    for index, layer in enumerate(source.layers):
        held: Any = layer
        cache.update(held.keys, held.values, index)


class CompiledStep:
    """A runner's compiled single-token forward over static caches of ``capacity`` slots."""

    def __init__(self, model: torch.nn.Module, cache_kw: str, capacity: int = STATIC_TOKENS):
        self.model = model
        self.capacity = capacity
        self._cache_kw = cache_kw
        self._compiled: Callable[..., Any] = torch.compile(model.forward, dynamic=False)

    def new_cache(self) -> StaticCache | None:
        """A static cache (None where the model's layers are not plain full attention)."""
        return new_static(self.model.config, self.capacity)

    def fits(self, cache: Any) -> bool:
        """Whether one more token over ``cache`` can take the compiled step."""
        if not is_static(cache):
            return False
        layer: Any = cache.layers[0]
        return layer.max_cache_len == self.capacity and int(cache.get_seq_length()) < self.capacity

    def step(self, token: int, cache: StaticCache, device: torch.device) -> torch.Tensor:
        """Logits ``[1, V]`` (model dtype) after feeding ``token`` over ``cache``."""
        ids = torch.tensor([[token]], dtype=torch.long, device=device)
        out = self._compiled(
            input_ids=ids, **{self._cache_kw: cache}, use_cache=True, logits_to_keep=1
        )
        return out.logits[0, -1:]


@dataclass(frozen=True)
class StepChoice:
    """Whether a runner's single-token steps run compiled, and the measurements behind it."""

    compiled: bool
    reason: str
    eager_seconds: float | None = None
    compiled_seconds: float | None = None
    compile_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "compiled": self.compiled,
            "reason": self.reason,
            "eager_seconds": self.eager_seconds,
            "compiled_seconds": self.compiled_seconds,
            "compile_seconds": self.compile_seconds,
        }


def choose_compiled_step(
    runner: Any,
    *,
    key: str,
    store: Any | None = None,
    measure: bool = True,
    context_tokens: int = 64,
    steps: int = 12,
) -> StepChoice:
    """Decide whether ``runner`` (a ``ModelRunner`` not handed out yet) runs its single-token
    steps compiled, and set it up accordingly (``runner.compiled``).

    A decision recorded in ``store`` for this machine and model shape (``key``) is reused.
    Otherwise, with ``measure``: compile, run ``steps`` greedy single-token steps both ways from
    the same ``context_tokens``-token context, and keep the compiled step only if it chose the
    same tokens and took less than ``MIN_GAIN`` of the eager time (medians). Without
    ``measure`` and nothing recorded, steps stay eager."""
    entry = f"compiled-step:{key}"
    stored = store.get(entry) if store is not None else None
    if isinstance(stored, dict) and isinstance(stored.get("compiled"), bool):
        choice = StepChoice(
            compiled=stored["compiled"],
            reason=f"{stored.get('reason', '')} (measured earlier on this machine)",
            eager_seconds=stored.get("eager_seconds"),
            compiled_seconds=stored.get("compiled_seconds"),
            compile_seconds=stored.get("compile_seconds"),
        )
        runner._use_compiled(runner.compiler() if choice.compiled else None)
        return choice
    if not measure:
        runner._use_compiled(None)
        return StepChoice(False, "not measured on this machine: eager steps")
    choice = _measure(runner, context_tokens, steps)
    if store is not None:
        store.put(entry, choice.to_json())
    return choice


def _measure(runner: Any, context_tokens: int, steps: int) -> StepChoice:
    vocab = runner.vocab_size
    context = [i % max(vocab - 1, 1) + 1 for i in range(context_tokens)]

    def run(compiled: CompiledStep | None) -> tuple[list[int], list[float]]:
        runner._use_compiled(compiled)
        cache = runner.new_cache()
        logits = runner.forward(context, cache, keep=1)
        tokens, seconds = [], []
        for _ in range(steps + 1):  # the first step warms (and compiles)
            token = int(logits[-1].argmax())
            tokens.append(token)
            start = time.perf_counter()
            logits = runner.forward([token], cache, keep=1)
            float(logits[-1, 0])  # synchronise with the device before reading the clock
            seconds.append(time.perf_counter() - start)
        return tokens, seconds

    eager_tokens, eager = run(None)
    try:
        compiled_tokens, timed = run(runner.compiler())
    except Exception as error:  # no compiler toolchain, an unsupported op: stay eager
        runner._use_compiled(None)
        return StepChoice(False, f"compiling failed: {type(error).__name__}: {error}"[:300])
    eager_s, compiled_s = _median(eager[1:]), _median(timed[1:])
    figures = {
        "eager_seconds": round(eager_s, 5),
        "compiled_seconds": round(compiled_s, 5),
        "compile_seconds": round(timed[0], 2),
    }
    if compiled_tokens != eager_tokens:
        runner._use_compiled(None)
        return StepChoice(False, "compiled steps chose other tokens than eager ones", **figures)
    if compiled_s < MIN_GAIN * eager_s:
        reason = f"compiled step is faster here: {compiled_s:.4f} s vs eager {eager_s:.4f} s"
        return StepChoice(True, reason, **figures)
    runner._use_compiled(None)
    reason = f"compiled step not clearly faster here: {compiled_s:.4f} s vs eager {eager_s:.4f} s"
    return StepChoice(False, reason, **figures)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else math.inf
