"""Prompt sets for ``specagent eval`` and ``tune``: JSONL, one prompt per line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ...errors import EvaluationError

__all__ = ["EvalPrompt", "default_prompt_set", "load_prompt_set"]

_PROMPT_KEYS = {"id", "messages", "prompt", "max_new_tokens"}


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    messages: list[dict[str, str]]
    max_new_tokens: int | None = None


def default_prompt_set() -> Path:
    """The small set of internal-use prompts (summaries, action items, triage, code review,
    status updates) that ships with the package."""
    return Path(str(resources.files("specagent") / "data" / "eval_prompts.jsonl"))


def load_prompt_set(path: str | Path | None = None) -> list[EvalPrompt]:
    """Read a JSONL prompt set: one object per line with ``messages`` (chat messages) or
    ``prompt`` (a user message), and optionally ``id`` and ``max_new_tokens``. Blank lines are
    skipped. Every problem names the file and the line."""
    file = Path(path) if path is not None else default_prompt_set()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise EvaluationError(f"prompt set {str(file)!r}: file not found") from None
    except OSError as exc:
        raise EvaluationError(f"prompt set {str(file)!r}: cannot read: {exc}") from exc
    prompts: list[EvalPrompt] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{file} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            msg = f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
            raise EvaluationError(msg) from None
        prompt = _parse_prompt(item, where, default_id=f"line-{number}")
        if prompt.id in seen:
            raise EvaluationError(f"{where}: duplicate id {prompt.id!r}")
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise EvaluationError(f"prompt set {str(file)!r} holds no prompts")
    return prompts


def _parse_prompt(item: Any, where: str, default_id: str) -> EvalPrompt:
    if not isinstance(item, dict):
        raise EvaluationError(f"{where}: expected a JSON object, got {type(item).__name__}")
    unknown = sorted(set(item) - _PROMPT_KEYS)
    if unknown:
        msg = f"{where}: unknown field(s) {', '.join(unknown)} (allowed: {sorted(_PROMPT_KEYS)})"
        raise EvaluationError(msg)
    if ("messages" in item) == ("prompt" in item):
        raise EvaluationError(f"{where}: give exactly one of 'messages' or 'prompt'")
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"].strip():
            raise EvaluationError(f"{where}: field 'prompt' must be a non-empty string")
        messages = [{"role": "user", "content": item["prompt"]}]
    else:
        messages = item["messages"]
        valid = (
            isinstance(messages, list)
            and bool(messages)
            and all(
                isinstance(m, dict)
                and set(m) == {"role", "content"}
                and isinstance(m["role"], str)
                and isinstance(m["content"], str)
                for m in messages
            )
        )
        if not valid:
            msg = f"{where}: field 'messages' must be a non-empty list of {{role, content}} strings"
            raise EvaluationError(msg)
    budget = item.get("max_new_tokens")
    valid_budget = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1
    if budget is not None and not valid_budget:
        raise EvaluationError(f"{where}: field 'max_new_tokens' must be a positive integer")
    prompt_id = item.get("id", default_id)
    if not isinstance(prompt_id, str) or not prompt_id:
        raise EvaluationError(f"{where}: field 'id' must be a non-empty string")
    return EvalPrompt(prompt_id, messages, budget)
