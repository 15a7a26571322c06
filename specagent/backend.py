"""The backend seam: what a front door (the LangChain adapter, the HTTP server, the bench, the
evaluation) needs from whatever runs its calls. ``SpecRuntime`` is one; the Ray ingress's
``RemoteBackend`` (replicas behind Ray Serve handles) is another; anything else that runs the
same policies stands behind the same front doors by subclassing ``Backend``: ``run`` (one
``Call``) is the one member it must write, the rest has defaults that say "not known here"."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from .call import Call
from .errors import GenerationError
from .policy import Policy, PolicySet
from .results import GenerationResult, StreamChunk

if TYPE_CHECKING:
    from .chat import Prompt

__all__ = ["Backend"]

IDLE: dict[str, Any] = {"running": 0, "queued": 0, "measured": True, "closing": False}
"""The activity of a backend that does not report one: it answers, so it is ready."""


class Backend(ABC):
    """What runs calls under specagent's policies.

    Errors are ``specagent.errors`` exceptions (``PolicyNotFoundError``,
    ``InvalidRequestError``, ``RuntimeOverloadedError``, ...)."""

    model_name: str
    policies: PolicySet
    engine: str | None = None
    """The engine that runs the forwards (None: not known here, e.g. remote replicas)."""
    max_active: int | None = None
    """Calls decoded at once (None: not known here); a key's default share of them is a
    quarter."""

    @abstractmethod
    def run(self, call: Call, *, streaming: bool = True) -> AsyncGenerator[StreamChunk, None]:
        """Run ``call``: text chunks as tokens are accepted, and last a chunk with the
        ``GenerationResult``; closing the iterator early cancels the call. ``streaming``
        says whether the caller reads chunks as they come (time to first chunk is reported
        only then) or only the result (then only that last chunk comes)."""

    def stream(self, prompt: Prompt, **kwargs: Any) -> AsyncGenerator[StreamChunk, None]:
        """Stream a call: text chunks as tokens are accepted; the last chunk has the result.
        Keywords: the fields of ``Call`` (policy, tags, sampling, tools, constraint, tenant,
        prediction, ...), declared there once. Closing the generator cancels the call."""
        return self.run(Call(prompt, **kwargs))

    async def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        """Run a call to the end. Keywords as ``stream``."""
        async with contextlib.aclosing(self.run(Call(prompt, **kwargs), streaming=False)) as it:
            async for chunk in it:
                if chunk.result is not None:
                    return chunk.result
        raise GenerationError("the call ended without a result")

    def describe(self, policy: Policy) -> dict[str, Any]:
        """What runs ``policy`` here, for the dashboard: ``engine``, the target's ``dtype``,
        the ``drafter`` (only what is known)."""
        return {"engine": self.engine} if self.engine is not None else {}

    async def report_activity(self) -> dict[str, Any]:
        """Calls ``running`` and ``queued``, whether step costs are ``measured``, whether it is
        ``closing`` (``/ready``, the dashboard)."""
        return dict(IDLE)

    @property
    def activity_gauge(self) -> Callable[[], Mapping[str, Any]] | None:
        """The same, read without waiting (the metrics' gauge); None where it takes a wait."""
        return None

    async def aclose(self, drain: bool = True) -> None:
        """Stop taking calls (``drain``: let running ones finish). Nothing here."""
        return None

    def close(self, drain: bool = True) -> None:
        """``aclose`` from synchronous code. Nothing here."""
        return None
