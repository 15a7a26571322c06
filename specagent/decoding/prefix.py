"""Prefix reuse, as the decoding loop sees it: a call's cache starts from the longest prefix of
its prompt that ``Prefixes`` (``parts``) keeps for its runner. Where and for whom prefixes are
kept is the runtime's (``runtime.memory.PrefixCache``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .engine import Runner
from .parts import Prefixes

__all__ = ["common_prefix_length", "reuse_prefix"]


def reuse_prefix(
    runner: Runner, tokens: Sequence[int], prefixes: Prefixes | None
) -> tuple[Any, int]:
    """A cache for ``runner`` holding the longest kept prefix of ``tokens`` (empty when none is
    kept), and that prefix's length. Nothing is computed: the caller feeds the rest with its
    first forward (then ``Prefixes.store`` keeps the whole for later calls)."""
    cache, reused = prefixes.lookup(runner, tokens) if prefixes is not None else (None, 0)
    return (runner.new_cache() if cache is None else runner.adopt(cache)), reused


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
