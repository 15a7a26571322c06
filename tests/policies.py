"""Test policies from the few fields a test cares about (``make_policy``): the drafter (a kind or
a block), the mode and whatever else it sets; every other field the schema's default."""

from __future__ import annotations

from typing import Any

from specagent.policy import Policy

__all__ = ["make_policy"]


def make_policy(
    name: str,
    drafter: str | dict[str, Any] = "none",
    *,
    mode: str = "lossless",
    description: str = "test",
    **fields: Any,
) -> Policy:
    """``Policy`` ``name`` drafting with ``drafter`` (``"none"``: plain decoding), validated
    as a YAML file's would be; ``fields``: ``sampling``, ``acceptance``, ``match``, ..."""
    block = {"kind": drafter} if isinstance(drafter, str) else drafter
    return Policy.model_validate(
        {"name": name, "description": description, "mode": mode, "drafter": block, **fields}
    )
