"""A small target/draft pair on every engine present, for the decoding tests that must hold on
each: transformers (seeded tiny Llama models), llama.cpp (seeded tiny Qwen2 models written as
float32 GGUF files, where llama-cpp-python is installed) and the fake engine of the tests (no
transformers anywhere). The vocabulary is small enough to enumerate every continuation
(``distributions``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_engine import FakeModel

SMALL_VOCAB = 12
"""A vocabulary small enough to enumerate every continuation (the distribution tests)."""
BYTE_TOKENS = ["<pad>", "<s>", "</s>", "a", "b", "c", "d", "e", "f", "g", "h", "Ċ"]


def _llama_cpp_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


ENGINES = [
    pytest.param("transformers"),
    pytest.param(
        "llama.cpp",
        marks=pytest.mark.skipif(not _llama_cpp_installed(), reason="llama-cpp-python absent"),
    ),
    pytest.param("fake"),
]
"""Every engine a decoding test runs on (``@pytest.fixture(params=ENGINES)``)."""


@dataclass
class Pair:
    engine: str
    target: Any
    """The target's runner (``decoding.engine.Runner``)."""
    draft: Any
    """The draft's runner, over the target's vocabulary."""


class _ByteTokenizer:
    """Twelve byte-level tokens, as much of a tokenizer as a GGUF file needs."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0
    chat_template = None
    all_special_ids = (0, 1, 2)

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(BYTE_TOKENS)}

    def __len__(self) -> int:
        return len(BYTE_TOKENS)


def small_pair(engine: str, folder: Path) -> Pair:
    """The pair on ``engine`` (its distributions sharp enough that drafts are often accepted,
    never so sharp that sampling is deterministic)."""
    if engine == "transformers":
        from conftest import make_model

        from specagent.engines.transformers import ModelRunner

        target = make_model(SMALL_VOCAB, layers=2, seed=11, hidden=32, init=0.4)
        draft = make_model(SMALL_VOCAB, layers=1, seed=12, hidden=32, init=0.4)
        return Pair(engine, ModelRunner(target), ModelRunner(draft))
    if engine == "llama.cpp":
        from tiny_gguf import make_qwen2, write_gguf

        from specagent.engines.llama_cpp import LlamaCppModel

        models = [
            make_qwen2(SMALL_VOCAB, layers=2, hidden=32, seed=21),
            make_qwen2(SMALL_VOCAB, layers=1, hidden=32, seed=22),
        ]
        with torch.no_grad():  # sharper distributions than the default init gives
            for model in models:
                model.lm_head.weight.mul_(4.0)
        paths = [
            write_gguf(model, _ByteTokenizer(), folder / f"{name}.gguf", merges=["a b"])
            for model, name in zip(models, ("target", "draft"), strict=True)
        ]
        target, draft = (
            LlamaCppModel(path, context_tokens=2048, max_sequences=8, threads=1) for path in paths
        )
        return Pair(engine, target.runner(), draft.runner())
    if engine == "fake":
        return Pair(engine, FakeModel(seed=1000).runner(), FakeModel(seed=2000).runner())
    raise ValueError(f"no engine {engine!r}")
