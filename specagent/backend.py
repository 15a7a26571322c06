"""The backend seam: what a front door (the LangChain adapter, the HTTP server, the bench, the
evaluation) needs from an engine. ``SpecRuntime`` is one; another engine that runs the same
policies (a remote replica, a different decoding library) can stand behind the same front doors
by providing these few members."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, runtime_checkable

from .policy import PolicySet
from .results import GenerationResult, StreamChunk

__all__ = ["Backend"]


@runtime_checkable
class Backend(Protocol):
    """An engine behind specagent's policies.

    ``stream(prompt, policy=..., tags=..., max_new_tokens=..., temperature=..., top_p=...,
    top_k=..., stop=..., seed=..., timeout=..., tools=..., constraint=...)`` yields text chunks
    and, last, a chunk with the ``GenerationResult``; closing the iterator early cancels the
    call. Errors are ``specagent.errors`` exceptions (``PolicyNotFoundError``,
    ``InvalidRequestError``, ``RuntimeOverloadedError``, ...)."""

    model_name: str
    policies: PolicySet

    # Callables rather than methods: an engine's own keyword-only parameters (as
    # ``SpecRuntime.stream`` has) then match the protocol for type checkers too.
    @property
    def stream(self) -> Callable[..., AsyncIterator[StreamChunk]]: ...

    @property
    def generate(self) -> Callable[..., Awaitable[GenerationResult]]: ...

    async def aclose(self, drain: bool = True) -> None: ...

    def close(self, drain: bool = True) -> None: ...
