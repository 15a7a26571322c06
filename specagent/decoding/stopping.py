"""Stop strings on decoded text, and what text is safe to stream before a stop string can appear.

Stop strings live in text, tokens do not align with them: a stop string can begin in the middle
of a token or span several. So the check decodes, finds the earliest stop string, and reports both
the text cut and how many whole tokens precede it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["StopStrings"]

Decode = Callable[[Sequence[int]], str]


class StopStrings:
    """Finds stop strings in generated text (``stops`` must be non-empty strings)."""

    def __init__(self, stops: Sequence[str], decode: Decode) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = tuple(stops)
        self.decode = decode

    def find(self, text: str) -> int | None:
        """Index where the earliest stop string starts, or None."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def safe_length(self, text: str) -> int:
        """How much of ``text`` can be emitted now: all of it, except a trailing piece that may
        still grow into a stop string, and a trailing incomplete character (U+FFFD)."""
        cut = self.find(text)
        if cut is not None:
            return cut
        end = len(text)
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    end = min(end, len(text) - n)
                    break
        return end

    def tokens_to_keep(self, output: list[int]) -> int | None:
        """For the decoding loop: if a stop string appeared, how many output tokens lie wholly
        before it; else None."""
        cut = self.find(self.decode(output))
        if cut is None:
            return None
        keep = len(output)
        while keep > 0 and len(self.decode(output[:keep])) > cut:
            keep -= 1
        return keep
