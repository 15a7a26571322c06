"""Each token's own bytes (``specagent.token_bytes``): byte-level BPE and SentencePiece with
byte fallback spell a text back byte for byte, pieces of characters included; added and special
tokens, and tokenizers of other kinds, say nothing (their text stands for them)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specagent.token_bytes import byte_level_table, token_bytes_reader

TEXT = "héllo 日本 🙂"


def test_byte_level_pieces_spell_the_text(tokenizer) -> None:
    read = token_bytes_reader(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # pieces of characters
    assert b"".join(read(i) for i in ids) == TEXT.encode()
    assert len(byte_level_table()) == 256
    for special in tokenizer.all_special_ids:
        assert read(special) is None


def _byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (``▁`` for a space, unknown bytes as ``<0xNN>`` pieces)."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁", "h", "l", "o", "▁h", "ll", "llo"):
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("l", "l"), ("ll", "o")]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_byte_fallback_pieces_spell_the_text() -> None:
    tokenizer = _byte_fallback_tokenizer()
    read = token_bytes_reader(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert any(tokenizer.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    spelled = b"".join(read(i) for i in ids)
    assert spelled.removeprefix(b" ") == TEXT.encode()  # SentencePiece's leading space


def test_a_tokenizer_of_another_kind_says_nothing() -> None:
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    assert token_bytes_reader(tokenizer)(1) is None
    assert token_bytes_reader(None)(1) is None
