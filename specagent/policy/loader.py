"""Reading policy YAML files into ``Policy`` objects, with errors a person can act on.

Files are parsed with ``yaml.safe_load`` only: a policy is data, never code.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..decoding.registry import RULES
from ..errors import PolicyError
from .routing import PolicySet
from .schema import Policy

__all__ = [
    "SHIPPED_POLICIES",
    "load_policies",
    "load_policy",
    "parse_policy",
    "shipped_policies",
]


def _shipped_directory() -> Path:
    """Where the shipped policies are: inside an installed wheel, the package
    ``specagent._shipped_policies``; in a source checkout (an editable install), the
    repository's own ``policies/``, from which the wheel takes them."""
    installed = Path(__file__).resolve().parents[1] / "_shipped_policies"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "policies"


SHIPPED_POLICIES = _shipped_directory()
"""The directory of the policies that ship with the package (``customer-reply``,
``legal-drafting``, ...): found from any working directory, installed or editable."""


def shipped_policies() -> PolicySet:
    """The policies that ship with specagent, one per use case, as a ``PolicySet``."""
    return load_policies(SHIPPED_POLICIES)


def load_policies(directory: str | Path, extends: Iterable[Policy] | None = None) -> PolicySet:
    """Load every ``*.yaml`` / ``*.yml`` file in ``directory`` into a ``PolicySet``.

    With ``extends`` (for example ``shipped_policies()``), the directory adds to those policies
    and replaces any of the same name, so a team overrides one shipped policy with one file.
    """
    path = Path(directory)
    if not path.is_dir():
        msg = f"policy directory {str(path)!r} does not exist or is not a directory"
        raise PolicyError(msg)
    files = sorted([*path.glob("*.yaml"), *path.glob("*.yml")])
    if not files:
        msg = f"policy directory {str(path)!r} holds no *.yaml files"
        raise PolicyError(msg)
    loaded = [load_policy(file) for file in files]
    names = {policy.name for policy in loaded}
    base = extends.defined() if isinstance(extends, PolicySet) else list(extends or ())
    return PolicySet([*(p for p in base if p.name not in names), *loaded])


def load_policy(file: str | Path) -> Policy:
    """Load one policy file; its name must equal the file's stem."""
    path = Path(file)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        msg = f"{path}: cannot read policy file: {exc.strerror or exc}"
        raise PolicyError(msg) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        msg = f"{path}:{where} invalid YAML: {problem}"
        raise PolicyError(msg) from exc
    policy = parse_policy(data, source=str(path))
    if policy.name != path.stem:
        msg = f"{path}: field 'name': expected the file name {path.stem!r}, got {policy.name!r}"
        raise PolicyError(msg)
    return policy


def parse_policy(data: Any, source: str = "<policy>") -> Policy:
    """Validate a mapping (as read from YAML) into a ``Policy``."""
    if not isinstance(data, dict):
        msg = f"{source}: expected a mapping of policy fields, got {type(data).__name__}"
        raise PolicyError(msg)
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(f"{source}: {format_validation_error(exc)}") from exc


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``field 'a.b': what was wrong (got: value)``."""
    lines = []
    for error in exc.errors():
        loc = _location(error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field (not part of the policy schema)"
        got = error.get("input")
        detail = (
            f" (got: {_short(got)})"
            if error["type"] != "extra_forbidden" and not isinstance(got, dict)
            else ""
        )
        lines.append(f"field '{loc or '<root>'}': {message}{detail}")
    return "; ".join(lines)


def _location(parts: tuple[int | str, ...]) -> str:
    """``acceptance.typical.epsilon`` -> ``acceptance.epsilon``: pydantic puts the chosen union
    member after the field of a tagged union, which means nothing to a policy author."""
    kept: list[str] = []
    for i, part in enumerate(parts):
        if i > 0 and parts[i - 1] == "acceptance" and part in RULES:
            continue
        if isinstance(part, str) and "[" in part:  # function-after[...] wrappers
            continue
        kept.append(str(part))
    return ".".join(kept)


def _short(value: object, limit: int = 80) -> str:
    """A value's repr, cut so that an error never echoes a huge input back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
