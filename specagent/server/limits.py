"""Per-key limits: requests per minute (a token bucket), calls in flight, and of those the
reproducible ones (each holds KV and a context of its own on some engines: a key's flood of
them must not take what other keys' calls need).

A refused request gets 429 with ``Retry-After`` (seconds until the bucket has a token again);
the runtime's own queue bound (``max_queue``) answers 429 the same way when the whole server is
overloaded. Limits are per process: each replica of a scaled-out deployment keeps its own.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .keys import ApiKey

__all__ = ["Limited", "Limits"]


class Limited(Exception):
    """A key is over one of its limits; ``retry_after`` in whole seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class _Bucket:
    capacity: float
    rate: float  # tokens per second
    tokens: float
    stamp: float = field(default_factory=time.monotonic)

    def take(self) -> float:
        """0 when a token was taken, else seconds until one is there."""
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class Limits:
    """The limits of every key, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}
        self._in_flight: dict[str, int] = {}
        self._reproducible: dict[str, int] = {}

    def acquire(self, key: ApiKey, default_concurrent: int | None = None) -> Callable[[], None]:
        """Take one of ``key``'s slots for a call, or raise ``Limited``; the returned function
        gives the slot back (calling it again does nothing), when the call's response ends.
        ``default_concurrent`` bounds the calls in flight of a key that sets no bound."""
        with self._lock:
            if key.requests_per_minute is not None:
                bucket = self._buckets.get(key.name)
                if bucket is None:
                    per_minute = float(key.requests_per_minute)
                    bucket = _Bucket(per_minute, per_minute / 60.0, per_minute)
                    self._buckets[key.name] = bucket
                wait = bucket.take()
                if wait > 0:
                    msg = (
                        f"API key {key.name!r} is over its limit of {key.requests_per_minute} "
                        "requests per minute"
                    )
                    raise Limited(msg, retry_after=max(1, math.ceil(wait)))
            running = self._in_flight.get(key.name, 0)
            bound = key.max_concurrent if key.max_concurrent is not None else default_concurrent
            if bound is not None and running >= bound:
                msg = f"API key {key.name!r} already has {running} calls in flight (its limit)"
                raise Limited(msg, retry_after=1)
            self._in_flight[key.name] = running + 1
        return self._releaser(self._in_flight, key.name)

    def acquire_reproducible(self, key: ApiKey, bound: int) -> Callable[[], None]:
        """Take one of ``key``'s reproducible slots (at most ``bound`` in flight), or raise
        ``Limited``; the returned function gives it back (once)."""
        with self._lock:
            running = self._reproducible.get(key.name, 0)
            if running >= bound:
                msg = (
                    f"API key {key.name!r} already has {running} reproducible calls in flight "
                    "(its limit: each holds memory of its own)"
                )
                raise Limited(msg, retry_after=1)
            self._reproducible[key.name] = running + 1
        return self._releaser(self._reproducible, key.name)

    def _releaser(self, counts: dict[str, int], name: str) -> Callable[[], None]:
        """The function that gives back one of ``name``'s ``counts`` (calling it again does
        nothing)."""
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if not released.is_set():
                    released.set()
                    counts[name] -= 1

        return release

    def in_flight(self, name: str) -> int:
        with self._lock:
            return self._in_flight.get(name, 0)

    def total_in_flight(self) -> int:
        """Calls in flight over every key (responses not yet ended)."""
        with self._lock:
            return sum(self._in_flight.values())
