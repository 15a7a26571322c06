"""Memory kept between calls is accounted by principal: a principal that spreads its calls over
any number of sub-tenants (the server's ``user`` values) draws on one share and never flushes
another principal's history or kept prefixes while that one holds no more than it; a history
document and what the store keeps of the last call stay bounded however long the call."""

from __future__ import annotations

import pytest
from transformers import DynamicCache

from specagent.decoding.engine import CopiedSequences
from specagent.runtime.memory import HistoryStore, PrefixCache
from specagent.tenants import HistoryScope, Tenant, tenant_of


def _text(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 10 for i in range(n)]


def test_a_flood_over_many_sub_tenants_leaves_another_principals_history() -> None:
    store = HistoryStore(max_tokens=32768, max_subtenants=64)
    victim = HistoryScope(Tenant("other-key"))
    store.record(victim, _text(1, 2000), _text(2, 500))
    store.record(HistoryScope(Tenant("other-key"), "p"), _text(3, 2000), _text(4, 500))
    held = store.held("other-key")
    assert held == 5000
    for user in range(300):
        key = HistoryScope(Tenant("flooder", f"user-{user}"))
        store.record(key, _text(100 + user, 400), _text(900 + user, 100))
    assert store.held("other-key") == held  # untouched: the flooder evicted its own
    assert store.held("flooder") <= store.max_tokens - held
    assert store.stats()["tokens"] <= store.max_tokens
    assert store.stats()["principals"] == 2
    assert store.stats()["keys"] <= 2 + store.max_subtenants  # its oldest sub-tenants went


def test_a_flood_over_many_sub_tenants_leaves_another_principals_prefixes() -> None:
    cache = PrefixCache(max_tokens=32768, max_subtenants=64)
    runner = CopiedSequences()  # what the cache asks of a runner: how its sequences are kept
    victim = cache.scoped(Tenant("other-key"))
    victim.store(runner, _text(1, 8000), DynamicCache())
    for user in range(300):
        cache.scoped(Tenant("flooder", f"user-{user}")).store(
            runner, _text(100 + user, 600), DynamicCache()
        )
    assert cache.held("other-key") == 8000
    assert cache.held("flooder") <= cache.max_tokens - 8000
    found, length = victim.lookup(runner, _text(1, 8000))
    assert found is not None
    assert length == 8000


def test_the_largest_principal_still_loses_first() -> None:
    """A principal over its share is what goes: the other one's flood evicts it, oldest first."""
    store = HistoryStore(max_tokens=10000, max_document_tokens=10000)
    store.record(HistoryScope(Tenant("big")), _text(1, 9000), [])
    store.record(HistoryScope(Tenant("small")), _text(2, 3000), [])
    assert store.held("small") == 3000
    assert store.held("big") == 0  # over budget: the one holding the most lost its document


def test_a_huge_call_keeps_a_bounded_document_and_digest() -> None:
    store = HistoryStore(max_tokens=32768)
    key = HistoryScope(Tenant("t"))
    prompt = _text(3, 1_200_000)
    store.record(key, prompt, _text(4, 50))
    assert store.stats()["tokens"] <= store.max_document_tokens
    assert len(store._last[key]) <= len(prompt) // 32 + 2  # digests, not the text
    # The next turn resends the prompt: only what is new is kept again.
    store.record(key, [*prompt, *_text(4, 50), *_text(5, 30)], _text(6, 20))
    assert store.stats()["tokens"] <= 2 * store.max_document_tokens


def test_tenant_names_are_checked() -> None:
    assert tenant_of("acme") == Tenant("acme")
    assert str(Tenant("key", "bob")) == "key/bob"
    with pytest.raises(ValueError, match="principal"):
        Tenant("")
    with pytest.raises(ValueError, match="sub"):
        Tenant("key", "x" * 300)
    with pytest.raises(ValueError, match="string or a Tenant"):
        tenant_of(3)  # type: ignore[arg-type]
