"""Tiny seeded models and a character tokenizer, built in the test: no hub, no download."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from engine_pairs import ENGINES, Pair, small_pair
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the tests marked slow (statistical suites, slow integrations) and "
        "real_model (a real model from the catalog): what CI runs",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast suite by default; ``--full`` keeps every test (docs/testing.md)."""
    if config.getoption("--full"):
        return
    kept, left = [], []
    for item in items:
        full_only = item.get_closest_marker("slow") or item.get_closest_marker("real_model")
        (left if full_only else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x + 1",
    "Hello world, hello there!",
    '{"name": "Ada", "age": 36, "tags": ["math", "code"]}',
    "Summarise the meeting notes for the team.",
    "Your order has shipped and will arrive soon.",
]


SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style) trained here on a few sentences: every byte
    sequence encodes, and grammar libraries understand it like a real model's tokenizer."""
    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 20, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
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


def ragged_rounds(
    reference: Any,
    runner: Any,
    *,
    calls: int,
    rounds: int,
    vocab: int,
    tol: dict[str, float],
    tensors: float = 0.0,
) -> list[tuple[Any, Any]]:
    """``calls`` calls on each runner, ``rounds`` rounds (seeded): each round a random subset
    feeds 1-5 tokens (or a 40-token prompt) in one batched forward with random ``keep``s, and
    some roll back 1-2 positions; ``runner``'s logits and lengths must follow ``reference``'s.
    ``tensors``: the share of ``runner``'s feeds passed as tensors (tokens a drafter chose on
    the device) instead of lists. Returns the calls' cache pairs (reference's, runner's)."""
    rng = random.Random(0)
    caches = [(reference.new_cache(), runner.new_cache()) for _ in range(calls)]
    for _round in range(rounds):
        chosen = rng.sample(range(calls), rng.randrange(1, calls + 1))
        feeds = [
            [rng.randrange(1, vocab) for _ in range(rng.choice([1, 2, 3, 5, 40]))] for _ in chosen
        ]
        keeps = [rng.choice([None, 1, 2]) for _ in chosen]
        pairs = list(zip(feeds, chosen, strict=True))
        want = reference.forward_batch([(f, caches[i][0]) for f, i in pairs], keeps)
        theirs = [torch.tensor(f) if tensors and rng.random() < tensors else f for f in feeds]
        got = runner.forward_batch(
            [(f, caches[i][1]) for f, i in zip(theirs, chosen, strict=True)], keeps
        )
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(b, a, **tol)
        for i in chosen:
            if rng.random() < 0.4:  # a rejected draft: both roll back
                drop = rng.randrange(1, 3)
                for cache in caches[i]:
                    cache.crop(-drop)
        for theirs, ours in caches:
            assert ours.get_seq_length() == theirs.get_seq_length()
    return caches


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


def hf_greedy(model: LlamaForCausalLM, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy decode of n tokens (no EOS stop): the reference of every
    greedy-equality test."""
    out = model.generate(  # type: ignore[operator]
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


class MemoryStore:
    """A machine's kept measurements, in memory and empty unless given entries: a runtime
    measures for real and keeps what it measured here (``puts`` counts what it kept)."""

    def __init__(self, entries: dict[str, Any] | None = None) -> None:
        self.entries: dict[str, Any] = entries or {}
        self.puts = 0

    def get(self, key: str) -> Any | None:
        return copy.deepcopy(self.entries.get(key))

    def put(self, key: str, value: Any) -> None:
        self.puts += 1
        self.entries[key] = copy.deepcopy(value)


class PinnedCosts:
    """Step costs as a GPU measures them (verifying up to 40 tokens costs one forward, a draft
    forward a twentieth of that), given to a runtime as its machine's kept measurements
    (``probe_store=``): drafting pays, so adaptive schedules reach long drafts, every runtime
    plans with the same costs once it has read them (its first background step), and no timing
    of this machine changes which tokens a seed drafts."""

    def get(self, key: str) -> dict:
        cost = 0.010 if key.startswith("verify") else 0.0005
        return {"costs": [cost] * 40, "transposed_rows": []}

    def put(self, key: str, value: object) -> None:
        """Nothing is measured, so nothing is stored."""


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="session")
def target(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    return make_model(len(tokenizer), layers=4, seed=0, init=0.1)


@pytest.fixture(scope="session")
def draft(target: LlamaForCausalLM) -> LlamaForCausalLM:
    return perturbed_copy(target, scale=0.05, seed=1)


@pytest.fixture(params=["asyncio", pytest.param("trio", marks=pytest.mark.slow)])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on both of anyio's backends: the runtime promises asyncio or
    trio callers alike (its worker wakes either loop). The fast suite runs asyncio; trio's
    runs come with ``--full``."""
    return str(request.param)


SMALL_VOCAB = 12
"""A vocabulary small enough to enumerate every continuation (the distribution tests)."""


@pytest.fixture(scope="session", params=ENGINES)
def engine_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """A small target/draft pair on each engine present (``engine_pairs``): the decoding tests
    that take it run on every engine."""
    return small_pair(str(request.param), tmp_path_factory.mktemp(str(request.param)))


@pytest.fixture(scope="module")
def small_target() -> LlamaForCausalLM:
    return make_model(SMALL_VOCAB, layers=2, seed=11, hidden=32, init=0.4)


@pytest.fixture(scope="module")
def small_draft() -> LlamaForCausalLM:
    return make_model(SMALL_VOCAB, layers=1, seed=12, hidden=32, init=0.4)
