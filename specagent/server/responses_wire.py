"""OpenAI's Responses API on the wire: the request as a pydantic model, its translation into the
chat completions request every call of the server becomes (one translation layer: keys, limits,
policies, grammars, audit and spans then treat both endpoints' calls alike), and the
``response`` object and its output items built from a finished call.

Fields the server cannot honour (built-in tools, ``background``, files and images, reasoning
settings, server-side conversations) are refused by name, never ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..calls import CallChunk
from ..chat import ToolCall
from ..policy.sampling import MaxNewTokens, Seed, Temperature, TopK, TopLogprobs, TopP
from ..results import GenerationResult, Logprob
from .wire import MAX_MESSAGES, MAX_TOOLS, printable, speculative_stats

__all__ = [
    "LOGPROBS_INCLUDE",
    "ResponsesRequest",
    "function_call_item",
    "item_id",
    "items_page",
    "message_item",
    "output_items",
    "response_body",
    "response_id",
    "text_logprobs",
]

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The ``include`` entry that asks for each output token's log-probability."""

HARMLESS_INCLUDES = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content"})
"""``include`` entries this server honours (no reasoning items are ever made, so asking for
their encrypted content asks for nothing)."""

UNHONOURED = {
    "background": "background responses are not supported; call without background",
    "conversation": "server-side conversations are not supported; chain by previous_response_id",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "reasoning": "reasoning settings are not supported by this model",
    "max_tool_calls": "max_tool_calls is not supported (only function tools are)",
    "context_management": "context management is not supported",
}
"""The Responses API's request fields this server cannot honour, each with its reason."""

BUILT_IN_TOOL = "only function tools are supported ({!r} is a built-in tool OpenAI runs)"

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_where_asked(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs a 'schema' object")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(
        default=None, description="verbosity other than medium is not supported"
    )


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Unknown fields are ignored, as OpenAI's clients add new ones;
    known fields that cannot be honoured are refused."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: MaxNewTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    """Not in OpenAI's API; as on chat completions."""
    seed: Seed | None = None
    """Not in OpenAI's API (its chat completions take it): a call made reproducible."""
    top_logprobs: TopLogprobs | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    store: bool | None = None
    previous_response_id: str | None = Field(default=None, max_length=128)
    stream: bool = False
    truncation: Literal["disabled"] | None = Field(
        default=None, description="'auto' truncation is not supported: nothing is dropped"
    )
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    max_tool_calls: Any = None
    context_management: Any = None

    @field_validator(*UNHONOURED)
    @classmethod
    def _not_honoured(cls, value: Any, info: ValidationInfo) -> Any:
        empty_reasoning = (
            info.field_name == "reasoning"
            and isinstance(value, dict)
            and not any(value.get(k) for k in ("effort", "summary", "generate_summary"))
        )
        if value not in (None, False, {}, []) and not empty_reasoning:
            raise ValueError(UNHONOURED[str(info.field_name)])
        return value

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[dict[str, Any]]) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("at least one input item is needed")
        if isinstance(value, list) and len(value) > MAX_MESSAGES:
            raise ValueError(f"{len(value)} items; at most {MAX_MESSAGES} per call")
        return value

    @field_validator("include")
    @classmethod
    def _known_includes(cls, value: list[str] | None) -> list[str] | None:
        for i, entry in enumerate(value or ()):
            if entry not in HARMLESS_INCLUDES:
                raise ValueError(f"entry {i}: {entry!r} is not supported")
        return value

    @field_validator("user", "safety_identifier")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        return printable(value)

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def continued(self, earlier: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation this continues, as chat messages: ``earlier`` (a stored response's,
        where chained) and then ``input``; never ``instructions`` (the Responses API does not
        carry them over to a later call). ``ValueError`` names the input item that cannot be
        translated."""
        return [*earlier, *self.input_messages()]

    def chat_body(self, conversation: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The chat completions request this asks for, over ``conversation``: what
        ``ChatCompletionRequest`` validates and the server runs. ``ValueError`` names the
        Responses field that cannot be translated."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages.extend(conversation)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "tools": _chat_tools(self.tools),
            "tool_choice": _chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": _chat_format(self.text),
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "metadata": self.metadata,
            "user": self.safety_identifier or self.user,
            "stream": self.stream,
        }
        if self.wants_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        return {k: v for k, v in body.items() if v is not None}

    def input_messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages: a string is one user message; items in order, a run of
        function calls one assistant message with its tool calls."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                out.append(_message(item, f"input.{i}"))
            elif kind == "function_call":
                call = _tool_call(item, f"input.{i}")
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and not last.get("_closed"):
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append(_tool_result(item, f"input.{i}"))
            else:
                raise ValueError(f"input.{i}.type: {kind!r} items are not supported")
        for message in out:
            message.pop("_closed", None)
        return out

    def input_items(self) -> list[dict[str, Any]]:
        """``input`` as the Responses API lists it back (``GET /v1/responses/{id}/input_items``):
        each item in its own shape, with an id of this server's. For input ``input_messages``
        accepted."""
        if isinstance(self.input, str):
            return [_listed_message("user", self.input)]
        out: list[dict[str, Any]] = []
        for item in self.input:
            kind = item.get("type", "message")
            if kind == "message":
                out.append(_listed_message(item["role"], _message(item, "input")["content"]))
            elif kind == "function_call":
                fields = {k: item[k] for k in ("call_id", "name", "arguments")}
                out.append({"type": kind, "id": item_id("fc"), **fields, "status": "completed"})
            else:
                output = _tool_result(item, "input")["content"]
                out.append(
                    {
                        "type": kind,
                        "id": item_id("fco"),
                        "call_id": item["call_id"],
                        "output": output,
                        "status": "completed",
                    }
                )
        return out


def _listed_message(role: str, text: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "input_text", "text": text}
    if role == "assistant":
        part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": item_id("msg"),
        "role": role,
        "content": [part],
        "status": "completed",
    }


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role: must be one of {list(ROLES)}, got {role!r}")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        pieces = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                msg = f"{where}.content.{j}.type: only text parts are supported, got {kind!r}"
                raise ValueError(msg)
            pieces.append(part["text"])
        text = "".join(pieces)
    else:
        raise ValueError(f"{where}.content: must be text or a list of text parts")
    # A message that follows tool calls starts a new turn: later calls are not merged into it.
    return {"role": role, "content": text, "_closed": role != "assistant"}


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for field in ("call_id", "name", "arguments"):
        if not isinstance(item.get(field), str) or not item[field]:
            raise ValueError(f"{where}.{field}: a function_call item needs it as a string")
    try:
        json.loads(item["arguments"])
    except json.JSONDecodeError:
        raise ValueError(f"{where}.arguments: not valid JSON") from None
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _tool_result(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise ValueError(f"{where}.call_id: a function_call_output item needs it")
    output = item.get("output")
    if isinstance(output, list):
        parts = [p for p in output if isinstance(p, dict)]
        if len(parts) != len(output) or any(p.get("type") not in TEXT_PARTS for p in parts):
            raise ValueError(f"{where}.output: only text parts are supported")
        output = "".join(str(p.get("text", "")) for p in parts)
    if not isinstance(output, str):
        raise ValueError(f"{where}.output: must be text")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output, "_closed": True}


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise ValueError(f"tools.{i}.type: " + BUILT_IN_TOOL.format(kind))
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ValueError(f"tools.{i}.name: a function tool needs a name")
        fields = ("name", "description", "parameters", "strict")
        function = {k: tool[k] for k in fields if k in tool}
        out.append({"type": "function", "function": function})
    return out or None


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        kind = choice.get("type")
        msg = f"tool_choice: only 'auto', 'none', 'required' or a function, got {kind!r}"
        raise ValueError(msg)
    return {"type": "function", "function": {"name": choice["name"]}}


def _chat_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec: dict[str, Any] = {"name": fmt.name or "output", "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}


# --------------------------------------------------------------------------- the response


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_logprobs(logprobs: Sequence[Logprob] | None) -> list[dict[str, Any]]:
    """An output text's ``logprobs`` (empty where the call did not ask for them)."""
    return [each.as_openai() for each in logprobs or ()]


def message_item(
    message_id: str, text: str, logprobs: Sequence[Logprob] | None, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "message",
        "id": message_id,
        "status": status,
        "role": "assistant",
        "content": [
            {
                "type": "output_text",
                "text": text,
                "annotations": [],
                "logprobs": text_logprobs(logprobs),
            }
        ],
    }


def function_call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id("fc"),
        "call_id": call.id,
        "name": call.name,
        "arguments": json.dumps(call.arguments, ensure_ascii=False),
        "status": status,
    }


def output_items(last: CallChunk, message_id: str) -> list[dict[str, Any]]:
    """A finished call's output items: its text (where it wrote any) and its tool calls."""
    items: list[dict[str, Any]] = []
    logprobs = last.result.logprobs if last.result is not None and not last.tool_calls else None
    if last.content or not last.tool_calls:
        items.append(message_item(message_id, last.content, logprobs))
    items.extend(function_call_item(call) for call in last.tool_calls)
    return items


def usage(result: GenerationResult) -> dict[str, Any]:
    return {
        "input_tokens": result.usage.input_tokens,
        "input_tokens_details": {"cached_tokens": result.usage.cached_input_tokens},
        "output_tokens": result.usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.usage.total_tokens,
    }


def response_body(
    rid: str,
    request: ResponsesRequest,
    *,
    output: list[dict[str, Any]] | None = None,
    last: CallChunk | None = None,
    stored: bool = False,
    created_at: int | None = None,
) -> dict[str, Any]:
    """The ``response`` object: in progress (no ``last``) or finished (``last``, the call's
    last chunk, its content the whole output's)."""
    result = last.result if last is not None else None
    status = "in_progress"
    incomplete = None
    if result is not None:
        status = "incomplete" if result.finish_reason == "length" else "completed"
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
    fmt = request.text.format if request.text is not None and request.text.format else None
    body: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": created_at if created_at is not None else int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": request.model,
        "output": output or [],
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": None,
        "store": stored,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_logprobs": request.top_logprobs,
        "text": {
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        },
        "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [],
        "truncation": "disabled",
        "usage": usage(result) if result is not None else None,
        "metadata": request.metadata or {},
        "user": request.user,
        "safety_identifier": request.safety_identifier,
    }
    if result is not None:
        body["completed_at"] = int(time.time())
        body["speculative_decoding_stats"] = speculative_stats(result.stats)
    return body


MAX_PAGE = 100
"""The most input items one page lists (OpenAI's bound)."""


def items_page(items: Sequence[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of a stored response's input items as OpenAI's list object: ``limit`` (1 to
    100, default 20), ``order`` (``desc``, the default: newest first, or ``asc``) and ``after``
    (an item id: the page starts past it). ``ValueError`` names the parameter that is wrong."""
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise ValueError("limit: must be an integer") from None
    if not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit: must be between 1 and {MAX_PAGE}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ValueError("order: must be 'asc' or 'desc'")
    ordered = list(items) if order == "asc" else list(reversed(items))
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ValueError(f"after: no input item {after!r} in this response")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }
