"""A draft's vocabulary projection over the ids a call is likely to need, not all of them.

A small draft model's LM head is a large share of its single-token forward: the Qwen2.5 0.5B
draft's 152k x 896 head is 27% of its int8 weights, read in full for every drafted token. The
ids of a byte-level BPE vocabulary are its merge ranks, so the frequent tokens come first: on
the recorded agent episodes, ids below 32768 plus the call's own tokens (its prompt and what it
wrote so far) covered 97.5% of the tokens the target emitted. A draft runner with ``head_rows``
projects onto those rows only (``ModelRunner``'s ``head_rows``); every other id gets -inf.

Losslessness does not depend on it: the draft's distribution is what the acceptance rule
compares against (any draft distribution gives the target's), and a token the draft cannot
propose is one it does not draft, which the target's verification supplies. Each call's own
ids are masked per row, so in a batched forward one call's text never becomes a draft token
for another's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...decoding.engine import to_device
from .quantized import Int8Linear
from .views import ModelView

__all__ = [
    "HEAD_ROWS",
    "MIN_COVERAGE",
    "Head",
    "head_rows_for",
    "project_rows",
    "restricted_logits",
]

HEAD_ROWS = 32768
"""Rows of a draft's head kept by default (``head_rows_for``): a fifth of Qwen2.5's vocabulary,
holding 96% of the shipped evaluation prompts' tokens (English prose and code)."""

MIN_COVERAGE = 0.8
"""Share of a sample text's tokens that must fall below ``HEAD_ROWS`` for the rows to be kept:
a vocabulary that is not ordered by frequency puts about rows / size of them there (22% for
Qwen2.5's), a rank-ordered one over 90%."""


def head_rows_for(tokenizer: Any | None, vocab_size: int, rows: int = HEAD_ROWS) -> int | None:
    """How many leading rows of a draft's head to project onto (None: all of them): ``rows``
    where the vocabulary is at least twice that and ``tokenizer`` puts at least
    ``MIN_COVERAGE`` of the shipped evaluation prompts' tokens below it (its ids are ordered
    by frequency), else None."""
    if tokenizer is None or vocab_size < 2 * rows:
        return None
    text = "\n".join(
        message["content"]
        for line in resources.files("specagent.data")
        .joinpath("eval_prompts.jsonl")
        .read_text(encoding="utf-8")
        .splitlines()
        if line.strip()
        for message in json.loads(line)["messages"]
    )
    try:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    except Exception:  # a tokenizer that cannot encode plain text: keep the whole head
        return None
    if not ids:
        return None
    covered = sum(1 for i in ids if i < rows) / len(ids)
    return rows if covered >= MIN_COVERAGE else None


def project_rows(head: nn.Module, hidden: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """``head(hidden)`` restricted to the head's ``rows`` (a slice of leading rows, a view, or
    an index tensor). ``head`` is an ``nn.Linear`` or an ``Int8Linear``."""
    if isinstance(head, Int8Linear):
        weight, scales = head.weight[rows], head.scales[rows]
        flat = hidden.reshape(-1, head.in_features).to(scales.dtype).contiguous()
        out = torch._weight_int8pack_mm(flat, weight.contiguous(), scales.contiguous())
        if head.bias is not None:
            out = out + head.bias[rows]
        return out
    if isinstance(head, nn.Linear):
        bias = head.bias[rows] if head.bias is not None else None
        return F.linear(hidden, head.weight[rows], bias)
    kind = type(head).__name__
    raise TypeError(f"a restricted head needs an nn.Linear or Int8Linear, not {kind}")


def restricted_logits(
    head: nn.Module,
    hidden: torch.Tensor,
    rows: int,
    always: torch.Tensor,
    pieces: Sequence[tuple[int, torch.Tensor | None]],
) -> torch.Tensor:
    """Logits ``[n, V]`` of ``hidden`` ``[n, H]`` over the head's first ``rows`` rows, the
    ``always`` ids and, for each consecutive block of ``count`` rows in ``pieces``, its own
    ids (a call's ``CallVocabulary.ids``); -inf elsewhere. One product covers the leading
    rows, one more the union of the other ids; each block then takes only its own."""
    weight: torch.Tensor = head.weight  # type: ignore[assignment]
    vocab = int(weight.shape[0])
    out = hidden.new_full((hidden.shape[0], vocab), float("-inf"))
    out[:, :rows] = project_rows(head, hidden, slice(0, rows))
    own = [ids for _, ids in pieces if ids is not None and ids.numel()]
    union = torch.unique(torch.cat([always, *own])) if own or always.numel() else always
    if not union.numel():
        return out
    union = to_device(union, hidden.device)
    extra = project_rows(head, hidden, union)
    if always.numel():
        always = to_device(always, hidden.device)
        out[:, always] = extra[:, torch.searchsorted(union, always)]
    start = 0
    for count, ids in pieces:
        if ids is not None and ids.numel():
            ids = to_device(ids, hidden.device)
            out[start : start + count, ids] = extra[start : start + count][
                :, torch.searchsorted(union, ids)
            ]
        start += count
    return out


class Head:
    """What a runner's logits cover: the whole vocabulary (``rows`` None), or a draft's head's
    first ``rows`` rows, the ``always`` ids (end of sequence) and each request's own ids,
    projected onto those alone, -inf elsewhere. Fixed when the runner is made."""

    def __init__(self, rows: int | None = None, always: torch.Tensor | None = None) -> None:
        self.rows = rows
        self.always = always if always is not None else torch.tensor([], dtype=torch.long)

    @classmethod
    def checked(cls, view: ModelView, rows: int | None, always: Sequence[int] = ()) -> Head:
        """``rows`` kept only for a head that is a plain ``nn.Linear`` or ``Int8Linear`` over
        the decoder body's last hidden state (checked on a short forward against the model's
        own logits) and has more rows than that; elsewhere the whole head. Only for a draft: a
        target's logits define the output."""
        model, body = view.model, view.body
        head = model.get_output_embeddings()
        if rows is None or body is None or not isinstance(head, nn.Linear | Int8Linear):
            return cls()
        vocab = int(head.weight.shape[0])
        if not 0 < rows < vocab:
            return cls()
        ids = torch.arange(1, 9, device=view.device)[None] % vocab
        with torch.inference_mode():
            full = model(input_ids=ids, use_cache=False).logits[0].float()
            hidden = body(input_ids=ids, use_cache=False).last_hidden_state[0]
            projected = head(hidden).float()
        if not torch.allclose(projected, full, atol=1e-3, rtol=1e-3):
            return cls()
        kept = sorted({int(i) for i in always if rows <= int(i) < vocab})
        return cls(rows, torch.tensor(kept, dtype=torch.long))

    def restricted(
        self,
        head: nn.Module,
        hidden: torch.Tensor,
        pieces: list[tuple[int, torch.Tensor | None]],
    ) -> torch.Tensor:
        """``restricted_logits`` over this head's rows (``rows`` set only)."""
        assert self.rows is not None
        return restricted_logits(head, hidden, self.rows, self.always, pieces)

    def masked(self, logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """Full logits cut to what ``restricted`` would cover (paths that run the whole head:
        a compiled step, a model whose gathered projection differs); as they are without
        ``rows``."""
        if self.rows is None:
            return logits
        kept = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        kept[: self.rows] = True
        kept[to_device(self.always, logits.device)] = True
        if vocab is not None:
            kept[to_device(vocab, logits.device)] = True
        return logits.masked_fill(~kept, float("-inf"))
