"""Greedy speculative decoding reproduces the target's own greedy decode, and the KV-cache
rollback after rejections gives the same tokens as recomputing everything without a cache."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, make_model
from transformers import LlamaForCausalLM

from specagent.decoding.costs import CostModel
from specagent.decoding.drafters import DraftModelDrafter, EarlyExitDrafter, PromptLookupDrafter
from specagent.decoding.loop import speculative_generate
from specagent.decoding.proposal import DraftRequest
from specagent.decoding.sampling import SamplingParams, make_generator
from specagent.decoding.schedule import AdaptiveSchedule, FixedSchedule
from specagent.engines.transformers import ModelRunner, early_exit_view

PROMPTS = ["Hello world, hello", "def f(x):\n    return x", "abcabcabc", "The quick brown fox"]


GREEDY = SamplingParams(0.0)


def run(target_runner, ids, drafter, k, params=GREEDY, seed=0, n=40, schedule=None, **options):
    events = list(
        speculative_generate(
            target_runner,
            ids,
            params=params,
            generator=make_generator(seed),
            max_new_tokens=n,
            drafter=drafter,
            schedule=schedule or FixedSchedule(k),
            **options,
        )
    )
    return events[-1]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_target_greedy_for_each_drafter(target, draft, tokenizer, prompt, k) -> None:
    ids = tokenizer.encode(prompt)
    expected = hf_greedy(target, ids, 40)
    drafters = [
        DraftModelDrafter(ModelRunner(draft)),
        PromptLookupDrafter(),
        EarlyExitDrafter(ModelRunner(early_exit_view(target, 2))),
    ]
    for drafter in drafters:
        last = run(ModelRunner(target), ids, drafter, k)
        assert last.output_ids == expected, drafter.name


def test_greedy_with_adaptive_k_equals_target_greedy(target, draft, tokenizer) -> None:
    ids = tokenizer.encode(PROMPTS[0])
    schedule = AdaptiveSchedule(max_k=5, costs=CostModel(draft_step=0.1, verify=(1.0, 1.05, 1.1)))
    last = run(
        ModelRunner(target), ids, DraftModelDrafter(ModelRunner(draft)), 0, schedule=schedule
    )
    assert last.output_ids == hf_greedy(target, ids, 40)
    assert last.counters.num_drafts > 0


def test_speculation_accepts_tokens_on_a_related_pair(target, draft, tokenizer) -> None:
    """Not a correctness property but a sanity one: the perturbed draft agrees often enough
    that the equality tests above exercise accepted prefixes and rollbacks alike."""
    last = run(
        ModelRunner(target), tokenizer.encode(PROMPTS[1]), DraftModelDrafter(ModelRunner(draft)), 4
    )
    assert 0.0 < last.counters.acceptance_rate < 1.0
    assert last.counters.mean_acceptance_length > 1.0


class _ListCache:
    """Stands in for a KV cache: remembers the tokens it 'holds'."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def get_seq_length(self) -> int:
        return len(self.tokens)

    def crop(self, n: int) -> None:
        assert n < 0
        del self.tokens[n:]


class NoCacheRunner(ModelRunner):
    """Recomputes the full sequence at every forward: the reference for rollback."""

    def new_cache(self):  # type: ignore[override]
        return _ListCache()

    @torch.inference_mode()
    def forward(self, input_ids, cache, keep=None, tree=None, vocab=None):  # type: ignore[override]
        cache.tokens.extend(input_ids)
        logits = self.model(input_ids=torch.tensor([cache.tokens])).logits[0, -len(input_ids) :]
        if keep is not None:
            logits = logits[-keep:] if keep > 0 else logits[:0]
        return logits.float()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_output_equals_recomputed_without_cache(
    target, draft, tokenizer, temperature
) -> None:
    params = SamplingParams(temperature=temperature)
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt)
        cached = run(
            ModelRunner(target), ids, DraftModelDrafter(ModelRunner(draft)), 4, params, seed=i
        )
        fresh = run(
            NoCacheRunner(target), ids, DraftModelDrafter(NoCacheRunner(draft)), 4, params, seed=i
        )
        assert cached.output_ids == fresh.output_ids
        assert cached.counters.num_accepted_tokens == fresh.counters.num_accepted_tokens
        assert 0 < cached.counters.num_accepted_tokens < cached.counters.num_draft_tokens


def test_eos_stops_without_emitting_it(target, draft, tokenizer) -> None:
    ids = tokenizer.encode(PROMPTS[0])
    free = run(ModelRunner(target), ids, None, 0).output_ids
    eos = free[5]
    events = list(
        speculative_generate(
            ModelRunner(target),
            ids,
            params=SamplingParams(0.0),
            generator=make_generator(0),
            max_new_tokens=40,
            drafter=DraftModelDrafter(ModelRunner(draft)),
            schedule=FixedSchedule(4),
            eos_token_ids=[eos],
        )
    )
    assert events[-1].finish_reason == "stop"
    assert events[-1].output_ids == free[: free.index(eos)]


def test_max_new_tokens_and_context_window(target, tokenizer) -> None:
    ids = tokenizer.encode(PROMPTS[2])
    last = run(ModelRunner(target), ids, PromptLookupDrafter(), 8, n=7)
    assert last.finish_reason == "length"
    assert len(last.output_ids) == 7
    events = list(
        speculative_generate(
            ModelRunner(target),
            ids,
            params=SamplingParams(0.0),
            generator=make_generator(0),
            max_new_tokens=100,
            drafter=PromptLookupDrafter(),
            schedule=FixedSchedule(8),
            max_context=len(ids) + 5,
        )
    )
    assert events[-1].finish_reason == "length"
    assert len(events[-1].output_ids) == 5


def test_same_seed_same_tokens(target, draft, tokenizer) -> None:
    ids = tokenizer.encode(PROMPTS[3])
    params = SamplingParams(temperature=0.9, top_k=20)
    a = run(ModelRunner(target), ids, DraftModelDrafter(ModelRunner(draft)), 3, params, seed=5)
    b = run(ModelRunner(target), ids, DraftModelDrafter(ModelRunner(draft)), 3, params, seed=5)
    c = run(ModelRunner(target), ids, DraftModelDrafter(ModelRunner(draft)), 3, params, seed=6)
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids


def test_bad_arguments_are_refused(target) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        next(
            speculative_generate(
                ModelRunner(target),
                [],
                params=SamplingParams(0.0),
                generator=make_generator(0),
                max_new_tokens=3,
            )
        )
    with pytest.raises(ValueError, match="max_new_tokens"):
        next(
            speculative_generate(
                ModelRunner(target),
                [1],
                params=SamplingParams(0.0),
                generator=make_generator(0),
                max_new_tokens=0,
            )
        )


class _ScaledLogits(LlamaForCausalLM):
    """A model whose logits are more than its output embedding (as with soft-capping)."""

    def forward(self, input_ids=None, cache=None, **kwargs):  # type: ignore[no-untyped-def]
        out = super().forward(input_ids=input_ids, cache=cache, **kwargs)
        out.logits = 30.0 * torch.tanh(out.logits / 30.0) + 0.25
        return out


@pytest.mark.parametrize("model_class", [LlamaForCausalLM, _ScaledLogits])
def test_forward_batch_equals_forward_with_kept_positions(model_class) -> None:
    """Batched logits (projected only at the positions read) equal one-by-one forwards, for a
    plain LM head and for a model whose logits the gathered projection cannot reproduce (the
    runner notices on its first batch and uses the model's own logits from then on)."""
    reference = make_model(320, seed=3)
    model = model_class(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    runner = ModelRunner(model)
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=rng).tolist() for n in (1, 9, 17, 4)]
    feeds = [torch.randint(3, 320, (n,), generator=rng).tolist() for n in (5, 1, 3, 7)]
    keeps = [None, 1, 2, None]
    for _ in range(2):  # the first batch checks the gathered projection, the second uses it
        alone_caches, batch_caches = [], []
        for prompt in prompts:
            caches = [runner.new_cache(), runner.new_cache()]
            for cache in caches:
                if len(prompt) > 1:
                    runner.forward(prompt[:-1], cache, keep=1)
            alone_caches.append(caches[0])
            batch_caches.append(caches[1])
        alone = [
            runner.forward(feed, cache, keep)
            for feed, cache, keep in zip(feeds, alone_caches, keeps, strict=True)
        ]
        batched = runner.forward_batch(list(zip(feeds, batch_caches, strict=True)), keeps)
        for a, b, ca, cb in zip(alone, batched, alone_caches, batch_caches, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            assert ca.get_seq_length() == cb.get_seq_length()
            torch.testing.assert_close(ca.layers[0].keys, cb.layers[0].keys, atol=1e-5, rtol=1e-5)
    assert runner.batched.gather_checked is (model_class is LlamaForCausalLM)


@pytest.mark.parametrize("temperature", [0.0, 0.05])
def test_lookup_guesses_give_the_drafts_own_proposals_in_fewer_forwards(
    target, draft, temperature
) -> None:
    """Guessing the draft's next tokens by n-gram lookup changes how many draft forwards run,
    never what is proposed: same tokens, same distributions, same random numbers (temperature
    0.05 goes through sampling), along a context that repeats a phrase and then grows by each
    proposal as if the target accepted it."""
    params = SamplingParams(temperature)
    runner = ModelRunner(draft)
    plain = DraftModelDrafter(runner, confidence_threshold=0.0)
    guessing = DraftModelDrafter(runner, confidence_threshold=0.0, guess_ngrams=(2, 3))
    phrase = [11, 42, 57, 99, 23, 64, 8, 77]
    context = [5, *phrase, 31, *phrase, 31, *phrase[:3]]
    gen_a, gen_b = make_generator(7), make_generator(7)
    proposed = 0
    for _ in range(8):
        a = plain.propose(DraftRequest(list(context), 6, params, gen_a))
        b = guessing.propose(DraftRequest(list(context), 6, params, gen_b))
        assert a.tokens == b.tokens
        if temperature > 0:  # greedy proposals are deterministic: q is one-hot on the tokens
            assert a.probs is not None
            assert b.probs is not None
            torch.testing.assert_close(a.probs, b.probs, atol=1e-4, rtol=1e-4)
        proposed += len(a.tokens)
        context += a.tokens
    assert plain.draft_forwards == proposed
    assert guessing.draft_forwards < 0.8 * plain.draft_forwards, (guessing.draft_forwards, proposed)


# --------------------------------------------------------------------- on every engine

ENGINE_PROMPTS = [[3, 7, 3, 7, 3], [4, 5, 6, 4, 5, 6, 4], [9, 3, 10, 8, 3, 10]]


def engine_greedy(runner, ids: list[int], n: int) -> list[int]:
    """Greedy decoding written out against the engine, one token a forward."""
    cache, out = runner.new_cache(), []
    logits = runner.forward(ids, cache, keep=1)
    for _ in range(n):
        token = int(logits[-1].argmax())
        out.append(token)
        logits = runner.forward([token], cache)
    return out


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_equals_the_engines_plain_greedy(engine_pair, k) -> None:
    """Every drafter, at a fixed k and adaptive, on every engine: the tokens of the engine's
    own greedy decode (rejections rolled back by cropping the engine's sequences)."""
    schedules = [
        FixedSchedule(k),
        AdaptiveSchedule(max_k=k + 2, costs=CostModel(draft_step=0.1, verify=(1.0, 1.05))),
    ]
    for ids in ENGINE_PROMPTS:
        expected = engine_greedy(engine_pair.target, ids, 24)
        for schedule in schedules:
            for drafter in (DraftModelDrafter(engine_pair.draft), PromptLookupDrafter()):
                last = run(engine_pair.target, ids, drafter, k, n=24, schedule=schedule)
                assert last.output_ids == expected, (drafter.name, schedule)


def test_batched_forwards_equal_single_ones_on_every_engine(engine_pair) -> None:
    """One engine call over several sequences (different lengths, different token counts)
    gives each the logits and the KV its own forward would."""
    runner = engine_pair.target
    caches, alone = [runner.new_cache() for _ in ENGINE_PROMPTS], []
    for ids, cache in zip(ENGINE_PROMPTS, caches, strict=True):
        runner.forward(ids, cache, keep=1)
        twin = runner.new_cache()
        runner.forward(ids, twin, keep=1)
        alone.append(twin)
    feeds = [[5], [7, 8, 9], [11, 3]]
    batched = runner.forward_batch(list(zip(feeds, caches, strict=True)), [None, 2, 1])
    for feed, twin, logits, keep in zip(feeds, alone, batched, [None, 2, 1], strict=True):
        torch.testing.assert_close(logits, runner.forward(feed, twin, keep), atol=1e-4, rtol=1e-4)
    for cache, twin in zip(caches, alone, strict=True):
        assert cache.get_seq_length() == twin.get_seq_length()
        after_cache, after_twin = runner.forward([6], cache), runner.forward([6], twin)
        torch.testing.assert_close(after_cache, after_twin, atol=1e-4, rtol=1e-4)
