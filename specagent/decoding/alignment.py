"""Aligned copying: drafting the unchanged rest of a text that the output is rewriting.

An edit's answer is its input with a few changes: a function with a name changed, a contract with
a date moved, a configuration with two values updated. An n-gram lookup (``history``) drafts it
in pieces: it needs a few tokens past every change before it matches again, and where a line
occurs twice (``return None``, a repeated clause) its votes split and its drafts go short.
``SpanCopier`` instead keeps the output *aligned* with one source (the call's own text, or the
text the caller predicted): while the output follows the source it drafts the source from that
position, as far as the costs say; where the output leaves it (the change), it re-anchors right
after, on the shortest match that lies just ahead of where the alignment broke (one token is
enough there, where anywhere else it would be a guess). What the output put in place of the
source's span is learned as a substitution (``margin`` -> ``common_indent``), and later drafts
apply it where the same span comes again, so a rename drafts through every later occurrence.

Drafting lengths come from the cost curve and two acceptance estimates it keeps (decayed counts
with priors): the chance the output's next token is the source's after a fresh anchor (by the
anchor's match length), and the chance each further token of an aligned copy is. Both are read
off the context itself, every token the output writes while aligned (drafted or not), not off
the copier's own drafts: where verification is steep the priors alone draft nothing, and a
copier that learnt only from its drafts would never learn that the output is copying (on the
Zen 4's measured curve it drafted nothing over the whole edits replay). A copier is pure: its
state is what it saw of one call's context.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .costs import CostModel, chained_gains, draft_length
from .history import Continuation

__all__ = ["CopyRates", "SpanCopier"]

LONG_MATCH = 4
"""A match this long may anchor anywhere in the source; a shorter one only just ahead of where
the alignment broke (``WINDOW``)."""
WINDOW = 48
"""How far past the break (source tokens) a short re-anchoring match may lie: an edit replaces a
span, and the text resumes right after it."""
MAX_MATCH = 8
"""Longest match measured when anchoring (longer ones pin the place no better)."""
SCAN = 32
"""Places of a long match read per re-anchoring, at most twice over: the latest and those just
ahead of the break (a text that repeats a line a thousand times costs no more)."""
MAX_RULE_SOURCE = 8
MAX_RULE_OUTPUT = 24
"""A substitution is learned only for a short span replaced by short text (a rename, a changed
literal), not for a rewritten paragraph."""
MAX_RULES = 16


@dataclass
class _Rate:
    """A decayed acceptance estimate (0.95 per observation) with a prior worth ``weight``."""

    hits: float
    trials: float

    @classmethod
    def prior(cls, chance: float, weight: float = 4.0) -> _Rate:
        return cls(chance * weight, weight)

    @property
    def chance(self) -> float:
        return min(self.hits / self.trials, 0.995)

    def add(self, hits: float, trials: float) -> None:
        if trials > 0:
            self.hits = self.hits * 0.95 + hits
            self.trials = self.trials * 0.95 + trials


@dataclass
class CopyRates:
    """What following one source has been worth in this call: the chance the output's next
    token is the source's right after a fresh anchor, by the anchor's match length (1, 2, 3,
    4+), and the chance each further token of an aligned copy is. The priors are low (0.2-0.55
    and 0.8): replayed over single prompts and agent episodes on a cheap verify curve, higher
    ones (up to 0.85 and 0.9) cost a prose prompt up to 22% more steps in failed copies, and
    the tokens of an edit's copy raise them within a few steps anyway (``SpanCopier.sync``
    counts every token the output writes along the alignment, drafted or not)."""

    first: dict[int, _Rate] = field(
        default_factory=lambda: {
            n: _Rate.prior(chance) for n, chance in ((1, 0.2), (2, 0.3), (3, 0.4), (4, 0.55))
        }
    )
    further: _Rate = field(default_factory=lambda: _Rate.prior(0.8, 8.0))


@dataclass
class _Cursor:
    """Where the output stands in the source: the next source token to copy, and what is left
    to emit of a substitution started before it."""

    pos: int
    pending: tuple[int, ...] = ()


@dataclass
class SpanCopier:
    """Aligned copying from one source (see the module docstring).

    ``source`` is static (a prediction) or, with ``own=True``, the call's context itself as it
    grows (the prompt the output quotes, and the output's own earlier lines)."""

    source: list[int]
    own: bool = False
    label: str = "history"
    """The proposals' source (``accepted_by_source``): ``history`` or ``prediction``."""
    cursor: _Cursor | None = None
    run: int = 0
    """Tokens the output has followed the source since the last anchor (the anchor's match
    included)."""
    broke_at: int | None = None
    """Source position where the alignment last broke (re-anchoring looks just ahead)."""
    broke_out: int = 0
    """Context length at that break (what the output wrote instead starts there)."""
    rules: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)
    """Substitutions learned in this call: a source span -> what the output wrote instead."""
    rates: CopyRates = field(default_factory=CopyRates)
    aligned_once: bool = False
    """Whether the output has been aligned with the source at all (before, a prediction
    re-anchors only at its start or on two tokens or more: the output's preamble, a code
    fence, is not the prediction's)."""
    seen: int = 0
    """Context tokens synced."""
    _positions: dict[int, list[int]] = field(default_factory=dict)
    """Each token's places in the source (ascending)."""
    _grams: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    """Each ``LONG_MATCH``-gram's places (its last token's, ascending)."""
    _indexed: int = 0
    _anchored: int = 0
    """The latest anchor's match length, 1 to 4 (0: none yet): whose estimate the first
    tokens after it use."""

    def __post_init__(self) -> None:
        if not self.own:
            # A prediction is the answer's expected text: the output starts at its start.
            self.seen = -1
            self.cursor, self.broke_at = _Cursor(0), 0
            self._anchored = 2

    # ---------------------------------------------------------------- following the context

    def sync(self, context: Sequence[int]) -> None:
        """Follow the context's new tokens: along the alignment while they match it, else
        break it, each token judging the estimate its drafting would have used (a fresh
        anchor's, or the aligned copy's); then re-anchor if it is broken."""
        if self.seen < 0:  # the first sync: the context is the prompt
            self.seen = len(context)
        if self.own:
            self._index_own(context)
        elif self._indexed < len(self.source):
            self._index(len(self.source))
        judged: dict[int, list[float]] = {}  # estimate (``_estimate``) -> hits, trials
        for i in range(self.seen, len(context)):
            estimate = self._estimate()
            followed = self._follow(context[i], i)
            if estimate is not None:
                tally = judged.setdefault(estimate, [0.0, 0.0])
                tally[0] += followed
                tally[1] += 1.0
        for estimate, (hits, trials) in judged.items():
            self._rate(estimate).add(hits, trials)  # decayed once per sync, as once per step
        self.seen = len(context)
        if self.cursor is None:
            self._anchor(context)

    def _estimate(self) -> int | None:
        """Which estimate a draft from here would start with: a fresh anchor's match length
        (1 to 4), 0 for the aligned copy's, None where not aligned."""
        if self.cursor is None:
            return None
        return self._anchored if self.run < LONG_MATCH else 0

    def _rate(self, estimate: int) -> _Rate:
        return self.rates.first[estimate] if estimate else self.rates.further

    def _follow(self, token: int, at: int) -> bool:
        """Move along the alignment with the output's next token; False where it broke (or
        there was none)."""
        cursor = self.cursor
        if cursor is None:
            return False
        step = self._step(cursor)
        if step is not None and step[0] == token:
            self.cursor, self.run = step[1], self.run + 1
            self.aligned_once = True
            return True
        if (
            not cursor.pending
            and cursor.pos < self._length(at)
            and self.source[cursor.pos] == token
        ):
            # The output kept the source where a substitution would have changed it: drop it.
            self._forget_rule_at(cursor.pos)
            self.cursor, self.run = _Cursor(cursor.pos + 1), self.run + 1
            return True
        self.broke_at = cursor.pos
        self.broke_out = at
        self.cursor, self.run = None, 0
        return False

    def _length(self, at: int) -> int:
        """How much of the source exists before context position ``at`` (own context: the
        tokens before it; a prediction: all of it)."""
        return at if self.own else len(self.source)

    def _index_own(self, context: Sequence[int]) -> None:
        """The call's context is the source: index what it added (a context that is not the
        one seen so far grown, as in a drafter reused for another call, starts over)."""
        known = self._indexed
        if len(context) < known or (known and context[known - 1] != self.source[known - 1]):
            self.source, self._positions, self._grams, self._indexed = [], {}, {}, 0
            self.seen, self.cursor, self.broke_at, self.run = 0, None, None, 0
            known = 0
        self.source.extend(context[known:])
        self._index(len(self.source))

    def _index(self, end: int) -> None:
        source = self.source
        for i in range(self._indexed, end):
            self._positions.setdefault(source[i], []).append(i)
            if i + 1 >= LONG_MATCH:
                self._grams.setdefault(tuple(source[i + 1 - LONG_MATCH : i + 1]), []).append(i)
        self._indexed = end

    def _anchor(self, context: Sequence[int]) -> None:
        """Re-anchor on the context's tail: a long match anywhere (nearest after the break,
        else the latest), a short one only just ahead of the break; learn what replaced the
        source's span where the alignment broke. What it reads is bounded whatever the
        source's size: the places of the tail's last ``LONG_MATCH`` tokens (the latest
        ``SCAN`` and those just ahead of the break), else those of its last token just ahead
        of the break."""
        end = len(context)
        if end == 0:
            return
        limit = self._length(end)
        broke = self.broke_at
        found: list[tuple[int, int]] = []
        if end >= LONG_MATCH:
            places = self._grams.get(tuple(context[end - LONG_MATCH :]), [])
            if len(places) > 2 * SCAN:
                ahead = _between(places, broke, broke + SCAN) if broke is not None else []
                places = sorted({*places[-SCAN:], *ahead})
            found = self._matches(places, context, limit)
        if not found and broke is not None:
            places = _between(self._positions.get(context[end - 1], []), broke, broke + WINDOW)
            found = self._matches(places, context, limit)
        best = self._choose(found) if found else None
        if best is None:
            return
        n, pos = best
        if broke is not None and broke <= pos - n <= broke + MAX_RULE_SOURCE:
            tail_start = self.broke_out
            self._learn_rule(broke, pos - n, context[tail_start : end - n])
        self.cursor, self.run = _Cursor(pos), n
        self._anchored = min(n, 4)

    def _matches(
        self, places: Sequence[int], context: Sequence[int], limit: int
    ) -> list[tuple[int, int]]:
        """For each place ``p`` of the context's last token (before ``limit``): how many tokens
        the source and the context's tail share up to it (at most ``MAX_MATCH``), and ``p + 1``,
        where the copy would resume."""
        end, source = len(context), self.source
        out = []
        for p in places:
            if p + 1 >= limit:
                break  # the context's own tail, or past what exists yet
            n = 1
            while n < MAX_MATCH and p - n >= 0 and source[p - n] == context[end - 1 - n]:
                n += 1
            out.append((n, p + 1))
        return out

    def _choose(self, candidates: list[tuple[int, int]]) -> tuple[int, int] | None:
        broke = self.broke_at
        longest = max(n for n, _ in candidates)
        if longest >= LONG_MATCH:
            pool = [c for c in candidates if c[0] == longest]
            if broke is not None:
                ahead = [c for c in pool if c[1] - c[0] >= broke]
                if ahead:
                    return min(ahead, key=lambda c: c[1])
            return max(pool, key=lambda c: c[1])
        if broke is None:
            return None
        near = [
            c
            for c in candidates
            if broke <= c[1] - c[0] <= broke + WINDOW
            and (self.aligned_once or c[0] >= 2 or c[1] - c[0] == 0)
        ]
        if not near:
            return None
        return max(near, key=lambda c: (c[0], -c[1]))

    def _learn_rule(self, start: int, stop: int, written: Sequence[int]) -> None:
        """The output wrote ``written`` where the source had ``source[start:stop]``."""
        span = tuple(self.source[start:stop])
        if (
            not span
            or len(span) > MAX_RULE_SOURCE
            or not written
            or len(written) > MAX_RULE_OUTPUT
            or span == tuple(written)
        ):
            return
        if len(self.rules) >= MAX_RULES and span not in self.rules:
            return
        self.rules[span] = tuple(written)

    def _forget_rule_at(self, pos: int) -> None:
        for span in list(self.rules):
            if tuple(self.source[pos : pos + len(span)]) == span:
                del self.rules[span]

    def _step(self, cursor: _Cursor) -> tuple[int, _Cursor] | None:
        """The next token the alignment expects, and the cursor after it."""
        if cursor.pending:
            return cursor.pending[0], _Cursor(cursor.pos, cursor.pending[1:])
        if cursor.pos >= len(self.source):
            return None
        for span, written in self.rules.items():
            if (
                self.source[cursor.pos] == span[0]
                and tuple(self.source[cursor.pos : cursor.pos + len(span)]) == span
            ):
                return written[0], _Cursor(cursor.pos + len(span), written[1:])
        return self.source[cursor.pos], _Cursor(cursor.pos + 1)

    # ---------------------------------------------------------------- drafting

    def candidate(
        self,
        context: Sequence[int],
        limit: int,
        costs: CostModel,
        after: Callable[[float], float] | None = None,
    ) -> tuple[Continuation, float]:
        """The aligned draft worth proposing (cut by cost) and its expected tokens per unit of
        cost (0.0: nothing to copy)."""
        self.sync(context)
        if self.cursor is None or limit <= 0:
            return Continuation([], [], 0), 0.0
        tokens: list[int] = []
        cursor: _Cursor | None = self.cursor
        limit_pos = self._length(len(context))
        while cursor is not None and len(tokens) < limit:
            if not cursor.pending and cursor.pos >= limit_pos:
                break
            step = self._step(cursor)
            if step is None:
                break
            tokens.append(step[0])
            cursor = step[1]
        if not tokens:
            return Continuation([], [], 0), 0.0
        first = self._rate(self._estimate() or 0).chance
        further = self.rates.further.chance
        confidences = [first] + [further] * (len(tokens) - 1)
        length, rate = draft_length(chained_gains(confidences), costs, after)
        return Continuation(tokens[:length], confidences[:length], self.run), rate


def _between(places: list[int], low: int, high: int) -> list[int]:
    """The places in ``[low, high]`` (``places`` ascending)."""
    return places[bisect.bisect_left(places, low) : bisect.bisect_right(places, high)]
