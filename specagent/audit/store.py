"""``AuditStore``: rows written in batches by a thread of its own, never by a call.

A call hands its row to ``record`` (a deque append under a lock: nothing a call waits for, on
the event loop or the decoding worker). The writer thread takes what has piled up, up to
``batch_rows`` at a time, and inserts it in one transaction. When the database is slow or
down, rows wait in the buffer (``buffer_rows`` at most) and are written when it answers again
(retried with a growing pause, up to ``max_retry_s``); rows past the buffer are dropped,
counted (``dropped``, the ``specagent.audit.dropped`` metric, the dashboard) and logged. A row
is inserted by its id with "on conflict do nothing": a batch retried after a commit whose
answer was lost is not stored twice. A batch the database refuses for one row's data is
written again row by row: only the rows it refuses are dropped (counted in ``rejected`` and
``dropped``, logged by id, never by value), and the store says it is unhealthy until a write
goes through. ``healthy`` says whether rows are being stored now (a server with
``--audit-required`` refuses calls while they are not).

Requests refused before any valid key was shown are not rows of their own: ``count_refusal``
adds them to a tally per minute, source address and status, at most ``refusal_sources``
addresses a minute (the rest as ``other``), written as ``specagent_refusals`` rows with a count
once their minute is over. A client with no key can so add at most a bounded number of rows a
minute, and never fills the buffer honest calls' rows wait in.

The store's size is bounded two ways, both kept by the writer on a timer whatever the traffic:
rows older than ``retention_days`` are deleted hourly, and where a table holds more than
``max_rows`` rows its oldest are deleted down to nine tenths of it (counted in ``evicted`` and
logged: an operator who must keep every row sets retention and size to fit the database).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Table, create_engine, delete, event, func, select
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError

from .schema import CALLS, REFUSALS, migrate

__all__ = ["AuditStore", "masked", "masked_url", "row_bound"]

COLUMNS = tuple(column.name for column in CALLS.columns)

log = logging.getLogger("specagent.audit")

RETENTION_EVERY_S = 3600.0
"""How often the writer deletes rows past the retention window."""
SIZE_EVERY_S = 3600.0
"""How often the writer counts the rows again (between counts it adds what it wrote)."""
DEFAULT_MAX_ROWS = 10_000_000
"""Rows a table keeps at most by default (about 5 GB of calls on SQLite)."""
OTHER_SOURCE = "other"
"""The source of refusals past the per-minute bound of addresses."""


class AuditStore:
    """The audit rows of one process, in the database at ``url`` (``sqlite:///PATH`` or
    ``postgresql://...``; SQLAlchemy URLs). The schema is created or migrated on open; a new
    SQLite file (and a folder made for it) is readable by its owner only."""

    def __init__(
        self,
        url: str,
        *,
        buffer_rows: int = 100_000,
        batch_rows: int = 500,
        flush_s: float = 0.5,
        retention_days: float | None = None,
        max_rows: int | None = DEFAULT_MAX_ROWS,
        refusal_sources: int = 256,
        max_retry_s: float = 5.0,
    ) -> None:
        if retention_days is not None and not retention_days > 0:
            msg = f"retention_days must be more than 0 (None: keep rows), got {retention_days}"
            raise ValueError(msg)
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be at least 1 (None: no bound), got {max_rows}")
        if refusal_sources < 1:
            raise ValueError(f"refusal_sources must be at least 1, got {refusal_sources}")
        self.url = _with_driver(url)
        self.engine: Engine = _engine(self.url)
        migrate(self.engine)
        self.buffer_rows = buffer_rows
        self.batch_rows = batch_rows
        self.flush_s = flush_s
        self.retention_days = retention_days
        self.max_rows = max_rows
        self.refusal_sources = refusal_sources
        self.max_retry_s = max_retry_s
        self.dropped = 0
        """Rows lost since the start: the buffer was full, the database refused them, or the
        store closed with them unwritten."""
        self.rejected = 0
        """Of ``dropped``: rows the database refused for their data."""
        self.evicted = 0
        """Rows deleted because a table held more than ``max_rows``."""
        self.written = 0
        self._rows: collections.deque[dict[str, Any]] = collections.deque()
        self._tally: dict[tuple[datetime, str, str, str], int] = {}
        """Refusals counted, not yet written: (minute, front door, source, status) -> count."""
        self._sources: dict[datetime, set[str]] = {}
        self._refusal_rows: list[dict[str, Any]] = []
        """Refusal rows taken from the tally, kept with their ids until written."""
        self._cond = threading.Condition()
        self._healthy = True
        self._writing = False
        self._batch_rows = 0
        """Rows of the batch being written (refusal rows stay listed until written)."""
        self._flushing = 0
        """Callers waiting in ``flush``: the writer does not wait for more rows meanwhile."""
        self._closing = False
        self._last_retention = 0.0
        self._last_count = 0.0
        self._stored: dict[str, int] = {}
        """Rows per table as last counted, plus those written since."""
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

    def count_refusal(self, source: str | None, status: str | int, front_door: str) -> None:
        """Count one request refused before any valid key was shown, from ``source`` (the
        client's address). Memory and rows are bounded: past ``refusal_sources`` addresses in
        a minute, or past that many minutes' worth waiting, it counts as ``other``."""
        minute = datetime.now(timezone.utc).replace(second=0, microsecond=0)
        name = (source or "unknown")[:64]
        with self._cond:
            sources = self._sources.setdefault(minute, set())
            crowded = len(self._tally) >= 16 * self.refusal_sources
            if name not in sources and (len(sources) >= self.refusal_sources or crowded):
                name = OTHER_SOURCE
            sources.add(name)
            key = (minute, front_door, name, str(status))
            self._tally[key] = self._tally.get(key, 0) + 1

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every row recorded and every refusal counted so far is written (False:
        not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._rows or self._writing or self._tally or self._refusal_rows:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.1))
            finally:
                self._flushing -= 1
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is buffered (within ``timeout``), then stop the writer. Rows that could
        not be written by then are counted as dropped and logged as lost."""
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        with self._cond:
            lost = len(self._rows) + len(self._refusal_rows) + len(self._tally)
            if self._thread.is_alive() and self._writing:
                lost += self._batch_rows  # still waiting on the database: not written yet
            self._rows.clear()
            self._refusal_rows.clear()
            self._tally.clear()
            self.dropped += lost
        if lost:
            log.error(
                "audit store closed with %d rows unwritten (the database did not take them "
                "within %.0f s); they are lost",
                lost,
                timeout,
            )
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
                if self._closing and (not self._rows or not self._healthy):
                    return
                batch = [self._rows.popleft() for _ in range(min(self.batch_rows, len(self._rows)))]
                self._take_refusals(everything=bool(self._flushing))
                refusals = list(self._refusal_rows)
                self._writing = bool(batch or refusals)
                self._batch_rows = len(batch)
            if batch or refusals:
                pause = self._write(batch, refusals, pause)
            self._maintain()

    def _take_refusals(self, everything: bool) -> None:
        """Move the tally's finished minutes (every minute when ``everything``) into rows.
        Called with the lock held."""
        now = datetime.now(timezone.utc).replace(second=0, microsecond=0)
        for key in [k for k in self._tally if everything or k[0] < now]:
            minute, front_door, source, status = key
            count = self._tally.pop(key)
            row = {"minute": minute, "front_door": front_door, "source": source, "status": status}
            self._refusal_rows.append({"id": str(uuid.uuid4()), **row, "count": count})
        for minute in [m for m in self._sources if everything or m < now]:
            del self._sources[minute]  # its counts were all taken above

    def _write(
        self, batch: list[dict[str, Any]], refusals: list[dict[str, Any]], pause: float
    ) -> float:
        """One pass's rows into the database; returns the pause before the next try."""
        try:
            with self.engine.begin() as connection:
                _insert(connection, CALLS, batch)
                _insert(connection, REFUSALS, refusals)
        except (OperationalError, InterfaceError) as exc:  # the database is not there
            self._unwritten(batch, exc)
            pause = min(max(pause * 2, 0.1), self.max_retry_s)
            time.sleep(pause)
            return pause
        except SQLAlchemyError as exc:  # a row this database refuses: find it, keep the rest
            with self._cond:
                self._healthy = False
            log.error("audit store refused a batch (%s); writing it row by row", _kind(exc))
            return self._write_one_by_one(batch, refusals, pause)
        self._stored_more(CALLS, len(batch))
        self._stored_more(REFUSALS, len(refusals))
        self._written(batch, refusals)
        return 0.0

    def _write_one_by_one(
        self, batch: list[dict[str, Any]], refusals: list[dict[str, Any]], pause: float
    ) -> float:
        for table, rows in ((CALLS, batch), (REFUSALS, refusals)):
            for i, row in enumerate(rows):
                try:
                    with self.engine.begin() as connection:
                        _insert(connection, table, [row])
                except (OperationalError, InterfaceError) as exc:
                    # The database went away meanwhile: what is left waits for it.
                    # (Rows before it were counted as they went in.)
                    self._unwritten(batch[i:] if table is CALLS else [], exc)
                    return min(max(pause * 2, 0.1), self.max_retry_s)
                except SQLAlchemyError as exc:
                    with self._cond:
                        self.dropped += 1
                        self.rejected += 1
                        if table is REFUSALS:
                            self._refusal_rows.remove(row)
                    log.error("audit row %s refused (%s); it is dropped", row["id"], _kind(exc))
                else:
                    self._stored_more(table, 1)
                    with self._cond:
                        if table is CALLS:
                            self.written += 1
                        else:
                            self._refusal_rows.remove(row)
                        self._healthy = True
        with self._cond:
            self._writing = False
            self._cond.notify_all()
        return 0.0

    def _unwritten(self, batch: list[dict[str, Any]], exc: Exception) -> None:
        """``batch`` back in front of the buffer, in order (refusal rows stay where they are),
        and the store unhealthy until the database answers."""
        with self._cond:
            self._rows.extendleft(reversed(batch))
            self._writing = False
            if self._healthy:
                log.error("audit store unavailable, rows wait in memory: %s", _kind(exc))
            self._healthy = False
            self._cond.notify_all()

    def _written(self, batch: list[dict[str, Any]], refusals: list[dict[str, Any]]) -> None:
        with self._cond:
            self._writing = False
            self.written += len(batch)
            done = {row["id"] for row in refusals}
            self._refusal_rows = [row for row in self._refusal_rows if row["id"] not in done]
            if not self._healthy:
                log.warning("audit store back: %d rows waiting", len(self._rows))
            self._healthy = True
            self._cond.notify_all()

    def _stored_more(self, table: Table, rows: int) -> None:
        if table.name in self._stored:
            self._stored[table.name] += rows

    def _maintain(self) -> None:
        """Retention and the size bound, on their timers (the writer runs this every pass,
        busy or idle, so steady traffic never postpones them)."""
        now = time.monotonic()
        if self.retention_days is not None and (
            not self._last_retention or now - self._last_retention >= RETENTION_EVERY_S
        ):
            self._last_retention = now
            self._retention()
        if self.max_rows is not None:
            if not self._last_count or now - self._last_count >= SIZE_EVERY_S:
                self._last_count = now
                self._count_rows()
            for table in (CALLS, REFUSALS):
                if self._stored.get(table.name, 0) > self.max_rows:
                    self._evict(table)

    def _retention(self) -> None:
        """Delete rows past ``retention_days``."""
        assert self.retention_days is not None
        cutoff = datetime.now(timezone.utc) - timedelta(days=self.retention_days)
        removed = 0
        try:
            with self.engine.begin() as connection:
                removed += connection.execute(delete(CALLS).where(CALLS.c.at < cutoff)).rowcount
                old = REFUSALS.c.minute < cutoff
                removed += connection.execute(delete(REFUSALS).where(old)).rowcount
        except SQLAlchemyError as exc:
            log.warning("audit retention could not run: %s", _kind(exc))
            return
        self._stored.clear()  # counted again at the next pass
        self._last_count = 0.0
        if removed:
            days = self.retention_days
            log.info("audit retention: %d rows older than %s days deleted", removed, days)

    def _count_rows(self) -> None:
        try:
            with self.engine.connect() as connection:
                for table in (CALLS, REFUSALS):
                    count = select(func.count()).select_from(table)
                    self._stored[table.name] = int(connection.execute(count).scalar() or 0)
        except SQLAlchemyError as exc:
            log.warning("audit store could not count its rows: %s", _kind(exc))

    def _evict(self, table: Table) -> None:
        """The oldest rows of ``table`` down to nine tenths of ``max_rows``."""
        assert self.max_rows is not None
        excess = self._stored[table.name] - self.max_rows * 9 // 10
        when = table.c.at if table is CALLS else table.c.minute
        oldest = select(table.c.id).order_by(when).limit(excess).scalar_subquery()
        try:
            with self.engine.begin() as connection:
                removed = connection.execute(delete(table).where(table.c.id.in_(oldest))).rowcount
        except SQLAlchemyError as exc:
            log.warning("audit store could not bound its size: %s", _kind(exc))
            return
        self._stored[table.name] -= removed
        self.evicted += removed
        log.warning(
            "audit store over %d rows in %s: its %d oldest rows deleted",
            self.max_rows,
            table.name,
            removed,
        )

    def __repr__(self) -> str:
        return f"AuditStore({self.engine.url.render_as_string(hide_password=True)!r})"


def _insert(connection: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    dialect = connection.dialect.name
    statement: Any
    if dialect == "postgresql":
        from sqlalchemy.dialects import postgresql

        statement = postgresql.insert(table).on_conflict_do_nothing(index_elements=["id"])
    elif dialect == "sqlite":
        from sqlalchemy.dialects import sqlite

        statement = sqlite.insert(table).on_conflict_do_nothing(index_elements=["id"])
    else:  # pragma: no cover - the two backends specagent supports
        raise RuntimeError(f"unsupported audit database {dialect!r}")
    connection.execute(statement, rows)


def _kind(exc: BaseException) -> str:
    """What went wrong, without the statement's values: the error's class and the driver's
    first line (the engine hides parameters; a driver's message can still quote a value on
    later lines, as PostgreSQL's DETAIL does)."""
    orig = getattr(exc, "orig", None) or exc
    first = str(orig).strip().splitlines()[0] if str(orig).strip() else ""
    return f"{type(orig).__name__}: {first[:200]}"


def row_bound(option: int | None) -> int | None:
    """``AuditStore``'s ``max_rows`` from a command-line or config option: None (not given)
    is the default bound, 0 no bound."""
    return DEFAULT_MAX_ROWS if option is None else option or None


def masked_url(url: str) -> str:
    """``url`` fit for a message or a log: its password as ``***``. A password is better not
    in the URL at all: PostgreSQL's client reads ``PGPASSWORD``, ``~/.pgpass`` or the file a
    ``?passfile=`` names."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy reads: mask what looks like user:password@
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def masked(text: str, url: str) -> str:
    """``text`` (a driver's message, say) with ``url``'s password, wherever it appears, as
    ``***``."""
    try:
        password = make_url(url).password
    except Exception:
        return text
    return text.replace(str(password), "***") if password else text


def _with_driver(url: str) -> str:
    """``postgresql://`` means psycopg 3 (SQLAlchemy would pick psycopg2)."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def _engine(url: str) -> Engine:
    # hide_parameters: an error's message never carries a row's values into a log.
    if url.startswith("sqlite"):
        path = make_url(url).database
        if path and path != ":memory:":
            _private_file(Path(path).expanduser())
        engine = create_engine(url, connect_args={"timeout": 30}, hide_parameters=True)

        @event.listens_for(engine, "connect")
        def _wal(connection: Any, _: Any) -> None:  # readers (a BI tool) never block the writer
            cursor = connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=0, hide_parameters=True)


def _private_file(path: Path) -> None:
    """A new SQLite store readable by its owner only (rows name keys and users): its folder,
    where made here, 0700; the file 0600 (SQLite gives its WAL and shared-memory files the
    database file's mode)."""
    folder = path.parent
    if not folder.exists():
        folder.mkdir(parents=True, mode=0o700)
    if not path.exists():
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
