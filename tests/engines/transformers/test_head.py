"""A draft's restricted vocabulary projection (``decoding.vocab``): the logits it keeps are the
full head's, every other id is -inf, each call's own ids reach only that call's rows (in a
batch too), and decoding through it stays exact (greedy equality, sampling distribution)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import PinnedCosts, hf_greedy, make_model
from distributions import chi_square_pvalues, exact_marginals, sample_counts
from torch import nn

from specagent import RuntimeOptions, SpecRuntime
from specagent.decoding.drafters import DraftModelDrafter
from specagent.decoding.sampling import SamplingParams
from specagent.decoding.vocab import CallVocabulary
from specagent.engines.transformers import ModelRunner
from specagent.engines.transformers.head import head_rows_for, restricted_logits
from specagent.engines.transformers.quantized import Int8Linear, int8_supported
from specagent.grammar import Constraint

VOCAB = 40
PATTERN = r"[A-Z]{3}-[0-9]{2}"
ROWS = 16


def _expected(full: torch.Tensor, kept: list[int]) -> torch.Tensor:
    mask = torch.zeros(full.shape[-1], dtype=torch.bool)
    mask[kept] = True
    return full.masked_fill(~mask, float("-inf"))


@pytest.mark.parametrize("int8", [False, True])
def test_restricted_logits_keep_the_heads_numbers_and_each_blocks_own_ids(int8: bool) -> None:
    if int8 and not int8_supported(torch.device("cpu")):
        pytest.skip("this torch has no CPU int8 weight kernel")
    torch.manual_seed(0)
    linear = nn.Linear(64, VOCAB, bias=True)
    head: nn.Module = Int8Linear(linear, torch.bfloat16) if int8 else linear
    dtype = torch.bfloat16 if int8 else torch.float32
    hidden = torch.randn(5, 64, dtype=dtype)
    always = torch.tensor([39])
    first, second = torch.tensor([20, 31]), torch.tensor([25])
    out = restricted_logits(head, hidden, ROWS, always, [(2, first), (1, None), (2, second)])
    full = head(hidden)
    base = [*range(ROWS), 39]
    for rows, kept in [
        (slice(0, 2), [*base, 20, 31]),
        (slice(2, 3), base),
        (slice(3, 5), [*base, 25]),
    ]:
        torch.testing.assert_close(out[rows].float(), _expected(full[rows].float(), kept))
    # Another block's ids are never finite in a row: one call's text is not another's draft.
    assert torch.isinf(out[2:5, [20, 31]]).all()
    assert torch.isinf(out[:3, 25]).all()


def test_call_vocabulary_grows_with_its_context_and_rescans_another() -> None:
    vocab = CallVocabulary(rows=10)
    assert vocab.update([1, 12, 3]).tolist() == [12]
    assert vocab.update([1, 12, 3, 15, 12, 2]).tolist() == [12, 15]
    assert vocab.update([4, 11]).tolist() == [11, 12, 15]  # a new context only adds ids


def _runner(model: nn.Module) -> ModelRunner:
    runner = ModelRunner(copy.deepcopy(model), head_rows=ROWS, always=[VOCAB - 1])
    assert runner.inputs.head_rows == ROWS
    return runner


def test_forwards_single_and_batched_cover_the_rows_and_each_calls_own_ids() -> None:
    model = make_model(VOCAB, layers=2, seed=3, init=0.3)
    plain, restricted = ModelRunner(model), _runner(model)
    prompts = [[1, 20, 5, 33], [2, 7, 25, 25, 9]]
    vocabs = [CallVocabulary(ROWS).update(p) for p in prompts]
    caches = [[plain.new_cache(), restricted.new_cache()] for _ in prompts]
    for prompt, vocab, (full_cache, cut_cache) in zip(prompts, vocabs, caches, strict=True):
        full = plain.forward(prompt, full_cache)
        cut = restricted.forward(prompt, cut_cache, vocab=vocab)
        kept = [*range(ROWS), VOCAB - 1, *vocab.tolist()]
        torch.testing.assert_close(cut, _expected(full, kept), atol=1e-5, rtol=1e-4)
    steps = [[4, 6], [33]]
    full = plain.forward_batch(
        [(s, c[0]) for s, c in zip(steps, caches, strict=True)], [None, None]
    )
    cut = restricted.forward_batch(
        [(s, c[1]) for s, c in zip(steps, caches, strict=True)], [None, None], vocabs
    )
    for i, vocab in enumerate(vocabs):
        kept = [*range(ROWS), VOCAB - 1, *vocab.tolist()]
        torch.testing.assert_close(cut[i], _expected(full[i], kept), atol=1e-5, rtol=1e-4)
    assert torch.isinf(cut[1][:, [20, 33]]).all()  # the first call's ids, not in the second's
    assert torch.isinf(cut[0][:, 25]).all()


def test_head_rows_are_refused_where_they_cannot_hold() -> None:
    model = make_model(VOCAB, layers=1, seed=4)
    assert ModelRunner(model, head_rows=VOCAB).inputs.head_rows is None  # not fewer than it has
    assert ModelRunner(model, head_rows=0).inputs.head_rows is None

    class Scaled(nn.Module):  # a head that is more than a projection (soft-capping, scaling)
        def __init__(self, inner: nn.Linear) -> None:
            super().__init__()
            self.inner, self.weight = inner, inner.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * 0.5

    odd = copy.deepcopy(model)
    odd.lm_head = Scaled(odd.lm_head)  # type: ignore[assignment]
    assert ModelRunner(odd, head_rows=ROWS).inputs.head_rows is None


def test_head_rows_for_reads_the_tokenizers_order(tokenizer) -> None:
    # The test tokenizer's first ids are its special tokens and byte alphabet (what plain text
    # is mostly made of here); its first 8 are special tokens only.
    assert head_rows_for(tokenizer, vocab_size=1000, rows=300) == 300
    assert head_rows_for(tokenizer, vocab_size=1000, rows=8) is None
    assert head_rows_for(tokenizer, vocab_size=len(tokenizer), rows=300) is None  # too few
    assert head_rows_for(None, vocab_size=10**6) is None


@pytest.mark.anyio
async def test_runtime_with_a_restricted_draft_head_equals_target_greedy(
    target, draft, tokenizer
) -> None:
    ids = tokenizer.encode("def f(x): return x + 1")
    expected = hf_greedy(target, ids, 24)
    runtime = SpecRuntime(
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        device="cpu",
        options=RuntimeOptions(probe_store=PinnedCosts()),  # drafting pays: the draft model runs
        engine_options={"draft_head_rows": 64},
    )
    async with runtime:
        assert runtime.draft_head_rows == 64
        results = [
            await runtime.generate(ids, max_new_tokens=24, policy="default") for _ in range(2)
        ]
    for result in results:
        n = len(result.token_ids)
        assert result.token_ids == expected[:n]
        assert n == 24 or expected[n] in runtime.eos_token_ids
    assert sum(r.stats.num_accepted_tokens for r in results) > 0


def test_a_grammar_whose_tokens_the_draft_head_lacks(target, draft, tokenizer) -> None:
    """Eight rows hold only special tokens: the letters and digits the pattern allows reach
    the draft only through the prompt's own ids, or not at all (the draft then stops and the
    target decodes). The output is the same as with the whole head."""
    outputs = []
    for rows in (8, None):
        runtime = SpecRuntime(
            target=target,
            draft=draft,
            tokenizer=tokenizer,
            device="cpu",
            options=RuntimeOptions(probe_store=PinnedCosts()),
            engine_options={"draft_head_rows": rows},
        )
        with runtime:
            result = runtime.generate_sync(
                "Code: AB", constraint=Constraint.regex(PATTERN), max_new_tokens=12
            )
        assert re.fullmatch(PATTERN, result.text), result.text
        outputs.append(result.token_ids)
    assert outputs[0] == outputs[1]


def test_runtime_refuses_a_bad_head_rows_value(target, draft, tokenizer) -> None:
    for bad in (0, -3, 2.5, True, "all"):
        with pytest.raises(ValueError, match="draft_head_rows"):
            SpecRuntime(
                target=target,
                draft=draft,
                tokenizer=tokenizer,
                device="cpu",
                engine_options={"draft_head_rows": bad},
            )


@pytest.mark.slow
def test_sampling_through_a_restricted_draft_head_matches_target(small_target, small_draft) -> None:
    """The draft proposes only ids below 5, its prompt's (3, 7) and id 9; the target's tokens
    must still follow its own distribution (the acceptance rule compares against the
    restricted q the draft sampled from)."""
    runner = ModelRunner(small_draft, head_rows=5, always=[9])
    assert runner.inputs.head_rows == 5
    params = SamplingParams(temperature=1.0)
    marginals = exact_marginals(small_target, params)
    counts = sample_counts(small_target, lambda: DraftModelDrafter(runner), params, 3)
    pvalues = chi_square_pvalues(counts, marginals)
    assert min(pvalues) > 1e-3, pvalues
