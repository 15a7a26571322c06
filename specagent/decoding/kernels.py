"""Linear-layer kernels chosen by measurement, per forward length.

A decoder step is a series of products ``x @ W.T`` over a handful of rows: one in plain decoding,
k + 1 in a verification. Matrix libraries pick a kernel by shape, and the pick for few rows
differs between machines of one kind. Measured on a 2-core AMD EPYC (AVX2, MKL 2024.2, fp32),
a 1536 -> 8960 projection as ``F.linear`` took 4.7 ms for 1 row, 10.2 for 2, 13.4 for 4 and
40 for 16: the weights are read again for every row, so verifying draft tokens costs what
decoding them would, and speculation cannot pay. The same product written as ``(W @ x.T).T``
reaches another kernel that reads the weights once: 4.6, 4.6, 5.0 and 10.2 ms. On the whole
Qwen2.5 1.5B target that made a 4-token verification 0.78 s instead of 2.35 s (1 token: 0.65 s).
Elsewhere ``F.linear`` is the faster one, so nothing is assumed: ``choose_kernels`` times whole
forwards of the model both ways at each length (the cost measurement of ``costs.measure_costs``
does this) and keeps the transposed form at the lengths where it is clearly faster. Whole
forwards, not one layer in a loop: a layer timed alone keeps its weights in the CPU's cache and
measures arithmetic, while a real forward streams every weight from memory.

The plan applies inside ``LinearPlan.active()`` only (a ``TorchFunctionMode`` that reroutes
``F.linear``): the model object is not changed, so the caller's own use of it and the baselines
a benchmark runs beside specagent keep torch's kernels. Both forms compute the same products;
only the order of the additions, and so the last bits of rounding, differ.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["LinearPlan", "choose_kernels", "kernel_choice_steps", "transposed_linear"]

MIN_GAIN = 0.92
"""The transposed form is kept only where it takes less than this share of torch's time: a tie
keeps torch's own kernels."""


@dataclass(frozen=True)
class LinearPlan:
    """The row counts at which every ``F.linear`` is computed as ``(W @ x.T).T``."""

    transposed_rows: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.transposed_rows)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the forwards inside with this plan (a no-op when it changes nothing)."""
        if not self:
            yield
            return
        with _PlannedLinears(self.transposed_rows):
            yield


def transposed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``(weight @ x.T).T``.

    A single row is fed as two copies of itself: ``weight @ x.T`` over one column is a
    matrix-vector product, which torch sends to the same kernel as ``F.linear``, while two
    columns reach the matrix-matrix kernel. On a 2-core Xeon with AMX (bf16), that made the Qwen
    1.5B target's single-token step 0.14 s instead of 0.18 s (the 0.5B draft's: 0.062 s
    instead of 0.079 s); whether it pays is measured per machine like every other length."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    columns = flat.repeat(2, 1) if rows == 1 else flat
    out = torch.mm(weight, columns.t()).t()[:rows]  # [rows, out_features]
    if bias is not None:
        out = out + bias
    return out.contiguous().reshape(*x.shape[:-1], weight.shape[0])


class _PlannedLinears(TorchFunctionMode):
    def __init__(self, rows: frozenset[int]) -> None:
        super().__init__()
        self._rows = rows

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            width = x.shape[-1]
            if weight.dim() == 2 and width and x.numel() // width in self._rows:
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return transposed_linear(x, weight, bias)
        return func(*args, **kwargs)


def choose_kernels(
    time_forward: Callable[[int, LinearPlan], float], lengths: Sequence[int]
) -> tuple[LinearPlan, dict[int, float]]:
    """Per length n (rows fed to one forward): time it with torch's kernels and with the
    transposed form (``time_forward(n, plan)``, seconds), keep the clearly faster. Lengths
    between two timed ones follow the timed one below. Returns the plan and each timed
    length's time under it."""
    steps = kernel_choice_steps(time_forward, lengths)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def kernel_choice_steps(
    time_forward: Callable[[int, LinearPlan], float], lengths: Sequence[int]
) -> Generator[None, None, tuple[LinearPlan, dict[int, float]]]:
    """``choose_kernels`` one timing at a time: yields after each ``time_forward`` call, so a
    worker can interleave the measurement with the calls it serves."""
    timed = sorted(set(lengths))
    chosen: set[int] = set()
    times: dict[int, float] = {}
    for n in timed:
        plan = LinearPlan(frozenset({n}))
        standard = time_forward(n, LinearPlan())
        yield
        flipped = time_forward(n, plan)
        yield
        if flipped < MIN_GAIN * standard:
            # Confirmed in the opposite order before it is kept (for good, in the store): a
            # 2-core machine shares memory bandwidth with its neighbours, and one timing that
            # caught them busy once kept a bf16 target's single-token step 6% slower.
            flipped_again = time_forward(n, plan)
            yield
            standard_again = time_forward(n, LinearPlan())
            yield
            if flipped_again < MIN_GAIN * standard_again:
                chosen.add(n)
                standard, flipped = max(standard, standard_again), max(flipped, flipped_again)
        times[n] = min(standard, flipped) if n in chosen else standard
    for lower, upper in itertools.pairwise(timed):
        if lower in chosen:
            chosen.update(range(lower + 1, upper))
    return LinearPlan(frozenset(chosen)), times
