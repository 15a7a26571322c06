"""What a runtime keeps between calls, and the locks, budgets and tenants that govern it: the
prefix cache (``prefixes``), the drafting history (``history``) and the step-cost book
(``costs``). The decoding core reaches each through a protocol or a plain value
(``decoding.parts.Prefixes``, ``SuffixIndex``, ``CostModel``) and holds none of them."""

from .costs import COSTS_VERSION, CostBook, CurveStore
from .history import HistoryStore
from .prefixes import PrefixCache, PrefixScope, Scoped

__all__ = [
    "COSTS_VERSION",
    "CostBook",
    "CurveStore",
    "HistoryStore",
    "PrefixCache",
    "PrefixScope",
    "Scoped",
]
