"""OpenAI-shaped calls, for every front door (the LangChain adapter, the HTTP server, scripts).

``CallSpec.build`` turns the fields of an OpenAI chat completion (messages, tools,
tool_choice, response_format, stop, seed, max_tokens, temperature, top_p, top_k) plus specagent's
policy name, tags and default into what a backend runs: the prompt and the grammar constraint
that enforces a forced tool call or a response format (the policy is chosen once, where the call
is admitted: ``PolicySet.resolve``). ``run_call`` runs it on a backend with retries
before the first token, holds back streamed text that may be a tool call, and parses tool calls
from the finished output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from .backend import Backend
from .call import Call
from .chat import TOOL_CALL_MARKERS, ToolCall, parse_tool_calls
from .errors import (
    GenerationError,
    IncompleteOutputError,
    InvalidRequestError,
    ModelNotFoundError,
    RuntimeOverloadedError,
)
from .grammar import Constraint
from .results import GenerationResult, Logprob
from .tenants import Tenant

__all__ = [
    "ANSWER_AFTER_TOOLS",
    "CallChunk",
    "CallSpec",
    "constraint_for",
    "format_instruction",
    "repeats_answered_calls",
    "run_call",
    "split_model",
    "tool_choice_name",
]

TOOL_CHOICE_KEYWORDS = frozenset({"auto", "none", "any", "required"})

ANSWER_AFTER_TOOLS = Constraint.lark("start: ANSWER\nANSWER: /[^{\\[<\\s](?s:.*)/")
"""The grammar of an answer to a tool result when no tools are offered: prose, not markup.

Small instruct models (Qwen2.5-Coder-0.5B, SmolLM2) shown a tool call and its result often
echo both as JSON instead of answering, or start another tool call that no tool can serve. This
grammar lets the answer start with anything but ``{``, ``[``, ``<`` or blank space, and (as every
llguidance grammar does) keeps the template's tool-call marker tokens out of free text. Under a
lossless policy the output is then exactly the target's distribution conditioned on that
grammar, as under any constraint. ``CallSpec.build(answer_guard=False)`` turns it off."""


@dataclass(frozen=True)
class CallSpec:
    """One validated call: the ``Call`` a backend runs (``Backend.run``) and how to read its
    output."""

    call: Call
    """The prompt (chat messages as a Hugging Face chat template takes them), the policy by
    name or tags, the tenant, the offered tools, the grammar and the sampling fields."""
    forced_tool: bool = False
    """The grammar forces a tool call: the whole output is held back and parsed."""
    repeat_guard: bool = False
    """A reply that only repeats tool calls the conversation already made and answered (same
    tool, same arguments) is replaced by an answer from those results (``ANSWER_AFTER_TOOLS``,
    no tools): small models shown a tool result often call the same tool again, forever."""
    one_tool_call: bool = False
    """At most one tool call per reply (OpenAI's ``parallel_tool_calls: false``): a reply that
    made several keeps its first."""

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.call.prompt)  # type: ignore[arg-type]  # built from messages

    @property
    def tool_names(self) -> list[str] | None:
        tools = self.call.tools
        return [t["function"]["name"] for t in tools] if tools else None

    @classmethod
    def build(
        cls,
        messages: list[dict[str, Any]],
        *,
        policy: str | None = None,
        tags: Sequence[str] = (),
        tenant: str | Tenant | None = None,
        default_policy: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        response_format: Mapping[str, Any] | None = None,
        stop: Sequence[str] | str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        timeout: float | None = None,
        answer_guard: bool = True,
        describe_format: bool = True,
        repeat_guard: bool = False,
        prediction: Any = None,
        parallel_tool_calls: bool | None = None,
    ) -> CallSpec:
        """Validate and translate. The policy is not chosen here: ``policy``, ``tags`` and the
        front door's ``default_policy`` go on the ``Call``, and whoever admits it chooses by
        ``PolicySet.resolve`` (a name, else the tags' route, else the default).

        ``answer_guard``: a call that offers no tools and answers a tool result (the last
        message has role ``tool``) gets ``ANSWER_AFTER_TOOLS`` as its grammar, unless it has a
        response format.

        ``repeat_guard``: see ``CallSpec.repeat_guard`` (only when the model may choose
        between calling a tool and answering: ``tool_choice`` "auto").

        ``describe_format``: a ``json_schema`` or ``json_object`` response format is also told
        to the model (``format_instruction``, in the system message): the grammar makes the
        output valid, the instruction makes it the answer (a small model constrained to a
        schema it was never shown fills its first string with anything).

        ``parallel_tool_calls``: False, at most one tool call per reply (None and True: as
        many as the model makes).

        ``prediction``: OpenAI's predicted output (``{"type": "content", "content": ...}``, or
        the text itself; ``predicted_content``)."""
        offered = [dict(t) for t in tools] if tools else None
        names = [t["function"]["name"] for t in offered] if offered else []
        choice = tool_choice_name(tool_choice, names)
        if choice == "none":
            offered = None
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        constraint = constraint_for(offered, choice, response_format)
        if constraint is None and not offered and answer_guard and _answers_tool_result(messages):
            constraint = ANSWER_AFTER_TOOLS
        if describe_format and response_format is not None:
            messages = _with_instruction(messages, format_instruction(response_format))
        call = Call(
            list(messages),
            policy=policy,
            tags=tuple(tags),
            default_policy=default_policy,
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop=tuple(sorted(set(stops))) or None,
            seed=seed,
            logprobs=logprobs,
            timeout=timeout,
            tools=offered,
            constraint=constraint,
            tenant=tenant,
            prediction=predicted_content(prediction),
        )
        return cls(
            call,
            forced_tool=constraint is not None and offered is not None,
            repeat_guard=repeat_guard and offered is not None and constraint is None,
            one_tool_call=parallel_tool_calls is False,
        )


def predicted_content(prediction: Any) -> str | None:
    """The text of a predicted output as OpenAI's API and ``ChatOpenAI`` pass it:
    ``{"type": "content", "content": text}`` where the content is text or a list of text parts
    (``{"type": "text", "text": ...}``), or the text itself; None for none. Any other shape is
    ``InvalidRequestError`` naming what was wrong."""
    if prediction is None or isinstance(prediction, str):
        return prediction
    if not isinstance(prediction, Mapping):
        kind = type(prediction).__name__
        msg = f"prediction: must be an object {{'type': 'content', 'content': ...}}, got {kind}"
        raise InvalidRequestError(msg)
    if prediction.get("type") != "content":
        raise InvalidRequestError("prediction: 'type' must be 'content'")
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, Mapping)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    msg = "prediction: 'content' must be text or a list of {'type': 'text', 'text': ...} parts"
    raise InvalidRequestError(msg)


def split_model(requested: str, served: str) -> str | None:
    """The policy a model name asks for: ``served`` asks for none (the front door's default),
    ``served:<policy>`` for that policy, as OpenAI-compatible servers name variants of one model.
    Any other model is ``ModelNotFoundError``: a call is never run on a model it did not name."""
    name, sep, policy = requested.partition(":")
    if name != served or (sep and not policy):
        raise ModelNotFoundError(requested, served)
    return policy or None


def tool_choice_name(tool_choice: Any, names: Sequence[str]) -> str | None:
    """OpenAI's and LangChain's spellings of ``tool_choice`` as one: None/"auto", "none",
    "any" (for "any", "required" and True), or a tool's name (from a name or a
    ``{"type": "function", "function": {"name": ...}}`` object)."""
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        if function is not None and not isinstance(function, Mapping):
            msg = "tool_choice: 'function' must be an object {'name': ...}"
            raise InvalidRequestError(msg)
        tool_choice = (function or {}).get("name") or tool_choice.get("name")
    if tool_choice is True or tool_choice == "required":
        return "any"
    if tool_choice is None or tool_choice is False:
        return None
    if not isinstance(tool_choice, str) or tool_choice not in TOOL_CHOICE_KEYWORDS | set(names):
        msg = (
            f"tool_choice {tool_choice!r} is not one of the bound tools: {list(names)} "
            "(nor 'auto', 'none', 'required')"
        )
        raise InvalidRequestError(msg)
    return tool_choice


def constraint_for(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | None,
    response_format: Mapping[str, Any] | None,
) -> Constraint | None:
    """The grammar a call's output must follow: its response format, or a call of the tools
    ``tool_choice`` requires; None when the output is free."""
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            msg = "response_format must be an object such as {'type': 'json_object'}"
            raise InvalidRequestError(msg)
        kind = response_format.get("type")
        if kind == "json_object":
            return Constraint.json_object(compact=False)
        if kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema", spec) if isinstance(spec, Mapping) else None
            if not isinstance(schema, Mapping):
                msg = "response_format.json_schema must be an object with a 'schema' object"
                raise InvalidRequestError(msg)
            return Constraint.json_schema(schema, strict=True, compact=False)
        if kind == "text":
            return None
        msg = f"response_format type must be text, json_object or json_schema, got {kind!r}"
        raise InvalidRequestError(msg)
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "any":
        return Constraint.tool_call(tools)
    chosen = [t for t in tools if t["function"]["name"] == tool_choice]
    return Constraint.tool_call(chosen)


def format_instruction(response_format: Mapping[str, Any]) -> str | None:
    """What the model is told a response format wants (None for plain text)."""
    kind = response_format.get("type")
    if kind == "json_object":
        return "Reply with one JSON object and nothing else."
    if kind != "json_schema":
        return None
    spec = response_format.get("json_schema") or {}
    schema = spec.get("schema", spec) if isinstance(spec, Mapping) else spec
    return (
        "Reply with one JSON value and nothing else. It must match this JSON schema; fill "
        "each field with the answer taken from the conversation:\n"
        + json.dumps(schema, ensure_ascii=False)
    )


def _with_instruction(
    messages: Sequence[Mapping[str, Any]], instruction: str | None
) -> list[dict[str, Any]]:
    """``messages`` with ``instruction`` appended to the system message (one is added first
    when there is none)."""
    out = [dict(m) for m in messages]
    if not instruction:
        return out
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{out[0]['content']}\n\n{instruction}".strip()
    else:
        out.insert(0, {"role": "system", "content": instruction})
    return out


def _answers_tool_result(messages: Sequence[Mapping[str, Any]]) -> bool:
    return bool(messages) and messages[-1].get("role") == "tool"


@dataclass(frozen=True)
class CallChunk:
    """A piece of a call's output: text to show now, or (last) the result with its content and
    parsed tool calls."""

    text: str = ""
    result: GenerationResult | None = None
    content: str = ""
    """On the last chunk: the output not yet sent as text chunks (held back, or the last piece),
    without its tool calls; the whole content is the text chunks followed by this."""
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None
    """On the last chunk: "tool_calls" when the output called tools, else the result's."""
    logprobs: list[Logprob] | None = None
    """The log-probabilities of the tokens this chunk's text (or, last, its content and
    tool calls) came from, where the call asked for them."""


async def run_call(
    backend: Backend, spec: CallSpec, max_retries: int = 2, allow_incomplete: bool = False
) -> AsyncGenerator[CallChunk, None]:
    """Run ``spec``'s call on ``backend``: text chunks as they are safe to show, then the last
    chunk.

    Retries (on overload or a failed decoding step) happen only before any output, so a stream
    never repeats itself. Text that may start a tool call is held back to the end; a constrained
    output that runs out of tokens raises ``IncompleteOutputError`` rather than returning
    JSON that does not parse, unless ``allow_incomplete`` (OpenAI's behaviour: the partial
    output with ``finish_reason="length"``)."""
    attempt = 0
    while True:
        started = shown = repeated = False
        held: list[str] = []
        # Log-probabilities of tokens whose text is not shown yet (held back, or none).
        pending: list[Logprob] | None = [] if spec.call.logprobs is not None else None
        holding = spec.forced_tool
        try:
            stream = backend.run(spec.call)
            async with contextlib.aclosing(stream):  # closing cancels
                async for chunk in stream:
                    if pending is not None and chunk.logprobs:
                        pending.extend(chunk.logprobs)
                    if chunk.result is None:
                        if not chunk.text:
                            continue
                        started = True
                        if spec.call.tools is not None and not holding:
                            holding = may_start_tool_call("".join(held) + chunk.text)
                        if holding:
                            held.append(chunk.text)
                        else:
                            shown = True
                            yield CallChunk(text=chunk.text, logprobs=pending)
                            pending = [] if pending is not None else None
                        continue
                    content = "".join(held) + chunk.text
                    last = _last_chunk(spec, chunk.result, content, allow_incomplete)
                    repeated = (
                        spec.repeat_guard
                        and not shown
                        and repeats_answered_calls(spec.messages, last.tool_calls)
                    )
                    if not repeated:
                        yield dataclasses.replace(last, logprobs=pending)
                        return
            if not repeated:
                raise GenerationError("the call ended without a result")  # pragma: no cover
        except (RuntimeOverloadedError, GenerationError) as exc:
            attempt += 1
            if started or attempt > max_retries or isinstance(exc, IncompleteOutputError):
                raise
            await anyio.sleep(min(0.1 * 2**attempt, 2.0))
            continue
        # The reply only repeated answered calls (nothing of it was shown): answer from the
        # results instead, as with no tools bound.
        answer = CallSpec(dataclasses.replace(spec.call, tools=None, constraint=ANSWER_AFTER_TOOLS))
        async for piece in run_call(backend, answer, max_retries, allow_incomplete):
            yield piece
        return


def _last_chunk(
    spec: CallSpec, result: GenerationResult, content: str, allow_incomplete: bool = False
) -> CallChunk:
    structured = spec.call.constraint not in (None, ANSWER_AFTER_TOOLS)  # prose: cut anywhere
    if structured and result.finish_reason == "length" and not allow_incomplete:
        msg = (
            f"the constrained output did not complete within {result.usage.output_tokens} "
            "tokens; raise max_tokens"
        )
        raise IncompleteOutputError(msg, output=result.text)
    tool_calls: tuple[ToolCall, ...] = ()
    if spec.call.tools is not None and content:
        parsed = parse_tool_calls(content, spec.tool_names or [])
        if parsed.tool_calls:
            content, tool_calls = parsed.content, tuple(parsed.tool_calls)
            if spec.one_tool_call:
                tool_calls = tool_calls[:1]
    return CallChunk(
        result=result,
        content=content,
        tool_calls=tool_calls,
        finish_reason="tool_calls" if tool_calls else result.finish_reason,
    )


def repeats_answered_calls(
    messages: Sequence[Mapping[str, Any]], calls: Sequence[ToolCall]
) -> bool:
    """Whether every call in ``calls`` (same tool, same arguments) was already made by an
    assistant message of ``messages`` and answered by a tool message after it."""
    answered_ids = {m.get("tool_call_id") for m in messages if m.get("role") == "tool"}
    made: set[tuple[str, str]] = set()
    for message in messages:
        for made_call in message.get("tool_calls") or ():
            function = made_call.get("function", made_call)
            if made_call.get("id") not in answered_ids and None not in answered_ids:
                continue
            made.add((str(function.get("name")), _canonical(function.get("arguments"))))
    return bool(calls) and all((c.name, _canonical(c.arguments)) in made for c in calls)


def _canonical(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def may_start_tool_call(text: str) -> bool:
    """Whether streamed text may be (the start of) a tool call, so it is held back until the
    end of the call rather than shown as content."""
    stripped = text.lstrip()
    if not stripped:
        return False
    if stripped[0] in "{[`":
        return True
    return any(marker in text or marker.startswith(stripped) for marker in TOOL_CALL_MARKERS)
