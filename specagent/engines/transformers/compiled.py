"""Compiled fixed-shape forwards over the KV slot pool, switched on only where they measure faster.

A decoding step feeds a few tokens per call (one for a draft's step or a plain step, k + 1 for
a verification) and runs the same small graph thousands of times per call. ``torch.compile``
can make it cheaper: inductor fuses the elementwise work between the matrix products, and on
CUDA graph capture (``mode="reduce-overhead"``) removes the per-kernel launch cost that
dominates a small model's step on a GPU. Both need fixed shapes and, for graphs, fixed
addresses, which per-call caches do not have. The slot pool (``slots``) does: one buffer per
layer for all calls. So a compiled forward here is a forward over a prefix of the pool's slots:

- its batch is the pool's first ``rows`` slots (a power of two covering every slot in the
  round: the runtime hands out the lowest free slot, so concurrent calls keep to the first rows)
  and its width a bucket of ``WIDTHS`` (the most new tokens of any row, padded up); a slot with
  nothing to feed this round is a padding row that writes back what its positions held;
- each row writes its new keys and values at its own positions and attends over the round's
  span (the positions up to its longest row's end, rounded up by at most a quarter) under a
  per-row mask built inside the graph from two small tensors (each row's start and count);
  the span is the graph's one dynamic size, so calls at any length share one graph per
  (rows, width) (with CUDA graphs, a graph is recorded once per span);
- each bucket has its own compiled function (its own code object, so its own dynamo cache):
  recompiling happens only when the pool itself grows (more slots or positions; the pool does
  not shrink back while steps run compiled);
- wider forwards (prompts) and token trees run eagerly over the same slots.

Neither gain is a law. On a 2-core AMD EPYC (``benchmarks/batched_decode.py``, a Llama 12 x
256, 16 calls), compiled forwards decoded a token in 1.33 ms against eager's 1.57 at 32 tokens
of context but in 3.33 ms against 2.97 at 2,048 (attending a span rounded up to 2,560
positions where the eager round reads about 2,210); before this design, over per-call
static caches, the 0.5B Qwen draft's compiled single-token step took 0.228 s against 0.164 s
eager, after 76 s of compiling. So ``choose_compiled_step`` compiles,
checks that compiled steps give the eager steps' tokens, times both, keeps the compiled forwards
only where they are clearly faster, and records the decision per machine and model shape, so a
machine where it loses never compiles again.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import threading
import time
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from ...decoding.engine import Tokens, crop_to, to_device, token_rows
from .slots import PoolLayer, SlotPool, SlotSequence

__all__ = [
    "MIN_GAIN",
    "WIDTHS",
    "CompiledSlots",
    "StepChoice",
    "choose_compiled_step",
    "serial_forwards",
    "warm_buckets",
]

WIDTHS = (1, 2, 4, 8, 16)
"""New tokens per row that a compiled forward takes, padded up to one of these; wider forwards
(prompts, drafts of more than 15 tokens) run eagerly."""
SHORTEST_SPAN = 64
"""The fewest positions a compiled round attends (``CompiledSlots._key_positions``)."""
MIN_GAIN = 0.92
"""The compiled forwards are kept only where a step takes less than this share of the eager one."""


_log = logging.getLogger("specagent.compiled")
_SERIAL = threading.RLock()
_COMPILED: weakref.WeakSet[CompiledSlots] = weakref.WeakSet()


def serial_forwards() -> contextlib.AbstractContextManager[Any]:
    """What every runner's forward holds: one process-wide lock while any runner in the process
    runs compiled forwards, else nothing. A compiled graph replays, after it runs, the writes to
    module-level state that it traced (transformers' hub-kernel wrapper keeps its active kernels
    in one, switched to a plain global while compiling); an eager forward in another thread (a
    second runtime) reading that state mid-way fails. Forwards of one process then take turns,
    which on one accelerator or a few cores they mostly do anyway."""
    return _SERIAL if _COMPILED else contextlib.nullcontext()


class _PoolLayer(PoolLayer):
    """One layer of a ``_PoolView``: writes each active row's new keys and values at its own
    positions (a padding row writes back what it read) and returns the rows' slots up to the
    view's span."""

    is_compileable = True

    def __init__(self, view: _PoolView, index: int) -> None:
        super().__init__(view.pool, index)
        self.view = view

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        view = self.view
        keys, values = view.pool.keys[self.index], view.pool.values[self.index]
        rows, width = key_states.shape[0], key_states.shape[2]
        device = key_states.device
        position = view.starts[:, None] + torch.arange(width, device=device)[None, :]
        row = torch.arange(rows, device=device)[:, None].expand(rows, width)
        active = (view.counts > 0)[:, None, None, None]
        for held, new in ((keys, key_states), (values, value_states)):
            held[row, :, position] = torch.where(
                active, new.transpose(1, 2), held[row, :, position]
            )
        span = view.key_positions.shape[0]
        return keys[:rows, :, :span], values[:rows, :, :span]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.view.key_positions.shape[0], 0

    def get_seq_length(self) -> int:
        return 0  # positions come with the forward; nothing reads the cache's own length


class _PoolView(Cache):
    """The ``Cache`` a compiled forward sees: the pool's first ``rows`` slots, with each row's
    start and count of new tokens in tensors that keep their addresses between forwards, and
    the positions attended (``key_positions``: ``0..span - 1``, a dynamic size)."""

    def __init__(self, pool: SlotPool, rows: int) -> None:
        self.pool = pool
        self.starts = torch.zeros(rows, dtype=torch.long, device=pool.device)
        self.counts = torch.zeros(rows, dtype=torch.long, device=pool.device)
        self.key_positions = torch.arange(0)
        super().__init__(layers=[_PoolLayer(self, i) for i in range(pool.layers)])

    def __deepcopy__(self, memo: dict[int, Any]) -> _PoolView:  # pragma: no cover - never kept
        raise TypeError("a pool view lives inside a compiled forward; keep the SlotSequences")


def _hidden_states(
    body: torch.nn.Module, cache_kw: str, mask_dtype: Any, ids: torch.Tensor, view: _PoolView
) -> torch.Tensor:
    """The decoder body over ``ids`` ``[rows, width]`` after the view's slots: ``[rows, width,
    hidden]``. Row ``b``'s query ``j`` sees its slot up to ``start + min(j, count - 1)``; a
    padding row sees its first position (its output is dropped; all-masked rows give NaN)."""
    width = ids.shape[1]
    device = ids.device
    query = torch.arange(width, device=device)
    positions = view.starts[:, None] + query[None, :]
    last = torch.minimum(query[None, :], (view.counts - 1).clamp(min=0)[:, None])
    keys = view.key_positions
    mask = (keys[None, None, :] <= (view.starts[:, None] + last)[:, :, None])[:, None]
    if mask_dtype is not None:  # eager attention adds its mask
        lowest = torch.finfo(mask_dtype).min
        mask = torch.zeros(mask.shape, dtype=mask_dtype, device=device).masked_fill(~mask, lowest)
    out = body(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **{cache_kw: view},
    )
    return out.last_hidden_state


class CompiledSlots:
    """A runner's compiled forwards over its slot pool, one compiled function per (rows, width)
    bucket, compiled at its first use."""

    def __init__(
        self,
        body: torch.nn.Module,
        pool: SlotPool,
        *,
        cache_kw: str,
        mask_dtype: torch.dtype | None,
        backend: str | Callable[..., Any] = "inductor",
    ) -> None:
        self.body = body
        self.pool = pool
        self._cache_kw = cache_kw
        self._mask_dtype = mask_dtype
        self._backend = backend
        self._mode = (
            "reduce-overhead" if pool.device.type == "cuda" and backend == "inductor" else None
        )
        self._views: dict[int, _PoolView] = {}
        self._spans: dict[int, torch.Tensor] = {}
        self._functions: dict[tuple[int, int], Callable[..., torch.Tensor]] = {}
        self._marked: torch.Tensor | None = None
        self.failed: dict[tuple[int, int], str] = {}
        """Buckets whose compiling or compiled run raised, and why: their forwards run
        eagerly from then on (a compiler that fails must not fail a call)."""
        _COMPILED.add(self)

    @staticmethod
    def fits(widest: int) -> bool:
        """Whether a forward whose widest row feeds ``widest`` tokens runs compiled."""
        return 1 <= widest <= WIDTHS[-1]

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """The (rows, width) buckets compiled so far."""
        return sorted(self._functions)

    def hidden(
        self, sequences: Sequence[SlotSequence], tokens: Sequence[Tokens]
    ) -> tuple[torch.Tensor, int] | None:
        """Hidden states ``[rows, width, hidden]`` of feeding each ``tokens[i]`` after
        ``sequences[i]`` (row = the sequence's slot), and the width; the new KV is written into
        the slots (lengths are the caller's to move). None: this bucket's compiling failed, run
        the forward eagerly (whatever a failed run wrote lies past the sequences' lengths). Call
        with the pool's lock held."""
        pool = self.pool
        widest = max(len(t) for t in tokens)
        width = next(w for w in WIDTHS if w >= widest)
        end = max(s.length for s in sequences) + width  # the positions this round reaches
        pool.ensure(end)
        rows = 1 << (max(s.slot for s in sequences)).bit_length()
        rows = min(rows, pool.slots)
        if (rows, width) in self.failed:
            return None
        fed: list[Tokens] = [[] for _ in range(rows)]
        starts = torch.zeros(rows, dtype=torch.long)
        counts = torch.zeros(rows, dtype=torch.long)
        for sequence, new in zip(sequences, tokens, strict=True):
            fed[sequence.slot] = new
            starts[sequence.slot] = sequence.length
            counts[sequence.slot] = len(new)
        ids = token_rows(fed, width, pool.device)
        view = self._views.get(rows)
        if view is None:
            view = self._views[rows] = _PoolView(pool, rows)
        view.starts.copy_(to_device(starts, pool.device))
        view.counts.copy_(to_device(counts, pool.device))
        view.key_positions = self._key_positions(end)
        if self._mode is not None and self._marked is not pool.keys[0]:
            # CUDA graphs replay over fixed addresses: the pool's buffers are such (until the
            # pool grows, which compiles the buckets again).
            for held in (*pool.keys, *pool.values):
                torch._dynamo.mark_static_address(held)
            self._marked = pool.keys[0]
        first = (rows, width) not in self._functions
        function = self._function(rows, width)
        try:
            hidden = function(self.body, self._cache_kw, self._mask_dtype, ids, view)
        except Exception as error:  # no toolchain, an op the compiler refuses, a bad graph
            self.failed[(rows, width)] = f"{type(error).__name__}: {error}"[:300]
            _log.warning(
                "compiled forward %dx%d failed, running it eagerly: %s", rows, width, error
            )
            return None
        finally:
            if first:
                # Compiling leaves exceptions in reference cycles whose tracebacks hold the
                # callers' frames, and with them these calls' sequences: collected now, a
                # finished call's slot is free for the next call, not at some later collection.
                gc.collect()
        return hidden, width

    def _key_positions(self, end: int) -> torch.Tensor:
        """``0..span - 1`` on the pool's device: the positions a round whose rows end by
        ``end`` attends, ``end`` rounded up to a quarter step between powers of two (5, 6, 7
        or 8 eighths of the next one: at most a quarter more than needed, where a power of two
        could be twice as much right past one; at least ``SHORTEST_SPAN``, at most the
        capacity). A dynamic size in the compiled graphs, so a new span compiles nothing (with
        CUDA graphs, it records one more graph the first time: four per doubling)."""
        step = 1 << max((end - 1).bit_length() - 3, 0)
        span = min(self.pool.capacity, max(SHORTEST_SPAN, -(-end // step) * step))
        positions = self._spans.get(span)
        if positions is None:
            positions = torch.arange(span, device=self.pool.device)
            # Dynamic where it can be: a span equal to the capacity (a slice of the whole
            # buffer) specialises, one more graph, once.
            torch._dynamo.maybe_mark_dynamic(positions, 0)
            self._spans[span] = positions
        return positions

    def _function(self, rows: int, width: int) -> Callable[..., torch.Tensor]:
        """The bucket's compiled function: a copy of ``_hidden_states`` under its own code
        object, whose dynamo cache (and recompile limit) is the bucket's alone."""
        function = self._functions.get((rows, width))
        if function is None:
            code = _hidden_states.__code__.replace(co_name=f"slot_forward_{rows}x{width}")
            fresh = types.FunctionType(code, _hidden_states.__globals__, code.co_name)
            # Every shape is fixed but the attended span, marked dynamic (``_key_positions``).
            function = torch.compile(fresh, backend=self._backend, mode=self._mode, dynamic=False)
            self._functions[(rows, width)] = function
        return function


@dataclass(frozen=True)
class StepChoice:
    """Whether a runner's steps run compiled, and the measurements behind it."""

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
    warm: bool = True,
) -> StepChoice:
    """Decide whether ``runner`` (a ``ModelRunner`` not handed out yet) runs its few-token
    forwards over slots compiled, and set it up accordingly (``runner.compiled``).

    Only a runner whose calls hold KV slots can (``slots``). A decision recorded in ``store``
    for this machine and model shape (``key``) is reused. Otherwise, with ``measure``: compile,
    run ``steps`` greedy single-token steps both ways from the same ``context_tokens``-token
    context, and keep the compiled forwards only if they chose the same tokens and took less
    than ``MIN_GAIN`` of the eager time (medians). Without ``measure`` and nothing recorded,
    forwards stay eager. Compiled forwards are warmed (``warm_buckets``) unless ``warm`` is
    False."""
    if runner.slots is None:
        runner._use_compiled(None)
        return StepChoice(False, "compiled forwards run over KV slots; this runner has none")
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
    elif not measure:
        runner._use_compiled(None)
        return StepChoice(False, "not measured on this machine: eager steps")
    else:
        choice = _measure(runner, context_tokens, steps)
        if store is not None:
            store.put(entry, choice.to_json())
    if choice.compiled and warm:
        seconds = warm_buckets(runner)
        _log.info("compiled forwards: one call's buckets warmed in %.1f s", seconds)
    return choice


def warm_buckets(runner: Any, widths: Sequence[int] = WIDTHS) -> float:
    """Compile, before any call needs them, the buckets one call's forwards reach (one row,
    each of ``widths``): a bucket otherwise compiles at its first use, inside some call's step
    (seconds on a CPU; with CUDA graphs on a large model, up to a minute). Buckets of several
    concurrent calls still compile when first met. Runs through the runner's own forwards, as
    calls do, on a slot it frees again; returns the seconds spent."""
    start = time.perf_counter()
    vocab = max(runner.vocab_size - 1, 1)
    cache = runner.new_cache()
    # Wider than any bucket, so eager: it also settles the runner's check of its gathered head,
    # which a compiled forward needs first.
    runner.forward([i % vocab + 1 for i in range(WIDTHS[-1] + 1)], cache, keep=1)
    held = cache.get_seq_length()
    for width in widths:
        runner.forward([1] * width, cache, keep=1)
        crop_to(cache, held)
    return time.perf_counter() - start


def _measure(runner: Any, context_tokens: int, steps: int) -> StepChoice:
    vocab = runner.vocab_size
    context = [i % max(vocab - 1, 1) + 1 for i in range(context_tokens)]

    def run(compiled: CompiledSlots | None) -> tuple[list[int], list[float]]:
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
