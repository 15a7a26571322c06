"""Turning a call's prompt into token ids: text, token ids, or chat messages.

Chat messages go through the tokenizer's own chat template (``apply_chat_template``), so every
model gets the format it was trained on.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequestError

__all__ = ["ParsedOutput", "Prompt", "ToolCall", "parse_tool_calls", "render_prompt"]

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]

_ROLES = {"system", "user", "assistant", "tool", "developer"}


def render_prompt(
    prompt: Prompt,
    tokenizer: Any | None,
    *,
    vocab_size: int,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids for ``prompt``; raises ``InvalidRequestError`` naming what is wrong."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        ids = list(_need_tokenizer(tokenizer, "a text prompt").encode(prompt))
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        if len(prompt) == 0:
            raise InvalidRequestError("prompt is empty (no tokens or messages)")
        if all(isinstance(x, Mapping) for x in prompt):
            ids = _render_messages(prompt, tokenizer, tools)  # type: ignore[arg-type]
        elif all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            ids = [int(x) for x in prompt]  # type: ignore[arg-type]
        else:
            msg = "prompt must be a string, a list of token ids (int) or of chat messages (dict)"
            raise InvalidRequestError(msg)
    else:
        msg = f"prompt must be a string, token ids or chat messages, got {type(prompt).__name__}"
        raise InvalidRequestError(msg)
    if not ids:
        raise InvalidRequestError("prompt encodes to no tokens")
    bad = [x for x in ids if not 0 <= x < vocab_size]
    if bad:
        msg = f"token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        raise InvalidRequestError(msg)
    return ids


def _need_tokenizer(tokenizer: Any | None, what: str) -> Any:
    if tokenizer is None:
        msg = f"{what} needs a tokenizer; this runtime has none (pass tokenizer=...)"
        raise InvalidRequestError(msg)
    return tokenizer


def _render_messages(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any | None,
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[int]:
    tok = _need_tokenizer(tokenizer, "a chat prompt")
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in _ROLES:
            msg = f"message {i}: role must be one of {sorted(_ROLES)}, got {role!r}"
            raise InvalidRequestError(msg)
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            kind = type(content).__name__
            msg = f"message {i}: content must be a string or a list of parts, got {kind}"
            raise InvalidRequestError(msg)
    if getattr(tok, "chat_template", None) is None:
        raise InvalidRequestError("this tokenizer has no chat template; pass text or token ids")
    try:
        rendered = tok.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=True,
            tokenize=True,
        )
    except Exception as exc:  # jinja errors, template-specific checks
        msg = f"the chat template could not render these messages: {exc}"
        raise InvalidRequestError(msg) from exc
    ids = (
        rendered["input_ids"]
        if isinstance(rendered, Mapping) or hasattr(rendered, "keys")
        else rendered
    )
    return [int(x) for x in ids]


# --------------------------------------------------------------------------- tool calls


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str


@dataclass(frozen=True)
class ParsedOutput:
    """A model's reply split into its text and the tool calls it made."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
TOOL_CALL_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
"""Text that starts a tool call in the formats parsed here (Hermes/Qwen, Mistral, Llama 3.1)."""


def parse_tool_calls(text: str, tool_names: Sequence[str] | None = None) -> ParsedOutput:
    """Find tool calls in a model's output.

    Formats: Hermes/Qwen (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several
    allowed), Mistral (``[TOOL_CALLS] [{...}]``), Llama 3.1 (``<|python_tag|>{...}``), and a plain
    JSON object or list of objects (optionally in a ```json fence) with ``name`` and
    ``arguments`` (or ``parameters``). A plain-JSON call must name one of ``tool_names`` (when
    given), so ordinary JSON answers are not mistaken for calls.
    """
    calls: list[ToolCall] = []
    if "<tool_call>" in text:
        for body in _HERMES.findall(text):
            calls.extend(_calls_from_json(body, tool_names=None, start=len(calls)))
        if calls:
            content = text[: text.index("<tool_call>")].strip()
            return ParsedOutput(content=content, tool_calls=calls)
    for marker in ("[TOOL_CALLS]", "<|python_tag|>"):
        if marker in text:
            head, _, body = text.partition(marker)
            calls = _calls_from_json(body.strip(), tool_names=None, start=0)
            if calls:
                return ParsedOutput(content=head.strip(), tool_calls=calls)
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    body = fenced.group(1) if fenced else stripped
    if body.startswith(("{", "[")):
        calls = _calls_from_json(body, tool_names=tool_names, start=0)
        if calls:
            return ParsedOutput(content="", tool_calls=calls)
        # A call written first, then prose (small models narrate after the JSON): the call,
        # with the prose as content. Only for calls naming a known tool, as above.
        try:
            _, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            end = 0
        if end and tool_names:
            calls = _calls_from_json(body[:end], tool_names=tool_names, start=0)
            if calls:
                return ParsedOutput(content=body[end:].strip(), tool_calls=calls)
    return ParsedOutput(content=text)


def _calls_from_json(body: str, tool_names: Sequence[str] | None, start: int) -> list[ToolCall]:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return []
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # some models double-encode
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return []
        if not isinstance(arguments, dict):
            return []
        if tool_names is not None and item["name"] not in tool_names:
            return []
        calls.append(ToolCall(item["name"], arguments, f"call_{uuid.uuid4().hex[:24]}"))
    return calls
