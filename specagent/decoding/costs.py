"""Step costs: what a draft forward and a verification cost on the machine at hand, and the one
rule that turns costs and acceptance into a draft length.

Costs are relative to one target forward over a single new token (``CostModel``). They are
measured, never assumed: the same model pair verifies 4 tokens for the price of 1 on one 2-core
CPU and for the price of 3 on the next. ``measure_costs`` has each runner time whole forwards at
the lengths a step can take (``Runner.tune``: an engine that chooses how it runs its forwards by
timing them settles that choice on the way, once), one timing per step of ``measure_steps``;
the runtime keeps its curves (``runtime.memory.CostBook``), loads and stores them per machine,
and measures what is missing a slice at a time so that a worker can serve calls (with
``prior_costs``) while it measures.

``most_per_cost`` is where every length decision ends: the schedule's k, a draft model's planned
draft length and the length of its lookup guesses all maximise expected tokens per unit of cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .engine import Runner, crop_to

__all__ = [
    "MEASURED_LENGTHS",
    "CostModel",
    "SettlesNothing",
    "chained_gains",
    "draft_length",
    "expected_tokens",
    "finish",
    "forward_timer",
    "interpolate_costs",
    "measure_costs",
    "measure_steps",
    "most_per_cost",
    "prior_costs",
    "time_lengths",
    "unit_ratio",
]


@dataclass(frozen=True)
class CostModel:
    """Step costs relative to one target forward over a single new token."""

    draft_step: float = 0.0
    """Cost of one draft forward (one draft token)."""
    verify: tuple[float, ...] = ()
    """``verify[n - 1]``: cost of one target forward over n new tokens. Missing entries grow
    linearly from the last known one (a pessimistic guess)."""

    def verify_cost(self, n: int) -> float:
        if n <= 0:
            return 0.0
        if n <= len(self.verify):
            return self.verify[n - 1]
        if not self.verify:
            return 1.0 + 0.1 * (n - 1)
        last = self.verify[-1]
        slope = (last - 1.0) / max(len(self.verify) - 1, 1) if len(self.verify) > 1 else 0.1
        return last + max(slope, 0.05) * (n - len(self.verify))

    draft: tuple[float, ...] = ()
    """``draft[n - 1]``: cost of one draft forward over n tokens (``draft[0] == draft_step``);
    the draft checks lookup guesses in such wider forwards. Empty when not measured."""

    def draft_cost(self, n: int) -> float:
        """Cost of a draft forward over n tokens; past the measured curve, a pessimistic guess
        (each extra token a quarter of a step)."""
        if n <= len(self.draft):
            return self.draft[n - 1]
        last = self.draft[-1] if self.draft else self.draft_step
        return last + 0.25 * self.draft_step * (n - max(len(self.draft), 1))

    def catch_up_cost(self, n: int) -> float:
        """What feeding ``n`` tokens the draft has not seen (a prompt's prefill, the tokens of
        plain steps) adds to a draft forward: ``draft_cost(n + 1) - draft_step``. Past the
        measured curve it grows by the curve's per-token slope over its upper half (where wide
        forwards run as a prefill does: through a float32 twin, or compute-bound), not by the
        quarter-step guess ``draft_cost`` plans guesses with, which would price a 1,500-token
        prompt at several times what it costs."""
        if n <= 0:
            return 0.0
        measured = len(self.draft)
        if n + 1 <= measured or measured < 4:
            return max(self.draft_cost(n + 1) - self.draft_step, 0.0)
        half = measured // 2
        slope = (self.draft[-1] - self.draft[half - 1]) / (measured - half)
        slope = max(slope, 0.01 * self.draft_step)
        return max(self.draft[-1] + slope * (n + 1 - measured) - self.draft_step, 0.0)

    def step_cost(self, k: int) -> float:
        return k * self.draft_step + self.verify_cost(k + 1)


def expected_tokens(acceptance: float, k: int) -> float:
    """Expected tokens per verification with per-token acceptance a and k draft tokens."""
    a = min(max(acceptance, 0.0), 0.999999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def chained_gains(chances: Iterable[float], start: float = 1.0, reach: float = 1.0) -> list[float]:
    """Expected tokens of a step after each further draft token: ``start``, then each token
    adds the chance that it and every token before it are accepted (``reach`` times their
    ``chances``)."""
    gains, chance = [start], reach
    for p in chances:
        chance *= p
        gains.append(gains[-1] + chance)
    return gains


def draft_length(
    gains: Sequence[float], costs: CostModel, after: Callable[[float], float] | None = None
) -> tuple[int, float]:
    """How many draft tokens to keep (an index of ``gains``) for the most expected tokens per
    unit of the step's cost, verifying them after the context's last token plus ``after(gain)``
    (what emitting that many tokens costs later), and that rate."""
    step_costs = [
        costs.verify_cost(n + 1) + (after(gain) if after is not None else 0.0)
        for n, gain in enumerate(gains)
    ]
    length = most_per_cost(gains, step_costs)
    return length, gains[length] / step_costs[length]


def most_per_cost(gains: Sequence[float], costs: Sequence[float], margin: float = 1.0) -> int:
    """The index i with the most ``gains[i] / costs[i]`` (expected tokens per unit of cost);
    a later index must beat the best so far by the factor ``margin`` (ties keep the shorter).

    The whole range is searched, not until the rate first falls: measured verify curves are not
    monotone (on a 2-core CPU, 16 rows can cost less than 10), so one more token can be a loss
    while six more are a gain."""
    best, best_rate = 0, gains[0] / max(costs[0], 1e-9)
    for i in range(1, len(gains)):
        rate = gains[i] / max(costs[i], 1e-9)
        if rate > best_rate * margin:
            best, best_rate = i, rate
    return best


def prior_costs(target: Runner, draft: Runner | None) -> CostModel:
    """Costs to plan with until the measurement is done: a single-token forward of a model that
    streams its weights from memory costs about its weight bytes, so a draft step costs the
    ratio of the two models' bytes; verification grows a tenth of a step per extra token (the
    pessimistic default of ``CostModel``)."""
    if draft is None:
        return CostModel()
    ratio = draft.weight_bytes / max(target.weight_bytes, 1)
    return CostModel(draft_step=round(min(max(ratio, 0.01), 1.0), 3))


# --------------------------------------------------------------------------- measuring

MEASURED_LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
"""Forward lengths ``measure_costs`` times (every one up to 8, where kernels switch most; then a
grid, and always the longest asked for); the ones between are interpolated."""
Steps = Generator[None, None, Any]
R = TypeVar("R")


def measure_costs(
    target: Runner,
    draft: Runner | None,
    max_tokens: int,
    *,
    context_tokens: int = 32,
    repeats: int = 2,
    draft_tokens: int = 1,
) -> CostModel:
    """Measure the cost curve once: target forwards over 1..max_tokens new tokens, and draft
    forwards over 1..draft_tokens, relative to a single-token target forward (best of
    ``repeats`` after a warm-up), each runner timed by its own ``tune`` (which settles the
    engine's own choices the first time). With a draft and ``max_tokens`` 1, only the target's
    unit is timed, as it runs.

    Timing makes the result machine-dependent by design: the best k on a 2-core CPU is not the
    best k on a GPU. The curve is kept as measured, even where it falls: matrix libraries switch
    kernels with the row count (with MKL on 2 cores, 4 to 12 rows cost up to twice as much per
    row as 16), and a curve forced to rise would hide the long drafts that pay. Lengths between
    the measured ones (``MEASURED_LENGTHS``) are interpolated."""
    steps = measure_steps(
        target,
        draft,
        max_tokens,
        context_tokens=context_tokens,
        repeats=repeats,
        draft_tokens=draft_tokens,
    )
    return finish(steps)


def measure_steps(
    target: Runner,
    draft: Runner | None,
    max_tokens: int,
    *,
    context_tokens: int = 32,
    repeats: int = 2,
    draft_tokens: int = 1,
) -> Generator[None, None, CostModel]:
    """``measure_costs`` one timing at a time (it yields after each), returning the model."""

    def curve(runner: Runner, longest: int) -> Generator[None, None, dict[int, float]]:
        lengths = sorted({n for n in MEASURED_LENGTHS if n < longest} | {1, longest})
        return runner.tune(lengths, context_tokens=context_tokens, repeats=repeats)

    if draft is not None and max_tokens <= 1:
        # Only the draft's curve is wanted: the target's unit is 1 by definition, and the
        # draft's price in it is timed in turns below (``unit_ratio``).
        verify_seconds = {1: 1.0}
    else:
        verify_seconds = yield from curve(target, max(max_tokens, 1))
    unit = verify_seconds[1]
    verify = interpolate_costs({n: t / unit for n, t in verify_seconds.items()}, max(max_tokens, 1))
    if draft is None:
        return CostModel(verify=tuple(round(v, 2) for v in verify))
    draft_seconds = yield from curve(draft, max(draft_tokens, 1))
    # The draft's curve is its own ratios; what its unit costs in target steps is timed apart,
    # in turns with the target's (the curves themselves ran minutes apart).
    price = yield from unit_ratio(draft, target, context_tokens=context_tokens, repeats=repeats)
    scale = price / draft_seconds[1]
    drafts = [t * scale for t in interpolate_costs(draft_seconds, max(draft_tokens, 1))]
    return CostModel(
        draft_step=round(drafts[0], 2),
        verify=tuple(round(v, 2) for v in verify),
        draft=tuple(round(v, 2) for v in drafts),
    )


def forward_timer(
    runner: Runner, *, context_tokens: int = 32, repeats: int = 2, keep: int | None = None
) -> Callable[[int], float]:
    """``time(n)``: seconds of one forward of ``runner`` over n new tokens after
    ``context_tokens`` cached ones, as the runner runs it now (best of ``repeats``; the first
    time a length is timed, after one more run that warms kernels and allocator). ``keep``:
    logits of the last positions only, as a prefill asks (None: all, as a verification)."""
    vocab = runner.vocab_size
    context = [i % max(vocab - 1, 1) + 1 for i in range(context_tokens)]
    cache = runner.new_cache()
    runner.forward(context, cache, keep=1)
    warmed: set[int] = set()

    def time_forward(n: int) -> float:
        tokens = [context[i % context_tokens] for i in range(n)]
        best = math.inf
        runs = repeats if n in warmed else repeats + 1
        warmed.add(n)
        for _ in range(runs):
            start = time.perf_counter()
            logits = runner.forward(tokens, cache, keep)
            float(logits[-1, 0])  # synchronise with the device before reading the clock
            best = min(best, time.perf_counter() - start)
            crop_to(cache, context_tokens)
        return best

    return time_forward


def time_lengths(
    runner: Runner, lengths: Sequence[int], *, context_tokens: int = 32, repeats: int = 2
) -> Generator[None, None, dict[int, float]]:
    """Seconds of ``runner``'s forwards over each of ``lengths`` new tokens as it runs them now,
    one length per step (what ``Runner.tune`` does on an engine with nothing to choose).

    Each length is timed in turns with a single-token forward, in the same spell (the best of
    ``repeats`` of each), and given as its ratio to that unit times the best unit of all: a
    curve is a set of ratios, and a host whose speed drifts between lengths (a shared cloud
    machine, another process starting) would otherwise skew all of them by the spell the unit
    alone was timed in. Stored curves of one 2-core host, timed one length after the other,
    put 17 rows at 7.3 to 10.2 single steps."""
    timer = forward_timer(runner, context_tokens=context_tokens, repeats=1)
    ratios: dict[int, float] = {}
    units: list[float] = []
    for n in lengths:
        unit = took = math.inf
        for _ in range(max(repeats, 1)):
            unit = min(unit, timer(1))
            took = min(took, timer(n)) if n != 1 else unit
        units.append(unit)
        ratios[n] = took / unit
        yield
    best = min(units, default=0.0)
    return {n: ratio * best for n, ratio in ratios.items()}


def unit_ratio(
    runner: Runner, reference: Runner, *, context_tokens: int = 32, repeats: int = 2
) -> Generator[None, None, float]:
    """What ``runner``'s single-token forward costs in ``reference``'s, the two timed in turns
    (best of ``repeats`` each, one pair per step) so that a spell of slowness weighs on both:
    timed at different moments, a busy spell during either skews the ratio by its slowdown
    (``time_lengths`` does the same for one runner's lengths)."""
    mine = forward_timer(runner, context_tokens=context_tokens, repeats=1)
    theirs = forward_timer(reference, context_tokens=context_tokens, repeats=1)
    took = unit = math.inf
    for _ in range(max(repeats, 1)):
        took = min(took, mine(1))
        unit = min(unit, theirs(1))
        yield
    return took / unit


class SettlesNothing:
    """The step-cost side of ``Runner`` for an engine that chooses nothing by timing its
    forwards (llama.cpp picks its own kernels): ``tune`` only times, and there is nothing to
    store or take back."""

    def tune(
        self, lengths: Sequence[int], *, context_tokens: int = 32, repeats: int = 2
    ) -> Generator[None, None, dict[int, float]]:
        runner: Runner = self  # type: ignore[assignment]  # mixed into a runner
        return time_lengths(runner, lengths, context_tokens=context_tokens, repeats=repeats)

    @property
    def settings(self) -> dict[str, Any]:
        return {}

    def restore(self, settings: Mapping[str, Any]) -> bool:
        return True


def interpolate_costs(measured: dict[int, float], max_tokens: int) -> list[float]:
    """Costs for 1..max_tokens tokens from costs measured at some lengths (1 among them):
    linear between neighbours; no forward is taken to cost less than a single-token one."""
    known = sorted(measured)
    floor = measured[1]
    out = []
    for n in range(1, max_tokens + 1):
        if n in measured:
            out.append(max(floor, measured[n]))
            continue
        lower = max(m for m in known if m < n)
        upper = min((m for m in known if m > n), default=None)
        if upper is None:
            out.append(max(floor, measured[lower]))
            continue
        w = (n - lower) / (upper - lower)
        out.append(max(floor, (1 - w) * measured[lower] + w * measured[upper]))
    return out


def finish(steps: Generator[None, None, R]) -> R:
    """Run a measurement (``measure_steps``) to its end, on the calling thread."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            value: R = done.value
            return value
