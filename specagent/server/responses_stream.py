"""A Responses API call streamed as its typed server-sent events: ``response.created`` and
``response.in_progress``; the message's ``output_item.added``, ``content_part.added``, each
``output_text.delta`` (with its tokens' log-probabilities where asked) and their ``done``
events; each function call's ``output_item.added``, ``function_call_arguments.delta`` and
``done`` (a tool call is parsed from the whole output, so its arguments come as one delta); then
``response.completed`` (or ``response.incomplete`` where the token budget ran out). An error
after the stream began is an ``error`` event. Closing the stream (the client left) cancels the
call, as on chat completions."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import anyio

from ..calls import CallChunk
from .errors import as_api_error
from .responses_wire import function_call_item, item_id, message_item, text_logprobs

__all__ = ["response_events"]


async def response_events(
    started: dict[str, Any],
    chunks: AsyncGenerator[CallChunk, None],
    finish: Callable[[CallChunk, list[dict[str, Any]]], dict[str, Any]],
    release: Callable[[], None],
    ended: Callable[[int, Any], None],
) -> AsyncIterator[dict[str, str]]:
    """The events of one call, ``started`` its response in progress. ``finish(last,
    output)`` is the finished ``response`` object (kept where asked); ``ended(status,
    result)`` says how the call ended (200, an error's status, or 499: the client went
    away)."""
    status, result = 499, None
    sequence = 0

    def event(kind: str, **fields: Any) -> dict[str, str]:
        nonlocal sequence
        body = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return {"event": kind, "data": json.dumps(body, separators=(",", ":"))}

    message_id = item_id("msg")
    text: list[str] = []
    logprobs: list[dict[str, Any]] = []
    opened = False  # the message item announced

    def open_message() -> list[dict[str, str]]:
        nonlocal opened
        opened = True
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            event(
                "response.output_item.added",
                output_index=0,
                item=message_item(message_id, "", None, status="in_progress"),
            ),
            event(
                "response.content_part.added",
                item_id=message_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    def delta(piece: str, piece_logprobs: Any) -> dict[str, str]:
        text.append(piece)
        shown = text_logprobs(piece_logprobs)
        logprobs.extend(shown)
        return event(
            "response.output_text.delta",
            item_id=message_id,
            output_index=0,
            content_index=0,
            delta=piece,
            logprobs=shown,
        )

    try:
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        async for chunk in chunks:
            if chunk.result is None:
                if chunk.text:
                    if not opened:
                        for each in open_message():
                            yield each
                    yield delta(chunk.text, chunk.logprobs)
                continue
            output: list[dict[str, Any]] = []
            if chunk.content or opened or not chunk.tool_calls:
                if not opened:
                    for each in open_message():
                        yield each
                if chunk.content:
                    yield delta(chunk.content, chunk.logprobs if not chunk.tool_calls else None)
                whole = "".join(text)
                item = message_item(message_id, whole, None)
                item["content"][0]["logprobs"] = logprobs
                yield event(
                    "response.output_text.done",
                    item_id=message_id,
                    output_index=0,
                    content_index=0,
                    text=whole,
                    logprobs=logprobs,
                )
                yield event(
                    "response.content_part.done",
                    item_id=message_id,
                    output_index=0,
                    content_index=0,
                    part=item["content"][0],
                )
                yield event("response.output_item.done", output_index=0, item=item)
                output.append(item)
            for call in chunk.tool_calls:
                index = len(output)
                item = function_call_item(call)
                yield event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"},
                )
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                )
                yield event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
                yield event("response.output_item.done", output_index=index, item=item)
                output.append(item)
            body = finish(chunk, output)
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            status, result = 200, chunk.result
            yield event(kind, response=body)
    except Exception as exc:  # after the first event: the status line is already sent
        api = as_api_error(exc)
        status, result = api.status, None
        yield event("error", code=api.code or api.kind, message=str(api), param=api.param)
    finally:
        ended(status, result)
        release()
        with anyio.CancelScope(shield=True):
            await chunks.aclose()
