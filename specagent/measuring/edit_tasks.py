"""The edits ``specagent bench --workload edits`` asks for: the text comes back whole with a few
changes, as agents that edit code and revise business documents ask for it.

Code is real source from the standard library, read at run time with ``inspect`` (so the tasks
hold on any Python version: a task whose text is missing from this version's source is left
out, never faked), in functions and whole files; business text (a contract clause, a letter, a
JSON and a YAML configuration) ships with the package (``data/edit_documents.json``). Each task
has the edit's kind, the instruction, the text, the expected text (the edit applied by string
operations) and checks that say whether an output applied the edit: what must appear, what must
not, and what must come before what.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

__all__ = ["SYSTEM", "EditTask", "edit_tasks", "extract_text", "rewrite_task"]

SYSTEM = (
    "You are an editing assistant. Apply exactly the change the user asks for and return the "
    "whole edited text in one fenced code block, every other line unchanged, with nothing "
    "before or after the block."
)


@dataclass(frozen=True)
class EditTask:
    id: str
    kind: str
    """``rename``, ``add_parameter``, ``change_literal``, ``fix_bug``, ``change_date``,
    ``add_sentence``, ``update_config`` or ``reorder``."""
    instruction: str
    text: str
    expected: str
    language: str
    """The code fence's language (``python``, ``text``, ``json``, ``yaml``)."""
    present: tuple[str, ...] = ()
    """Each must occur in an output that applied the edit."""
    absent: tuple[str, ...] = ()
    """None may occur (as whole words where they start and end with a word character)."""
    ordered: tuple[str, ...] = ()
    """These must occur in this order."""
    predicted: str | None = None
    """What a caller that knows the answer's likely text passes as the call's prediction (None:
    the text to edit, as an editor passes the file it asks to change)."""

    @property
    def prediction(self) -> str:
        return self.predicted if self.predicted is not None else self.text

    def messages(self) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"{self.instruction}\n\n```{self.language}\n{self.text}\n```",
            },
        ]

    def applied(self, output: str) -> bool:
        """Whether ``output`` (a model's whole reply) carries the edit."""
        text = extract_text(output)
        if any(p not in text for p in self.present):
            return False
        if any(_occurs(a, text) for a in self.absent):
            return False
        positions = [text.find(o) for o in self.ordered]
        return all(p >= 0 for p in positions) and positions == sorted(positions)

    def similarity(self, output: str) -> float:
        """How close the output's text is to the expected one (difflib's ratio over lines)."""
        mine = extract_text(output).splitlines()
        return difflib.SequenceMatcher(None, mine, self.expected.splitlines()).ratio()


def _occurs(needle: str, text: str) -> bool:
    if re.match(r"\w", needle) and re.search(r"\w$", needle):
        return re.search(rf"\b{re.escape(needle)}\b", text) is not None
    return needle in text


def extract_text(output: str) -> str:
    """The first fenced block's text (the whole output where there is none)."""
    found = re.search(r"```[^\n]*\n(.*?)(?:\n```|$)", output, re.S)
    return found.group(1) if found else output


def _source(target: str) -> str | None:
    """The source of ``module:qualname`` (``module`` alone: the whole file), or None where this
    Python has none."""
    module_name, _, qualname = target.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
        for part in qualname.split(".") if qualname else ():
            obj = getattr(obj, part)
        return inspect.getsource(obj).rstrip("\n")  # type: ignore[arg-type]
    except (ImportError, AttributeError, OSError, TypeError):
        return None


def _rename(text: str, old: str, new: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new, text)


def _code_tasks() -> list[EditTask]:
    """Edits of real standard-library code; each builder returns None where this Python's
    source lacks what the edit needs."""
    builders: list[Callable[[], EditTask | None]] = [
        _rename_dedent,
        _rename_nsmallest,
        _add_parameter,
        _change_literal,
        _fix_bug,
    ]
    return [task for task in (build() for build in builders) if task is not None]


def _rename_dedent() -> EditTask | None:
    text = _source("textwrap:dedent")
    if text is None or not re.search(r"\bmargin\b", text):
        return None
    return EditTask(
        "rename-dedent",
        "rename",
        "Rename the local variable `margin` to `common_indent` everywhere in this function.",
        text,
        _rename(text, "margin", "common_indent"),
        "python",
        present=("common_indent = None",),
        absent=("margin",),
    )


def _rename_nsmallest() -> EditTask | None:
    text = _source("heapq:nsmallest")
    if text is None or text.count("iterable") < 4:
        return None
    return EditTask(
        "rename-nsmallest",
        "rename",
        "Rename the parameter `iterable` to `items` everywhere in this function, docstring "
        "included.",
        text,
        _rename(text, "iterable", "items"),
        "python",
        present=("def nsmallest(n, items",),
        absent=("iterable",),
    )


def _add_parameter() -> EditTask | None:
    text = _source("difflib:get_close_matches")
    signature = "def get_close_matches(word, possibilities, n=3, cutoff=0.6):"
    if text is None or signature not in text:
        return None
    new = "def get_close_matches(word, possibilities, n=3, cutoff=0.6, *, strict=False):"
    return EditTask(
        "add-parameter-close-matches",
        "add_parameter",
        "Add a keyword-only parameter `strict=False` at the end of this function's signature; "
        "leave the body unchanged.",
        text,
        text.replace(signature, new),
        "python",
        present=("strict=False",),
    )


def _change_literal() -> EditTask | None:
    text = _source("base64:a85encode")
    if text is None or text.count("range(33, 118)") != 1:
        return None
    return EditTask(
        "change-literal-a85encode",
        "change_literal",
        "Change the character range `range(33, 118)` to `range(33, 117)`; nothing else.",
        text,
        text.replace("range(33, 118)", "range(33, 117)"),
        "python",
        present=("range(33, 117)",),
        absent=("range(33, 118)",),
    )


def _fix_bug() -> EditTask | None:
    """The whole ``bisect`` module with one comparison turned: the edit puts it back."""
    text = _source("bisect")
    right = "            if a[mid] < x:\n                lo = mid + 1"
    if text is None or text.count(right) < 1:
        return None
    broken = text.replace(right, right.replace("a[mid] < x", "a[mid] <= x"), 1)
    return EditTask(
        "fix-bug-bisect",
        "fix_bug",
        "This module has a bug: in `bisect_left`, the loop without a key compares "
        "`a[mid] <= x`, which makes it behave like `bisect_right`. Fix that comparison and "
        "return the whole file.",
        broken,
        text,
        "python",
        present=(right.strip().splitlines()[0],),
        absent=("if a[mid] <= x:",),
    )


def _document_tasks() -> list[EditTask]:
    """Business text edits (``data/edit_documents.json``: each document with its edits as
    literal replacements)."""
    path = resources.files("specagent") / "data" / "edit_documents.json"
    tasks = []
    for item in json.loads(path.read_text()):
        text = item["text"].rstrip("\n")
        expected = text
        for old, new in item["replace"]:
            if expected.count(old) != 1:
                raise ValueError(f"edit document {item['id']}: {old!r} must occur once")
            expected = expected.replace(old, new)
        tasks.append(
            EditTask(
                item["id"],
                item["kind"],
                item["instruction"],
                text,
                expected,
                item["language"],
                present=tuple(item.get("present", ())),
                absent=tuple(item.get("absent", ())),
                ordered=tuple(item.get("ordered", ())),
            )
        )
    return tasks


def edit_tasks(only: set[str] | None = None) -> list[EditTask]:
    """Every task (code first, then business text); ``only``: those ids."""
    tasks = _code_tasks() + _document_tasks()
    for task in tasks:
        if not task.applied(f"```\n{task.expected}\n```"):
            raise ValueError(f"edit task {task.id}: its expected text fails its own checks")
    if only is not None:
        unknown = only - {t.id for t in tasks}
        if unknown:
            raise ValueError(f"unknown edit tasks {sorted(unknown)}")
        tasks = [t for t in tasks if t.id in only]
    return tasks


def rewrite_task() -> EditTask:
    """The JSON configuration of ``data/edit_documents.json`` asked for as YAML: text the prompt
    does not hold, whose expected form a caller that keeps the YAML already would pass as the
    prediction."""
    path = resources.files("specagent") / "data" / "edit_documents.json"
    source = next(d for d in json.loads(path.read_text()) if d["language"] == "json")["text"]
    expected = "\n".join(_yaml_lines(json.loads(source), 0))
    return EditTask(
        "rewrite-json-as-yaml",
        "rewrite",
        "Convert this JSON configuration to YAML: block style, two-space indentation, keys in "
        "the same order, lists as `- item` lines, no quotes unless YAML needs them.",
        source,
        expected,
        "json",
        present=("timeout_seconds: 30", "statement_timeout_ms: 15000", "on_failure: true"),
        absent=("{",),
        predicted=expected,
    )


def _yaml_lines(value: object, depth: int) -> list[str]:
    """Block-style YAML of parsed JSON (objects, lists of scalars, scalars)."""
    pad = "  " * depth
    lines: list[str] = []
    for key, item in value.items():  # type: ignore[attr-defined]
        if isinstance(item, dict):
            lines += [f"{pad}{key}:", *_yaml_lines(item, depth + 1)]
        elif isinstance(item, list):
            lines += [f"{pad}{key}:", *(f"{pad}  - {_scalar(v)}" for v in item)]
        else:
            lines.append(f"{pad}{key}: {_scalar(item)}")
    return lines


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    return f'"{text}"' if any(c in text for c in ":*#") else text
