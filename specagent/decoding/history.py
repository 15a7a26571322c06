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

The runtime keeps one index per scope key (``runtime.memory.HistoryStore``: per policy, per
tenant or the whole runtime, always within one tenant) under a total token budget, and hands a
call only the indexes of its own key: one tenant's text can never be proposed to another
tenant's call.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["NGRAMS", "Continuation", "SuffixIndex", "continuation", "runner_up"]

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
