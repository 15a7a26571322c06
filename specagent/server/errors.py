"""Errors answered in OpenAI's shape, and the mapping of specagent's errors onto HTTP statuses.
Messages come from a fixed set or from specagent's own errors: any other exception's text (a
path, a traceback, a replica's address) stays in the server's log, under an id the client can
quote."""

from __future__ import annotations

import logging
import secrets

from fastapi.responses import JSONResponse

from ..errors import (
    CallTimeoutError,
    ContextLengthError,
    InvalidRequestError,
    PolicyNotFoundError,
    RuntimeClosedError,
    RuntimeOverloadedError,
)
from .wire import error_body

__all__ = ["ApiError", "as_api_error", "param_of"]

log = logging.getLogger("specagent.server")


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        error_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.headers = headers or {}
        self.error_id = error_id
        """The id the server's log files this error under (its audit row names it)."""

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(str(self), self.kind, self.param, self.code),
            status_code=self.status,
            headers=self.headers,
        )


def as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, PolicyNotFoundError):
        return ApiError(404, str(exc), "not_found_error", param="policy", code="policy_not_found")
    if isinstance(exc, ContextLengthError):
        code = "context_length_exceeded"
        return ApiError(400, str(exc), "invalid_request_error", param="messages", code=code)
    if isinstance(exc, RuntimeOverloadedError):
        return ApiError(
            429,
            str(exc),
            "rate_limit_error",
            code="overloaded",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, RuntimeClosedError):
        return ApiError(503, str(exc), "unavailable")
    if isinstance(exc, CallTimeoutError):
        return ApiError(504, str(exc), "timeout_error", code="deadline_exceeded")
    if isinstance(exc, InvalidRequestError):
        return ApiError(422, str(exc), "invalid_request_error", param=param_of(str(exc)))
    # Any other exception's text is the server's business (paths, tensor shapes, other calls'
    # state, a replica's traceback): the log has it under an id the client can quote.
    error_id = secrets.token_hex(6)
    if isinstance(exc, ValueError):  # a library's complaint about the input: its words stay here
        log.warning("request refused (error id %s): %r", error_id, exc)
        message = f"the request could not be processed (error id {error_id})"
        return ApiError(422, message, "invalid_request_error", error_id=error_id)
    log.error("call failed (error id %s)", error_id, exc_info=exc)
    message = f"the call failed on the server (error id {error_id}; its log has the details)"
    return ApiError(500, message, "server_error", error_id=error_id)


def param_of(message: str) -> str | None:
    head = message.split(":", 1)[0].strip()
    return head if head and " " not in head else None
