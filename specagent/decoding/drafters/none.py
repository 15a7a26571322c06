"""``none``: plain decoding, one token per target forward (the baseline every drafter is
measured against, and what a policy that must not draft uses)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from ..schedule import FixedSchedule, Schedule
from .base import Drafter, DrafterBlock, DrafterKind

if TYPE_CHECKING:
    from ..parts import DraftingParts

__all__ = ["KIND", "NoDrafterConfig"]


class NoDrafterConfig(DrafterBlock):
    """``drafter: {kind: none}``."""

    kind: Literal["none"] = "none"


def build_no_drafter(
    config: NoDrafterConfig, parts: DraftingParts
) -> tuple[Drafter | None, Schedule]:
    """Plain decoding: no drafter, k = 0 at every step."""
    return None, FixedSchedule(0)


KIND = DrafterKind(NoDrafterConfig, build_no_drafter, drafts=False)
