"""Turning a call's prompt into token ids: text, token ids, or chat messages.

Chat messages go through the tokenizer's own chat template (``apply_chat_template``), so every
model gets the format it was trained on.
"""

from __future__ import annotations

import json
import re
import secrets
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ContextLengthError, InvalidRequestError

__all__ = ["ParsedOutput", "Prompt", "ToolCall", "parse_tool_calls", "render_prompt"]

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]

_ROLES = {"system", "user", "assistant", "tool", "developer"}


def render_prompt(
    prompt: Prompt,
    tokenizer: Any | None,
    *,
    vocab_size: int,
    tools: Sequence[Mapping[str, Any]] | None = None,
    max_tokens: int | None = None,
) -> list[int]:
    """Token ids for ``prompt``; raises ``InvalidRequestError`` naming what is wrong.
    ``max_tokens`` (the context window): a prompt whose text alone holds more tokens is
    refused before its template renders, after tokenizing about that many tokens of it
    (``ContextLengthError``), whatever its size."""
    if max_tokens is not None and tokenizer is not None:
        _refuse_past(_texts_of(prompt, tools), tokenizer, max_tokens)
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


def prediction_ids(
    prediction: str | Sequence[int] | None,
    tokenizer: Any | None,
    vocab_size: int,
    max_tokens: int | None,
) -> list[int]:
    """A call's predicted output as token ids (text spelled as ordinary text: a control token's
    spelling in it stays text); refused, naming ``prediction``, where it is not text or token
    ids, holds ids outside the vocabulary, or is longer than the context window (text is
    counted first as a prompt's is, ``_refuse_past``: a flood is refused after about a
    window's tokens, never tokenized whole)."""
    if prediction is None:
        return []
    bound = max_tokens if max_tokens is not None else PREDICTION_TOKENS
    if isinstance(prediction, str):
        tok = _need_tokenizer(tokenizer, "a text prediction")
        try:
            _refuse_past([prediction], tok, bound)
        except ContextLengthError:
            msg = f"prediction: {len(prediction)} characters; at most {bound} tokens fit"
            raise InvalidRequestError(msg) from None
        ids = _spell(tok, prediction)
    elif isinstance(prediction, Sequence) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in prediction
    ):
        ids = [int(x) for x in prediction]
        bad = [x for x in ids if not 0 <= x < vocab_size]
        if bad:
            msg = f"prediction: token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            raise InvalidRequestError(msg)
    else:
        msg = f"prediction: must be text or token ids, got {type(prediction).__name__}"
        raise InvalidRequestError(msg)
    if len(ids) > bound:
        msg = f"prediction: {len(ids)} tokens; at most {bound} fit (the context window)"
        raise InvalidRequestError(msg)
    return ids


PREDICTION_TOKENS = 32768
"""The longest prediction where the model declares no context window."""

COUNT_CHUNK_CHARS = 16384
"""Text is counted this many characters at a time (cut at a space), so counting stops soon
after the limit is passed."""
BOUNDARY_SLACK = 4
"""Tokens a cut between two chunks may add over tokenizing them as one (a word or a run of
spaces split in two): subtracted per cut, so the count stays a lower bound."""


def _texts_of(prompt: Prompt, tools: Sequence[Mapping[str, Any]] | None = None) -> list[str]:
    """Every string the template will see: a text prompt; each message's fields but its role
    (content and its parts, tool calls' names and arguments, names, ids) and every string of
    the tools (names, descriptions, parameter schemas, keys included)."""
    if isinstance(prompt, str):
        return [prompt]
    texts: list[str] = []
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        for message in prompt:
            if isinstance(message, Mapping):
                texts.extend(_strings({k: v for k, v in message.items() if k != "role"}))
    texts.extend(_strings(list(tools or ())))
    return texts


def _strings(value: Any) -> list[str]:
    """The strings in ``value``, a JSON-like tree (mapping keys included), depth first."""
    out: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, Mapping):
            for key, inner in item.items():
                stack.append(inner)
                stack.append(key)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return out


def _refuse_past(texts: Sequence[str], tokenizer: Any, limit: int) -> None:
    """``ContextLengthError`` where ``texts`` alone hold more than ``limit`` tokens; counted
    chunk by chunk, stopping as soon as the count passes it (a lower bound: the template and
    the cuts only add)."""
    if sum(len(t) for t in texts) <= limit:  # a token is at least one character
        return
    counted = 0
    for text in texts:
        start = 0
        while start < len(text):
            end = min(len(text), start + COUNT_CHUNK_CHARS)
            if end < len(text):
                space = text.rfind(" ", start + COUNT_CHUNK_CHARS // 2, end)
                end = space if space > start else end
            counted += len(tokenizer(text[start:end], add_special_tokens=False)["input_ids"])
            counted -= BOUNDARY_SLACK
            start = end
            if counted > limit:
                msg = (
                    f"the prompt's text alone holds more than {limit} tokens; the model's "
                    f"context window is {limit}"
                )
                raise ContextLengthError(msg)


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
    marker = f"specagent-literal-{secrets.token_hex(8)}"  # ASCII: survives a template's tojson
    guarded, guarded_tools, literals = _guard_control_text(messages, tools or (), tok, marker)
    try:
        rendered = tok.apply_chat_template(
            guarded,
            tools=guarded_tools or None,
            add_generation_prompt=True,
            tokenize=not literals,
        )
    except Exception as exc:  # jinja errors, template-specific checks
        msg = f"the chat template could not render these messages: {exc}"
        raise InvalidRequestError(msg) from exc
    if literals:
        return _tokenize_with_literals(str(rendered), literals, tok, marker)
    ids = (
        rendered["input_ids"]
        if isinstance(rendered, Mapping) or hasattr(rendered, "keys")
        else rendered
    )
    return [int(x) for x in ids]


MAX_CONTROL_LITERALS = 1024
"""How many times one call's messages may spell a control token's text: each is tokenized
apart, and a flood of them must not make one call's admission dearer for everyone."""


def _control_texts(tok: Any) -> list[str]:
    """Every added token's text (role markers, end of turn, ``<tool_call>``, fill-in-the-middle
    markers: marked special or not, the template gives them meaning), longest first."""
    decoder = getattr(tok, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in decoder.values()}
    texts.update(getattr(tok, "all_special_tokens", []) or [])
    return sorted((t for t in texts if t and t.strip()), key=len, reverse=True)


def _guard_control_text(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    tok: Any,
    marker: str,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """Text that spells an added token (``<|im_start|>system``, ``<tool_call>``) would become
    that control token if the rendered prompt were tokenized whole: a user could write a
    system turn, a tool result could end the turn, an assistant turn echoed back by a client
    could open a tool call, and so could a tool call's name or arguments or a tool's name,
    description or schema (often a third party's). Such text, in every string the template
    sees but the roles, is swapped for placeholders before the template renders, and tokenized
    as plain text afterwards (``_tokenize_with_literals``); the template's own markup alone
    becomes control tokens. Returns copies of the messages and the tools and the placeholders'
    texts (none: nothing to guard)."""
    controls = _control_texts(tok)
    if not controls:
        return [dict(m) for m in messages], [dict(t) for t in tools], []
    pattern = re.compile("|".join(re.escape(c) for c in controls))
    literals: list[str] = []

    def swap(match: re.Match[str]) -> str:
        if len(literals) >= MAX_CONTROL_LITERALS:
            msg = (
                f"the messages spell control tokens (such as {match.group(0)!r}) more than "
                f"{MAX_CONTROL_LITERALS} times"
            )
            raise InvalidRequestError(msg)
        literals.append(match.group(0))
        return f"[[{marker}-{len(literals) - 1}]]"

    def hide(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(swap, value) if pattern.search(value) else value
        if isinstance(value, Mapping):
            return {hide(k): hide(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [hide(v) for v in value]
        return value

    guarded = [{k: v if k == "role" else hide(v) for k, v in m.items()} for m in messages]
    return guarded, [hide(t) for t in tools], literals


def _tokenize_with_literals(rendered: str, literals: list[str], tok: Any, marker: str) -> list[int]:
    """The rendered prompt's ids, the template's own markup as control tokens and the guarded
    texts spelled out as ordinary text (``split_special_tokens``)."""
    ids: list[int] = []
    pos = 0
    spelled: dict[str, list[int]] = {}
    for match in re.finditer(rf"\[\[{marker}-(\d+)\]\]", rendered):
        ids.extend(tok(rendered[pos : match.start()], add_special_tokens=False)["input_ids"])
        literal = literals[int(match.group(1))]
        if literal not in spelled:
            spelled[literal] = _spell(tok, literal)
        ids.extend(spelled[literal])
        pos = match.end()
    ids.extend(tok(rendered[pos:], add_special_tokens=False)["input_ids"])
    return [int(x) for x in ids]


def _spell(tok: Any, text: str) -> list[int]:
    """``text`` as ordinary text, never as an added token: through the fast tokenizer's
    normalizer, pre-tokenizer and model, past its added vocabulary (``split_special_tokens``
    splits only the tokens marked special, not ``<tool_call>``); a slow tokenizer splits the
    special ones."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return list(tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
    pieces = (
        backend.pre_tokenizer.pre_tokenize_str(normalized)
        if backend.pre_tokenizer
        else [(normalized, None)]
    )
    return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


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
    ``arguments`` (or ``parameters``). With ``tool_names`` (the tools the call offered), a call
    in any format must name one of them, or the whole output is text: a tool result that quotes
    ``<tool_call>{"name": "delete_account", ...}`` never becomes a call to a tool nobody offered,
    and ordinary JSON answers are not mistaken for calls. None accepts any name (for reading
    recorded outputs), except in plain JSON, which then is never a call.
    """
    if "<tool_call>" in text:
        calls: list[ToolCall] = []
        for body in _HERMES.findall(text):
            found = _calls_from_json(body, tool_names=tool_names, start=len(calls))
            if not found:  # malformed, or a tool that was not offered: all of it is text
                return ParsedOutput(content=text)
            calls.extend(found)
        if calls:
            content = text[: text.index("<tool_call>")].strip()
            return ParsedOutput(content=content, tool_calls=calls)
    for marker in ("[TOOL_CALLS]", "<|python_tag|>"):
        if marker in text:
            head, _, body = text.partition(marker)
            calls = _calls_from_json(body.strip(), tool_names=tool_names, start=0)
            if calls:
                return ParsedOutput(content=head.strip(), tool_calls=calls)
            return ParsedOutput(content=text)
    if not tool_names:
        return ParsedOutput(content=text)
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
        if end:
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
