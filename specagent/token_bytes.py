"""Each token's own bytes, as OpenAI's log-probabilities report them (``bytes``): a token that is
part of a multi-byte character decodes alone to U+FFFD, but its bytes joined with its
neighbours' spell the character. Read from the tokenizer's declared decoder: byte-level BPE
(GPT-2, Llama 3, Qwen: each character of a piece stands for one byte) and SentencePiece with
byte fallback (Llama 2, Mistral: ``<0xE2>`` pieces, ``▁`` for a space)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["byte_level_table", "token_bytes_reader"]


def byte_level_table() -> dict[str, int]:
    """Byte-level BPE's alphabet: the printable character each byte is written as, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The kinds of the decoders a fast tokenizer declares (nested sequences flattened)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    try:  # the decoder's own JSON (the whole tokenizer's would take half a second to write)
        declared = json.loads(decoder.__getstate__())
    except (ValueError, TypeError, AttributeError):
        return set()
    kinds: set[str] = set()
    pending = [declared]
    while pending:
        each = pending.pop()
        if isinstance(each, dict):
            kinds.add(str(each.get("type")))
            pending.extend(each.get("decoders") or ())
    return kinds


def token_bytes_reader(tokenizer: Any) -> Callable[[int], bytes | None]:
    """A function from a token id to its bytes (None where the tokenizer's pieces do not say:
    an added or special token, or a tokenizer of another kind; the token's text then stands
    for them)."""
    kinds = _decoder_kinds(tokenizer)
    if not kinds or tokenizer is None:
        return lambda token: None
    skipped = set(getattr(tokenizer, "all_special_ids", ()) or ())
    skipped |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    pieces: Callable[[int], Any] = tokenizer.convert_ids_to_tokens

    def piece_of(token: int) -> str | None:
        """The token's piece as the tokenizer writes it; None for an added or special one."""
        piece = None if token in skipped else pieces(token)
        return piece if isinstance(piece, str) else None

    if "ByteLevel" in kinds:
        table = byte_level_table()

        def byte_level(token: int) -> bytes | None:
            piece = piece_of(token)
            if piece is None or any(c not in table for c in piece):
                return None
            return bytes(table[c] for c in piece)

        return byte_level
    if "ByteFallback" in kinds:

        def byte_fallback(token: int) -> bytes | None:
            piece = piece_of(token)
            if piece is None:
                return None
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    return None
            return piece.replace("\u2581", " ").encode()

        return byte_fallback
    return lambda token: None
