"""Admission: a call is validated in the caller's task, before any work is queued, so bad input
fails at once with an error that names what was wrong (policy, sampling field, context length,
constraint)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..call import Call
from ..chat import Prompt, prediction_ids, render_prompt
from ..decoding.drafters.base import DrafterBlock
from ..decoding.registry import DRAFTERS
from ..decoding.sampling import SamplingParams
from ..engines import EngineModel
from ..errors import ContextLengthError, InvalidRequestError, PolicyError
from ..grammar import GrammarState, compile_constraint
from ..policy import Policy, PolicySet, load_policies
from ..policy.loader import format_validation_error
from ..policy.sampling import MAX_TOP_LOGPROBS
from ..policy.schema import SamplingConfig
from ..tenants import HistoryScope, Tenant

__all__ = [
    "Admission",
    "CallPlan",
    "PoliciesArg",
    "coerce_policies",
    "drafter_blocks",
    "drafter_for",
]

PoliciesArg = str | Path | PolicySet | Sequence[Policy] | None


@dataclass(frozen=True)
class CallPlan:
    """A call as admission decided it, once: its policy, the drafter block it runs here, its
    sampling, budget, stops and seed, its tenant and history scope, its grammar. The worker,
    the decoder, the span and the audit row read this and decide nothing again."""

    prompt: Prompt
    prompt_ids: list[int]
    policy: Policy
    drafter: DrafterBlock
    """The block the policy runs on this runtime (``drafter_for``: its fallback without a
    draft model)."""
    params: SamplingParams
    max_new_tokens: int
    stop: tuple[str, ...]
    seed: int
    explicit_max_tokens: bool
    grammar: GrammarState | None = None
    """The call's own grammar state (advanced as it decodes)."""
    tenant: Tenant | None = None
    history_key: HistoryScope | None = None
    """Whose earlier text this call may draft from, and where its own text is kept (None:
    its own context only, nothing kept)."""
    prediction_ids: tuple[int, ...] = ()
    """The caller's predicted output, tokenized (``Call.prediction``)."""
    logprobs: int | None = None
    """Alternatives per emitted token's log-probability (``Call.logprobs``; None: none)."""

    @property
    def reproducible(self) -> bool:
        """Forwards alone, own prefill, measured costs only (``Policy.reproducible``)."""
        return self.policy.reproducible


@dataclass(frozen=True)
class Admission:
    """What a runtime checks calls against: its policies and its model's vocabulary, context
    window and chat template."""

    policies: PolicySet
    tokenizer: Any
    vocab_size: int
    context_window: int | None
    eos_token_ids: tuple[int, ...]
    drafters: Mapping[str, DrafterBlock]
    """The drafter block each policy runs on this runtime, by policy name (``drafter_blocks``:
    decided once, when the runtime is built)."""

    def plan(self, call: Call, tenant: Tenant | None, tokenizer: Any = None) -> CallPlan:
        """The call's plan. ``tenant``: ``call.tenant`` as the call path parsed it (it picks
        the admission's turn before this runs); ``tokenizer``: the one to use on this thread
        (an admission thread's own, ``_gate``; default the runtime's)."""
        tok = tokenizer if tokenizer is not None else self.tokenizer
        policy = self.policies.resolve(call.policy, call.tags, call.default_policy)
        drafter = self.drafters[policy.name]
        key = history_key(policy, drafter, tenant)
        overrides = {
            key: value
            for key, value in {
                "max_new_tokens": call.max_new_tokens,
                "temperature": call.temperature,
                "top_p": call.top_p,
                "top_k": call.top_k,
                "stop": call.stop,
                "seed": call.seed,
            }.items()
            if value is not None
        }
        try:
            sampling = SamplingConfig.model_validate({**policy.sampling.model_dump(), **overrides})
        except ValidationError as exc:
            raise InvalidRequestError(
                f"invalid call parameters: {format_validation_error(exc)}"
            ) from exc
        prompt = call.prompt
        prompt_ids = render_prompt(
            prompt,
            tok,
            vocab_size=self.vocab_size,
            tools=call.tools,
            max_tokens=self.context_window,
        )
        budget = sampling.max_new_tokens
        if self.context_window is not None:
            room = self.context_window - len(prompt_ids)
            if room < 1:
                msg = (
                    f"the prompt has {len(prompt_ids)} tokens; the model's context window is "
                    f"{self.context_window}, leaving no room to generate"
                )
                raise ContextLengthError(msg)
            if "max_new_tokens" in overrides and budget > room:
                msg = (
                    f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({budget}) exceeds the "
                    f"context window ({self.context_window}); at most {room} new tokens fit"
                )
                raise ContextLengthError(msg)
            budget = min(budget, room)
        params = SamplingParams(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p
        )
        call_seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        if call.logprobs is not None and not 0 <= call.logprobs <= MAX_TOP_LOGPROBS:
            msg = (
                f"logprobs must be between 0 and {MAX_TOP_LOGPROBS} alternatives, "
                f"got {call.logprobs}"
            )
            raise InvalidRequestError(msg)
        grammar = None
        if call.constraint is not None:
            # The runtime's own tokenizer: llguidance converts each tokenizer object once.
            grammar = compile_constraint(
                call.constraint, self.tokenizer, self.vocab_size, self.eos_token_ids
            )
        return CallPlan(
            prompt=prompt,
            prompt_ids=prompt_ids,
            policy=policy,
            drafter=drafter,
            params=params,
            max_new_tokens=budget,
            stop=sampling.stop,
            seed=call_seed,
            explicit_max_tokens="max_new_tokens" in overrides,
            grammar=grammar,
            tenant=tenant,
            history_key=key,
            prediction_ids=tuple(
                prediction_ids(call.prediction, tok, self.vocab_size, self.context_window)
            ),
            logprobs=call.logprobs,
        )


def history_key(
    policy: Policy, drafter: DrafterBlock, tenant: Tenant | None
) -> HistoryScope | None:
    """The key of the history a call reads and writes (``drafter.history`` of the block the
    policy runs); the tenant is part of every key but the runtime-wide one, which refuses calls
    that name a tenant. A call with no tenant shares nothing under ``policy`` and ``tenant``
    history: callers who are one party say so by naming a tenant (the runtime cannot tell two
    anonymous callers apart)."""
    if not DRAFTERS[drafter.kind].reads_history:
        return None
    scope = drafter.history_scope()
    if scope in ("none", "call"):
        return None
    if tenant is None and scope in ("policy", "tenant"):
        return None  # isolation by default: a call that names no one drafts from itself only
    if scope == "policy":
        return HistoryScope(tenant, policy.name)
    if scope == "tenant":
        return HistoryScope(tenant)
    if tenant is not None:
        msg = (
            f"policy {policy.name!r} shares drafting history across the whole runtime "
            "(drafter.history: runtime), so it cannot serve a call that names a tenant; "
            "use drafter.history: tenant"
        )
        raise InvalidRequestError(msg)
    return HistoryScope()


def drafter_for(policy: Policy, has_draft_model: bool) -> DrafterBlock:
    """The drafter block a policy runs on a runtime (its fallback when there is no draft
    model; without one, the policy's own block, which ``drafter_blocks`` refuses)."""
    block = policy.drafter
    if DRAFTERS[block.kind].needs_draft_model and not has_draft_model:
        return block.fallback_block() or block
    return block


def drafter_blocks(
    policies: PolicySet, has_draft_model: bool, target: EngineModel
) -> dict[str, DrafterBlock]:
    """The drafter block each policy runs on a runtime, by name (``drafter_for``), decided
    once when the runtime is built (admission, the cost measurement and ``describe`` read
    it); a policy its models cannot run is refused here (``PolicyError``)."""
    blocks: dict[str, DrafterBlock] = {}
    for policy in policies:
        block = blocks[policy.name] = drafter_for(policy, has_draft_model)
        kind, spec = block.kind, DRAFTERS[block.kind]
        if spec.needs_draft_model and not has_draft_model:
            msg = (
                f"policy {policy.name!r}: field 'drafter.kind': {kind} needs a draft "
                "model, but this runtime has none (pass draft=..., set drafter.fallback, "
                "or use prompt_lookup / early_exit)"
            )
            raise PolicyError(msg)
        if spec.cuts_layers and not target.capabilities.early_exit:
            msg = (
                f"policy {policy.name!r}: field 'drafter.kind': {kind} cuts the target's "
                "layers, which only an engine that declares early exit can do (the "
                f"transformers engine; this runtime runs {target.engine})"
            )
            raise PolicyError(msg)
        problem = spec.check(block, target.num_layers)
        if problem is not None:
            raise PolicyError(f"policy {policy.name!r}: {problem}")
    return blocks


def eos_token_ids(model: EngineModel, tokenizer: Any | None) -> list[int]:
    """Tokens that end a call: the model's own (its generation config, the GGUF's) and the
    tokenizer's."""
    ids = list(model.eos_token_ids())
    found = getattr(tokenizer, "eos_token_id", None)
    if isinstance(found, int):
        ids.append(found)
    elif isinstance(found, (list, tuple)):
        ids.extend(int(x) for x in found)
    return sorted(set(ids))


def coerce_policies(policies: PoliciesArg) -> PolicySet:
    if policies is None:
        return PolicySet()
    if isinstance(policies, PolicySet):
        return policies
    if isinstance(policies, (str, Path)):
        return load_policies(policies)
    return PolicySet(policies)
