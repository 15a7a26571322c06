"""The step-cost book: the curves one runtime plans with, measured in the background (one timing
at a time, under a lock) or taken back from what this machine measured before (``CurveStore``).
The decoding core plans with what it hands out (``decoding.costs.CostModel``)."""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterable
from typing import Any, Protocol

from ...decoding.costs import CostModel, finish, measure_steps, prior_costs
from ...decoding.engine import Runner

__all__ = ["COSTS_VERSION", "CostBook", "CurveStore"]


class CurveStore(Protocol):
    """Where measured curves outlive the process (``specagent.machine.ProbeStore``)."""

    def get(self, key: str) -> Any: ...

    def put(self, key: str, value: Any) -> None: ...


COSTS_VERSION = 10
"""Bumped whenever ``measure_costs`` measures differently: older stored costs are not reused.
3: a transposed kernel's win is confirmed by a second pair of timings before it is kept.
4: the transposed form feeds a single row as two, reaching the matrix-matrix kernel.
5: packed weights are a third form.
6: each length's form is chosen by the vote of two or three passes (``kernel_choice_steps``).
7: a runner's plan reroutes its linear modules, not every torch call (``LinearPlan.active``).
8: each engine keys its own curves and stores what it settled (``Runner.settings``).
9: each length is timed in turns with a single-token forward (``time_lengths``)."""


class CostBook:
    """The step costs one runtime plans with: the target's verify curve up to ``longest``
    tokens and each drafting runner's forward curve up to the same length (its lookup guesses
    widen draft forwards); prompt lookup costs nothing.

    A curve comes from ``store`` when this machine measured the same runner before (its
    ``speed_key``) and the runner takes back what it settled then (``Runner.restore``), else it
    is measured (``Runner.tune``) and stored with the runner's ``settings``. Until then,
    ``model`` answers with ``prior_costs``: ``measurement`` measures whatever is missing one
    timing at a time, which the runtime's worker runs between the steps of the calls it
    serves. Thread-safe: one timing at a time."""

    def __init__(self, target: Runner, longest: int, store: CurveStore | None = None) -> None:
        self.target = target
        self.longest = longest
        self.store = store
        self._verify: tuple[float, ...] | None = None
        self._drafts: dict[Runner, tuple[float, ...]] = {}
        """Each drafting runner's curve, keyed by the runner itself (the book holds it: a key
        never names another runner made later in a freed one's place, as an ``id`` would)."""
        self._lock = threading.RLock()

    def covers(self, longest: int) -> bool:
        return self.longest >= longest

    def is_measured(self, draft: Runner | None) -> bool:
        return self._verify is not None and (draft is None or draft in self._drafts)

    def model(self, draft: Runner | None) -> CostModel:
        """The measured costs of drafting with ``draft`` (None: a free drafter), or the prior
        while they are not measured yet."""
        if not self.is_measured(draft):
            return prior_costs(self.target, draft)
        return self._assemble(draft)

    def measured(self, draft: Runner | None) -> CostModel:
        """The measured costs, measuring now (on the calling thread) what is missing."""
        finish(self.measurement([draft]))
        return self._assemble(draft)

    def measurement(self, drafts: Iterable[Runner | None]) -> Generator[None, None, None]:
        """Measure what is missing for drafting with each of ``drafts``, one timing per step of
        the generator (the book is locked during a step, not between steps)."""
        wanted = list(dict.fromkeys(drafts))
        if not wanted:
            return
        yield from self._curve("verify", self.target, None)
        for draft in wanted:
            if draft is not None:
                yield from self._curve("draft", draft, draft)

    def _assemble(self, draft: Runner | None) -> CostModel:
        assert self._verify is not None
        drafts = self._drafts.get(draft, ()) if draft is not None else ()
        return CostModel(draft_step=drafts[0] if drafts else 0.0, verify=self._verify, draft=drafts)

    def _done(self, what: str, runner: Runner) -> bool:
        return self._verify is not None if what == "verify" else runner in self._drafts

    def _curve(
        self, what: str, runner: Runner, draft: Runner | None
    ) -> Generator[None, None, None]:
        key = f"{what}-v{COSTS_VERSION}:{runner.speed_key(self.longest)}:{self.target.speed_key()}"
        with self._lock:
            if self._done(what, runner):
                return
            stored = self.store.get(key) if self.store is not None else None
            if (
                isinstance(stored, dict)
                and stored.get("costs")
                and runner.restore(stored.get("settings") or {})
            ):
                self._keep(what, runner, tuple(float(c) for c in stored["costs"]))
                return
            if draft is None:
                steps = measure_steps(self.target, None, self.longest)
            else:
                steps = measure_steps(self.target, draft, 1, draft_tokens=self.longest)
        while True:
            with self._lock:
                if self._done(what, runner):  # measured meanwhile by another thread
                    steps.close()
                    return
                try:
                    next(steps)
                except StopIteration as done:
                    model: CostModel = done.value
                    costs = model.verify if draft is None else model.draft
                    self._keep(what, runner, costs)
                    if self.store is not None:
                        entry = {"costs": list(costs), "settings": dict(runner.settings)}
                        self.store.put(key, entry)
                    return
            yield

    def _keep(self, what: str, runner: Runner, costs: tuple[float, ...]) -> None:
        if what == "verify":
            self._verify = costs
        else:
            self._drafts[runner] = costs
