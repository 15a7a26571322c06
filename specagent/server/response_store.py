"""Stored responses (the Responses API's ``store`` and ``previous_response_id``), in memory, per
API key.

A key sees only its own responses: another key's id is "not found", exactly as an id that never
existed, so ids leak nothing across keys. Each response keeps the conversation a later call
chained to it continues (its messages, without the instructions, which the Responses API never
carries over) and its ``response`` object for ``GET``. What a key keeps is bounded in bytes
(its oldest responses make room for new ones, never another key's), all keys together are
bounded too (the oldest anywhere go first), and every response expires after the retention.
Nothing is written to disk: a restart, or another replica, does not have them.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENTRY_OVERHEAD", "ResponseStore", "StoredResponse"]

ENTRY_OVERHEAD = 1024
"""Bytes each stored response is counted beyond its text (its bookkeeping), so that a flood of
tiny responses meets the bound too."""


@dataclass(frozen=True)
class StoredResponse:
    key: str
    """The API key's name that made it: the only key that may read, chain or delete it."""
    created: float
    messages: tuple[dict[str, Any], ...]
    """The conversation up to and including this response's output, as chat messages."""
    body: dict[str, Any]
    size: int
    input_items: tuple[dict[str, Any], ...] = ()
    """Its own input as the Responses API lists it back (not the earlier responses')."""


@dataclass
class ResponseStore:
    retention_s: float = 3600.0
    max_bytes_per_key: int = 16 << 20
    max_bytes: int = 256 << 20
    clock: Callable[[], float] = time.monotonic
    _by_key: dict[str, OrderedDict[str, StoredResponse]] = field(default_factory=dict)
    _bytes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.retention_s <= 0 or self.max_bytes_per_key <= 0 or self.max_bytes <= 0:
            raise ValueError("the response store's retention and bounds must be positive")

    @property
    def total_bytes(self) -> int:
        return sum(self._bytes.values())

    def put(
        self,
        key: str,
        response_id: str,
        messages: list[dict[str, Any]],
        body: dict[str, Any],
        input_items: Sequence[dict[str, Any]] = (),
    ) -> bool:
        """Keep ``key``'s response; False where it alone is over the key's bound (not kept)."""
        size = ENTRY_OVERHEAD + sum(len(json.dumps(x)) for x in (messages, body, input_items))
        if size > min(self.max_bytes_per_key, self.max_bytes):
            return False
        self._expire()
        while self._bytes.get(key, 0) + size > self.max_bytes_per_key:
            self._drop(key, next(iter(self._by_key[key])))
        while self.total_bytes + size > self.max_bytes:
            self._drop_oldest()
        kept = self._by_key.setdefault(key, OrderedDict())
        kept[response_id] = StoredResponse(
            key, self.clock(), tuple(messages), body, size, tuple(input_items)
        )
        self._bytes[key] = self._bytes.get(key, 0) + size
        return True

    def get(self, key: str, response_id: str) -> StoredResponse | None:
        """``key``'s response ``response_id``, or None (never made, expired, dropped, deleted,
        or another key's: the caller cannot tell which)."""
        self._expire()
        kept = self._by_key.get(key)
        return kept.get(response_id) if kept is not None else None

    def delete(self, key: str, response_id: str) -> bool:
        if self.get(key, response_id) is None:
            return False
        self._drop(key, response_id)
        return True

    def count(self, key: str) -> int:
        self._expire()
        return len(self._by_key.get(key, ()))

    def _drop(self, key: str, response_id: str) -> None:
        kept = self._by_key[key]
        self._bytes[key] -= kept.pop(response_id).size
        if not kept:
            del self._by_key[key], self._bytes[key]

    def _drop_oldest(self) -> None:
        key = min(self._by_key, key=lambda k: next(iter(self._by_key[k].values())).created)
        self._drop(key, next(iter(self._by_key[key])))

    def _expire(self) -> None:
        """Drops what is past the retention (each key's responses are kept oldest first)."""
        horizon = self.clock() - self.retention_s
        for key in list(self._by_key):
            kept = self._by_key[key]
            while kept and next(iter(kept.values())).created <= horizon:
                self._drop(key, next(iter(kept)))
                if key not in self._by_key:
                    break
