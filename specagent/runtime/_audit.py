"""A call's audit row, as the runtime records it (``SpecRuntime(audit=...)``): what the call
learned on its way (``CallFacts``) and how it ended. SQLAlchemy is imported only where a store
is in use (the audit extra)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

import anyio

from ..results import GenerationResult
from ..tenants import Tenant
from ._admission import CallPlan

if TYPE_CHECKING:
    from ..audit import AuditStore

__all__ = ["CallFacts", "audit_store", "record_call", "status_of"]


def audit_store(audit: Any) -> AuditStore | None:
    """``audit`` opened (``specagent.audit.open_audit``: a database URL or a store)."""
    if audit is None:
        return None
    from ..audit import open_audit

    return open_audit(audit)


@dataclasses.dataclass
class CallFacts:
    """What a call learned on its way, for its audit row."""

    audit: AuditStore | None
    """Where its row goes (None: not recorded here)."""
    tenant: Tenant | None = None
    plan: CallPlan | None = None
    result: GenerationResult | None = None
    trace_id: str | None = None
    recorded: bool = False


def record_call(facts: CallFacts, status: str, engine: str, model: str) -> None:
    """The call's audit row, once."""
    if facts.audit is None or facts.recorded:
        return
    facts.recorded = True
    from ..audit import call_row

    plan = facts.plan
    facts.audit.record(
        call_row(
            front_door="sdk",
            status=status,
            result=facts.result,
            tenant=plan.tenant if plan is not None else facts.tenant,
            policy=plan.policy.name if plan is not None else None,
            mode=plan.policy.mode if plan is not None else None,
            engine=engine,
            model=model,
            prompt_tokens=len(plan.prompt_ids) if plan is not None else None,
            trace_id=facts.trace_id,
        )
    )


def status_of(exc: BaseException) -> str:
    """An audit row's status for a call that ended by ``exc``: its error type, or
    ``cancelled`` (its caller went away or was cancelled)."""
    if isinstance(exc, GeneratorExit):
        return "cancelled"
    with contextlib.suppress(Exception):  # outside an event loop: not a cancellation
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            return "cancelled"
    return type(exc).__name__
