"""What every drafter is (``Drafter``, ``StepwiseDrafter``), the policy block every kind's
settings extend (``DrafterBlock``, ``AdaptiveFields``), what each kind declares to the registry
(``DrafterKind``: its settings, its builder, the model its drafting costs, and what it needs),
and the helpers drafters share (``lookup_continuation``, ``admissible``, ``run_inline``)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..engine import ForwardRequest, Runner, advance
from ..proposal import EMPTY, DraftRequest, DraftTree, Proposal, TokenConstraint
from ..schedule import Schedule

if TYPE_CHECKING:
    from ..parts import DraftingParts

__all__ = [
    "AdaptiveFields",
    "Calibration",
    "Drafter",
    "DrafterBlock",
    "DrafterKind",
    "StepwiseDrafter",
    "admissible",
    "lookup_continuation",
    "run_inline",
]


T = TypeVar("T")


def run_inline(steps: Generator[ForwardRequest, torch.Tensor | None, T]) -> T:
    """Drive a coroutine of forward requests to its value, running each forward directly."""
    try:
        item = advance(steps, None, inline=True)
    except StopIteration as stop:
        value: T = stop.value
        return value
    raise TypeError(f"a drafting coroutine yielded {type(item).__name__}, not a forward request")


class Drafter:
    """Proposes draft tokens for one call. A drafter answers ``propose`` at once (no model to
    run: lookup, history) or, running a model, is a ``StepwiseDrafter`` whose ``propose_steps``
    yields each forward so the runtime can batch them across calls. What a drafter does not
    need (tree feedback, a cache to leave) it inherits as a no-op."""

    name: str = "drafter"

    def propose(self, ask: DraftRequest) -> Proposal:
        """Up to ``ask.k`` tokens to follow ``ask.context`` (prompt + output so far). Under
        ``ask.constraint``, only allowed tokens, each consumed into it (the loop rolls them
        back)."""
        raise NotImplementedError

    def propose_steps(
        self, ask: DraftRequest
    ) -> Generator[ForwardRequest, torch.Tensor | None, Proposal]:
        """``propose`` as a coroutine of forward requests: none here (nothing to run)."""
        yield from ()
        return self.propose(ask)

    def observe(self, proposed: int, accepted: int) -> None:
        """How many of the last proposal's tokens the target accepted (nothing to learn here)."""

    def observe_tree(self, tree: DraftTree, path: list[int]) -> None:
        """The last proposal's token tree was judged: the accepted ``path`` (nodes). By default
        the drafter learns how far the path followed the proposal's own tokens (the tree's
        first draft)."""
        self.observe(len(tree.chains[0]), tree.accepted_of(0, path))

    def leave_cache(self) -> None:
        """At the end of the call: hand what the drafter holds for later calls to the prefix
        cache (nothing here)."""


class StepwiseDrafter(Drafter):
    """Base of drafters that run a model: ``propose_steps`` yields each draft forward (so the
    runtime can batch them across calls); ``propose`` runs them inline."""

    def propose(self, ask: DraftRequest) -> Proposal:
        return run_inline(self.propose_steps(ask))

    def propose_steps(
        self, ask: DraftRequest
    ) -> Generator[ForwardRequest, torch.Tensor | None, Proposal]:
        raise NotImplementedError


@dataclass
class Calibration:
    """How far a drafter's confidence in its tokens is borne out by the target: decayed sums
    (0.9 per judged proposal) over the tokens the target judged, of the drafter's confidence in
    each and of how many it accepted (the priors: the drafter's expectation before any). Their
    ratio scales the drafter's next confidences."""

    confidence: float
    hits: float
    last: list[float] = field(default_factory=list)
    """The drafter's confidence in each token of its last proposal."""

    def ratio(self) -> float:
        return self.hits / self.confidence

    def judged(self, proposed: int, accepted: int) -> None:
        """The target judged the last proposal's tokens up to the first rejected one."""
        if proposed <= 0:
            return
        judged = self.last[: min(accepted + 1, proposed)]
        self.confidence = self.confidence * 0.9 + sum(judged)
        self.hits = self.hits * 0.9 + accepted


def lookup_continuation(
    context: Sequence[int], limit: int, min_ngram: int, max_ngram: int
) -> list[int]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the context's last
    n-gram (longest n first, ``max_ngram`` down to ``min_ngram``); empty when none occurs."""
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = context[length - n :]
        # Search right to left, excluding the tail itself.
        for start in range(length - n - 1, -1, -1):
            if context[start : start + n] == tail:
                follow = context[start + n : start + n + limit]
                if follow:
                    return list(follow)
    return []


def admissible(tokens: list[int], constraint: TokenConstraint | None) -> Proposal:
    """The longest prefix of ``tokens`` the constraint allows, consumed into it, with masks."""
    if constraint is None:
        return Proposal(tokens=tokens)
    masks: list[torch.Tensor] = []
    for token in tokens:
        mask = constraint.allowed()
        if not bool(mask[token]):
            break
        masks.append(mask)
        constraint.consume([token])
        if constraint.is_stopped():
            break
    kept = tokens[: len(masks)]
    return Proposal(tokens=kept, masks=masks) if kept else EMPTY


class DrafterBlock(BaseModel):
    """A policy's ``drafter`` block: the settings every kind has. Each kind's module extends it
    with its own fields and a ``Literal`` kind (``prompt_lookup.PromptLookupConfig``, ...), and
    a block holds only its kind's fields, so a setting another kind reads is an error rather than
    silently ignored (as the relaxed rules' blocks). The registry picks the class by ``kind``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    """The name the kind is registered under in ``decoding.registry.DRAFTERS``."""
    num_speculative_tokens: int = Field(default=4, ge=1, le=64)
    """k: the most draft tokens proposed per step."""

    @model_validator(mode="before")
    @classmethod
    def _a_kind_of_drafter(cls, data: Any) -> Any:
        if cls is DrafterBlock:
            msg = (
                "a drafter block is validated as its kind's settings: give a kind's class "
                "(such as PromptLookupConfig) or validate it within a policy"
            )
            raise ValueError(msg)
        return data

    def fallback_block(self) -> DrafterBlock | None:
        """What a runtime without a draft model runs instead of this block (None: nothing)."""
        return None

    def history_scope(self) -> str:
        """Whose earlier text drafts for the policy's calls (``HistoryFields.history``); a kind
        that reads no history drafts from nothing kept."""
        return "none"

    def fixed(self, k: int) -> DrafterBlock:
        """This block drafting up to ``k`` tokens every step, adaptive choices off (what
        ``specagent tune`` measures: the raw cost of one setting)."""
        return self.model_copy(update={"num_speculative_tokens": k})


class AdaptiveFields(DrafterBlock):
    """Settings of kinds that can pick k per step."""

    adaptive: bool = True
    """Pick k per step from observed acceptance and measured step costs (k = 0: plain decoding);
    draft models also end each draft where their calibrated confidence says one more token no
    longer pays."""

    def fixed(self, k: int) -> DrafterBlock:
        return super().fixed(k).model_copy(update={"adaptive": False})


Build = Callable[[Any, "DraftingParts"], "tuple[Drafter | None, Schedule]"]


@dataclass(frozen=True)
class DrafterKind:
    """One drafter kind as its module declares it to ``decoding.registry.DRAFTERS``: how a
    call's drafter and schedule are built from the policy's settings, and what it needs."""

    config: type[DrafterBlock]
    """The kind's policy block (its ``kind`` is the name it is registered under)."""
    build: Build
    cost_runner: Callable[[Any, DraftingParts], Runner | None] = lambda config, parts: None
    """The model whose forwards drafting costs (None: free; only verification is priced)."""
    needs_draft_model: bool = False
    check: Callable[[Any, int], str | None] = lambda config, num_layers: None
    """A problem with the settings on a target of that many layers (None: fits)."""
    drafts: bool = True
    """Whether it proposes tokens at all (plain decoding does not: no costs to measure, no
    relaxed rule to apply)."""
    reads_history: bool = False
    """It drafts from earlier calls' text (``drafter.history``): its calls get a history key."""
    cuts_layers: bool = False
    """It runs the target's first layers: only on an engine whose models declare
    ``Capabilities.early_exit``."""
