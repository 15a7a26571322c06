"""``auto``: per step, the better of a history match (``suffix.SuffixDrafter``), the draft
model's draft (``model_drafts.DraftModelDrafter``) and plain decoding, by expected tokens per unit
of cost; where a second draft is worth a few more rows of the same forward, both as one token
tree."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import TYPE_CHECKING, Literal

import torch

from ..costs import expected_tokens, most_per_cost
from ..engine import ForwardRequest
from ..history import Continuation
from ..proposal import EMPTY, DraftRequest, DraftTree, Proposal
from ..schedule import AdaptiveSchedule, FixedSchedule, Schedule
from .base import Drafter, DrafterKind, StepwiseDrafter
from .draft_model import ModelDraftFields, build_draft_model
from .model_drafts import DraftModelDrafter
from .suffix import HistoryFields, SuffixDrafter, history_drafter

if TYPE_CHECKING:
    from ..parts import DraftingParts

__all__ = ["KIND", "AutoConfig", "AutoDrafter"]


class AutoConfig(ModelDraftFields, HistoryFields):
    """``drafter: {kind: auto, ...}``: the draft model's settings and the history's."""

    kind: Literal["auto"] = "auto"


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
        self, ask: DraftRequest
    ) -> Generator[ForwardRequest, torch.Tensor | None, Proposal]:
        context, k, _, _, constraint = ask
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
            proposal: Proposal = yield from self.model.propose_steps(ask._replace(k=model_k))
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


def build_auto(config: AutoConfig, parts: DraftingParts) -> tuple[Drafter | None, Schedule]:
    """The registry's builder for ``auto``: history, the draft model (if any) or plain."""
    history = history_drafter(config, parts)
    if parts.draft is None:
        return AutoDrafter(history), FixedSchedule(config.num_speculative_tokens)
    model, schedule = build_draft_model(config, parts)
    trees = config.tree and parts.target.inputs.trees
    return (
        AutoDrafter(history, model, schedule, trees=trees),
        FixedSchedule(config.num_speculative_tokens),
    )


KIND = DrafterKind(AutoConfig, build_auto, lambda config, parts: parts.draft, reads_history=True)
