"""``GET /dashboard``: what each policy delivers and costs, live, on the server itself.

A relaxed policy trades exactness for speed; the people who chose that trade need to see it
while the service runs. Each finished call is folded, as numbers only (no prompt, no output,
no tenant), into per-policy aggregates in time buckets (``CallLog``): HTTP status, latency, time
to first token, output tokens, acceptance, accepted tokens by source, a relaxed call's
divergence and whether it fell back to lossless. ``/dashboard/data`` merges them over a window
(5 min, 1 h, or since the server started) per policy and in total, behind the same key check as the
API: a key that may use every policy sees every key's calls, the totals, the calls refused before
a policy was known, and the runtime's queue; any other key sees its own calls, under the policies
it may use. ``/dashboard`` is
one self-contained page (no CDN, no script from elsewhere) that polls the data every second; it
carries no data itself, and takes the key from the address's fragment (``#key=...``, never sent
to the server) or asks for it.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["WINDOWS", "CallLog", "CallRecord", "dashboard_page", "list_reports", "summarise"]

WINDOWS: dict[str, float | None] = {"5m": 300.0, "1h": 3600.0, "all": None}
"""The windows the data endpoint aggregates over (``all``: since the server started)."""


@dataclass(frozen=True)
class CallRecord:
    """One finished (or refused) call, as numbers."""

    policy: str | None
    """None: refused before its policy was known and allowed (a bad key, a malformed body, a
    policy the key may not use)."""
    status: int
    """The HTTP status it was answered with (200 for a stream that ended well)."""
    key: str | None = None
    """The API key's name (None: refused before a key matched): a key that may not use
    every policy sees its own calls only."""
    latency_s: float | None = None
    ttft_s: float | None = None
    output_tokens: int = 0
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    divergence: float | None = None
    fell_back: bool = False

    @classmethod
    def of_result(cls, result: Any, status: int = 200, key: str | None = None) -> CallRecord:
        """The record of a call that produced a ``GenerationResult``."""
        stats = result.stats
        return cls(
            policy=stats.policy,
            status=status,
            key=key,
            latency_s=stats.latency_s,
            ttft_s=stats.ttft_s,
            output_tokens=result.usage.output_tokens,
            acceptance_rate=stats.acceptance_rate if stats.num_draft_tokens else None,
            mean_acceptance_length=stats.mean_acceptance_length,
            accepted_by_source=dict(stats.accepted_by_source),
            divergence=stats.divergence,
            fell_back=bool(stats.fell_back_to_lossless),
        )


_RATIO = 1.02
"""Quantiles come from log-spaced bins this far apart: within 1% of the exact value."""
_LOW, _HIGH = 1e-6, 1e5
"""The binned range (seconds, or a divergence); below it counts as zero, above it as the top."""
_BINS = 2 + math.ceil(math.log(_HIGH / _LOW) / math.log(_RATIO))
_LEVELS = ((10.0, 300.0), (60.0, 3600.0))
"""(bucket seconds, kept seconds): the log keeps one aggregate per policy per bucket, 10 s
buckets for the last 5 minutes and 1 min buckets for the last hour; a window is read from the
finest level that covers it (its edge exact to a bucket), so a poll merges at most 60 buckets
whatever the call rate."""


def _bin(value: float) -> int:
    if value < _LOW:
        return 0
    return min(_BINS - 1, 1 + math.floor(math.log(value / _LOW) / math.log(_RATIO)))


class _Histogram:
    """Counts per log-spaced bin (``_RATIO`` apart; bin 0: zero), allocated at first use:
    merging two is one vector addition."""

    __slots__ = ("counts", "high", "low")

    def __init__(self) -> None:
        self.counts: np.ndarray | None = None
        self.low, self.high = math.inf, -math.inf

    def add(self, value: float) -> None:
        if self.counts is None:
            self.counts = np.zeros(_BINS, dtype=np.int64)
        self.counts[_bin(value)] += 1
        self.low, self.high = min(self.low, value), max(self.high, value)

    def merge(self, other: _Histogram) -> None:
        if other.counts is None:
            return
        if self.counts is None:
            self.counts = other.counts.copy()
        else:
            self.counts += other.counts
        self.low, self.high = min(self.low, other.low), max(self.high, other.high)

    @property
    def count(self) -> int:
        return 0 if self.counts is None else int(self.counts.sum())

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (nearest rank), as its bin's middle within the smallest and
        largest values seen (exact where they are all one value); None for no values."""
        if self.counts is None:
            return None
        cumulative = np.cumsum(self.counts)
        total = int(cumulative[-1])
        if not total:
            return None
        rank = min(total, max(1, math.ceil(q * total)))
        index = int(np.searchsorted(cumulative, rank))
        middle = 0.0 if index == 0 else _LOW * _RATIO ** (index - 0.5)
        return min(self.high, max(self.low, middle))


@dataclass
class _Aggregate:
    """What the dashboard shows of a set of calls, mergeable: counts and sums, and each
    distribution as counts per bin."""

    calls: int = 0
    completed: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    output_tokens: int = 0
    seconds: float = 0.0
    latency: _Histogram = field(default_factory=_Histogram)
    ttft: _Histogram = field(default_factory=_Histogram)
    acceptance: list[float] = field(default_factory=lambda: [0.0, 0.0])
    """Sum and count of the acceptance rates of calls that drafted."""
    length: list[float] = field(default_factory=lambda: [0.0, 0.0])
    sources: collections.Counter[str] = field(default_factory=collections.Counter)
    divergence: _Histogram = field(default_factory=_Histogram)
    divergence_sum: float = 0.0
    fallbacks: int = 0

    def add(self, r: CallRecord) -> None:
        self.calls += 1
        if r.status != 200 or r.latency_s is None:
            self.errors[str(r.status)] += 1
            return
        self.completed += 1
        self.output_tokens += r.output_tokens
        self.seconds += r.latency_s
        self.latency.add(r.latency_s)
        if r.ttft_s is not None:
            self.ttft.add(r.ttft_s)
        if r.acceptance_rate is not None:
            self.acceptance[0] += r.acceptance_rate
            self.acceptance[1] += 1
        if r.mean_acceptance_length:
            self.length[0] += r.mean_acceptance_length
            self.length[1] += 1
        self.sources.update(r.accepted_by_source)
        if r.divergence is not None:
            self.divergence.add(r.divergence)
            self.divergence_sum += r.divergence
        self.fallbacks += int(r.fell_back)

    def merge(self, other: _Aggregate) -> None:
        self.calls += other.calls
        self.completed += other.completed
        self.errors.update(other.errors)
        self.output_tokens += other.output_tokens
        self.seconds += other.seconds
        self.sources.update(other.sources)
        for mine, theirs in (
            (self.latency, other.latency),
            (self.ttft, other.ttft),
            (self.divergence, other.divergence),
        ):
            mine.merge(theirs)
        for pair, more in ((self.acceptance, other.acceptance), (self.length, other.length)):
            pair[0] += more[0]
            pair[1] += more[1]
        self.divergence_sum += other.divergence_sum
        self.fallbacks += other.fallbacks

    def to_json(self, max_divergence: float | None = None) -> dict[str, Any]:
        def spread(values: _Histogram) -> dict[str, float | None]:
            return {"p50": _rounded(values.quantile(0.5)), "p95": _rounded(values.quantile(0.95))}

        out: dict[str, Any] = {
            "calls": self.calls,
            "completed": self.completed,
            "errors": dict(sorted(self.errors.items())),
            "latency_s": spread(self.latency),
            "ttft_s": spread(self.ttft),
            "output_tokens": self.output_tokens,
            "tokens_per_s": (
                _rounded(self.output_tokens / self.seconds, 2) if self.seconds > 0 else None
            ),
            "acceptance_rate": _rounded(_ratio(self.acceptance), 3),
            "mean_acceptance_length": _rounded(_ratio(self.length), 3),
            "accepted_by_source": dict(sorted(self.sources.items())),
            "divergence": None,
            "fallbacks": self.fallbacks,
        }
        relaxed = self.divergence.count
        if relaxed:
            out["divergence"] = {
                "mean": _rounded(self.divergence_sum / relaxed),
                "p95": _rounded(self.divergence.quantile(0.95)),
                "calls": relaxed,
                "max_divergence": max_divergence,
            }
        return out


def _ratio(pair: list[float]) -> float | None:
    return pair[0] / pair[1] if pair[1] else None


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


class _Level:
    """Aggregates per policy in buckets of ``width`` seconds, for the last ``keep`` seconds."""

    def __init__(self, width: float, keep: float) -> None:
        self.width, self.keep = width, keep
        self.buckets: dict[int, dict[_Cell, _Aggregate]] = {}

    def add(self, now: float, record: CallRecord) -> None:
        index = int(now // self.width)
        held = self.buckets.get(index)
        if held is None:
            held = self.buckets[index] = collections.defaultdict(_Aggregate)
            oldest = index - int(self.keep // self.width)
            for old in [b for b in self.buckets if b < oldest]:
                del self.buckets[old]
        held[(record.policy, record.key)].add(record)


class CallLog:
    """Finished (and refused) calls, aggregated as they are recorded: per policy, in time
    buckets (``_LEVELS``) and since the start. Recording is a few counter updates under a lock
    (nothing a call waits for). A window is the merge of its closed buckets, which no longer
    change and so are merged once per bucket boundary and kept, with a copy of the open one:
    every read is exact and current, and costs about the same at ten calls a minute or a
    thousand a second."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._levels = [_Level(width, keep) for width, keep in _LEVELS]
        self._total: dict[_Cell, _Aggregate] = collections.defaultdict(_Aggregate)
        self._lock = threading.Lock()
        self._closed: dict[float, tuple[tuple[int, int], dict[_Cell, _Aggregate]]] = {}
        """Per window: the (first, open) buckets its kept merge covers, and that merge."""

    def record(self, record: CallRecord) -> None:
        with self._lock:
            # The bucket of now, read under the lock: a window read after this one sees it
            # in its open bucket, so the buckets it treats as closed never change.
            now = time.monotonic()
            self._total[(record.policy, record.key)].add(record)
            for level in self._levels:
                level.add(now, record)

    def window(self, seconds: float | None) -> dict[_Cell, _Aggregate]:
        """Per policy and key (None: refused before a policy was known, or before a key
        matched), the calls of the last ``seconds`` (to a bucket); None: since the start. A
        new dict, the caller's."""
        with self._lock:
            if seconds is None:
                return _copied(self._total)
            now = time.monotonic()
            level = next(lv for lv in self._levels if lv.keep >= seconds)
            span = (int((now - seconds) // level.width), int(now // level.width))
            kept = self._closed.get(seconds)
            closed = None
            if kept is None or kept[0] != span:
                closed = [h for b, h in level.buckets.items() if span[0] <= b < span[1]]
            open_part = _copied(level.buckets.get(span[1], {}))
        if closed is not None:  # a bucket closed since the last read: merged once, kept
            merged: dict[_Cell, _Aggregate] = {}
            for part in closed:
                for cell, aggregate in part.items():
                    merged.setdefault(cell, _Aggregate()).merge(aggregate)
            kept = (span, merged)
            with self._lock:
                self._closed[seconds] = kept
        assert kept is not None
        out = _copied(kept[1])
        for cell, aggregate in open_part.items():
            out.setdefault(cell, _Aggregate()).merge(aggregate)
        return out


_Cell = tuple[str | None, str | None]
"""What the log aggregates by: a policy and a key's name."""


def _copied(part: dict[_Cell, _Aggregate]) -> dict[_Cell, _Aggregate]:
    out: dict[_Cell, _Aggregate] = {}
    for cell, aggregate in part.items():
        out[cell] = _Aggregate()
        out[cell].merge(aggregate)
    return out


def summarise(
    log: CallLog,
    window: str,
    policies: Iterable[Any],
    *,
    may_use: Any,
    everything: bool,
    describe: dict[str, dict[str, Any]] | None = None,
    key: str | None = None,
) -> dict[str, Any]:
    """The dashboard's numbers over ``window`` (a key of ``WINDOWS``): per policy the key
    ``may_use`` (a predicate on policy names), and with ``everything`` (a key that may use every
    policy) every key's calls, the totals and the calls refused before their policy was known;
    without, only the calls of the key named ``key``. ``describe``: per policy, what runs it
    (engine, dtype, drafter)."""
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {list(WINDOWS)}, got {window!r}")
    span = WINDOWS[window]
    by_policy: dict[str | None, _Aggregate] = {}
    for (policy, caller), aggregate in log.window(span).items():
        if everything or caller == key:
            by_policy.setdefault(policy, _Aggregate()).merge(aggregate)
    rows = {}
    for policy in policies:
        if policy.name == "default" and policy.name not in by_policy:
            continue
        if not may_use(policy.name):
            continue
        budget = policy.acceptance.max_divergence if policy.acceptance is not None else None
        rows[policy.name] = {
            "mode": policy.mode,
            **(describe or {}).get(policy.name, {}),
            **by_policy.get(policy.name, _Aggregate()).to_json(budget),
        }
    out: dict[str, Any] = {
        "window": window,
        "window_s": span if span is not None else round(time.monotonic() - log.started, 1),
        "policies": rows,
    }
    if everything:
        total = _Aggregate()
        for aggregate in by_policy.values():
            total.merge(aggregate)
        out["total"] = total.to_json()
        out["unresolved"] = by_policy.get(None, _Aggregate()).to_json()
    return out


def dashboard_page() -> str:
    """The page (``data/dashboard.html``, shipped with the package)."""
    return resources.files("specagent.data").joinpath("dashboard.html").read_text("utf-8")


def list_reports(directory: Path | None) -> list[str]:
    """The HTML reports (``specagent eval --out DIR``) the dashboard links to."""
    if directory is None or not directory.is_dir():
        return []
    return sorted(p.name for p in directory.glob("*.html") if p.is_file())
