"""Drafting from text already written: ``SuffixDrafter`` (the call's own context and the history
its policy may read) and ``AutoDrafter``, which picks per step between a history match, the
draft model and plain decoding by expected tokens per unit of cost.

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
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING

import torch

from .costs import CostModel, expected_tokens, most_per_cost
from .draft_model import DraftModelDrafter, build_draft_model
from .drafters import Drafter, StepwiseDrafter, _admissible
from .engine import ForwardRequest
from .history import Continuation, SuffixIndex, continuation, runner_up
from .proposal import EMPTY, DraftTree, Proposal, TokenConstraint
from .sampling import SamplingParams
from .schedule import AdaptiveSchedule, FixedSchedule, Schedule

if TYPE_CHECKING:
    from .parts import DrafterSettings, DraftingParts

__all__ = ["AutoDrafter", "SuffixDrafter", "build_auto", "build_suffix"]


class SuffixDrafter(Drafter):
    """Proposes what most often followed the context's longest match, in the call's own context
    (prompt and output so far) and in the earlier calls of ``shared`` indexes."""

    name = "suffix"

    def __init__(
        self,
        shared: Sequence[SuffixIndex] = (),
        costs: CostModel | None = None,
        own_context: bool = True,
        trees: bool = False,
    ) -> None:
        self.shared = list(shared)
        self.costs = costs or CostModel()
        self.trees = trees
        """Whether the history's runner-up continuation may ride beside its best one in a token
        tree (``with_runner_up``)."""
        self.own = SuffixIndex() if own_context else None
        self._indexed: list[int] = []
        self._tested_confidence = 2.0
        self._tested_hits = 1.6
        """Decayed sums over judged history tokens: their vote shares, and how many the target
        accepted (prior: 80% of the vote share)."""
        self._last_confidences: list[float] = []

    def candidate(
        self, context: list[int], limit: int, after: Callable[[float], float] | None = None
    ) -> tuple[Continuation, float]:
        """The draft worth proposing (cut by cost) and its expected tokens per unit of cost.
        ``after(tokens)``: what emitting that many tokens this way costs later (a draft model
        feeding them at its next draft), added to the verification's cost."""
        self._sync(context)
        found = continuation(self._indexes(), context, limit)
        if not found.tokens:
            return found, 0.0
        gains = self.gains(found.confidences)
        costs = [self.costs.verify_cost(n + 1) for n in range(len(gains))]
        if after is not None:
            costs = [cost + after(gain) for cost, gain in zip(costs, gains, strict=True)]
        length = most_per_cost(gains, costs)
        kept = Continuation(found.tokens[:length], found.confidences[:length], found.match_length)
        return kept, gains[length] / costs[length]

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
        if not self.trees or not found.tokens:
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
        gains, chance = [start], reach
        for confidence in confidences:
            chance *= min(confidence * calibration, 0.999)
            gains.append(gains[-1] + chance)
        return gains

    def calibration(self) -> float:
        """What the target accepted of earlier history drafts per unit of their vote share."""
        return self._tested_hits / self._tested_confidence

    def take(self, found: Continuation, constraint: TokenConstraint | None) -> Proposal:
        """Propose ``found`` (the admissible part under a constraint)."""
        proposal = _admissible(list(found.tokens), constraint) if found.tokens else EMPTY
        self._last_confidences = found.confidences[: len(proposal.tokens)]
        return Proposal(proposal.tokens, masks=proposal.masks, source="history")

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        constraint: TokenConstraint | None = None,
    ) -> Proposal:
        found, _ = self.candidate(context, k)
        if constraint is None:
            return self.with_runner_up(context, found, k)
        return self.take(found, constraint)

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        judged = self._last_confidences[: min(accepted + 1, proposed)]
        self._tested_confidence = self._tested_confidence * 0.9 + sum(judged)
        self._tested_hits = self._tested_hits * 0.9 + accepted

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


class AutoDrafter(StepwiseDrafter):
    """Per step, the best of: a history match (free to draft), the draft model (when the runtime
    has one; its own adaptive schedule says whether and how well it pays), and plain decoding,
    by expected tokens per unit of cost."""

    name = "auto"

    def __init__(
        self,
        history: SuffixDrafter,
        model: DraftModelDrafter | None = None,
        schedule: Schedule | None = None,
        trees: bool = False,
    ) -> None:
        self.history = history
        self.model = model
        self.schedule = schedule
        self.trees = trees
        """Whether a history continuation may ride beside the model's draft in a token tree."""
        self._source: str | None = None

    def propose_steps(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        constraint: TokenConstraint | None = None,
    ) -> Generator[ForwardRequest, torch.Tensor | None, Proposal]:
        model_k, model_rate = 0, 0.0
        if self.model is not None and self.schedule is not None:
            model_k = self.schedule.next_k(k)
            if model_k > 0 and not self.model.catch_up_pays(context):
                model_k = 0  # catching the draft up would cost more than the call can save
            if model_k > 0 and isinstance(self.schedule, AdaptiveSchedule):
                best = max(self.schedule.best_k(), 1)
                costs = self.schedule.costs
                model_rate = expected_tokens(self.schedule.acceptance, best) / costs.step_cost(best)
            elif model_k > 0:  # a fixed k: the policy asked for the draft model at every step
                model_rate = 1.0
        found, history_rate = self.history.candidate(
            context, k, self._catch_up if model_k > 0 else None
        )
        self._source = None
        if found.tokens and history_rate >= max(model_rate, 1.0):
            self._source = "history"
            if constraint is None:
                after = self._catch_up if model_k > 0 else None
                return self.history.with_runner_up(context, found, k, after)
            return self.history.take(found, constraint)
        if self.model is not None and model_k > 0:
            self._source = "model"
            proposal: Proposal = yield from self.model.propose_steps(
                context, model_k, params, generator, constraint
            )
            if self.trees and found.tokens and proposal.tokens and constraint is None:
                return self._with_history_branch(proposal, found)
            return proposal
        return EMPTY

    def _catch_up(self, tokens: float) -> float:
        """What a history draft that emits ``tokens`` costs the draft model later: it feeds
        them at its next draft (one forward over them all, more than a single-token step)."""
        costs = self.model.costs if self.model is not None else None
        if costs is None or not costs.draft:
            return 0.0
        # A draft after a model step feeds one token (the one the target added); these, more.
        whole = int(tokens - 1.0)
        low, high = costs.catch_up_cost(whole), costs.catch_up_cost(whole + 1)
        return low + (high - low) * (tokens - 1.0 - whole)

    def _with_history_branch(self, proposal: Proposal, found: Continuation) -> Proposal:
        """The model's draft, and beside it in a token tree the history's where that is
        expected to pay: the history's tokens are free to draft and cost only the rows they add
        to the verification; they bring tokens when the model's draft is rejected where the
        history's continues. With the model's acceptance a and the history's calibrated
        confidences c, a history branch leaving the model's draft after d shared tokens brings
        ``a^d (1 - a) (c_d + c_d c_(d+1) + ...)`` expected tokens; its length is the one with
        the most expected tokens per unit of the step's cost (draft forwards and verification),
        and none at all unless that beats the model's draft alone."""
        shared = 0
        for mine, theirs in zip(proposal.tokens, found.tokens, strict=False):
            if mine != theirs:
                break
            shared += 1
        if shared >= len(found.tokens) or not isinstance(self.schedule, AdaptiveSchedule):
            return proposal
        costs = self.schedule.costs
        acceptance = min(max(self.schedule.acceptance, 0.0), 0.999)
        n = len(proposal.tokens)
        spent = costs.step_cost(n) - costs.verify_cost(n + 1)  # the draft's forwards
        reach = acceptance**shared * (1.0 - acceptance)
        gains = self.history.gains(
            found.confidences[shared:], expected_tokens(acceptance, n), reach
        )
        step_costs = [spent + costs.verify_cost(n + 1 + extra) for extra in range(len(gains))]
        extra = most_per_cost(gains, step_costs)
        if extra == 0:
            return proposal
        branch = self.history.take(
            Continuation(
                found.tokens[: shared + extra],
                found.confidences[: shared + extra],
                found.match_length,
            ),
            None,
        )
        tree = DraftTree.of([proposal, branch])
        return dataclasses.replace(proposal, tree=tree)

    def leave_cache(self) -> None:
        """The draft model's KV goes to the prefix cache at the end of the call."""
        if self.model is not None:
            self.model.leave_cache()

    def observe_tree(self, tree: DraftTree, path: list[int]) -> None:
        """A token tree was judged: the model's draft and the history's first (best) one learn
        how far the accepted path followed them (a runner-up's vote shares are not the ones
        the history's calibration tracks)."""
        history_seen = False
        for chain, source in enumerate(tree.sources):
            proposed, accepted = len(tree.chains[chain]), tree.accepted_of(chain, path)
            if source == "history":
                if not history_seen:
                    self.history.observe(proposed, accepted)
                history_seen = True
            elif self.model is not None:
                self.model.observe(proposed, accepted)
                if self.schedule is not None:
                    self.schedule.observe(proposed, accepted)

    def observe(self, proposed: int, accepted: int) -> None:
        if self._source == "history":
            self.history.observe(proposed, accepted)
        elif self._source == "model" and self.model is not None:
            self.model.observe(proposed, accepted)
            if self.schedule is not None:
                self.schedule.observe(proposed, accepted)


def build_suffix(config: DrafterSettings, parts: DraftingParts) -> tuple[Drafter | None, Schedule]:
    """The registry's builder for ``suffix``: history drafts, their length from the match."""
    drafter = _history_drafter(config, parts)
    return drafter, FixedSchedule(config.num_speculative_tokens)


def build_auto(config: DrafterSettings, parts: DraftingParts) -> tuple[Drafter | None, Schedule]:
    """The registry's builder for ``auto``: history, the draft model (if any) or plain."""
    history = _history_drafter(config, parts)
    if parts.draft is None:
        return AutoDrafter(history), FixedSchedule(config.num_speculative_tokens)
    model, schedule = build_draft_model(config, parts)
    trees = config.tree and parts.target.takes_trees
    return (
        AutoDrafter(history, model, schedule, trees=trees),
        FixedSchedule(config.num_speculative_tokens),
    )


def _history_drafter(config: DrafterSettings, parts: DraftingParts) -> SuffixDrafter:
    own = config.history != "none"
    trees = config.tree and parts.target.takes_trees
    return SuffixDrafter(parts.history, parts.costs(None), own_context=own, trees=trees)
