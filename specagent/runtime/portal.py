"""The sync front door's one bridge into the async core: ``iterate_sync`` drives an async
iterator from blocking code through an anyio blocking portal (a private event loop in a helper
thread). The runtime's ``stream_sync``/``generate_sync`` and the LangChain adapter's sync
``stream``/``invoke`` all go through it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

from anyio.from_thread import start_blocking_portal

__all__ = ["current_async_library", "iterate_sync", "refuse_inside_event_loop"]

T = TypeVar("T")


def iterate_sync(open_stream: Callable[[], AsyncIterator[T]]) -> Iterator[T]:
    """Items of the async iterator ``open_stream()`` as they arrive, from synchronous code.
    Closing this iterator early closes the async one (which cancels the call behind it)."""
    with start_blocking_portal() as portal:
        stream = open_stream()
        try:
            while True:
                try:
                    item = portal.call(stream.__anext__)
                except StopAsyncIteration:
                    return
                yield item
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                portal.call(aclose)


def current_async_library() -> str | None:
    """``"asyncio"`` or ``"trio"`` when called inside that event loop, else None."""
    import asyncio

    try:
        asyncio.get_running_loop()
        return "asyncio"
    except RuntimeError:
        pass
    try:
        import trio
    except ImportError:
        return None
    try:
        trio.lowlevel.current_task()
        return "trio"
    except RuntimeError:
        return None


def refuse_inside_event_loop(name: str, async_name: str) -> None:
    """Blocking calls from inside an event loop would stall it: say what to use instead."""
    if current_async_library() is None:
        return
    msg = f"{name}() blocks; inside async code use `await {async_name}(...)` instead"
    raise RuntimeError(msg)
