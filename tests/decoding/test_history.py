"""The history index against a brute-force matcher, its memory bound, and the suffix drafter's
exactness: its drafts are verified like any other, so sampling stays the target's."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from distributions import (
    chi_square_pvalues,
    exact_marginals,
    sample_counts,
)

from specagent.decoding import acceptance
from specagent.decoding.costs import CostModel
from specagent.decoding.drafters import SuffixDrafter
from specagent.decoding.history import NGRAMS, SuffixIndex, continuation
from specagent.decoding.proposal import DraftRequest
from specagent.decoding.sampling import SamplingParams
from specagent.runtime.memory import HistoryStore
from specagent.tenants import HistoryScope


def brute_force(docs: list[list[int]], context: list[int], limit: int) -> tuple[list[int], int]:
    """The longest n of NGRAMS whose last-n context tokens occur (with something after them)
    in any document; then, token by token, the most frequent next token among the places that
    still agree (ties: the place indexed last)."""
    for n in reversed(NGRAMS):
        if len(context) < n:
            continue
        tail = context[-n:]
        places = [
            (d, end)
            for d, doc in enumerate(docs)
            for end in range(n, len(doc))
            if doc[end - n : end] == tail
        ]
        if places:
            break
    else:
        return [], 0
    out: list[int] = []
    for offset in range(limit):
        votes: collections.Counter[int] = collections.Counter()
        latest: dict[int, int] = {}
        for rank, (d, end) in enumerate(places):
            if end + offset < len(docs[d]):
                token = docs[d][end + offset]
                votes[token] += 1
                latest[token] = rank
        if not votes:
            break
        token = max(votes, key=lambda t: (votes[t], latest[t]))
        out.append(token)
        places = [
            (d, end)
            for d, end in places
            if end + offset < len(docs[d]) and docs[d][end + offset] == token
        ]
    return out, n


@pytest.mark.parametrize("seed", range(6))
def test_index_agrees_with_brute_force_on_random_streams(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = rng.randint(3, 6)  # small alphabets repeat n-grams often
    docs = [[rng.randrange(alphabet) for _ in range(rng.randint(5, 60))] for _ in range(5)]
    index = SuffixIndex(max_occurrences=10_000)
    for doc_id, doc in enumerate(docs):
        index.add(doc_id, doc)
    for _ in range(40):
        context = [rng.randrange(alphabet) for _ in range(rng.randint(1, 12))]
        found = continuation([index], context, 6)
        expected, n = brute_force(docs, context, 6)
        assert (found.tokens, found.match_length) == (expected, n), context
        assert all(0 < c <= 1 for c in found.confidences)


def test_removing_a_document_forgets_it_and_its_entries() -> None:
    index = SuffixIndex()
    index.add(0, [1, 2, 3, 4, 5, 6])
    index.add(1, [9, 2, 3, 7, 7, 7])
    assert continuation([index], [2, 3], 3).tokens == [7, 7, 7]  # the latest place wins a tie
    index.remove(1)
    assert continuation([index], [2, 3], 3).tokens == [4, 5, 6]
    index.remove(0)
    assert index.entries == 0
    assert continuation([index], [2, 3], 3).tokens == []


def test_store_evicts_the_oldest_within_its_budget_and_reports_memory() -> None:
    store = HistoryStore(max_tokens=50)
    for i in range(10):
        store.record(
            HistoryScope("a"), [100 + i] * 3, [i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6]
        )
    stats = store.stats()
    assert stats["tokens"] <= 50
    assert 0 < stats["documents"] < 10
    assert stats["entries"] > 0
    (index,) = store.indexes(HistoryScope("a"))
    assert 0 not in index.docs  # the first call's text went first
    assert continuation([index], [109, 9], 2).tokens == [10, 11]
    store.clear()
    assert store.stats()["tokens"] == 0
    assert store.stats()["entries"] == 0


def test_one_tenants_long_calls_evict_only_its_own_history() -> None:
    """Over budget, the tenant holding the most loses its oldest text first: a flood of long
    calls from one tenant leaves a small tenant's history whole (and its drafts with it), while
    a tenant alone still uses the whole budget."""
    store = HistoryStore(max_tokens=1000)
    quiet = [[7, 8, 9, 10 + i, 11, 12, 13] for i in range(5)]
    for text in quiet:
        store.record(HistoryScope("quiet"), [1, 2, 3], text)
    for i in range(50):
        store.record(
            HistoryScope("loud", "summary"), [500 + i] * 3, list(range(i * 100, i * 100 + 97))
        )
    assert store.stats()["tokens"] <= 1000
    (index,) = store.indexes(HistoryScope("quiet"))
    assert sorted(map(tuple, index.docs.values())) == sorted((1, 2, 3, *t) for t in quiet)
    (loud,) = store.indexes(HistoryScope("loud", "summary"))
    assert 0 < len(loud.docs) < 50
    assert continuation([loud], [500 + 49] * 3, 3).tokens == [4900, 4901, 4902]
    # Alone, a tenant still fills the whole budget.
    alone = HistoryStore(max_tokens=1000)
    for i in range(50):
        alone.record(HistoryScope("a"), [500 + i] * 3, list(range(i * 100, i * 100 + 97)))
    assert 900 < alone.stats()["tokens"] <= 1000


def test_a_tenant_flooding_many_small_calls_evicts_its_own_documents() -> None:
    store = HistoryStore(max_tokens=100_000, max_documents=20)
    store.record(HistoryScope("quiet"), [1, 2, 3], [4, 5, 6])
    for i in range(100):
        store.record(HistoryScope("loud"), [i, i + 1], [i + 2])
    assert store.stats()["documents"] == 20
    assert len(store.indexes(HistoryScope("quiet"))[0].docs) == 1
    store.clear(HistoryScope("loud"))
    assert store.stats() == {**store.stats(), "documents": 1, "tokens": 6, "keys": 1}


def test_a_resent_conversation_is_stored_once() -> None:
    store = HistoryStore(max_tokens=10_000)
    system = list(range(200, 400))
    store.record(HistoryScope("a"), [*system, 1, 2], [3, 4])
    store.record(HistoryScope("a"), [*system, 1, 2, 3, 4, 5], [6, 7])
    # The second call kept only what was new (plus a few tokens of overlap for its n-grams).
    assert store.stats()["tokens"] < len(system) + 40


def test_one_tenants_history_is_invisible_to_another() -> None:
    store = HistoryStore()
    secret = [7, 8, 9, 10, 11, 12, 13]
    store.record(HistoryScope("a"), [1, 2, 3], secret)
    assert store.indexes(HistoryScope("b")) == []
    drafter = SuffixDrafter(store.indexes(HistoryScope("b")), own_context=True)
    assert (
        drafter.propose(DraftRequest([1, 2, 3], 6, SamplingParams(0.0), torch.Generator())).tokens
        == []
    )
    drafter = SuffixDrafter(store.indexes(HistoryScope("a")), own_context=True)
    assert drafter.propose(
        DraftRequest([1, 2, 3], 6, SamplingParams(0.0), torch.Generator())
    ).tokens[:3] == [
        7,
        8,
        9,
    ]


def test_draft_length_follows_the_vote_and_the_verify_cost() -> None:
    index = SuffixIndex()
    index.add(0, [1, 2, 3, 4, 5, 6, 7, 8])
    index.add(1, [1, 2, 3, 4, 9, 9, 9, 9])
    params, gen = SamplingParams(0.0), torch.Generator()
    cheap = SuffixDrafter([index], CostModel(verify=(1.0,) * 9), own_context=False)
    # After [1, 2, 3]: two places agree on 4, then split 1:1; free verification keeps going.
    assert len(cheap.propose(DraftRequest([1, 2, 3], 8, params, gen)).tokens) >= 2
    steep = SuffixDrafter([index], CostModel(verify=(1.0, 3.0, 5.0, 7.0)), own_context=False)
    assert (
        steep.propose(DraftRequest([1, 2, 3], 8, params, gen)).tokens == []
    )  # a second row is too dear


# --------------------------------------------------------------------------- exactness

HISTORY = [[3, 7, 3, 7, 3, 1, 2, 1, 2, 5], [7, 3, 1, 2, 4, 4, 4], [3, 7, 3, 9, 9, 9, 9]]


def _history_drafter() -> SuffixDrafter:
    index = SuffixIndex()
    for doc_id, doc in enumerate(HISTORY):
        index.add(doc_id, doc)
    return SuffixDrafter([index], CostModel(verify=(1.0,) * 8))


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)])
def test_suffix_drafts_keep_sampling_exact(small_target, params) -> None:
    marginals = exact_marginals(small_target, params)
    counts = sample_counts(small_target, _history_drafter, params, 4)
    assert min(chi_square_pvalues(counts, marginals)) > 1e-3


@pytest.mark.slow
def test_the_check_catches_history_drafts_accepted_unverified(small_target, monkeypatch) -> None:
    """Planted bug: deterministic drafts accepted without the ratio test (trusting the
    history). The history proposes tokens the target rarely samples, so the test must fail."""
    monkeypatch.setattr(
        acceptance, "_first_rejection", lambda passed: torch.tensor(passed.shape[0])
    )
    params = SamplingParams(1.0)
    marginals = exact_marginals(small_target, params)
    counts = sample_counts(small_target, _history_drafter, params, 4)
    assert min(chi_square_pvalues(counts, marginals)) < 1e-6
