"""Text that earlier calls wrote, as a source of drafts: agents quote tool results, rewrite their
own answers, return a function again with one change, and extract the same JSON shape from
document after document.

``SuffixIndex`` indexes token sequences by their n-grams (a few lengths, longest tried first):
looking up a context finds every earlier place where its last n tokens occurred, and the
continuation is grown token by token by a vote among those places (the most frequent next token,
then only the places that agree), each token with its share of the vote as a confidence. Where
the places split, ``runner_up`` follows the other way (the second branch of a token tree). A
lookup costs what the match and the draft cost, never the size of the history: an n-gram is one
dict probe and at most ``max_occurrences`` places (the most recent) are kept per n-gram.

``HistoryStore`` keeps one index per scope key (``drafter.history``: per policy, per tenant or the
whole runtime, always within one tenant) under a total token budget; over it, the principal
holding the most (``tenants``) loses its oldest document first. The scope is a security
boundary: a call reads only the indexes of its own key, so one tenant's text can never be
proposed to another tenant's call.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

from .tenants import HistoryScope, Tenant

__all__ = ["Continuation", "HistoryStore", "SuffixIndex", "continuation", "runner_up"]

NGRAMS = (2, 3, 5, 8)
"""Match lengths, longest tried first. One token matches by chance too often to be worth a
verification; eight already pins a place in the text."""


@dataclass(frozen=True)
class Continuation:
    """What followed the context's longest match: tokens with their vote shares."""

    tokens: list[int]
    confidences: list[float]
    match_length: int


EMPTY = Continuation([], [], 0)


class SuffixIndex:
    """N-gram index over documents (token sequences), with removal."""

    def __init__(self, ngrams: Sequence[int] = NGRAMS, max_occurrences: int = 32) -> None:
        self.ngrams = tuple(sorted(set(ngrams)))
        self.max_occurrences = max_occurrences
        self.docs: dict[int, list[int]] = {}
        self._places: dict[tuple[int, ...], collections.deque[tuple[int, int]]] = {}
        self._entries = 0

    @property
    def tokens(self) -> int:
        return sum(len(doc) for doc in self.docs.values())

    @property
    def entries(self) -> int:
        """Index entries held (places over all n-grams): the index's memory, besides the text."""
        return self._entries

    def add(self, doc_id: int, tokens: Sequence[int]) -> None:
        """Index a new document."""
        self.docs[doc_id] = []
        self.extend(doc_id, tokens)

    def extend(self, doc_id: int, tokens: Sequence[int]) -> None:
        """Append to a document (a call's context as it grows): only the n-grams that end in
        the new tokens are indexed."""
        doc = self.docs[doc_id]
        start = len(doc)
        doc.extend(tokens)
        for key, end in self._ngrams(doc, start):
            places = self._places.get(key)
            if places is None:
                places = self._places[key] = collections.deque(maxlen=self.max_occurrences)
            if len(places) == places.maxlen:
                self._entries -= 1
            places.append((doc_id, end))
            self._entries += 1

    def remove(self, doc_id: int) -> None:
        doc = self.docs.pop(doc_id, None)
        if doc is None:
            return
        for key, _ in self._ngrams(doc, 0):
            places = self._places.get(key)
            if places is None:
                continue  # removed already (the n-gram occurs twice in the document)
            kept = [p for p in places if p[0] != doc_id]
            self._entries -= len(places) - len(kept)
            if kept:
                self._places[key] = collections.deque(kept, maxlen=self.max_occurrences)
            else:
                del self._places[key]

    def _ngrams(self, doc: list[int], start: int) -> Iterator[tuple[tuple[int, ...], int]]:
        """Each indexed n-gram that ends after position ``start``, with its end."""
        for end in range(start + 1, len(doc) + 1):
            for n in self.ngrams:
                if end < n:
                    break
                yield tuple(doc[end - n : end]), end

    def places(self, context: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
        """Where the context's longest indexed suffix occurred (most recent last) and its
        length; places with nothing after them are left out."""
        for n in reversed(self.ngrams):
            if len(context) < n:
                continue
            found = self._places.get(tuple(context[len(context) - n :]))
            if found:
                live = [(d, end) for d, end in found if end < len(self.docs[d])]
                if live:
                    return live, n
        return [], 0


Place = tuple[SuffixIndex, int, int]
"""An earlier occurrence of the context's suffix: its index, document and end."""


def _matched(indexes: Sequence[SuffixIndex], context: Sequence[int]) -> tuple[list[Place], int]:
    """The places of the context's longest match in any of ``indexes`` (equal lengths pool)."""
    best: list[Place] = []
    best_n = 0
    for index in indexes:
        places, n = index.places(context)
        if n > best_n:
            best, best_n = [(index, d, end) for d, end in places], n
        elif n == best_n and n > 0:
            best.extend((index, d, end) for d, end in places)
    return best, best_n


def _votes(live: list[Place], offset: int) -> tuple[collections.Counter[int], dict[int, int]]:
    """What the places ``live`` hold ``offset`` tokens after their match, and each token's
    most recent place."""
    votes: collections.Counter[int] = collections.Counter()
    latest: dict[int, int] = {}
    for rank, (index, d, end) in enumerate(live):
        doc = index.docs[d]
        if end + offset < len(doc):
            token = doc[end + offset]
            votes[token] += 1
            latest[token] = rank
    return votes, latest


def _agreeing(live: list[Place], offset: int, token: int) -> list[Place]:
    return [
        (index, d, end)
        for index, d, end in live
        if end + offset < len(index.docs[d]) and index.docs[d][end + offset] == token
    ]


def _grow(live: list[Place], offset: int, limit: int) -> tuple[list[int], list[float]]:
    """From ``offset`` on: the most frequent next token (ties to the most recent place), then
    only the places that agree, up to ``limit`` tokens in all; each with its vote share."""
    tokens: list[int] = []
    confidences: list[float] = []
    while offset < limit:
        votes, latest = _votes(live, offset)
        if not votes:
            break
        token = max(votes, key=lambda t: (votes[t], latest[t]))
        tokens.append(token)
        confidences.append(votes[token] / sum(votes.values()))
        live = _agreeing(live, offset, token)
        offset += 1
    return tokens, confidences


def continuation(
    indexes: Sequence[SuffixIndex], context: Sequence[int], limit: int
) -> Continuation:
    """The continuation most often seen after the context's longest match in any of
    ``indexes`` (the longest match wins; equal lengths pool their places)."""
    if limit <= 0:
        return EMPTY
    best, best_n = _matched(indexes, context)
    if not best:
        return EMPTY
    tokens, confidences = _grow(best, 0, limit)
    return Continuation(tokens, confidences, best_n)


def runner_up(
    indexes: Sequence[SuffixIndex], context: Sequence[int], main: Continuation, limit: int
) -> Continuation:
    """The history's second opinion on ``main`` (this context's ``continuation``): where the
    places split, the token fewer of them hold, then what those places continue with. Of the
    splits along ``main``, the one most likely to be the text's way: the chance of reaching it
    (``main``'s vote shares before it) times the runner-up's share. Its tokens and vote shares
    start from the root (``main``'s up to the split); EMPTY where all places agree."""
    if not main.tokens:
        return EMPTY
    live, _ = _matched(indexes, context)
    best: tuple[float, int, int, float, list[Place]] | None = None
    reach = 1.0
    for offset, token in enumerate(main.tokens):
        votes, latest = _votes(live, offset)
        others = [t for t in votes if t != token]
        if others:
            second = max(others, key=lambda t: (votes[t], latest[t]))
            share = votes[second] / sum(votes.values())
            if best is None or reach * share > best[0]:
                best = (reach * share, offset, second, share, _agreeing(live, offset, second))
        reach *= main.confidences[offset]
        live = _agreeing(live, offset, token)
    if best is None:
        return EMPTY
    _, offset, token, share, voters = best
    tokens, confidences = _grow(voters, offset + 1, limit)
    return Continuation(
        [*main.tokens[:offset], token, *tokens],
        [*main.confidences[:offset], share, *confidences],
        main.match_length,
    )


class HistoryStore:
    """Earlier calls' prompts and outputs, one ``SuffixIndex`` per scope key, within a total
    token budget, accounted by principal (``tenants.Tenant``). Over budget, the principal
    holding the most tokens loses its oldest document first: one principal alone may use the
    whole budget, but its long calls only ever evict its own history until it holds no more
    than any other principal, so none can flush another's drafts (or learn from their loss that
    it did), however many sub-tenants it spreads its calls over: a principal keeps at most
    ``max_subtenants`` of them (its least recently used one goes first). A document keeps at
    most ``max_document_tokens`` (its end: what the next turn quotes), and what the next call's
    prompt shares with the last one is found from block digests, not kept text. Thread-safe."""

    def __init__(
        self,
        max_tokens: int = 32768,
        max_documents: int = 4096,
        *,
        max_subtenants: int = 64,
        max_document_tokens: int | None = None,
    ) -> None:
        self.max_tokens = max_tokens
        self.max_documents = max_documents
        self.max_subtenants = max_subtenants
        self.max_document_tokens = max_document_tokens or max(256, max_tokens // 8)
        self._principal_tokens: collections.Counter[Hashable] = collections.Counter()
        self._principal_docs: collections.Counter[Hashable] = collections.Counter()
        self._subtenants: dict[Hashable, collections.OrderedDict[Hashable, None]] = {}
        self._indexes: dict[Hashable, SuffixIndex] = {}
        self._order: collections.OrderedDict[int, Hashable] = collections.OrderedDict()
        self._last: dict[Hashable, list[int]] = {}
        """Per key: digests of the last call's text, one per ``DIGEST_BLOCK`` tokens."""
        self._ids = itertools.count()
        self._tokens = 0
        self._lock = threading.Lock()

    def indexes(self, key: Hashable) -> list[SuffixIndex]:
        """The indexes a call under ``key`` may read: its own key's, nothing else."""
        with self._lock:
            index = self._indexes.get(key)
            return [index] if index is not None else []

    def record(self, key: Hashable, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Keep a finished call's text under ``key``. The part of the prompt it shares with the
        previous call under the same key (the system prompt, tool schemas, earlier turns) is
        stored once, so an agent resending its conversation does not fill the budget."""
        digests = _digests([*prompt, *output])
        with self._lock:
            shared = DIGEST_BLOCK * _common(self._last.get(key, []), _digests(prompt))
            # Keep a few shared tokens so the n-grams across the cut still match.
            start = max(0, shared - max(NGRAMS))
            text = [*prompt[start:], *output][-self.max_document_tokens :]
            self._last[key] = digests
            if not text:
                return
            principal = _principal_of(key)
            self._seen(principal, _tenant_in(key))
            doc_id = next(self._ids)
            index = self._indexes.get(key)
            if index is None:
                index = self._indexes[key] = SuffixIndex()
            index.add(doc_id, text)
            self._order[doc_id] = key
            self._tokens += len(text)
            self._principal_tokens[principal] += len(text)
            self._principal_docs[principal] += 1
            while self._tokens > self.max_tokens:
                self._evict_from_largest(self._principal_tokens, principal)
            while len(self._order) > self.max_documents:
                self._evict_from_largest(self._principal_docs, principal)

    def _seen(self, principal: Hashable, tenant: Hashable) -> None:
        """``tenant`` (a sub-tenant of ``principal``) is the most recent; past
        ``max_subtenants`` the principal's least recently used one loses its history."""
        recent = self._subtenants.setdefault(principal, collections.OrderedDict())
        recent[tenant] = None
        recent.move_to_end(tenant)
        while len(recent) > self.max_subtenants:
            stale = next(iter(recent))
            del recent[stale]
            for doc_id, owner in list(self._order.items()):
                if _tenant_in(owner) == stale:
                    self._evict(doc_id)

    def _evict_from_largest(self, held: collections.Counter[Hashable], recording: Hashable) -> None:
        """Evict the oldest document of the principal that holds the most (tokens or
        documents); on a tie, the one recording now."""
        largest = max(held, key=lambda p: (held[p], p == recording))
        self._evict(next(d for d, k in self._order.items() if _principal_of(k) == largest))

    def _evict(self, doc_id: int) -> None:
        key = self._order.pop(doc_id)
        index = self._indexes[key]
        size = len(index.docs.get(doc_id, ()))
        self._tokens -= size
        principal = _principal_of(key)
        self._principal_tokens[principal] -= size
        self._principal_docs[principal] -= 1
        if self._principal_docs[principal] == 0:
            del self._principal_tokens[principal], self._principal_docs[principal]
            self._subtenants.pop(principal, None)
        index.remove(doc_id)
        if not index.docs:
            del self._indexes[key]
            self._last.pop(key, None)

    def clear(self, key: Hashable | None = None) -> None:
        """Forget everything (or one key's history)."""
        with self._lock:
            for doc_id, owner in list(self._order.items()):
                if key is None or owner == key:
                    self._evict(doc_id)
            if key is None:
                self._last.clear()

    def held(self, principal: Hashable) -> int:
        """Tokens ``principal`` holds (its sub-tenants' together)."""
        with self._lock:
            return self._principal_tokens.get(principal, 0)

    def stats(self) -> dict[str, int]:
        """Memory held: tokens, documents, scope keys and index entries."""
        with self._lock:
            return {
                "tokens": self._tokens,
                "max_tokens": self.max_tokens,
                "documents": len(self._order),
                "keys": len(self._indexes),
                "entries": sum(i.entries for i in self._indexes.values()),
                "principals": len(self._principal_tokens),
            }


DIGEST_BLOCK = 32
"""Tokens per digest of a call's text (what the next call's prompt shares with it is found
block by block: a few bytes kept per 32 tokens instead of the text)."""


def _digests(tokens: Sequence[int]) -> list[int]:
    """A chained hash per whole block of ``DIGEST_BLOCK`` tokens: equal digests up to block
    ``i`` mean (up to a hash collision, which only costs a duplicated document) equal text up
    to its end."""
    out: list[int] = []
    chained = 0
    for start in range(0, len(tokens) - DIGEST_BLOCK + 1, DIGEST_BLOCK):
        chained = hash((chained, tuple(tokens[start : start + DIGEST_BLOCK])))
        out.append(chained)
    return out


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _tenant_in(key: Hashable) -> Hashable:
    """The tenant a history key belongs to (a ``HistoryScope``'s), or the key itself (the
    runtime-wide scope, and keys of other kinds)."""
    if isinstance(key, HistoryScope) and key.tenant is not None:
        return key.tenant
    return key


def _principal_of(key: Hashable) -> Hashable:
    """Whose budget a history key draws on: its tenant's principal."""
    tenant = _tenant_in(key)
    return tenant.principal if isinstance(tenant, Tenant) else tenant
