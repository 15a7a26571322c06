"""OpenAI's chat completions wire format: the request as a pydantic model, responses and
stream chunks as dicts, errors in OpenAI's error shape.

The request model says which fields are accepted; a field the server cannot honour (``n > 1``,
``logit_bias``, penalties) is refused by name rather than ignored, so a client never believes it
got what it did not.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..calls import CallChunk
from ..chat import ToolCall
from ..errors import InvalidRequestError
from ..policy.sampling import MaxNewTokens, Seed, Temperature, TopK, TopLogprobs, TopP
from ..results import GenerationResult, Logprob, SpecStats

__all__ = [
    "ChatCompletionRequest",
    "assistant_message",
    "completion",
    "error_body",
    "printable",
    "stream_chunk",
    "to_template_messages",
    "usage_body",
]


MAX_MESSAGES = 2048
"""The most messages one call may send."""
MAX_TOOLS = 128
"""The most tools one call may offer."""
MAX_TOOL_BYTES = 32768
"""The largest tool definition (name, description and parameter schema), as JSON."""


UNHONOURED = {
    "logit_bias": "logit_bias is not supported (it would change the model's distribution)",
    "functions": "the legacy functions field is not supported; pass tools",
    "function_call": "the legacy function_call field is not supported; pass tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only the text modality is supported",
    "web_search_options": "web search is not supported",
}
"""OpenAI's request fields this server cannot honour, each with the reason it says."""


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_where_needed(self) -> Message:
        if self.role in ("system", "developer", "user", "tool") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part type {part.get('type')!r} is not supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``. Unknown fields are ignored, as OpenAI's clients add new
    ones; known fields that cannot be honoured are refused."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # The sampling fields as a policy declares them (``policy.sampling``); None: the policy's.
    max_tokens: MaxNewTokens | None = None
    max_completion_tokens: MaxNewTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    """Not in OpenAI's API; vLLM's and llama.cpp's servers take it, and so does this one."""
    seed: Seed | None = None
    stop: str | list[str] | None = None
    user: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None
    n: int = Field(default=1, ge=1, le=1, description="only one choice per call")
    logprobs: bool | None = None
    """Each output token's log-probability under the target (``choices[].logprobs``)."""
    top_logprobs: TopLogprobs | None = None
    """With ``logprobs``: that many most likely tokens at each position, with theirs."""
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    parallel_tool_calls: bool | None = None
    logit_bias: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: dict[str, Any] | None = None
    """OpenAI's predicted output (``{"type": "content", "content": ...}``): it drafts, never
    enters the prompt, and leaves a lossless policy's output as it is."""
    web_search_options: Any = None

    @field_validator(*UNHONOURED)
    @classmethod
    def _not_honoured(cls, value: Any, info: ValidationInfo) -> Any:
        # Each would change what comes back: refused by name, never silently dropped.
        if value not in (None, 0, {}, []) and not (
            info.field_name == "modalities" and value == ["text"]
        ):
            raise ValueError(UNHONOURED[str(info.field_name)])
        return value

    @field_validator("user")
    @classmethod
    def _printable_user(cls, value: str | None) -> str | None:
        return printable(value)

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalties(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties would change the model's distribution; not supported")
        return value

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value is not None and len(value) > MAX_TOOLS:
            raise ValueError(f"{len(value)} tools; at most {MAX_TOOLS} per call")
        for i, tool in enumerate(value or ()):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict):
                raise ValueError(f"tool {i}: only {{'type': 'function', 'function': ...}}")
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise ValueError(f"tool {i}: function.name is required")
            parameters = function.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise ValueError(f"tool {i}: function.parameters must be a JSON schema object")
            size = len(json.dumps(tool))
            if size > MAX_TOOL_BYTES:
                msg = f"tool {i}: its definition is {size} bytes; at most {MAX_TOOL_BYTES}"
                raise ValueError(msg)
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("logprobs must be true to ask for top_logprobs")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, value: str | dict[str, Any] | None) -> Any:
        if isinstance(value, dict):
            function = value.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                msg = "an object tool_choice is {'type': 'function', 'function': {'name': ...}}"
                raise ValueError(msg)
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format_shape(cls, value: dict[str, Any] | None) -> Any:
        if value is not None and value.get("type") == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", spec), dict):
                raise ValueError("json_schema must be an object with a 'schema' object")
        return value

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprob_alternatives(self) -> int | None:
        """``Call.logprobs``: alternatives per token where log-probabilities are asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None


def printable(value: str | None) -> str | None:
    """``value``, refused where it holds a control character: a caller's ``user`` becomes its
    call's sub-tenant, and spans, audit rows and logs name it."""
    if value is not None and not value.isprintable():
        raise ValueError("must be printable characters (no NUL or other control characters)")
    return value


def to_template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Wire messages -> what a Hugging Face chat template takes (tool call arguments as
    mappings, ``developer`` as ``system``)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        try:
            entry: dict[str, Any] = {"role": role, "content": message.text()}
        except ValueError as exc:
            raise InvalidRequestError(f"messages.{i}.content: {exc}") from None
        if message.tool_calls:
            calls = []
            for j, call in enumerate(message.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments or "{}")
                except json.JSONDecodeError:
                    msg = f"messages.{i}.tool_calls.{j}.function.arguments: not valid JSON"
                    raise InvalidRequestError(msg) from None
                calls.append(
                    {
                        "type": "function",
                        "id": call.id,
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            entry["tool_calls"] = calls
        if role == "tool":
            entry["tool_call_id"] = message.tool_call_id
            if message.name:
                entry["name"] = message.name
        out.append(entry)
    return out


# --------------------------------------------------------------------------- responses


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _tool_calls(calls: tuple[ToolCall, ...], with_index: bool = False) -> list[dict[str, Any]]:
    return [
        {
            **({"index": i} if with_index else {}),
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for i, call in enumerate(calls)
    ]


def speculative_stats(stats: SpecStats) -> dict[str, Any]:
    """A superset of vLLM's per-request speculative decoding stats: drafts, draft tokens,
    accepted tokens, acceptance per position, mean acceptance length, plus specagent's policy,
    mode, drafter, divergence, fallback, grammar-forced tokens and where accepted tokens came
    from."""
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "accepted_per_position": list(stats.accepted_per_position),
        "mean_acceptance_length": stats.mean_acceptance_length,
        "policy": stats.policy,
        "mode": stats.mode,
        "drafter": stats.drafter,
        "divergence": stats.divergence,
        "fell_back_to_lossless": stats.fell_back_to_lossless,
        "num_forced_tokens": stats.num_forced_tokens,
        "accepted_by_source": dict(stats.accepted_by_source),
        "num_tree_steps": stats.num_tree_steps,
        "ttft_s": stats.ttft_s,
        "latency_s": stats.latency_s,
        "tokens_per_s": stats.tokens_per_s,
    }


def usage_body(result: GenerationResult) -> dict[str, Any]:
    return {
        "prompt_tokens": result.usage.input_tokens,
        "completion_tokens": result.usage.output_tokens,
        "total_tokens": result.usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": result.usage.cached_input_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": result.usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": result.usage.rejected_prediction_tokens,
        },
    }


def assistant_message(last: CallChunk) -> dict[str, Any]:
    """A finished call's output as a chat message: its text and tool calls."""
    message: dict[str, Any] = {"role": "assistant", "content": last.content or None}
    if last.tool_calls:
        message["tool_calls"] = _tool_calls(last.tool_calls)
    elif message["content"] is None:
        message["content"] = ""
    return message


def completion(request_id: str, model: str, last: CallChunk) -> dict[str, Any]:
    """The whole ``chat.completion`` object of a finished call."""
    assert last.result is not None
    message = assistant_message(last)
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": last.finish_reason,
                "logprobs": logprobs_body(last.result.logprobs),
            }
        ],
        "usage": usage_body(last.result),
        "system_fingerprint": f"seed-{last.result.seed}",
        "speculative_decoding_stats": speculative_stats(last.result.stats),
    }


def logprobs_body(logprobs: Sequence[Logprob] | None) -> dict[str, Any] | None:
    """``choices[].logprobs`` (None where the call did not ask for them)."""
    if logprobs is None:
        return None
    return {"content": [each.as_openai() for each in logprobs], "refusal": None}


def stream_chunk(
    request_id: str,
    model: str,
    delta: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    usage: dict[str, int] | None = None,
    extra: dict[str, Any] | None = None,
    logprobs: Sequence[Logprob] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` with ``usage``: the usage-only chunk that
    ends a stream asked for with ``stream_options.include_usage``."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": []
        if delta is None
        else [
            {
                "index": 0,
                "delta": delta,
                "finish_reason": finish_reason,
                "logprobs": logprobs_body(logprobs),
            }
        ],
    }
    if usage is not None:
        body["usage"] = usage
    if extra:
        body.update(extra)
    return body


def final_delta(last: CallChunk) -> dict[str, Any]:
    """What the last chunk of a stream adds: held-back content, or the tool calls."""
    if last.tool_calls:
        return {"tool_calls": _tool_calls(last.tool_calls, with_index=True)}
    return {}


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
