"""Constrained output with llguidance: JSON schemas and objects, Lark grammars, regexes, tools.

A ``Constraint`` says what the output must match. The runtime compiles it for its tokenizer into
a ``GrammarState`` (an llguidance matcher), which the decoding loop asks for the mask of allowed
tokens at each position. The mask is applied to the draft's and the target's distributions alike,
and rejected draft tokens are rolled back out of the matcher, so a lossless policy stays exactly
lossless with respect to the *constrained* target.

llguidance is an optional dependency (``pip install "specagent[grammar]"``), imported lazily.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import InvalidRequestError

__all__ = ["Constraint", "GrammarState", "compile_constraint", "prepare"]


@dataclass(frozen=True)
class Constraint:
    """What a call's output must match. Build with the class methods."""

    kind: str
    spec: str
    compact: bool = True
    """JSON as ``json.dumps`` writes it (no line breaks): what tool calls look like, and the
    most tokens the grammar can force. False: the line breaks and indentation a model writes
    JSON answers with (bounded, so it cannot wander off into blanks)."""

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any], strict: bool = False, compact: bool = True
    ) -> Constraint:
        """Output is one JSON value valid for ``schema``. ``strict``: objects that do not say
        otherwise get ``additionalProperties: false`` (no invented keys), as in strict
        function calling."""
        spec = json.dumps(_strict(dict(schema)) if strict else dict(schema))
        return cls("json_schema", spec, compact)

    @classmethod
    def json_object(cls, compact: bool = True) -> Constraint:
        """Output is one JSON object (any keys)."""
        return cls("json_schema", json.dumps({"type": "object"}), compact)

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """Output matches a Lark grammar (llguidance's dialect, ``%json {...}`` included)."""
        return cls("lark", grammar)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def tool_call(cls, tools: Sequence[Mapping[str, Any]]) -> Constraint:
        """Output is one call of one of ``tools`` (OpenAI function format) as plain JSON:
        ``{"name": "<tool>", "arguments": {...valid for its parameters...}}``."""
        options = []
        for i, tool in enumerate(tools):
            function = tool.get("function", tool) if isinstance(tool, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise InvalidRequestError(f"tools[{i}]: a function with a name is required")
            parameters = function.get("parameters") or {"type": "object"}
            if not isinstance(parameters, Mapping):
                msg = f"tools[{i}].function.parameters must be a JSON schema object"
                raise InvalidRequestError(msg)
            parameters = _strict(dict(parameters))
            options.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        if not options:
            raise InvalidRequestError("a tool call constraint needs at least one tool")
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return cls("json_schema", json.dumps(schema))


def _strict(schema: Any) -> Any:
    """A copy of ``schema`` whose objects default to ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarState:
    """One call's matcher: allowed-token masks, consume, roll back."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """Boolean mask ``[V]`` of the tokens allowed next."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if mask.shape[0] < self.vocab_size:  # logits wider than the tokenizer: padding ids
            mask = np.concatenate([mask, np.zeros(self.vocab_size - mask.shape[0], dtype=bool)])
        return torch.from_numpy(mask)

    def consume(self, tokens: Sequence[int]) -> None:
        if tokens and not self._matcher.consume_tokens(list(tokens)):
            msg = f"the grammar rejected generated tokens: {self._matcher.get_error()}"
            raise RuntimeError(msg)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (the braces, keys and tool name of a tool call):
        llguidance's fast-forward tokens, in the tokenizer's canonical tokenization."""
        if self._matcher.is_stopped():
            return []
        return [int(t) for t in self._matcher.compute_ff_tokens()]

    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing more (the call should end)."""
        return bool(self._matcher.is_stopped())


# Tool calls: JSON as ``json.dumps`` writes it (and as chat templates show calls): no free
# whitespace, so the grammar forces every brace, key and separator.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Answers in a response format: models pretty-print JSON answers; held to one line, a small
# model keeps its first string open rather than write the ``",\n`` it wants (measured on
# Qwen2.5-Coder-0.5B). Up to 20 blanks or line breaks per gap: never endless blanks.
_JSON_ANSWER_STYLE = {"whitespace_pattern": r"[\n ]{0,20}"}

_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        msg = 'constrained output needs llguidance: pip install "specagent[grammar]"'
        raise InvalidRequestError(msg) from exc
    return llguidance


def _converted(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's view of ``tokenizer``, converted once per tokenizer, vocabulary size and
    end tokens (the conversion takes about a second and holds the GIL for most of it)."""
    llg = _llguidance()
    if tokenizer is None:
        raise InvalidRequestError("constrained output needs the runtime's tokenizer")
    key = (vocab_size, tuple(eos_token_ids))
    with _LOCK:
        converted = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in converted:
            try:
                converted[key] = llg.hf.from_tokenizer(
                    tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
                )
            except ValueError as exc:
                msg = f"llguidance cannot use this tokenizer: {exc}"
                raise InvalidRequestError(msg) from exc
        return converted[key]


def prepare(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> bool:
    """Convert ``tokenizer`` for constrained output now (a runtime does it at start, with its
    cost measurement), so that the first constrained call does not hold the GIL for a second
    while other calls stream. False when there is nothing to do it with (no llguidance, no
    tokenizer, or one llguidance cannot use)."""
    try:
        _converted(tokenizer, vocab_size, eos_token_ids)
    except Exception:  # an optimisation only: the first constrained call reports the error
        return False
    return True


def compile_constraint(
    constraint: Constraint, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]
) -> GrammarState:
    """A fresh matcher for ``constraint`` (the tokenizer's conversion is kept: see ``prepare``)."""
    llg = _llguidance()
    lltok = _converted(tokenizer, vocab_size, eos_token_ids)
    try:
        if constraint.kind == "json_schema":
            style = _JSON_STYLE if constraint.compact else _JSON_ANSWER_STYLE
            grammar = llg.LLMatcher.grammar_from_json_schema(constraint.spec, defaults=style)
        elif constraint.kind == "lark":
            grammar = llg.LLMatcher.grammar_from_lark(constraint.spec)
        elif constraint.kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(constraint.spec)
        else:
            raise InvalidRequestError(f"unknown constraint kind {constraint.kind!r}")
    except ValueError as exc:
        raise InvalidRequestError(f"invalid {constraint.kind} constraint: {exc}") from exc
    matcher = llg.LLMatcher(lltok, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(f"invalid {constraint.kind} constraint: {matcher.get_error()}")
    return GrammarState(matcher, vocab_size)
