"""An engine written in the tests: no transformers model or cache anywhere. Its "KV" is the
list of tokens fed, its logits a fixed function of the last two tokens (a seeded table), so
everything the decoding core does through the seam can be checked against a model whose
distribution is known exactly. It offers what ``docs/architecture.md`` says a new engine
offers, and nothing more."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specagent.decoding.costs import SettlesNothing
from specagent.decoding.engine import CopiedSequences, ForwardInputs, cropped_length
from specagent.engines import EngineModel, RunnerNeeds

VOCAB = 12
EOS = 2


class TokenSequence:
    """A call's 'KV': the tokens fed so far."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def get_seq_length(self) -> int:
        return len(self.tokens)

    def crop(self, max_length: int) -> None:
        keep = cropped_length(len(self.tokens), max_length)
        if keep is not None:
            del self.tokens[keep:]


def table_logits(context: Sequence[int], seed: int = 1000) -> torch.Tensor:
    """The fake model: logits from the last two tokens, fixed by a seeded table."""
    a = context[-2] if len(context) > 1 else 0
    b = context[-1] if context else 0
    gen = torch.Generator().manual_seed(seed + 31 * a + b)
    logits = torch.randn(VOCAB, generator=gen) * 2.0
    logits[EOS] = -30.0  # calls end by length: every sample is as long as asked
    return logits


class FakeRunner(SettlesNothing, CopiedSequences):
    inputs = ForwardInputs()

    def __init__(self, model: FakeModel, vocab_size: int | None = None) -> None:
        self.model = model
        self.vocab_size = vocab_size or VOCAB
        self.device = torch.device("cpu")

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    def speed_key(self, *parts: object) -> str:
        return f"fake-{self.model.seed}-{parts}"

    def new_cache(self) -> TokenSequence:
        return TokenSequence()

    def reproducible(self, tokens: int) -> FakeRunner:
        return self  # its logits depend on the tokens alone

    def adopt(self, cache: TokenSequence) -> TokenSequence:
        return cache

    def forward(self, input_ids, cache, keep=None, tree=None, vocab=None) -> torch.Tensor:
        return self.forward_batch([(input_ids, cache)], [keep])[0]

    def forward_batch(self, requests, keep=None, vocabs=None) -> list[torch.Tensor]:
        self.model.batches.append(len(requests))
        out = []
        for (tokens, cache), k in zip(requests, keep or [None] * len(requests), strict=True):
            rows = []
            for token in tokens:
                cache.tokens.append(int(token))
                rows.append(table_logits(cache.tokens, self.model.seed))
            logits = torch.stack(rows)
            out.append(logits if k is None else logits[len(tokens) - k :])
        return out


class FakeModel(EngineModel):
    engine = "fake"
    vocab_size = VOCAB
    context_window = 512
    num_layers = 2
    weight_bytes = 1000
    name = "fake"

    device = torch.device("cpu")

    def __init__(self, seed: int = 1000) -> None:
        self.seed = seed
        self.batches: list[int] = []

    @property
    def model(self) -> FakeModel:
        return self

    def build_runner(self, needs: RunnerNeeds) -> tuple[FakeRunner, None]:
        return self.runner(needs.vocab_size), None

    def runner(self, vocab_size: int | None = None) -> FakeRunner:
        return FakeRunner(self, vocab_size)

    def eos_token_ids(self) -> list[int]:
        return [EOS]

    def key(self) -> dict[str, Any]:
        return {"engine": "fake", "seed": self.seed}
