"""Reading a call's request: its key, its body (a chat completion's, or a Responses API
request's translated into one) and the ``CallSpec`` it asks for (policy by precedence, the key's
allowances, the tenant), and a key's default share of the slots."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from ..backend import Backend
from ..call import Call
from ..calls import CallSpec, split_model
from ..errors import ModelNotFoundError, PolicyNotFoundError
from ..tenants import Tenant
from .errors import ApiError, as_api_error, param_of
from .keys import ApiKey, KeyStore
from .options import ServerOptions
from .responses_wire import ResponsesRequest
from .wire import ChatCompletionRequest, to_template_messages

__all__ = [
    "DEFAULT_SHARE",
    "POLICY_HEADER",
    "POLICY_METADATA_KEY",
    "TAGS_METADATA_KEY",
    "Caller",
    "authenticate",
    "bearer",
    "budget",
    "call_spec",
    "caller_of",
    "chat_request",
    "default_per_key",
    "parse_body",
    "parse_responses",
    "resolved_policy",
    "token_cap",
    "translated",
    "unavailable_policy",
]


CALLER = "specagent.caller"
"""Where a request's ``Caller`` is kept in its ASGI scope."""


@dataclass
class Caller:
    """Who a chat request is from and what it asked for, as far as it got before it was
    answered or refused (its dashboard count and audit row read it)."""

    key: str | None = None
    """The API key's name, once authenticated."""
    key_checked: bool = False
    """Whether its bearer token was checked (``authenticate``), matched or not."""
    policy: str | None = None
    """The policy it runs under, once resolved and allowed for the key."""
    tenant: str | None = None


def caller_of(request: Request) -> Caller:
    """The request's ``Caller``, kept in its ASGI scope (every middleware and handler of the
    request sees the same one)."""
    caller: Caller = request.scope.setdefault(CALLER, Caller())
    return caller


POLICY_HEADER = "x-specagent-policy"
POLICY_METADATA_KEY = "specagent_policy"
TAGS_METADATA_KEY = "specagent_tags"


def parse_body(raw: bytes) -> ChatCompletionRequest:
    """The request body, or 422 naming the first field that is wrong."""
    try:
        return ChatCompletionRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise _invalid(exc) from None


def parse_responses(raw: bytes) -> ResponsesRequest:
    """A Responses API request body, or 422 naming the first field that is wrong."""
    try:
        return ResponsesRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise _invalid(exc) from None


RESPONSES_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
"""A chat request's fields by the Responses API's names, for the errors of a translated one."""


def translated(
    conversation: Callable[[Sequence[dict[str, Any]]], list[dict[str, Any]]],
    earlier: Sequence[dict[str, Any]],
) -> list[dict[str, Any]]:
    """``conversation(earlier)``, a Responses request's input as chat messages; 422 naming
    the input item that cannot be."""
    try:
        return conversation(earlier)
    except ValueError as exc:
        raise ApiError(422, str(exc), "invalid_request_error", param_of(str(exc))) from None


def chat_request(
    body: ResponsesRequest, conversation: Sequence[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request a Responses request asks for, over ``conversation``; 422 naming the
    Responses field where it is refused."""
    try:
        return ChatCompletionRequest.model_validate(body.chat_body(conversation))
    except ValueError as exc:  # ValidationError is one
        if isinstance(exc, ValidationError):
            raise _invalid(exc, RESPONSES_NAMES) from None
        raise ApiError(422, str(exc), "invalid_request_error", param_of(str(exc))) from None


def _invalid(exc: ValidationError, names: Mapping[str, str] | None = None) -> ApiError:
    """422 naming the first field ``exc`` refused (by ``names`` where it was translated)."""
    first = exc.errors()[0]
    location = [str(p) for p in first.get("loc", ())]
    if names and location:
        location[0] = names.get(location[0], location[0])
        if location[0] == "input":
            location = location[:1]  # the conversation's index is not the input's
    param = ".".join(location) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    text = f"{param}: {message}" if param else message
    return ApiError(422, text, "invalid_request_error", param)


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def authenticate(keys: KeyStore, request: Request) -> ApiKey:
    """The request's key (401 where none matches), kept in its ``Caller`` either way."""
    presented = bearer(request)
    key = keys.authenticate(presented)
    caller = caller_of(request)
    caller.key, caller.key_checked = (key.name if key is not None else None), True
    if key is None:
        message = (
            "invalid API key" if presented else "missing API key (Authorization: Bearer <key>)"
        )
        raise ApiError(401, message, "authentication_error", code="invalid_api_key")
    return key


def call_spec(
    backend: Backend,
    body: ChatCompletionRequest,
    request: Request,
    key: ApiKey,
    options: ServerOptions,
    budget_field: str = "max_tokens",
) -> CallSpec:
    """The call ``body`` asks for, under the policy it names or routes to, allowed for ``key``
    (``budget_field``: what the request calls its token budget, for its errors)."""
    metadata = body.metadata or {}
    policy = metadata.get(POLICY_METADATA_KEY) or request.headers.get(POLICY_HEADER)
    try:
        named = split_model(body.model, backend.model_name)
    except ModelNotFoundError as exc:
        code = "model_not_found"
        raise ApiError(404, str(exc), "not_found_error", param="model", code=code) from exc
    policy = policy or named
    tags = [t for t in (metadata.get(TAGS_METADATA_KEY) or "").split(",") if t.strip()]
    # The key is the principal (its memory is accounted as one), ``user`` a sub-tenant under it.
    try:
        tenant = Tenant(key.name, body.user or None)
    except ValueError as exc:
        raise ApiError(422, f"user: {exc}", "invalid_request_error", param="user") from None
    caller_of(request).tenant = str(tenant)
    try:
        spec = CallSpec.build(
            to_template_messages(body.messages),
            policy=policy,
            tags=[t.strip() for t in tags],
            tenant=tenant,
            default_policy=options.default_policy,
            tools=body.tools,
            tool_choice=body.tool_choice,
            response_format=body.response_format,
            stop=body.stop,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=budget(body.budget, key, options, budget_field),
            seed=body.seed,
            logprobs=body.logprob_alternatives,
            timeout=key.timeout_s if key.timeout_s is not None else options.timeout_s,
            prediction=body.prediction,
            # As ChatSpecAgent by default: a reply that only repeats answered tool calls is
            # answered from their results (small models otherwise loop an agent forever).
            repeat_guard=True,
            parallel_tool_calls=body.parallel_tool_calls,
        )
    except ValueError as exc:  # InvalidRequestError and message translation
        raise as_api_error(exc) from None
    chosen = resolved_policy(backend, spec.call, key)
    if not key.may_use(chosen):
        # The same answer as for a policy that does not exist: a restricted key learns no
        # policy names beyond its own.
        raise unavailable_policy(backend, spec.call.policy or chosen, key)
    caller_of(request).policy = chosen  # from here on its refusals count under it
    # The call runs under the policy resolved here (the backend looks it up by name). The
    # server records its calls in the audit store itself (with their HTTP status and key):
    # the runtime does not record them again.
    call = dataclasses.replace(spec.call, policy=chosen, record=False)
    if call.max_new_tokens is None:
        # A call that asks for no budget runs with its policy's default, never past the cap.
        cap = token_cap(key, options)
        if backend.policies[chosen].sampling.max_new_tokens > cap:
            call = dataclasses.replace(call, max_new_tokens=cap)
    return dataclasses.replace(spec, call=call)


DEFAULT_SHARE = 4
"""A key that sets no concurrency bound may hold a quarter of the runtime's decoding slots."""


def default_per_key(backend: Backend) -> int:
    """Calls in flight a key may hold when neither it nor the server says: a share of the
    backend's decoding slots (16 where it does not say how many it has)."""
    slots = backend.max_active
    return max(1, slots // DEFAULT_SHARE) if slots is not None else 16


def token_cap(key: ApiKey, options: ServerOptions) -> int:
    """The most new tokens one of ``key``'s calls may run: its own cap, else the server's."""
    return key.max_tokens if key.max_tokens is not None else options.max_tokens


def budget(
    asked: int | None, key: ApiKey, options: ServerOptions, field: str = "max_tokens"
) -> int | None:
    """The call's ``max_tokens``: what it asked for, refused over the key's or the server's
    cap (a call that asks for none runs with its policy's default, cut to the cap where it is
    over: ``call_spec``)."""
    cap = token_cap(key, options)
    if asked is None:
        return None
    if asked > cap:
        message = f"{field} {asked} is over this key's limit of {cap}"
        raise ApiError(422, message, "invalid_request_error", param=field)
    return asked


def resolved_policy(backend: Backend, call: Call, key: ApiKey) -> str:
    """The policy the backend will run the call under (unknown names: 404, listing only the
    policies the key may use: a restricted key learns nothing of the others)."""
    try:
        return backend.policies.resolve(call.policy, call.tags, call.default_policy).name
    except PolicyNotFoundError as exc:
        if "*" in key.policies:
            raise as_api_error(exc) from None
        raise unavailable_policy(backend, call.policy, key) from None


def unavailable_policy(backend: Backend, asked: str | None, key: ApiKey) -> ApiError:
    """404 for a policy a restricted key may not use, whether or not it exists."""
    allowed = [p.name for p in backend.policies if key.may_use(p.name)]
    message = f"no policy {asked!r} is available to this key; it may use: {allowed}"
    return ApiError(404, message, "not_found_error", param="policy", code="policy_not_found")
