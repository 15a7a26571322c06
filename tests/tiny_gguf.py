"""A tiny Qwen2 model written as a GGUF file in the test (gguf-py), from the same seeded
transformers model and byte-level tokenizer the other tests use: llama.cpp runs the very
weights transformers runs, so the two engines' logits can be compared directly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


def make_qwen2(vocab_size: int, *, layers: int = 2, hidden: int = 64, seed: int = 0) -> Any:
    """A seeded tiny Qwen2 (q/k/v biases, NEOX rope: llama.cpp's layout, no permutation)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases are zero-initialised: make them matter
        gen = torch.Generator().manual_seed(seed + 100)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def write_gguf(
    model: Any,
    tokenizer: Any,
    path: Path,
    *,
    context: int = 1024,
    extra: tuple[str, ...] = (),
    merges: list[str] | None = None,
) -> Path:
    """``model`` (a Qwen2ForCausalLM) and ``tokenizer`` (byte-level BPE) as a float32 GGUF;
    ``extra``: control tokens after the tokenizer's (the model's vocabulary has room);
    ``merges``: the BPE merges to write (default: the tokenizer's own)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_context_length(context)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", 10000.0)))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tokenizer.get_vocab()
    size = int(model.get_output_embeddings().weight.shape[0])
    by_id = {i: t for t, i in vocab.items()}
    for offset, text in enumerate(extra):
        by_id[len(vocab) + offset] = text
    special = set(tokenizer.all_special_ids) | {
        i for i, t in by_id.items() if t.startswith("<") and t.endswith(">")
    }
    tokens, types = [], []
    for i in range(size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        if i not in by_id:
            types.append(gguf.TokenType.UNUSED)
        elif i in special:
            types.append(gguf.TokenType.CONTROL)
        else:
            types.append(gguf.TokenType.NORMAL)
    if merges is None:
        merges = [
            " ".join(m) if isinstance(m, tuple | list) else m
            for m in _merges(tokenizer.backend_tokenizer)
        ]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(int(tokenizer.bos_token_id))
    writer.add_eos_token_id(int(tokenizer.eos_token_id))
    writer.add_pad_token_id(int(tokenizer.pad_token_id))
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for layer in range(config.num_hidden_layers):
        for hf, ours in names.items():
            tensor = state[f"model.layers.{layer}.{hf}"]
            writer.add_tensor(f"blk.{layer}.{ours}", np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _merges(backend: Any) -> list[Any]:
    import json

    return list(json.loads(backend.to_str())["model"]["merges"])
