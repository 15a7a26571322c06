"""A call's chunks as a response: the first chunk awaited (errors before any output get a
status code), the rest chained, collected for a JSON answer, or sent as server-sent events;
a client that leaves cancels its call."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request

from ..calls import CallChunk
from ..errors import SpecAgentError
from .errors import ApiError, as_api_error
from .wire import completion, error_body, final_delta, stream_chunk, usage_body

__all__ = [
    "DISCONNECT_POLL_S",
    "chain",
    "collect",
    "event",
    "first_chunk",
    "sse",
    "unless_disconnected",
    "whole",
]


async def first_chunk(chunks: AsyncGenerator[CallChunk, None]) -> CallChunk:
    """The first chunk, so that errors before any output are answered with a status code."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        raise ApiError(500, "the call ended without output", "server_error") from None
    except SpecAgentError as exc:
        raise as_api_error(exc) from None


async def chain(
    first: CallChunk, rest: AsyncGenerator[CallChunk, None]
) -> AsyncGenerator[CallChunk, None]:
    """``first`` then the rest; closing this closes ``rest`` (and so cancels the call)."""
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        with anyio.CancelScope(shield=True):
            await rest.aclose()


async def collect(chunks: AsyncGenerator[CallChunk, None]) -> CallChunk:
    """The last chunk of a call, its content the whole output's."""
    text: list[str] = []
    async for chunk in chunks:
        if chunk.result is None:
            text.append(chunk.text)
            continue
        return whole(chunk, "".join(text))
    raise ApiError(500, "the call ended without a result", "server_error")


async def unless_disconnected(request: Request, work: Awaitable[CallChunk]) -> CallChunk | None:
    """``work``'s result, or None when the client disconnects first (``work`` is cancelled:
    a non-streaming call must not run on for nobody; a streaming one stops as its response
    does). Errors of ``work`` come out as they are."""
    outcome: list[CallChunk] = []
    failure: list[BaseException] = []

    async def run(scope: anyio.CancelScope) -> None:
        try:
            outcome.append(await work)
        except Exception as exc:  # re-raised below, outside the task group
            failure.append(exc)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, tg.cancel_scope)
        while not await request.is_disconnected():
            await anyio.sleep(DISCONNECT_POLL_S)
        tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return outcome[0] if outcome else None


DISCONNECT_POLL_S = 0.25
"""How often a non-streaming call checks that its client is still there."""


def whole(last: CallChunk, streamed: str) -> CallChunk:
    """The last chunk with its content made the whole output's (text chunks + the rest)."""
    return CallChunk(
        result=last.result,
        content=streamed + last.content,
        tool_calls=last.tool_calls,
        finish_reason=last.finish_reason,
    )


async def sse(
    request_id: str,
    model: str,
    chunks: AsyncGenerator[CallChunk, None],
    include_usage: bool,
    release: Callable[[], None],
    ended: Callable[[int, Any], None],
) -> AsyncIterator[dict[str, str]]:
    """Server-sent events of one call. Closing this generator (the client went away) closes
    ``chunks``, which cancels the call in the runtime. ``ended(status, result)`` says how the
    call ended: 200 with its result, an error's status, or 499 (the client went away)."""
    status, result = 499, None
    try:
        yield event(stream_chunk(request_id, model, {"role": "assistant", "content": ""}))
        async for chunk in chunks:
            if chunk.result is None:
                if chunk.text:
                    delta = {"content": chunk.text}
                    yield event(stream_chunk(request_id, model, delta, logprobs=chunk.logprobs))
                continue
            delta = final_delta(chunk)
            if not chunk.tool_calls and chunk.content:
                delta["content"] = chunk.content
            stats = {
                "speculative_decoding_stats": completion(request_id, model, chunk)[
                    "speculative_decoding_stats"
                ]
            }
            last = stream_chunk(
                request_id, model, delta, chunk.finish_reason, extra=stats, logprobs=chunk.logprobs
            )
            yield event(last)
            if include_usage:
                yield event(stream_chunk(request_id, model, usage=usage_body(chunk.result)))
            status, result = 200, chunk.result
        yield {"data": "[DONE]"}
    except Exception as exc:  # after the first chunk: the status line is already sent
        api = as_api_error(exc)
        status, result = api.status, None
        yield event(error_body(str(api), api.kind, api.param, api.code))
    finally:
        ended(status, result)
        release()
        with anyio.CancelScope(shield=True):
            await chunks.aclose()


def event(body: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(body, separators=(",", ":"))}
