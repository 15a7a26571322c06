"""Who a call is for, as the memory the runtime keeps between calls sees it.

A ``Tenant`` is a principal (who answers for the call: an API key's name on the server, the
name an SDK caller gives) and, under it, an optional sub-tenant (the server's ``user``
field). Isolation is by the whole tenant: one tenant's text and KV never reach another's call,
a sub-tenant's not even its principal's other sub-tenants'. Memory is accounted by principal:
the history and the prefix cache evict from the principal holding the most first, and cap how
many sub-tenants one principal keeps, so a principal that spreads its calls over any number of
sub-tenants still draws on one share and cannot flush another principal's entries.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_NAME_CHARS", "HistoryScope", "Tenant", "tenant_of"]

MAX_NAME_CHARS = 256


@dataclass(frozen=True, order=True)
class Tenant:
    """A principal and, under it, an optional sub-tenant."""

    principal: str
    sub: str | None = None

    def __post_init__(self) -> None:
        for field, value in (("principal", self.principal), ("sub", self.sub)):
            if value is None and field == "sub":
                continue
            if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
                msg = f"tenant {field} must be a non-empty string of at most {MAX_NAME_CHARS} chars"
                raise ValueError(msg)
            if not value.isprintable():
                # It names the call in spans, audit rows and logs: no NUL, no terminal escape.
                msg = f"tenant {field} must be printable characters (no control characters)"
                raise ValueError(msg)

    def __str__(self) -> str:
        return self.principal if self.sub is None else f"{self.principal}/{self.sub}"


def tenant_of(value: str | Tenant | None) -> Tenant | None:
    """A call's ``tenant`` argument as a ``Tenant``: a string names a principal (with no
    sub-tenant); ``ValueError`` for anything else than a string, a ``Tenant`` or None."""
    if value is None or isinstance(value, Tenant):
        return value
    if isinstance(value, str):
        return Tenant(value)
    raise ValueError(f"tenant must be a string or a Tenant, got {type(value).__name__}")


@dataclass(frozen=True)
class HistoryScope:
    """Whose earlier calls' text a call drafts from, and where its own is kept
    (``runtime.memory.HistoryStore``'s key): a tenant's, under one policy only where
    ``policy`` names it; with no tenant, the whole runtime's (single-tenant deployments)."""

    tenant: Tenant | str | None = None
    policy: str | None = None
