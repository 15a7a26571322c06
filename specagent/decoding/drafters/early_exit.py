"""``early_exit``: self-speculation with the target's own first N layers, its final norm and
head (no second model in memory; it pays only on checkpoints trained for early exit, such as
LayerSkip). It drafts as a draft model does (``model_drafts.DraftModelDrafter``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from ..schedule import Schedule
from .base import Drafter, DrafterKind
from .draft_model import ModelDraftFields, model_drafter
from .model_drafts import DraftModelDrafter

if TYPE_CHECKING:
    from ..parts import DraftingParts

__all__ = ["KIND", "EarlyExitConfig", "EarlyExitDrafter", "early_exit_layers"]


class EarlyExitConfig(ModelDraftFields):
    """``drafter: {kind: early_exit, ...}``."""

    kind: Literal["early_exit"] = "early_exit"
    early_exit_layers: int | None = Field(default=None, ge=1)
    """Decoder layers the drafter runs (default: three quarters of them)."""


class EarlyExitDrafter(DraftModelDrafter):
    """Self-speculation through a shallow view of the target (see ``cache.early_exit_view``)."""

    name = "early_exit"


def build_early_exit(
    config: EarlyExitConfig, parts: DraftingParts
) -> tuple[Drafter | None, Schedule]:
    """The registry's builder for ``early_exit``: a shallow view of the target."""
    runner = parts.shallow(early_exit_layers(config, parts.num_layers))
    return model_drafter(EarlyExitDrafter, runner, config, parts)


def early_exit_layers(config: EarlyExitConfig, num_layers: int) -> int:
    """Layers an early-exit drafter runs: the policy's, else three quarters of the target's."""
    return config.early_exit_layers or max(1, (3 * num_layers) // 4)


def check_early_exit(config: EarlyExitConfig, num_layers: int) -> str | None:
    layers = early_exit_layers(config, num_layers)
    if 1 <= layers < num_layers:
        return None
    return (
        f"field 'drafter.early_exit_layers': expected 1..{num_layers - 1} for this "
        f"{num_layers}-layer target, got {layers}"
    )


KIND = DrafterKind(
    EarlyExitConfig,
    build_early_exit,
    lambda config, parts: parts.shallow(early_exit_layers(config, parts.num_layers)),
    check=check_early_exit,
    cuts_layers=True,
)
