"""The audit store's tables, its per-minute view and their migrations (SQLAlchemy Core: one
schema for SQLite and PostgreSQL).

``specagent_calls`` has one row per call, numbers and names only: never a prompt, an output,
or anything derived from them that could restore them. ``specagent_refusals`` counts the
requests refused before any valid key was shown (a wrong or missing key, a body too large to
read): one row per minute, source address and status with a count, not a row per request, so a
client without a key cannot grow the store faster than a bounded number of rows a minute.
``specagent_policy_minutes`` is a view a BI tool reads directly: per minute and policy, calls,
errors, latency percentiles, tokens per second, acceptance, divergence and fallbacks
(nearest-rank percentiles by window functions, which both backends have).
``specagent_audit_schema`` holds the schema's version; ``migrate`` brings an older store up
to ``SCHEMA_VERSION`` step by step, in one transaction each.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import Connection, Engine

__all__ = [
    "CALLS",
    "METADATA",
    "MINUTES_VIEW",
    "REFUSALS",
    "SCHEMA_VERSION",
    "VERSION",
    "migrate",
]

SCHEMA_VERSION = 3

METADATA = MetaData()

CALLS = Table(
    "specagent_calls",
    METADATA,
    Column("id", String(36), primary_key=True, comment="a UUID per call"),
    Column("at", DateTime(timezone=True), nullable=False, comment="when the call ended, UTC"),
    Column("minute", DateTime(timezone=True), nullable=False, comment="at, to the minute"),
    Column("front_door", String(16), nullable=False, comment="server or sdk"),
    Column(
        "endpoint",
        String(32),
        comment="the server's route: chat.completions or responses; null: the SDK's",
    ),
    Column("key_name", String(128), comment="the API key's name (never the key); null: none"),
    Column("tenant", String(600), comment="as the runtime scopes it: principal[/sub-tenant]"),
    Column("policy", String(128), comment="null: refused before a policy was known"),
    Column("mode", String(16), comment="lossless or relaxed"),
    Column("engine", String(32), comment="transformers or llama.cpp"),
    Column("model", String(256)),
    Column("status", String(64), nullable=False, comment="HTTP status, or ok / error type"),
    Column("error_id", String(32), comment="the id the server's log files the error under"),
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Column("latency_ms", Float),
    Column("ttft_ms", Float),
    Column("tokens_per_s", Float),
    Column("acceptance_rate", Float),
    Column("tokens_per_forward", Float),
    Column("divergence", Float, comment="relaxed calls: total variation from the model's"),
    Column("fell_back_to_lossless", Boolean),
    Column("accepted_by_source", JSON, comment="accepted draft tokens per source"),
    Column("trace_id", String(32), comment="the call's OpenTelemetry trace (hex)"),
    Index("ix_specagent_calls_at", "at"),
    Index("ix_specagent_calls_policy_minute", "policy", "minute"),
    Index("ix_specagent_calls_key", "key_name", "at"),
)

REFUSALS = Table(
    "specagent_refusals",
    METADATA,
    Column("id", String(36), primary_key=True, comment="a UUID per row"),
    Column("minute", DateTime(timezone=True), nullable=False, comment="the minute counted, UTC"),
    Column("front_door", String(16), nullable=False, comment="server"),
    Column(
        "source",
        String(64),
        nullable=False,
        comment="the client's address; 'other': past the per-minute bound of addresses",
    ),
    Column("status", String(64), nullable=False, comment="HTTP status (401, 413, 503...)"),
    Column("count", Integer, nullable=False, comment="requests refused so in that minute"),
    Index("ix_specagent_refusals_minute", "minute"),
)

VERSION = Table(
    "specagent_audit_schema",
    METADATA,
    Column("version", Integer, primary_key=True),
)

MINUTES_VIEW = "specagent_policy_minutes"

_MINUTES_SQL = f"""
CREATE VIEW {MINUTES_VIEW} AS
WITH timed AS (
    SELECT minute, policy, latency_ms,
           ROW_NUMBER() OVER (PARTITION BY minute, policy ORDER BY latency_ms) AS rank,
           COUNT(*) OVER (PARTITION BY minute, policy) AS n
    FROM specagent_calls WHERE latency_ms IS NOT NULL AND policy IS NOT NULL
),
latency AS (
    SELECT minute, policy,
           MIN(CASE WHEN rank >= 0.5 * n THEN latency_ms END) AS p50_latency_ms,
           MIN(CASE WHEN rank >= 0.95 * n THEN latency_ms END) AS p95_latency_ms
    FROM timed GROUP BY minute, policy
),
diverged AS (
    SELECT minute, policy, divergence,
           ROW_NUMBER() OVER (PARTITION BY minute, policy ORDER BY divergence) AS rank,
           COUNT(*) OVER (PARTITION BY minute, policy) AS n
    FROM specagent_calls WHERE divergence IS NOT NULL AND policy IS NOT NULL
),
divergence AS (
    SELECT minute, policy,
           MIN(CASE WHEN rank >= 0.95 * n THEN divergence END) AS p95_divergence
    FROM diverged GROUP BY minute, policy
)
SELECT c.minute AS minute, c.policy AS policy,
       COUNT(*) AS calls,
       SUM(CASE WHEN c.status IN ('ok', '200') THEN 0 ELSE 1 END) AS errors,
       MAX(l.p50_latency_ms) AS p50_latency_ms,
       MAX(l.p95_latency_ms) AS p95_latency_ms,
       SUM(c.completion_tokens) * 1000.0 / NULLIF(SUM(c.latency_ms), 0) AS tokens_per_s,
       AVG(c.acceptance_rate) AS mean_acceptance,
       AVG(c.divergence) AS mean_divergence,
       MAX(d.p95_divergence) AS p95_divergence,
       SUM(CASE WHEN c.fell_back_to_lossless THEN 1 ELSE 0 END) AS fallbacks
FROM specagent_calls c
LEFT JOIN latency l ON l.minute = c.minute AND l.policy = c.policy
LEFT JOIN divergence d ON d.minute = c.minute AND d.policy = c.policy
WHERE c.policy IS NOT NULL
GROUP BY c.minute, c.policy
"""


def _create_v1(connection: Connection) -> None:
    METADATA.create_all(connection, tables=[CALLS])  # today's columns: later steps add none
    connection.execute(text(_MINUTES_SQL))


def _create_v2(connection: Connection) -> None:
    METADATA.create_all(connection, tables=[REFUSALS])


def _add_endpoint_v3(connection: Connection) -> None:
    """Which route a server call came through (a store made before it has no such column;
    its older rows read null)."""
    if "endpoint" not in {c["name"] for c in inspect(connection).get_columns(CALLS.name)}:
        connection.execute(text(f"ALTER TABLE {CALLS.name} ADD COLUMN endpoint VARCHAR(32)"))


MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: _create_v1,
    2: _create_v2,
    3: _add_endpoint_v3,
}
"""``MIGRATIONS[v]`` brings a store at version ``v - 1`` (0: empty) to version ``v``."""


def migrate(engine: Engine) -> int:
    """Create the schema in an empty database, or bring an older one to ``SCHEMA_VERSION``;
    returns the version found. A store newer than this code is refused (an older specagent
    must not write rows a newer schema reads differently)."""
    with engine.begin() as connection:
        METADATA.create_all(connection, tables=[VERSION])
        found = connection.execute(select(VERSION.c.version)).scalar() or 0
    if found > SCHEMA_VERSION:
        msg = (
            f"the audit store's schema is version {found}, newer than this specagent's "
            f"{SCHEMA_VERSION}; upgrade specagent"
        )
        raise RuntimeError(msg)
    for version in range(found + 1, SCHEMA_VERSION + 1):
        with engine.begin() as connection:
            MIGRATIONS[version](connection)
            connection.execute(VERSION.delete())
            connection.execute(VERSION.insert().values(version=version))
    return found
