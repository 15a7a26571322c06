"""The registry of drafters and relaxed acceptance rules: a name in a policy maps to how it is
built. A new drafter is its own module in ``drafters/`` (its settings block, the drafter, its
``build`` function and its ``KIND``) plus one line in ``DRAFTERS``; a new relaxed rule is its
rule class and config model plus one line in ``RULES``. The policy schema, the runtime, the CLI
and ``specagent tune`` read these tables and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BeforeValidator, SerializeAsAny, ValidationInfo

from .acceptance import LenienceAcceptance, TopKAcceptance, TypicalAcceptance
from .drafters import auto, draft_model, early_exit, none, prompt_lookup, suffix
from .drafters.base import DrafterBlock, DrafterKind
from .parts import DraftingParts

__all__ = [
    "DEFAULT_DRAFTER",
    "DRAFTERS",
    "RULES",
    "DrafterConfig",
    "DrafterKind",
    "DraftingParts",
    "RuleKind",
    "drafter_block",
]


DRAFTERS: Mapping[str, DrafterKind] = {
    "draft_model": draft_model.KIND,
    "prompt_lookup": prompt_lookup.KIND,
    "early_exit": early_exit.KIND,
    "suffix": suffix.KIND,
    "auto": auto.KIND,
    "none": none.KIND,
}

DEFAULT_DRAFTER = "draft_model"
"""The kind of a ``drafter`` block that names none."""


def drafter_block(data: Any, *, fallback: bool = False) -> Any:
    """A policy's ``drafter`` block as its kind's settings (``DRAFTERS[kind].config``), looked
    up when it is validated, so that a kind registered later validates too. ``fallback``: the
    block runs on a runtime without a draft model, so only kinds that need none are known."""
    kind = data.kind if isinstance(data, DrafterBlock) else None
    if isinstance(data, Mapping):
        data = {"kind": DEFAULT_DRAFTER, **data}
        kind = data["kind"]
    if kind is None:
        return data  # neither a block nor a mapping: pydantic says what it expected
    known = [name for name, spec in DRAFTERS.items() if not (fallback and spec.needs_draft_model)]
    if kind not in known:
        where = " for a fallback (it runs without a draft model)" if fallback else ""
        raise ValueError(f"unknown drafter {kind!r}{where}; expected one of {known}")
    if isinstance(data, DrafterBlock):
        return data
    return DRAFTERS[kind].config.model_validate(data)


def _fallback_block(data: Any, info: ValidationInfo) -> Any:
    """A fallback given as a mapping (a name alone is one: ``DraftModelConfig._flat_fallback``)
    takes the fields it does not set from the block it falls back from, where it has them too
    (``info.data``: that block's fields)."""
    if isinstance(data, Mapping) and data.get("kind") in DRAFTERS:
        fields = DRAFTERS[data["kind"]].config.model_fields
        shared = {k: v for k, v in info.data.items() if k in fields and k != "kind"}
        data = {**shared, **data}
    return drafter_block(data, fallback=True)


if TYPE_CHECKING:
    DrafterConfig = DrafterBlock
else:
    DrafterConfig = Annotated[SerializeAsAny[DrafterBlock], BeforeValidator(drafter_block)]
"""A ``drafter`` block of any registered kind (as a pydantic field's type)."""

for _kind in DRAFTERS.values():
    # A kind that needs a draft model names its fallback as ``FallbackConfig``: any kind that
    # runs without one, validated by that kind's block.
    _kind.config.model_rebuild(
        _types_namespace={
            "FallbackConfig": Annotated[
                SerializeAsAny[DrafterBlock], BeforeValidator(_fallback_block)
            ]
        }
    )


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
