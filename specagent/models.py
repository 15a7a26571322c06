"""What every engine's models share: where they run (``resolve_device``), the tokenizer
(``load_tokenizer``, from a local path or a hub id; nothing here downloads on its own, and
``trust_remote_code`` is False unless the caller passes True), and whether a draft can work with
the target (``check_draft_compatible``). Loading a transformers model is that engine's
(``engines.transformers.checkpoint``)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoTokenizer

from .errors import IncompatibleDraftError, ModelLoadError

__all__ = ["check_draft_compatible", "load_tokenizer", "resolve_device"]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"`` (or None) picks CUDA, then Apple MPS, then the CPU."""
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(device)


def load_tokenizer(source: str, *, trust_remote_code: bool = False) -> Any:
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        msg = f"cannot load tokenizer {source!r}: {exc}"
        raise ModelLoadError(msg) from exc


def check_draft_compatible(
    target_vocab: int,
    draft_vocab: int,
    tokenizer: Any | None,
    draft_tokenizer: Any | None = None,
) -> None:
    """Raise ``IncompatibleDraftError`` unless the draft's token ids mean what the target's do.

    With both tokenizers: every token of the target's vocabulary must have the same id in the
    draft's. Always: the draft's logits must cover every id the tokenizer can produce (models
    often pad the embedding beyond the tokenizer; those padding ids are never drafted).
    ``target_vocab`` and ``draft_vocab`` are the columns of each model's logits.
    """
    if draft_tokenizer is not None and tokenizer is not None:
        t_vocab, d_vocab = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        differing = [tok for tok, idx in t_vocab.items() if d_vocab.get(tok) != idx]
        if differing:
            sample = ", ".join(repr(t) for t in differing[:5])
            msg = (
                f"the draft tokenizer differs from the target's on {len(differing)} of "
                f"{len(t_vocab)} tokens (e.g. {sample}); speculative decoding needs one vocabulary"
            )
            raise IncompatibleDraftError(msg)
    used = len(tokenizer) if tokenizer is not None else min(target_vocab, draft_vocab)
    if draft_vocab < used or target_vocab < used:
        msg = (
            f"vocabulary sizes do not fit: tokenizer has {used} tokens, target logits "
            f"{target_vocab}, draft logits {draft_vocab}; the draft must cover every token"
        )
        raise IncompatibleDraftError(msg)
    if tokenizer is None and target_vocab != draft_vocab:
        msg = (
            f"target ({target_vocab}) and draft ({draft_vocab}) vocabularies differ and no "
            "tokenizer was given to tell which ids are real"
        )
        raise IncompatibleDraftError(msg)
