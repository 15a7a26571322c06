"""The registry of drafters and relaxed acceptance rules: a name in a policy maps to how it is
built. A new drafter is its own file (the drafter and a ``build`` function) plus one line in
``DRAFTERS``; a new relaxed rule is its rule class and config model plus one line in ``RULES``.
The policy schema, the runtime, the CLI and ``specagent tune`` read these tables and nothing
else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .acceptance import LenienceAcceptance, TopKAcceptance, TypicalAcceptance
from .draft_model import build_draft_model, build_early_exit, check_early_exit, early_exit_layers
from .drafters import Drafter, build_no_drafter, build_prompt_lookup
from .engine import Runner
from .parts import DrafterSettings, DraftingParts
from .schedule import Schedule
from .suffix import build_auto, build_suffix

__all__ = [
    "DRAFTERS",
    "RULES",
    "DrafterKind",
    "DrafterSettings",
    "DraftingParts",
    "RuleKind",
]


Build = Callable[[Any, DraftingParts], "tuple[Drafter | None, Schedule]"]


@dataclass(frozen=True)
class DrafterKind:
    """One drafter: how a call's drafter and schedule are built from the policy's settings."""

    build: Build
    cost_runner: Callable[[Any, DraftingParts], Runner | None] = lambda config, parts: None
    """The model whose forwards drafting costs (None: free; only verification is priced)."""
    needs_draft_model: bool = False
    check: Callable[[Any, int], str | None] = lambda config, num_layers: None
    """A problem with the settings on a target of that many layers (None: fits)."""


DRAFTERS: Mapping[str, DrafterKind] = {
    "draft_model": DrafterKind(
        build_draft_model, lambda config, parts: parts.draft, needs_draft_model=True
    ),
    "prompt_lookup": DrafterKind(build_prompt_lookup),
    "early_exit": DrafterKind(
        build_early_exit,
        lambda config, parts: parts.shallow(early_exit_layers(config, parts.num_layers)),
        check=check_early_exit,
    ),
    "suffix": DrafterKind(build_suffix),
    "auto": DrafterKind(build_auto, lambda config, parts: parts.draft),
    "none": DrafterKind(build_no_drafter),
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
