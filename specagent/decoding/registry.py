"""The registry of drafters and relaxed acceptance rules: a name in a policy maps to how it is
built. A new drafter is its own module in ``drafters/`` (the drafter, its ``build`` function and
its ``KIND``) plus one line in ``DRAFTERS``; a new relaxed rule is its rule class and config
model plus one line in ``RULES``. The policy schema, the runtime, the CLI and ``specagent tune``
read these tables and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .acceptance import LenienceAcceptance, TopKAcceptance, TypicalAcceptance
from .drafters import auto, draft_model, early_exit, none, prompt_lookup, suffix
from .drafters.base import DrafterKind
from .parts import DrafterSettings, DraftingParts

__all__ = [
    "DRAFTERS",
    "RULES",
    "DrafterKind",
    "DrafterSettings",
    "DraftingParts",
    "RuleKind",
]


DRAFTERS: Mapping[str, DrafterKind] = {
    "draft_model": draft_model.KIND,
    "prompt_lookup": prompt_lookup.KIND,
    "early_exit": early_exit.KIND,
    "suffix": suffix.KIND,
    "auto": auto.KIND,
    "none": none.KIND,
}


@dataclass(frozen=True)
class RuleKind:
    """One relaxed acceptance rule: its policy block (a pydantic model whose ``build`` makes the
    rule) and the grid ``specagent tune`` searches, loosest settings last."""

    config: type
    grid: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)


RULES: Mapping[str, RuleKind] = {
    "typical": RuleKind(
        TypicalAcceptance, {"epsilon": (0.05, 0.1, 0.2, 0.3, 0.5), "delta": (0.09, 0.3)}
    ),
    "top_k": RuleKind(TopKAcceptance, {"top_k": (2, 3, 5), "ratio": (0.8, 0.5, 0.3, 0.1)}),
    "lenience": RuleKind(LenienceAcceptance, {"lenience": (0.9, 0.8, 0.65, 0.5, 0.35, 0.2)}),
}
