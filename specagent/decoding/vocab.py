"""The ids one call may draft beyond a draft runner's head rows.

An engine may project a draft's logits onto the leading rows of its head only (the transformers
engine does, where the vocabulary is ordered by frequency: ``engines.transformers.head``);
the call's own tokens (its prompt and what it wrote) are added per call, so a draft can still
propose text the call already contains. The draft model drafter keeps one ``CallVocabulary``
per call and hands its ids to every draft forward (``ForwardRequest.vocab``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CallVocabulary"]


class CallVocabulary:
    """The ids beyond a runner's ``head_rows`` that one call's draft logits also cover: the
    tokens of its context (prompt and output so far). Grows with the context; ``ids`` is
    sorted."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._seen: set[int] = set()
        self._scanned: list[int] = []
        self.ids = torch.tensor([], dtype=torch.long)

    def update(self, context: Sequence[int]) -> torch.Tensor:
        """Take in what ``context`` adds since the last update; returns ``ids``."""
        done = len(self._scanned)
        if context[:done] != self._scanned:  # another context (never within a call): rescan
            done = 0
        new = {i for i in context[done:] if i >= self.rows} - self._seen
        self._scanned = list(context)
        if new:
            self._seen |= new
            self.ids = torch.tensor(sorted(self._seen), dtype=torch.long)
        return self.ids
