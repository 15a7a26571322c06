"""Stop strings on decoded text, and what text is safe to stream before a stop string can appear.

Stop strings live in text, tokens do not align with them: a stop string can begin in the middle
of a token or span several. A call's text is decoded incrementally (``IncrementalText``: each
step decodes only its new tokens and a few before them, never the whole output), and each step
searches only its new text, plus the tail a stop string could have started in, for each stop.
So a step's cost is bounded by its new tokens and the stop strings' lengths, whatever the
output's length; the limits below bound the stop strings themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["MAX_STOPS", "MAX_STOP_CHARS", "IncrementalText", "StopStrings"]

Decode = Callable[[Sequence[int]], str]

MAX_STOPS = 16
"""The most stop strings one call may give (OpenAI's API allows 4)."""
MAX_STOP_CHARS = 256
"""The longest stop string, in characters."""

_INCOMPLETE = "\ufffd"
_MAX_PENDING = 4
"""Tokens an incomplete character may wait for (UTF-8 has at most 4 bytes per character)."""


class IncrementalText:
    """The text of a growing token list, decoded a few tokens at a time.

    Each ``extend`` decodes the tokens added since the last emitted text together with those of
    the step before (so a tokenizer that spells a word's leading space from its neighbour still
    does) and appends what that adds. Text ending in an incomplete character (U+FFFD) waits for
    the tokens that complete it (at most 4: beyond that the bytes are invalid and stay U+FFFD,
    as a whole decode has them). ``marks`` records (tokens, text length) after every step, for
    finding how many tokens lie wholly before a position in the text."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # first token of the context decoded with the new ones
        self._read = 0  # tokens whose text is in ``self.text``
        self.marks: list[tuple[int, int]] = [(0, 0)]

    def extend(self, tokens: Sequence[int]) -> str:
        """Add tokens; returns the text they complete (possibly empty)."""
        self.tokens.extend(tokens)
        if len(self.tokens) == self._read:
            return ""
        before = self.decode(self.tokens[self._prefix : self._read])
        end, after = self._complete_end(before)
        if end == self._read:
            return ""
        if after.startswith(before):
            new = after[len(before) :]
        else:  # a tokenizer whose text of a window is not a prefix of the longer one
            whole = self.decode(self.tokens[:end])
            new = whole[len(self.text) :] if whole.startswith(self.text) else ""
        self.text += new
        self._prefix, self._read = self._read, end
        self.marks.append((self._read, len(self.text)))
        return new

    def _complete_end(self, before: str) -> tuple[int, str]:
        """The most tokens whose text ends in a complete character, with that text: a trailing
        token or few that begin a character wait for the rest of it (up to 4 tokens: longer, the
        bytes are invalid and stay U+FFFD, as a whole decode has them)."""
        last = len(self.tokens)
        after = self.decode(self.tokens[self._prefix : last])
        if not after.endswith(_INCOMPLETE) or before.endswith(_INCOMPLETE):
            return last, after
        for end in range(last - 1, max(self._read, last - _MAX_PENDING), -1):
            text = self.decode(self.tokens[self._prefix : end])
            if not text.endswith(_INCOMPLETE):
                return end, text
        if last - self._read < _MAX_PENDING:
            return self._read, before
        return last, after

    def tokens_before(self, cut: int) -> int:
        """How many tokens lie wholly before text position ``cut`` (a stop string's start):
        the last step that ends before it, then token by token through the step that crosses
        it (decoded with that step's own context, as ``extend`` did)."""
        context, start, length = 0, 0, 0
        end = len(self.tokens)
        for tokens, text_length in self.marks:
            if text_length > cut:
                end = tokens
                break
            if tokens > start:
                context = start
            start, length = tokens, text_length
        base = self.decode(self.tokens[context:start])
        keep = start
        for n in range(start + 1, end + 1):
            piece = self.decode(self.tokens[context:n])
            grown = piece[len(base) :] if piece.startswith(base) else piece
            if length + len(grown) > cut:
                break
            keep = n
        return keep


class StopStrings:
    """Finds a call's stop strings in its text as it grows (``stops``: 1 to ``MAX_STOPS``
    non-empty strings of at most ``MAX_STOP_CHARS`` characters). One instance per call and per
    side: the worker's (``tokens_to_keep``) and the caller's (``feed``, ``safe_length``)."""

    def __init__(self, stops: Sequence[str], decode: Decode) -> None:
        check_stops(stops)
        self.stops = tuple(stops)
        self.longest = max(len(s) for s in self.stops)
        self.text = IncrementalText(decode)
        self.cut: int | None = None
        """Where the earliest stop string starts in the text, once one appeared."""
        self._searched = 0  # text length already searched

    def feed(self, tokens: Sequence[int]) -> None:
        """Add a step's tokens and search the text they complete."""
        if self.cut is not None:
            self.text.tokens.extend(tokens)
            return
        self.text.extend(tokens)
        self._search()

    def _search(self) -> None:
        text = self.text.text
        if len(text) == self._searched:
            return
        start = max(0, self._searched - self.longest + 1)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        self.cut = min(hits) if hits else None
        self._searched = len(text)

    def safe_length(self) -> int:
        """How much of the text can be emitted now: all of it up to a stop string, except a
        trailing piece that may still grow into one."""
        text = self.text.text
        if self.cut is not None:
            return self.cut
        held = 0
        for stop in self.stops:
            window = min(len(stop) - 1, len(text))
            j = text.find(stop[0], len(text) - window) if window else -1
            while j != -1:
                if stop.startswith(text[j:]):
                    held = max(held, len(text) - j)
                    break
                j = text.find(stop[0], j + 1)
        return len(text) - held

    def tokens_to_keep(self, output: list[int]) -> int | None:
        """For the decoding loop (called with the growing output after every step): if a stop
        string appeared, how many output tokens lie wholly before it; else None."""
        seen = len(self.text.tokens)
        if len(output) < seen:
            raise ValueError("the output shrank between stop checks")
        self.feed(output[seen:])
        if self.cut is None:
            return None
        return self.text.tokens_before(self.cut)


def check_stops(stops: Sequence[str]) -> None:
    """Raise ValueError naming what is wrong with a call's stop strings."""
    if isinstance(stops, str):
        stops = (stops,)
    if not stops:
        raise ValueError("stop: give at least one stop string (or none at all)")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"stop: {len(stops)} stop strings; at most {MAX_STOPS} are allowed")
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop[{i}]: stop strings must be non-empty strings")
        if len(s) > MAX_STOP_CHARS:
            msg = f"stop[{i}]: {len(s)} characters; a stop string has at most {MAX_STOP_CHARS}"
            raise ValueError(msg)
