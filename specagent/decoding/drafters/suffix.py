"""``suffix``: drafting from text already written (``SuffixDrafter``: the call's own context
and the history its policy may read; ``auto`` picks per step between it, the draft model and
plain decoding).

A history draft is free to make: its only cost is verifying it. Its length comes from the match:
each token carries its share of the vote among the places that matched (``history``), calibrated
by what the target accepted of earlier history drafts, and the draft is cut where one more token
is expected to cost more than it brings (``costs.most_per_cost`` over the verify curve).

Where a second draft is worth a few more rows of the same forward, the proposal carries a token
tree (``tree.py``): the history's runner-up beside its best continuation, and in ``auto`` the
history's continuation beside the draft model's draft.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

from ..alignment import SpanCopier
from ..costs import CostModel, chained_gains, draft_length, most_per_cost
from ..history import Continuation, SuffixIndex, continuation, runner_up
from ..proposal import EMPTY, DraftRequest, DraftTree, Proposal, TokenConstraint
from ..schedule import FixedSchedule, Schedule
from .base import Calibration, Drafter, DrafterBlock, DrafterKind, admissible

if TYPE_CHECKING:
    from ..parts import DraftingParts

__all__ = ["KIND", "HistoryFields", "SuffixConfig", "SuffixDrafter", "history_drafter"]


class HistoryFields(DrafterBlock):
    """Settings of kinds that draft from text already written."""

    history: Literal["none", "call", "policy", "tenant", "runtime"] = "call"
    """Whose text may propose tokens for this policy's calls, and where this policy's calls
    leave theirs. ``none``: no text at all (``auto`` then chooses between the draft model and
    plain decoding); ``call``: the call's own prompt and output, nothing kept after it;
    ``policy``: earlier calls of this policy and tenant; ``tenant``: earlier calls of this
    tenant under any policy that shares at tenant scope; ``runtime``: every earlier call on the
    runtime (single-tenant deployments: a call that names a tenant is refused). A tenant's text
    never drafts for another tenant's call."""
    tree: bool = False
    """Verify several drafts in one forward as a token tree where the measured costs say the
    extra rows pay: the history's runner-up continuation beside its best one (where earlier
    places split), and, for ``auto``, the history's continuation beside the draft model's draft.
    Lossless calls without a grammar; others verify the first draft alone. Off by default: on
    the 2-core CPUs measured it did not pay (within 0.3% either way, ``benchmarks/README.md``);
    a device whose verify curve stays flat for many rows is where it can."""

    def history_scope(self) -> str:
        return self.history


class SuffixConfig(HistoryFields):
    """``drafter: {kind: suffix, ...}``."""

    kind: Literal["suffix"] = "suffix"


class SuffixDrafter(Drafter):
    """Proposes text already written: per step, the better (by expected tokens per unit of
    cost) of what most often followed the context's longest match, in the call's own context
    (prompt and output so far) and in the earlier calls of ``shared`` indexes, and the aligned
    copy (``alignment.SpanCopier``) of the call's own text or of the caller's ``prediction``."""

    name = "suffix"

    def __init__(
        self,
        shared: Sequence[SuffixIndex] = (),
        costs: CostModel | None = None,
        own_context: bool = True,
        trees: bool = False,
        prediction: Sequence[int] = (),
    ) -> None:
        self.shared = list(shared)
        self.costs = costs or CostModel()
        self.trees = trees
        """Whether the history's runner-up continuation may ride beside its best one in a token
        tree (``with_runner_up``)."""
        self.own = SuffixIndex() if own_context else None
        self._indexed: list[int] = []
        self._calibration = Calibration(confidence=2.0, hits=1.6)
        """History tokens' vote shares against the target's acceptance (prior: 80% of the vote
        share)."""
        self.copiers = [SpanCopier([], own=True)] if own_context else []
        if prediction:
            self.copiers.append(SpanCopier(list(prediction), label="prediction"))
        self._chosen: SpanCopier | None = None
        """The copier whose draft was the last candidate (None: the n-gram match's)."""

    def candidate(
        self, context: list[int], limit: int, after: Callable[[float], float] | None = None
    ) -> tuple[Continuation, float]:
        """The draft worth proposing (cut by cost) and its expected tokens per unit of cost.
        ``after(tokens)``: what emitting that many tokens this way costs later (a draft model
        feeding them at its next draft), added to the verification's cost."""
        self._sync(context)
        best, best_rate = Continuation([], [], 0), 0.0
        self._chosen = None
        # The caller's prediction first: on a tie its tokens count as the prediction's.
        for copier in reversed(self.copiers):
            copied, rate = copier.candidate(context, limit, self.costs, after)
            if copied.tokens and rate > best_rate:
                best, best_rate, self._chosen = copied, rate, copier
        matched, rate = self._matched(context, limit, after)
        if matched.tokens and rate > best_rate:
            best, best_rate, self._chosen = matched, rate, None
        return best, best_rate

    def _matched(
        self, context: list[int], limit: int, after: Callable[[float], float] | None
    ) -> tuple[Continuation, float]:
        """The n-gram match's continuation, cut by cost, and its tokens per unit of cost."""
        found = continuation(self._indexes(), context, limit)
        if not found.tokens:
            return found, 0.0
        length, rate = draft_length(self.gains(found.confidences), self.costs, after)
        kept = Continuation(found.tokens[:length], found.confidences[:length], found.match_length)
        return kept, rate

    def _indexes(self) -> list[SuffixIndex]:
        return [self.own, *self.shared] if self.own is not None else self.shared

    def with_runner_up(
        self,
        context: list[int],
        found: Continuation,
        limit: int,
        after: Callable[[float], float] | None = None,
    ) -> Proposal:
        """``found`` as a proposal and, beside it in a token tree, the history's runner-up
        continuation (``history.runner_up``: where the earlier places split, the other way)
        where its extra rows pay. It leaves ``found`` after d shared tokens; reaching the split
        has the chance of ``found``'s first d tokens, and the branch then brings its own
        calibrated vote shares' products. Its length is the one with the most expected tokens
        per unit of the step's cost (verification and ``after``), and none unless that beats
        ``found`` alone."""
        main = self.take(found, None)
        if not self.trees or not found.tokens or self._chosen is not None:
            return main
        other = runner_up(self._indexes(), context, found, limit)
        if not other.tokens:
            return main
        calibration = self.calibration()
        reach = 1.0
        shared = 0
        for mine, theirs in zip(found.tokens, other.tokens, strict=False):
            if mine != theirs:
                break
            shared += 1
            reach *= min(found.confidences[shared - 1] * calibration, 0.999)
        tree_gains = self.gains(
            other.confidences[shared:], self.gains(found.confidences)[-1], reach
        )
        n = len(found.tokens)
        costs = [
            self.costs.verify_cost(n + 1 + extra) + (after(gain) if after is not None else 0.0)
            for extra, gain in enumerate(tree_gains)
        ]
        extra = most_per_cost(tree_gains, costs)
        if extra == 0:
            return main
        branch = Proposal(other.tokens[: shared + extra], source="history")
        return dataclasses.replace(main, tree=DraftTree.of([main, branch]))

    def gains(
        self, confidences: Sequence[float], start: float = 1.0, reach: float = 1.0
    ) -> list[float]:
        """Expected tokens of a step after each further history token: ``start``, then each
        token adds the chance that it and those before it are accepted (``reach`` times their
        calibrated vote shares, each capped below 1)."""
        calibration = self.calibration()
        return chained_gains((min(c * calibration, 0.999) for c in confidences), start, reach)

    def calibration(self) -> float:
        """What the target accepted of earlier history drafts per unit of their vote share."""
        return self._calibration.ratio()

    def take(self, found: Continuation, constraint: TokenConstraint | None) -> Proposal:
        """Propose ``found`` (the admissible part under a constraint)."""
        proposal = admissible(list(found.tokens), constraint) if found.tokens else EMPTY
        if self._chosen is not None:
            return Proposal(proposal.tokens, masks=proposal.masks, source=self._chosen.label)
        self._calibration.last = found.confidences[: len(proposal.tokens)]
        return Proposal(proposal.tokens, masks=proposal.masks, source="history")

    def propose(self, ask: DraftRequest) -> Proposal:
        found, _ = self.candidate(ask.context, ask.k)
        if ask.constraint is None:
            return self.with_runner_up(ask.context, found, ask.k)
        return self.take(found, ask.constraint)

    def observe(self, proposed: int, accepted: int) -> None:
        # A copier learns from the context it syncs to, every token written along its source.
        if self._chosen is None:
            self._calibration.judged(proposed, accepted)

    def _sync(self, context: list[int]) -> None:
        """Index the context's new tokens (a call's context only grows, unless a drafter was
        handed tokens that were then rejected: then start over)."""
        if self.own is None:
            return
        known = len(self._indexed)
        if context[:known] != self._indexed:
            self.own.remove(0)
            self._indexed, known = [], 0
            self.own.add(0, [])
        elif 0 not in self.own.docs:
            self.own.add(0, [])
        new = context[known:]
        self.own.extend(0, new)
        self._indexed.extend(new)


def build_suffix(config: SuffixConfig, parts: DraftingParts) -> tuple[Drafter | None, Schedule]:
    """The registry's builder for ``suffix``: history drafts, their length from the match."""
    drafter = history_drafter(config, parts)
    return drafter, FixedSchedule(config.num_speculative_tokens)


def history_drafter(config: HistoryFields, parts: DraftingParts) -> SuffixDrafter:
    own = config.history != "none"
    trees = config.tree and parts.target.inputs.trees
    return SuffixDrafter(
        parts.history, parts.costs(None), own_context=own, trees=trees, prediction=parts.prediction
    )


KIND = DrafterKind(SuffixConfig, build_suffix, reads_history=True)
