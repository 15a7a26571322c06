"""What every route of the app shares (``Served``): the backend, the keys, the options, the
limits, the drain switch, the call log and the stored responses, and how a call that was
answered is counted and recorded (``ended``)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..backend import Backend
from .dashboard import CallLog, CallRecord
from .keys import KeyStore
from .limits import Limits
from .options import ServerOptions
from .requests import bearer, caller_of
from .response_store import ResponseStore

__all__ = ["ENDPOINTS", "Served"]

ENDPOINTS = {"/v1/chat/completions": "chat.completions", "/v1/responses": "responses"}
"""The routes that run calls, by the name their audit rows give."""

log = logging.getLogger("specagent.server")


@dataclass
class Served:
    backend: Backend
    keys: KeyStore
    options: ServerOptions
    per_key: int
    """Calls in flight a key may hold where neither it nor the server says."""
    limits: Limits = field(default_factory=Limits)
    calls: CallLog = field(default_factory=CallLog)
    draining: bool = False
    """New calls get 503; the calls in flight finish."""
    responses: ResponseStore | None = None
    """Stored Responses API responses (None: the server stores none)."""

    def __post_init__(self) -> None:
        if self.options.store_responses and self.responses is None:
            self.responses = ResponseStore(
                retention_s=self.options.responses_retention_s,
                max_bytes_per_key=self.options.responses_max_bytes_per_key,
                max_bytes=self.options.responses_max_bytes,
            )

    def ended(
        self, request: Request, status: int, result: Any = None, error_id: str | None = None
    ) -> None:
        """A call answered (either endpoint's): counted on the dashboard under its key and its
        policy where they were known and allowed (a refusal before that is filed under no
        policy), and its row in the audit store (every call, ran or refused). A request refused
        before it showed a valid key is only counted (per minute, address and status): whoever
        has no key cannot write the audit store a row per request."""
        if request.url.path not in ENDPOINTS:
            return
        caller = caller_of(request)
        if not caller.key_checked:
            # Refused before its key was read (draining, a body too large): a valid key still
            # earns its row, under its name.
            shown = self.keys.authenticate(bearer(request))
            caller.key = shown.name if shown is not None else None
        if caller.key is None:
            self.calls.record(CallRecord(policy=None, status=status, key=None))
            if self.options.audit is not None:
                source = request.client.host if request.client is not None else None
                self.options.audit.count_refusal(source, status, front_door="server")
            return
        if result is not None:
            self.calls.record(CallRecord.of_result(result, status, key=caller.key))
        else:
            self.calls.record(CallRecord(policy=caller.policy, status=status, key=caller.key))
        if self.options.audit is not None:
            self.options.audit.record(self._audit_row(request, status, result, error_id))

    def drain(self) -> None:
        """From now on new calls get 503; the calls in flight finish (whoever runs the app
        waits for them)."""
        self.draining = True
        log.info(
            "draining: new calls get 503; calls in flight, which finish first: %d",
            self.limits.total_in_flight(),
        )

    def _audit_row(
        self, request: Request, status: int, result: Any, error_id: str | None
    ) -> dict[str, Any]:
        """A call's audit row as the server knows it (``specagent.audit.call_row``)."""
        from ..audit import call_row

        caller = caller_of(request)
        policy = caller.policy
        mode = None
        if policy is not None:
            with contextlib.suppress(Exception):
                mode = self.backend.policies[policy].mode
        return call_row(
            front_door="server",
            status=status,
            result=result,
            key_name=caller.key,
            tenant=caller.tenant,
            policy=policy,
            mode=mode,
            engine=self.backend.engine,
            model=self.backend.model_name,
            error_id=error_id,
            endpoint=ENDPOINTS[request.url.path],
        )
