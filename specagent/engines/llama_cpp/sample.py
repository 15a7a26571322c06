"""A small GGUF written on the spot, for proving llama.cpp's native paths on a machine without
fetching a model (``specagent doctor``): a seeded random Qwen2 of two layers whose matrices are
quantized (Q8_0 or Q4_0) with shapes every CPU kernel takes, weight repacking included, and a
byte-level vocabulary of 257 tokens. Its outputs mean nothing; its forwards run the kernels a
real quantized model runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["QUANTS", "write_sample_gguf"]

QUANTS = ("Q8_0", "Q4_0")
"""The quantizations gguf-py writes that llama.cpp repacks for its CPU kernels."""

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (as its byte-level BPE writes them)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_sample_gguf(path: Path, quant: str = "Q8_0", seed: int = 0) -> Path:
    """Write the sample model to ``path`` with its matrices in ``quant`` (``QUANTS``)."""
    import gguf

    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    kind = getattr(gguf.GGMLQuantizationType, quant)
    rng = np.random.default_rng(seed)
    tokens = [*_byte_tokens(), "ab"]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(f"specagent-sample-{quant.lower()}")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(
        gguf.LlamaFileType.MOSTLY_Q8_0 if quant == "Q8_0" else gguf.LlamaFileType.MOSTLY_Q4_0
    )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_merges(["a b"])  # llama.cpp's BPE vocabulary needs at least one
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(False)

    def matrix(name: str, rows: int, cols: int) -> None:
        weights = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        packed = gguf.quants.quantize(weights, kind)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=kind)

    def vector(name: str, size: int, scale: float = 0.0, base: float = 0.0) -> None:
        values = base + rng.standard_normal(size) * scale
        writer.add_tensor(name, values.astype(np.float32))

    head_dim = HIDDEN // HEADS
    writer.add_tensor(
        "token_embd.weight", (rng.standard_normal((vocab, HIDDEN)) * 0.5).astype(np.float32)
    )
    vector("output_norm.weight", HIDDEN, base=1.0)
    matrix("output.weight", vocab, HIDDEN)
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        vector(f"{block}.attn_norm.weight", HIDDEN, base=1.0)
        vector(f"{block}.ffn_norm.weight", HIDDEN, base=1.0)
        matrix(f"{block}.attn_q.weight", HIDDEN, HIDDEN)
        matrix(f"{block}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"{block}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        vector(f"{block}.attn_q.bias", HIDDEN, scale=0.1)
        vector(f"{block}.attn_k.bias", KV_HEADS * head_dim, scale=0.1)
        vector(f"{block}.attn_v.bias", KV_HEADS * head_dim, scale=0.1)
        matrix(f"{block}.attn_output.weight", HIDDEN, HIDDEN)
        matrix(f"{block}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"{block}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"{block}.ffn_down.weight", HIDDEN, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
