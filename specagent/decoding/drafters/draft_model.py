"""``draft_model``: drafting with a separate small model that shares the target's tokenizer
(``model_drafts.DraftModelDrafter``; ``early_exit`` drafts the same way with the target's own
first layers): its policy block, the settings every model-drafting kind shares, and its
builder."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from ..engine import Runner
from ..schedule import AdaptiveSchedule, FixedSchedule, Schedule
from .base import AdaptiveFields, DrafterBlock, DrafterKind
from .model_drafts import DraftModelDrafter
from .prompt_lookup import NgramFields

if TYPE_CHECKING:
    from ..parts import DraftingParts

    FallbackConfig = DrafterBlock

__all__ = [
    "KIND",
    "DraftModelConfig",
    "ModelDraftFields",
    "build_draft_model",
    "model_drafter",
]


class ModelDraftFields(AdaptiveFields, NgramFields):
    """Settings of kinds that draft with a model (``draft_model``, ``early_exit``, ``auto``);
    the n-grams are those of the draft's lookup guesses (n >= 2)."""

    confidence_threshold: float = Field(default=0.4, ge=0.0, le=1.0)
    """Stop a step's draft early when the draft's top probability falls below this (0
    disables). Exactness does not depend on it; speed does."""
    lookup_guesses: bool = True
    """Guess the draft's next tokens by n-gram lookup in the context (n >= 2) and check a
    guessed run in one draft forward instead of one forward per token. Proposals are exactly the
    draft's own either way; text that repeats its context drafts faster."""


class DraftModelConfig(ModelDraftFields):
    """``drafter: {kind: draft_model, ...}``."""

    kind: Literal["draft_model"] = "draft_model"
    fallback: FallbackConfig | None = None
    """What a runtime that has no draft model runs instead: a kind that needs none, as its own
    block (``{kind: early_exit, early_exit_layers: 2}``) or its name alone; fields the block
    does not set it takes from this one where it has them too (k, adaptive, ...). Without it,
    such a runtime refuses the policy when it is loaded. (``FallbackConfig``: the registry's
    kinds that run without a draft model.)"""

    @model_validator(mode="before")
    @classmethod
    def _flat_fallback(cls, data: Any) -> Any:
        """The flat form (``fallback: early_exit`` with ``early_exit_layers: 2`` beside it in
        this block): the fields this kind does not have belong to the fallback."""
        if not isinstance(data, Mapping) or not isinstance(data.get("fallback"), str):
            return data
        block = {key: value for key, value in data.items() if key in cls.model_fields}
        theirs = {key: value for key, value in data.items() if key not in cls.model_fields}
        return {**block, "fallback": {"kind": data["fallback"], **theirs}}

    def fallback_block(self) -> DrafterBlock | None:
        return self.fallback

    def fixed(self, k: int) -> DrafterBlock:
        fixed = super().fixed(k)
        if self.fallback is None:
            return fixed
        return fixed.model_copy(update={"fallback": self.fallback.fixed(k)})


def build_draft_model(
    config: ModelDraftFields, parts: DraftingParts
) -> tuple[DraftModelDrafter, Schedule]:
    """The registry's builder for ``draft_model``: the runtime's draft model."""
    assert parts.draft is not None  # the registry refuses the policy on a runtime without one
    return model_drafter(DraftModelDrafter, parts.draft, config, parts)


def model_drafter(
    kind: type[DraftModelDrafter],
    runner: Runner,
    config: ModelDraftFields,
    parts: DraftingParts,
) -> tuple[DraftModelDrafter, Schedule]:
    k = config.num_speculative_tokens
    costs = parts.costs(runner) if config.adaptive or config.lookup_guesses else None
    guesses = None
    if config.lookup_guesses:
        # Single tokens repeat too often by chance to be worth a wider draft forward: n >= 2.
        guesses = max(2, config.min_ngram), max(2, config.max_ngram)
    drafter = kind(
        runner,
        parts.prefixes,
        config.confidence_threshold,
        guesses,
        costs,
        plan_lengths=config.adaptive,
        call_end=parts.call_end,
    )
    if not config.adaptive:
        return drafter, FixedSchedule(k)
    # The drafter ends each draft where it stops paying; the schedule only decides between
    # plain decoding and drafting, and a heavier prior keeps one early rejection from
    # switching drafting off for the next probe_every steps.
    assert costs is not None
    return drafter, AdaptiveSchedule(max_k=k, costs=costs, drafter_stops=True, prior_weight=2.0)


KIND = DrafterKind(
    DraftModelConfig,
    build_draft_model,
    lambda config, parts: parts.draft,
    needs_draft_model=True,
)
