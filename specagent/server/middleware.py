"""ASGI middleware of the server's own: the request body's size limit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request

from .errors import ApiError

__all__ = ["BodyLimit"]


class BodyLimit:
    """413 for a request body over ``max_bytes``: at once from ``Content-Length``, or as soon as
    a chunked body passes the limit (a plain ASGI middleware, so streaming responses and
    client disconnects pass through untouched)."""

    def __init__(
        self, app: Any, max_bytes: int, refused: Callable[[Request], None] | None = None
    ) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.refused = refused
        """Told of each request refused here (the dashboard and the audit store count it)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send, length)
            return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._refuse(scope, receive, send, f"more than {self.max_bytes}")

    async def _refuse(self, scope: Any, receive: Any, send: Any, size: str) -> None:
        message = f"request body of {size} bytes is over the limit of {self.max_bytes}"
        error = ApiError(413, message, "invalid_request_error", code="body_too_large")
        if self.refused is not None:
            self.refused(Request(scope))
        await error.response()(scope, receive, send)


class _TooLarge(Exception):
    pass
