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
from dataclasses import dataclass, field

from .costs import CostModel, expected_tokens, most_per_cost

__all__ = ["AdaptiveSchedule", "FixedSchedule", "Schedule"]


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
        ks = range(self.max_k + 1)
        gains = [expected_tokens(a, k) for k in ks]
        return most_per_cost(gains, [self.costs.step_cost(k) for k in ks], margin=1.0001)

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
