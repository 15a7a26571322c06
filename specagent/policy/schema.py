"""The policy schema: one YAML file per use case, validated strictly.

Every model forbids unknown keys. The ``drafter`` block is validated as its kind's settings
(``decoding.registry.DRAFTERS``: each kind's module declares its block) and relaxed acceptance
blocks are a tagged union on ``rule``, so a setting of another kind or rule is an error rather
than silently ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..decoding.acceptance import (
    AcceptanceBlock,
    LenienceAcceptance,
    RelaxedRule,
    TopKAcceptance,
    TypicalAcceptance,
)
from ..decoding.drafters.auto import AutoConfig
from ..decoding.drafters.base import DrafterBlock
from ..decoding.drafters.draft_model import DraftModelConfig
from ..decoding.drafters.early_exit import EarlyExitConfig
from ..decoding.drafters.none import NoDrafterConfig
from ..decoding.drafters.prompt_lookup import PromptLookupConfig
from ..decoding.drafters.suffix import SuffixConfig
from ..decoding.registry import DRAFTERS, RULES, DrafterConfig, drafter_block
from .sampling import SamplingConfig

__all__ = [
    "AcceptanceConfig",
    "AutoConfig",
    "DraftModelConfig",
    "DrafterBlock",
    "DrafterConfig",
    "EarlyExitConfig",
    "LenienceAcceptance",
    "MatchConfig",
    "NoDrafterConfig",
    "Policy",
    "PromptLookupConfig",
    "SamplingConfig",
    "SuffixConfig",
    "TelemetryConfig",
    "TopKAcceptance",
    "TypicalAcceptance",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


if TYPE_CHECKING:
    AcceptanceConfig = AcceptanceBlock
else:
    AcceptanceConfig = Annotated[
        Union[tuple(kind.config for kind in RULES.values())],  # noqa: UP007
        Field(discriminator="rule"),
    ]
"""The relaxed rules of ``decoding.registry.RULES`` (each an ``AcceptanceBlock``), told apart
by their ``rule`` field."""


class TelemetryConfig(_Strict):
    record_content: bool = False
    """Record prompt and output text on spans (GenAI opt-in attributes). Off for sensitive data."""


class MatchConfig(_Strict):
    tags: tuple[str, ...] = ()
    """A call whose tags overlap these is routed to this policy when it names none."""


def _runnable(drafter: DrafterBlock) -> tuple[DrafterBlock, ...]:
    """The drafter and, where it has one, its fallback: what a policy may run."""
    fallback = drafter.fallback_block()
    return (drafter,) if fallback is None else (drafter, fallback)


class Policy(_Strict):
    """One use case's decoding policy."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=64)
    """Unique; the file is ``<name>.yaml``."""
    description: str = Field(min_length=1)
    """What the policy is for and why it has its mode."""
    mode: Literal["lossless", "relaxed"]
    drafter: DrafterConfig = Field(default_factory=lambda: drafter_block({}))
    """The drafter's kind and its settings (``DEFAULT_DRAFTER`` when the block names none)."""
    acceptance: AcceptanceConfig | None = Field(default=None, validate_default=True)
    """Required in relaxed mode; an error in lossless mode."""
    sampling: SamplingConfig = SamplingConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    match: MatchConfig = MatchConfig()
    reproducible: bool = False
    """Outputs that depend only on the call (prompt, policy, seed) and this machine's kept
    measurements, never on load or timing: the call's forwards run alone (never batched with
    other calls, whose padding changes the rounding), it starts from its own prefill (no KV left
    by earlier calls), and it waits until the runtime's step costs and kernels are measured (or
    loaded), so its draft lengths, and with them its forward shapes, are the same every run.
    Needs ``drafter.history`` none or call. In low precision, a greedy lossless call can still
    differ from plain greedy decoding at a near-tie (a forward over k + 1 tokens rounds
    differently from k + 1 forwards over one); reproducible makes that difference the same on
    every run. Costs throughput under concurrency."""

    @model_validator(mode="after")
    def _reproducible_history(self) -> Policy:
        for block in _runnable(self.drafter) if self.reproducible else ():
            if block.history_scope() not in ("none", "call"):
                msg = (
                    f"a reproducible policy drafts from its own call only, but drafter.history "
                    f"is {block.history_scope()!r} (earlier calls' text would change its "
                    "drafts, and with them its forward shapes); use history: call"
                )
                raise ValueError(msg)
        return self

    @field_validator("acceptance", mode="after")
    @classmethod
    def _acceptance_fits_mode(
        cls, acceptance: AcceptanceConfig | None, info: ValidationInfo
    ) -> AcceptanceConfig | None:
        mode = info.data.get("mode")
        if mode == "lossless" and acceptance is not None:
            msg = "a lossless policy must not have an acceptance block (relaxed mode only)"
            raise ValueError(msg)
        if mode == "relaxed":
            if acceptance is None:
                raise ValueError("a relaxed policy needs an acceptance block with a rule")
            drafter = info.data.get("drafter")
            blocks = _runnable(drafter) if drafter is not None else ()
            if any(not DRAFTERS[block.kind].drafts for block in blocks):
                raise ValueError(
                    "a relaxed policy needs a drafter, but drafter.kind (or fallback) is none"
                )
        return acceptance

    def relaxed_rule(self) -> RelaxedRule | None:
        """The rule to verify with, or None for lossless."""
        return self.acceptance.build() if self.acceptance is not None else None
