"""The stored responses' bounds: each key's bytes (its oldest go first, never another key's),
all keys' together, the retention, and a flood of tiny responses from one key."""

from __future__ import annotations

import pytest

from specagent.server.response_store import ENTRY_OVERHEAD, ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def text(n: int) -> list[dict]:
    return [{"role": "user", "content": "x" * n}]


def test_a_key_sees_only_its_own() -> None:
    store = ResponseStore()
    assert store.put("a", "resp_1", text(10), {"id": "resp_1"})
    assert store.get("a", "resp_1").messages == tuple(text(10))
    assert store.get("b", "resp_1") is None
    assert not store.delete("b", "resp_1")
    assert store.get("a", "resp_1") is not None
    assert store.delete("a", "resp_1")
    assert store.get("a", "resp_1") is None


def test_a_key_over_its_bound_drops_its_own_oldest_never_anothers() -> None:
    clock = Clock()
    store = ResponseStore(max_bytes_per_key=10 * ENTRY_OVERHEAD, clock=clock)
    store.put("quiet", "resp_q", text(100), {})
    for i in range(1000):  # a flood from one key
        clock.now += 1
        store.put("flood", f"resp_{i}", text(100), {})
    assert store.get("quiet", "resp_q") is not None
    assert 1 <= store.count("flood") < 10
    assert store.get("flood", "resp_999") is not None
    assert store.get("flood", "resp_0") is None
    assert store.total_bytes <= 11 * ENTRY_OVERHEAD


def test_all_keys_together_drop_the_oldest_anywhere() -> None:
    clock = Clock()
    store = ResponseStore(
        max_bytes_per_key=8 * ENTRY_OVERHEAD, max_bytes=4 * ENTRY_OVERHEAD, clock=clock
    )
    for i in range(6):
        clock.now += 1
        store.put(f"key{i}", f"resp_{i}", text(10), {})
    assert store.total_bytes <= 4 * ENTRY_OVERHEAD
    assert store.get("key0", "resp_0") is None
    assert store.get("key5", "resp_5") is not None


def test_one_response_over_the_bound_is_not_kept() -> None:
    store = ResponseStore(max_bytes_per_key=4 * ENTRY_OVERHEAD)
    assert store.put("a", "resp_small", text(10), {})
    assert not store.put("a", "resp_big", text(8 * ENTRY_OVERHEAD), {})
    assert store.get("a", "resp_big") is None
    assert store.get("a", "resp_small") is not None  # nothing dropped for it


def test_responses_expire_after_the_retention() -> None:
    clock = Clock()
    store = ResponseStore(retention_s=60, clock=clock)
    store.put("a", "resp_1", text(1), {})
    clock.now = 30
    store.put("a", "resp_2", text(1), {})
    clock.now = 61
    assert store.get("a", "resp_1") is None
    assert store.get("a", "resp_2") is not None
    clock.now = 91
    assert store.count("a") == 0
    assert store.total_bytes == 0


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        ResponseStore(retention_s=0)
