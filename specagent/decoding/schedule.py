"""How many draft tokens to propose at each step.

Fixed-k speculation wastes time twice: on prose where the draft is rarely right, and on hardware
where verifying k + 1 tokens costs far more than verifying 1 (on a 2-core CPU, verifying 4 tokens
costs twice as much as 3). ``AdaptiveSchedule`` picks, before every step, the k that maximises
expected tokens per unit of cost:

    E(k) = (1 - a^(k+1)) / (1 - a)          expected tokens emitted by one verification
    C(k) = k * draft_cost + verify_cost(k+1) cost of drafting k and verifying k + 1 tokens

with ``a`` the per-token acceptance estimated from the call so far (a decayed Beta posterior),
and costs relative to one single-token target forward (``CostModel``). k = 0 is plain decoding;
while it is chosen, a probe step every few steps keeps the estimate from freezing.

With a draft model that plans its own length (``drafter_stops``), the schedule only chooses
between drafting (up to ``max_k``) and plain decoding; the drafter ends each draft where its own
confidence, calibrated by what the target accepted, says further tokens no longer pay
(``DraftModelDrafter._planned_length``): it knows, token by token, what the schedule can only
average.

The schedule is a deterministic function of what it observed, so a seeded call is reproducible for
a given cost model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .cache import ModelRunner, crop_to
from .kernels import LinearPlan, choose_kernels

__all__ = [
    "AdaptiveSchedule",
    "CostModel",
    "FixedSchedule",
    "Schedule",
    "forward_timer",
    "interpolate_costs",
    "measure_costs",
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

    def step_cost(self, k: int) -> float:
        return k * self.draft_step + self.verify_cost(k + 1)


def expected_tokens(acceptance: float, k: int) -> float:
    """Expected tokens per verification with per-token acceptance a and k draft tokens."""
    a = min(max(acceptance, 0.0), 0.999999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class Schedule:
    """Interface: ``next_k(limit)`` before a step, ``observe(proposed, accepted)`` after it."""

    def next_k(self, limit: int) -> int:
        raise NotImplementedError

    def observe(self, proposed: int, accepted: int) -> None:
        """Learn from a step that proposed ``proposed`` tokens and accepted ``accepted``."""


@dataclass
class FixedSchedule(Schedule):
    """Always k (capped by what the call still has room for)."""

    k: int

    def next_k(self, limit: int) -> int:
        return max(0, min(self.k, limit))


@dataclass
class AdaptiveSchedule(Schedule):
    """Cost-aware k from observed acceptance (see the module docstring)."""

    max_k: int
    costs: CostModel = field(default_factory=CostModel)
    prior_acceptance: float = 0.8
    prior_weight: float = 0.5
    """A light prior: two or three fully accepted steps should be enough to reach the long
    drafts that deterministic text (code, JSON) pays for; drafters with a confidence stop cut
    a long draft short where they are unsure, so erring long is cheap."""
    decay: float = 0.95
    """Weight kept by old observations per step: acceptance drifts within a call (code vs prose),
    but a slow decay lets the estimate reach the 0.97+ that long drafts need."""
    probe_every: int = 8
    """Fewest plain steps between two probes (a one-token draft that keeps the acceptance
    estimate from freezing while drafting does not pay)."""
    probe_budget: float = 0.02
    """Probes may cost a call that never drafts at most this share of its time: where a probe
    costs more than a plain step by c target steps (``step_cost(1) - 1``: drafting one token
    and verifying two, on CPUs where a second row costs nearly a whole step), probes come only
    every ``c / probe_budget`` plain steps."""
    drafter_stops: bool = False
    """The drafter ends each draft by cost itself (``DraftModelDrafter`` with costs): whenever
    drafting pays, allow up to ``max_k`` and let the drafter stop where its own confidence says
    further tokens no longer pay. The schedule then only chooses between drafting and plain
    decoding."""
    _hits: float = field(init=False, default=0.0)
    _trials: float = field(init=False, default=0.0)
    _plain_steps: int = field(init=False, default=0)

    @property
    def acceptance(self) -> float:
        hits = self._hits + self.prior_acceptance * self.prior_weight
        return hits / (self._trials + self.prior_weight)

    def best_k(self) -> int:
        a = self.acceptance
        best, best_rate = 0, 1.0 / self.costs.step_cost(0)
        for k in range(1, self.max_k + 1):
            rate = expected_tokens(a, k) / self.costs.step_cost(k)
            if rate > best_rate * 1.0001:
                best, best_rate = k, rate
        return best

    @property
    def probe_interval(self) -> int:
        """Plain steps between probes (see ``probe_budget``)."""
        extra = max(self.costs.step_cost(1) - 1.0, 0.0)
        return max(self.probe_every, math.ceil(extra / self.probe_budget))

    def next_k(self, limit: int) -> int:
        k = self.best_k()
        if k > 0 and self.drafter_stops:
            k = self.max_k
        if k == 0:
            self._plain_steps += 1
            if self._plain_steps >= self.probe_interval:
                self._plain_steps = 0
                k = 1
        return max(0, min(k, limit))

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self._hits = self._hits * self.decay + accepted
        self._trials = self._trials * self.decay + accepted + (1 if accepted < proposed else 0)


MEASURED_LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)
"""Forward lengths ``measure_costs`` times (every one up to 8, where kernels switch most; then a
grid, and always the longest asked for); the ones between are interpolated."""
PREFILL_LENGTHS = (48, 96, 192)
"""Longer forwards, timed once each way for the kernel choice only: prompt prefills (and the
draft's catch-up after plain steps) run through the same linear layers. Past the last one,
torch's kernels."""


def measure_costs(
    target: ModelRunner,
    draft: ModelRunner | None,
    max_tokens: int,
    *,
    context_tokens: int = 32,
    repeats: int = 2,
    draft_tokens: int = 1,
) -> CostModel:
    """Measure the cost curve once: target forwards over 1..max_tokens new tokens, and draft
    forwards over 1..draft_tokens, relative to a single-token target forward (best of
    ``repeats`` after a warm-up).

    Each length (and the prefill lengths of ``PREFILL_LENGTHS``) is timed with torch's linear
    kernels and with the transposed form of ``kernels.choose_kernels``; the faster is kept, and
    each runner is left with the kernels its costs were measured under (``ModelRunner.kernels``).
    With a draft and ``max_tokens`` 1, only the target's unit is timed, with its kernels as
    they are.

    Timing makes the result machine-dependent by design: the best k on a 2-core CPU is not the
    best k on a GPU. The curve is kept as measured, even where it falls: matrix libraries switch
    kernels with the row count (with MKL on 2 cores, 4 to 12 rows cost up to twice as much per
    row as 16), and a curve forced to rise would hide the long drafts that pay. Lengths between
    the measured ones (``MEASURED_LENGTHS``) are interpolated. The runtime measures once and
    keeps the result, so seeded calls on one runtime stay reproducible."""

    def curve(runner: ModelRunner, longest: int) -> dict[int, float]:
        lengths = {n for n in MEASURED_LENGTHS if n < longest} | {1, longest}
        timer = forward_timer(runner, context_tokens=context_tokens, repeats=repeats)
        prefill_timer = forward_timer(runner, context_tokens=context_tokens, repeats=1, keep=1)

        def time_forward(n: int, plan: LinearPlan) -> float:
            return timer(n, plan) if n in lengths else prefill_timer(n, plan)

        prefills = [n for n in PREFILL_LENGTHS if n > longest]
        plan, seconds = choose_kernels(time_forward, sorted(lengths) + prefills)
        runner.kernels = plan
        return {n: t for n, t in seconds.items() if n in lengths}

    if draft is not None and max_tokens <= 1:
        # Only the unit is wanted: the target keeps the kernels an earlier measurement chose.
        verify_seconds = {1: forward_timer(target, repeats=repeats)(1, target.kernels)}
    else:
        verify_seconds = curve(target, max(max_tokens, 1))
    unit = verify_seconds[1]
    verify = interpolate_costs({n: t / unit for n, t in verify_seconds.items()}, max(max_tokens, 1))
    if draft is None:
        return CostModel(verify=tuple(round(v, 2) for v in verify))
    draft_seconds = curve(draft, max(draft_tokens, 1))
    drafts = [t / unit for t in interpolate_costs(draft_seconds, max(draft_tokens, 1))]
    return CostModel(
        draft_step=round(drafts[0], 2),
        verify=tuple(round(v, 2) for v in verify),
        draft=tuple(round(v, 2) for v in drafts),
    )


def forward_timer(
    runner: ModelRunner, *, context_tokens: int = 32, repeats: int = 2, keep: int | None = None
) -> Callable[[int, LinearPlan], float]:
    """``time(n, plan)``: seconds of one forward of ``runner`` over n new tokens after
    ``context_tokens`` cached ones, with the linear kernels of ``plan`` (best of ``repeats``;
    the first time a length is timed, after one more run that warms kernels and allocator).
    ``keep``: logits of the last positions only, as a prefill asks (None: all, as a
    verification)."""
    vocab = runner.vocab_size
    context = [i % max(vocab - 1, 1) + 1 for i in range(context_tokens)]
    cache = runner.new_cache()
    runner.forward(context, cache, keep=1)
    warmed: set[int] = set()

    def time_forward(n: int, plan: LinearPlan) -> float:
        tokens = [context[i % context_tokens] for i in range(n)]
        before, runner.kernels = runner.kernels, plan
        try:
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
        finally:
            runner.kernels = before

    return time_forward


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
