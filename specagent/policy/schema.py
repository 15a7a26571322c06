"""The policy schema: one YAML file per use case, validated strictly.

Every model forbids unknown keys; relaxed acceptance blocks are a tagged union on ``rule`` so a
parameter of another rule is an error rather than silently ignored.
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
from ..decoding.registry import DRAFTERS, RULES
from ..decoding.stopping import check_stops

__all__ = [
    "AcceptanceConfig",
    "DrafterConfig",
    "LenienceAcceptance",
    "MatchConfig",
    "Policy",
    "SamplingConfig",
    "TelemetryConfig",
    "TopKAcceptance",
    "TypicalAcceptance",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DrafterConfig(_Strict):
    """Which drafter proposes tokens, and how many per step."""

    kind: str = "draft_model"
    """A drafter of ``decoding.registry.DRAFTERS``: ``draft_model`` (needs a draft model in the
    runtime), ``prompt_lookup``, ``early_exit``, or ``none`` (plain decoding)."""
    num_speculative_tokens: int = Field(default=4, ge=1, le=32)
    """k: the most draft tokens proposed per step."""
    fallback: str | None = None
    """For ``draft_model``: the drafter to use on a runtime that has no draft model. Without it,
    such a runtime refuses the policy when it is loaded."""
    adaptive: bool = True
    """Pick k per step from observed acceptance and measured step costs (k = 0: plain decoding);
    draft models also end each draft where their calibrated confidence says one more token no
    longer pays."""
    confidence_threshold: float = Field(default=0.4, ge=0.0, le=1.0)
    """For draft models: stop a step's draft early when the draft's top probability falls below
    this (0 disables). Exactness does not depend on it; speed does."""
    lookup_guesses: bool = True
    """For draft models: guess the draft's next tokens by n-gram lookup in the context (n >= 2)
    and check a guessed run in one draft forward instead of one forward per token. Proposals are
    exactly the draft's own either way; text that repeats its context drafts faster."""
    early_exit_layers: int | None = Field(default=None, ge=1)
    """For ``early_exit``: decoder layers the drafter runs (default: three quarters of them)."""
    min_ngram: int = Field(default=1, ge=1, le=16)
    """For ``prompt_lookup``: shortest n-gram to match."""
    max_ngram: int = Field(default=3, ge=1, le=16)
    """For ``prompt_lookup``: longest n-gram to match (tried first)."""
    history: Literal["none", "call", "policy", "tenant", "runtime"] = "call"
    """For ``suffix`` and ``auto``: whose text may propose tokens for this policy's calls, and
    where this policy's calls leave theirs. ``none``: no text at all (``auto`` then chooses
    between the draft model and plain decoding); ``call``: the call's own prompt and output,
    nothing kept after it; ``policy``: earlier calls of this policy and tenant; ``tenant``:
    earlier calls of this tenant under any policy that shares at tenant scope; ``runtime``:
    every earlier call on the runtime (single-tenant deployments: a call that names a tenant is
    refused). A tenant's text never drafts for another tenant's call."""
    tree: bool = False
    """For ``suffix`` and ``auto``: verify several drafts in one forward as a token tree where
    the measured costs say the extra rows pay: the history's runner-up continuation beside its
    best one (where earlier places split), and, for ``auto``, the history's continuation beside
    the draft model's draft. Lossless calls without a grammar; others verify the first draft
    alone. Off by default: on the 2-core CPUs measured it did not pay (within 0.3% either
    way, ``benchmarks/README.md``); a device whose verify curve stays flat for many rows is
    where it can."""

    @field_validator("kind", "fallback")
    @classmethod
    def _registered(cls, kind: str | None, info: ValidationInfo) -> str | None:
        known = list(DRAFTERS)
        if info.field_name == "fallback":  # what a runtime without a draft model can run
            known = [name for name in DRAFTERS if not DRAFTERS[name].needs_draft_model]
        if kind is not None and kind not in known:
            raise ValueError(f"unknown drafter {kind!r}; expected one of {known}")
        return kind

    @model_validator(mode="after")
    def _ngrams(self) -> DrafterConfig:
        if self.min_ngram > self.max_ngram:
            msg = f"min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})"
            raise ValueError(msg)
        kinds = [DRAFTERS[k] for k in (self.kind, self.fallback) if k is not None]
        if self.early_exit_layers is not None and not any(k.cuts_layers for k in kinds):
            raise ValueError("early_exit_layers applies only to kind (or fallback) early_exit")
        if self.fallback is not None and not DRAFTERS[self.kind].needs_draft_model:
            raise ValueError("fallback applies only to kind: draft_model")
        return self


if TYPE_CHECKING:
    AcceptanceConfig = AcceptanceBlock
else:
    AcceptanceConfig = Annotated[
        Union[tuple(kind.config for kind in RULES.values())],  # noqa: UP007
        Field(discriminator="rule"),
    ]
"""The relaxed rules of ``decoding.registry.RULES`` (each an ``AcceptanceBlock``), told apart
by their ``rule`` field."""


class SamplingConfig(_Strict):
    """Sampling defaults of the policy; a call may override them (never the mode)."""

    temperature: float = Field(default=0.0, ge=0.0, le=5.0)
    """0 is greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    max_new_tokens: int = Field(default=256, ge=1, le=1_000_000)
    stop: tuple[str, ...] = ()
    """Stop strings; generation ends before them and they are not emitted (at most
    ``MAX_STOPS``, each of at most ``MAX_STOP_CHARS`` characters)."""
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    """Default seed; None draws a fresh one per call."""

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stops: tuple[str, ...]) -> tuple[str, ...]:
        if stops:
            check_stops(stops)
        return stops


class TelemetryConfig(_Strict):
    record_content: bool = False
    """Record prompt and output text on spans (GenAI opt-in attributes). Off for sensitive data."""


class MatchConfig(_Strict):
    tags: tuple[str, ...] = ()
    """A call whose tags overlap these is routed to this policy when it names none."""


class Policy(_Strict):
    """One use case's decoding policy."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=64)
    """Unique; the file is ``<name>.yaml``."""
    description: str = Field(min_length=1)
    """What the policy is for and why it has its mode."""
    mode: Literal["lossless", "relaxed"]
    drafter: DrafterConfig = DrafterConfig()
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
        if self.reproducible and self.drafter.history not in ("none", "call"):
            msg = (
                f"a reproducible policy drafts from its own call only, but drafter.history is "
                f"{self.drafter.history!r} (earlier calls' text would change its drafts, and "
                "with them its forward shapes); use history: call"
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
            kinds = (drafter.kind, drafter.fallback) if drafter is not None else ()
            if any(k is not None and not DRAFTERS[k].drafts for k in kinds):
                raise ValueError(
                    "a relaxed policy needs a drafter, but drafter.kind (or fallback) is none"
                )
        return acceptance

    def relaxed_rule(self) -> RelaxedRule | None:
        """The rule to verify with, or None for lossless."""
        return self.acceptance.build() if self.acceptance is not None else None
