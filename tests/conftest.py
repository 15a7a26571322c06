"""Tiny seeded models and a character tokenizer, built in the test: no hub, no download."""

from __future__ import annotations

import copy

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (printable ASCII and newline) plus specials."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(
    vocab_size: int,
    *,
    layers: int = 2,
    seed: int = 0,
    hidden: int = 64,
    init: float = 0.02,
    max_positions: int = 512,
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=init,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def perturbed_copy(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A draft that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(
                torch.randn(param.shape, generator=gen) * scale * param.std().clamp_min(1e-3)
            )
    return draft.eval()


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="session")
def target(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    return make_model(len(tokenizer), layers=4, seed=0, init=0.1)


@pytest.fixture(scope="session")
def draft(target: LlamaForCausalLM) -> LlamaForCausalLM:
    return perturbed_copy(target, scale=0.05, seed=1)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
