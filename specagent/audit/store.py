"""``AuditStore``: rows written in batches by a thread of its own, never by a call.

A call hands its row to ``record`` (a deque append under a lock: nothing a call waits for, on
the event loop or the decoding worker). The writer thread takes what has piled up, up to
``batch_rows`` at a time, and inserts it in one transaction. When the database is slow or
down, rows wait in the buffer (``buffer_rows`` at most) and are written when it answers again
(retried with a growing pause, up to ``max_retry_s``); rows past the buffer are dropped,
counted (``dropped``, the ``specagent.audit.dropped`` metric, the dashboard) and logged. A row
is inserted by its id with "on conflict do nothing": a batch retried after a commit whose
answer was lost is not stored twice. ``healthy`` says whether rows are being stored now (a
server with ``--audit-required`` refuses calls while they are not). Rows older than
``retention_days`` are deleted by the writer, hourly.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, delete, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError

from .schema import CALLS, migrate

__all__ = ["AuditStore"]

COLUMNS = tuple(column.name for column in CALLS.columns)

log = logging.getLogger("specagent.audit")

RETENTION_EVERY_S = 3600.0


class AuditStore:
    """The audit rows of one process, in the database at ``url`` (``sqlite:///PATH`` or
    ``postgresql://...``; SQLAlchemy URLs). The schema is created or migrated on open."""

    def __init__(
        self,
        url: str,
        *,
        buffer_rows: int = 100_000,
        batch_rows: int = 500,
        flush_s: float = 0.5,
        retention_days: float | None = None,
        max_retry_s: float = 5.0,
    ) -> None:
        self.url = _with_driver(url)
        self.engine: Engine = _engine(self.url)
        migrate(self.engine)
        self.buffer_rows = buffer_rows
        self.batch_rows = batch_rows
        self.flush_s = flush_s
        self.retention_days = retention_days
        self.max_retry_s = max_retry_s
        self.dropped = 0
        """Rows dropped since the start because the buffer was full."""
        self.written = 0
        self._rows: collections.deque[dict[str, Any]] = collections.deque()
        self._cond = threading.Condition()
        self._healthy = True
        self._writing = False
        self._flushing = 0
        """Callers waiting in ``flush``: the writer does not wait for more rows meanwhile."""
        self._closing = False
        self._last_retention = 0.0
        self._thread = threading.Thread(target=self._run, name="specagent-audit", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        """Rows are being stored: the last write went through and the buffer has room."""
        with self._cond:
            return self._healthy and len(self._rows) < self.buffer_rows

    @property
    def buffered(self) -> int:
        with self._cond:
            return len(self._rows)

    def record(self, row: Mapping[str, Any]) -> bool:
        """Queue ``row`` (``specagent_calls``' columns) for the writer; False when the buffer
        was full and the row was dropped."""
        with self._cond:
            if len(self._rows) >= self.buffer_rows:
                self.dropped += 1
                dropped = self.dropped
            else:
                # Every column, absent ones NULL: a batch is one statement for all its rows.
                self._rows.append({name: row.get(name) for name in COLUMNS})
                if len(self._rows) >= self.batch_rows:
                    self._cond.notify()
                return True
        if dropped == 1 or dropped % 1000 == 0:
            log.error(
                "audit buffer full (%d rows; the database is not taking them): %d rows dropped",
                self.buffer_rows,
                dropped,
            )
        return False

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every row recorded so far is written (False: not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._rows or self._writing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.1))
            finally:
                self._flushing -= 1
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is buffered (within ``timeout``), then stop the writer."""
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        self.engine.dispose()

    def _run(self) -> None:
        pause = 0.0
        while True:
            with self._cond:
                # Rows gather for up to ``flush_s`` (or until a batch is full): one transaction
                # per batch, not per row, keeps the store's share of the process small.
                deadline = time.monotonic() + self.flush_s
                while (
                    len(self._rows) < self.batch_rows
                    and not self._closing
                    and not self._flushing
                    and (left := deadline - time.monotonic()) > 0
                ):
                    self._cond.wait(left)
                if self._closing and not self._rows:
                    return
                batch = [self._rows.popleft() for _ in range(min(self.batch_rows, len(self._rows)))]
                self._writing = bool(batch)
            if not batch:
                self._retention()
                continue
            try:
                self._insert(batch)
            except (OperationalError, InterfaceError) as exc:  # the database is not there
                with self._cond:
                    self._rows.extendleft(reversed(batch))  # back in front, in order
                    self._writing = False
                    if self._healthy:
                        log.error("audit store unavailable, rows wait in memory: %s", exc)
                    self._healthy = False
                pause = min(max(pause * 2, 0.1), self.max_retry_s)
                time.sleep(pause)
                continue
            except SQLAlchemyError:  # rows this database refuses: retrying cannot help
                log.exception("audit store refused %d rows; they are dropped", len(batch))
                with self._cond:
                    self._writing = False
                    self.dropped += len(batch)
                    self._cond.notify_all()
                continue
            with self._cond:
                self._writing = False
                self.written += len(batch)
                if not self._healthy:
                    log.warning("audit store back: %d rows waiting", len(self._rows))
                self._healthy = True
                self._cond.notify_all()
            pause = 0.0

    def _insert(self, batch: list[dict[str, Any]]) -> None:
        dialect = self.engine.dialect.name
        statement: Any
        if dialect == "postgresql":
            from sqlalchemy.dialects import postgresql

            statement = postgresql.insert(CALLS).on_conflict_do_nothing(index_elements=["id"])
        elif dialect == "sqlite":
            from sqlalchemy.dialects import sqlite

            statement = sqlite.insert(CALLS).on_conflict_do_nothing(index_elements=["id"])
        else:  # pragma: no cover - the two backends specagent supports
            raise RuntimeError(f"unsupported audit database {dialect!r}")
        with self.engine.begin() as connection:
            connection.execute(statement, batch)

    def _retention(self) -> None:
        """Delete rows past ``retention_days`` (hourly; called by the writer while idle)."""
        if self.retention_days is None:
            return
        now = time.monotonic()
        if now - self._last_retention < RETENTION_EVERY_S and self._last_retention:
            return
        self._last_retention = now
        cutoff = datetime.now(timezone.utc) - timedelta(days=self.retention_days)
        try:
            with self.engine.begin() as connection:
                removed = connection.execute(delete(CALLS).where(CALLS.c.at < cutoff)).rowcount
        except SQLAlchemyError as exc:
            log.warning("audit retention could not run: %s", exc)
            return
        if removed:
            days = self.retention_days
            log.info("audit retention: %d rows older than %s days deleted", removed, days)

    def __repr__(self) -> str:
        return f"AuditStore({self.engine.url.render_as_string(hide_password=True)!r})"


def _with_driver(url: str) -> str:
    """``postgresql://`` means psycopg 3 (SQLAlchemy would pick psycopg2)."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def _engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = make_url(url).database
        if path and path != ":memory:":
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine, "connect")
        def _wal(connection: Any, _: Any) -> None:  # readers (a BI tool) never block the writer
            cursor = connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=0)
