"""A call's prediction beside a drafter that does not read text (``prompt_lookup``,
``draft_model``, ``early_exit``): per step, the aligned copy of the prediction where it is
expected to bring more than plain decoding, else the drafter's own draft at the length its own
schedule picks (zero: plain decoding). (``suffix`` and ``auto`` weigh the prediction among
their own text sources: ``suffix.SuffixDrafter``.)"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from ..alignment import SpanCopier
from ..costs import CostModel
from ..engine import ForwardRequest
from ..proposal import EMPTY, DraftRequest, DraftTree, Proposal
from ..schedule import Schedule
from .base import Drafter, StepwiseDrafter, admissible

__all__ = ["PredictedDrafter"]


class PredictedDrafter(StepwiseDrafter):
    """``inner``'s drafts, except where the prediction's aligned copy pays (see the module)."""

    def __init__(
        self, inner: Drafter, schedule: Schedule, prediction: Sequence[int], costs: CostModel
    ) -> None:
        self.inner = inner
        self.schedule = schedule
        """The inner drafter's own schedule (the loop's is fixed at the policy's k: the
        prediction may draft where the inner drafter's schedule would not)."""
        self.name = inner.name
        self.copier = SpanCopier(list(prediction), label="prediction")
        self.costs = costs
        self._copied = False
        """Whether the last proposal was the prediction's."""

    def propose_steps(
        self, ask: DraftRequest
    ) -> Generator[ForwardRequest, torch.Tensor | None, Proposal]:
        found, rate = self.copier.candidate(ask.context, ask.k, self.costs)
        self._copied = bool(found.tokens) and rate > 1.0
        if self._copied:
            kept = admissible(list(found.tokens), ask.constraint)
            return Proposal(kept.tokens, masks=kept.masks, source="prediction")
        own_k = self.schedule.next_k(ask.k)
        if own_k <= 0:
            return EMPTY
        return (yield from self.inner.propose_steps(ask._replace(k=own_k)))

    def observe(self, proposed: int, accepted: int) -> None:
        # The copier learns from the context it syncs to (``SpanCopier.sync``).
        if not self._copied:
            self.schedule.observe(proposed, accepted)
            self.inner.observe(proposed, accepted)

    def observe_tree(self, tree: DraftTree, path: list[int]) -> None:
        self.inner.observe_tree(tree, path)

    def leave_cache(self) -> None:
        self.inner.leave_cache()
