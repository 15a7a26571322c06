"""The drafting history: earlier calls' prompts and outputs, one ``SuffixIndex`` per scope key
(``tenants.HistoryScope``), within a token budget accounted by principal. Calls read it through
the indexes their plan's scope may see (``HistoryStore.indexes``)."""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Hashable, Sequence

from ...decoding.history import NGRAMS, SuffixIndex
from ...tenants import HistoryScope, Tenant

__all__ = ["DIGEST_BLOCK", "HistoryStore"]


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
