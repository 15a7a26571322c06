"""The transformers engine's KV slot pool: calls hold slots of one preallocated buffer per layer,
batched rounds write each row at its own positions and attend in place. Checked against
ordinary per-call caches on random models: the same logits through random rounds of ragged
batches, rollbacks, kept prefixes, released and reused slots, non-consecutive batches, a call
that outgrows the pool, a full pool, and the runtime's outputs with and without slots."""

from __future__ import annotations

import copy
import gc
import random
import threading

import pytest
import torch
from conftest import make_model, ragged_rounds
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from specagent import Policy, SpecRuntime
from specagent.engines.transformers import ModelRunner
from specagent.engines.transformers.batched import batch_mask
from specagent.engines.transformers.slots import SlotPool, SlotSequence, slot_shapes

VOCAB = 64
TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module", params=["llama-sdpa", "llama-eager", "qwen2-gqa"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    """A Llama with sdpa (a boolean mask) and with eager attention (an additive one), and a
    Qwen2 with grouped KV heads and q/k/v biases."""
    if request.param == "qwen2-gqa":
        torch.manual_seed(5)
        config = Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            use_sliding_window=False,
        )
        return Qwen2ForCausalLM(config).eval()
    built = make_model(VOCAB, layers=2, seed=3, hidden=64, max_positions=2048)
    built.config._attn_implementation = request.param.removeprefix("llama-")
    return built


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def test_random_ragged_rounds_give_the_logits_of_ordinary_caches(model) -> None:
    """Eight calls, thirty rounds: each round a random subset feeds 1-5 tokens (or a prompt)
    in one batched forward, and some roll back what they fed; logits and lengths follow the
    same calls on ordinary caches exactly."""
    plain, slotted = ModelRunner(model), ModelRunner(model, slots=True)
    assert slotted.slots is not None
    caches = ragged_rounds(plain, slotted, calls=8, rounds=30, vocab=VOCAB, tol=TOL)
    assert all(isinstance(s, SlotSequence) for _, s in caches)


def test_tokens_chosen_on_the_device_run_as_host_tokens(model) -> None:
    """Half the feeds as tensors (a drafter's tokens, never read on the host): the same logits
    and lengths, over slots and over ordinary caches batched."""
    plain = ModelRunner(model)
    ragged_rounds(
        plain, ModelRunner(model, slots=True), calls=6, rounds=20, vocab=VOCAB, tol=TOL, tensors=0.5
    )
    ragged_rounds(plain, ModelRunner(model), calls=6, rounds=20, vocab=VOCAB, tol=TOL, tensors=0.5)


def test_a_kept_prefix_continues_as_the_whole_would(model) -> None:
    runner = ModelRunner(model, slots=True)
    prompt = list(range(3, 40))
    sequence = runner.new_cache()
    runner.forward(prompt, sequence, keep=1)
    kept = sequence.kept_copy()
    assert isinstance(kept, DynamicCache)
    assert kept.get_seq_length() == len(prompt)
    adopted = runner.adopt(kept)
    assert isinstance(adopted, SlotSequence)
    assert adopted.slot != sequence.slot
    copied = copy.deepcopy(sequence)
    assert isinstance(copied, SlotSequence)
    whole = runner.forward([*prompt, 50, 51], runner.new_cache())[-2:]
    torch.testing.assert_close(runner.forward([50, 51], adopted), whole, **TOL)
    torch.testing.assert_close(runner.forward([50, 51], copied), whole, **TOL)
    torch.testing.assert_close(runner.forward([50, 51], sequence), whole, **TOL)


def test_released_slots_are_reused_and_hold_nothing_of_their_last_call(model) -> None:
    runner = ModelRunner(model, slots=True)
    pool = runner.slots
    assert pool is not None
    first = runner.new_cache()
    runner.forward(list(range(5, 60)), first, keep=1)
    slot = first.slot
    del first
    gc.collect()
    again = runner.new_cache()
    assert again.slot == slot  # the lowest free slot
    assert again.get_seq_length() == 0
    fresh = runner.forward([7, 8, 9], again)
    torch.testing.assert_close(fresh, ModelRunner(model).forward([7, 8, 9], DynamicCache()), **TOL)


def test_batches_of_slots_out_of_order_gather_their_rows(model) -> None:
    """Slots 0 and 2 in one batch (slot 1 released), and in reverse order."""
    runner, plain = ModelRunner(model, slots=True), ModelRunner(model)
    sequences = [runner.new_cache() for _ in range(3)]
    ordinary = [plain.new_cache() for _ in range(3)]
    for i, (s, o) in enumerate(zip(sequences, ordinary, strict=True)):
        prompt = list(range(2 + i, 20 + 3 * i))
        runner.forward(prompt, s, keep=1)
        plain.forward(prompt, o, keep=1)
    del sequences[1], ordinary[1]
    gc.collect()
    for order in ([0, 1], [1, 0]):
        got = runner.forward_batch([([9, 10], sequences[i]) for i in order])
        want = plain.forward_batch([([9, 10], ordinary[i]) for i in order])
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(b, a, **TOL)


def test_a_call_that_outgrows_the_pool_continues(model) -> None:
    runner, plain = ModelRunner(model, slots=True), ModelRunner(model)
    short = runner.new_cache()
    runner.forward([4, 5, 6], short, keep=1)
    long, reference = runner.new_cache(), DynamicCache()
    for chunk in range(12):  # 12 x 100 tokens: past the pool's first 256 positions
        tokens = [(chunk * 100 + j) % (VOCAB - 1) + 1 for j in range(100)]
        torch.testing.assert_close(
            runner.forward(tokens, long, keep=1), plain.forward(tokens, reference, keep=1), **TOL
        )
    assert runner.slots is not None
    assert runner.slots.capacity >= 1200
    # The other call's positions survived the growth.
    torch.testing.assert_close(
        runner.forward([7], short), plain.forward([4, 5, 6, 7], DynamicCache())[-1:], **TOL
    )


def test_a_kept_prefix_is_adopted_and_copied_after_the_pool_grew_in_a_forward(model) -> None:
    """The pool's buffers grow inside a forward (made under inference mode); adopting a kept
    prefix, copying a slot and keeping a tree's path write them from the decoding loop, outside
    it (a served call that reused a long prompt's prefix once failed here)."""
    runner = ModelRunner(model, slots=True)
    prompt = [(j * 7) % (VOCAB - 1) + 1 for j in range(600)]  # past the first 256 positions
    sequence = runner.new_cache()
    runner.forward(prompt, sequence, keep=1)
    assert runner.slots is not None
    assert runner.slots.capacity >= 600
    assert not torch.is_inference_mode_enabled()
    adopted = runner.adopt(sequence.kept_copy())
    assert isinstance(adopted, SlotSequence)
    copied = copy.deepcopy(sequence)
    assert isinstance(copied, SlotSequence)
    whole = runner.forward([*prompt, 50, 51], runner.new_cache())[-2:]
    torch.testing.assert_close(runner.forward([50, 51], adopted), whole, **TOL)
    torch.testing.assert_close(runner.forward([50, 51], copied), whole, **TOL)
    runner.keep_path(sequence, len(prompt) - 1, [])
    assert sequence.get_seq_length() == len(prompt)


def test_a_full_pool_hands_out_ordinary_caches_and_mixed_batches_run(model) -> None:
    runner, plain = ModelRunner(model, slots=True), ModelRunner(model)
    assert runner.slots is not None
    runner.slots.max_bytes = 1  # no room to grow past the first slots
    held = [runner.new_cache() for _ in range(6)]
    kinds = {type(cache) for cache in held}
    assert kinds == {SlotSequence, DynamicCache}
    prompts = [list(range(3, 10 + i)) for i in range(6)]
    for prompt, cache in zip(prompts, held, strict=True):
        runner.forward(prompt, cache, keep=1)
    got = runner.forward_batch([([11], cache) for cache in held])
    for prompt, logits in zip(prompts, got, strict=True):
        want = plain.forward([*prompt, 11], DynamicCache())[-1:]
        torch.testing.assert_close(logits, want, **TOL)


def test_two_threads_over_one_pool_each_get_their_own_logits(model) -> None:
    """Two runtimes may share one model, each stepping from its own worker thread: while one
    grows the pool (more slots, more positions) or shrinks it back when idle, the other's
    forward must neither write into buffers about to be replaced nor index a smaller pool."""
    runner, plain = ModelRunner(model, slots=True), ModelRunner(model)
    failures: list[BaseException] = []

    def calls(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(12):
                held = [runner.new_cache() for _ in range(rng.randrange(1, 7))]
                for cache in held:
                    prompt = _tokens(rng, rng.choice([3, 90, 300]))
                    got = runner.forward(prompt, cache, keep=1)
                    want = plain.forward(prompt, DynamicCache(), keep=1)
                    torch.testing.assert_close(got, want, **TOL)
                del held
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=calls, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]


def test_an_idle_pool_goes_back_to_its_first_size() -> None:
    pool = SlotPool(2, 2, 8, dtype=torch.float32, device=torch.device("cpu"))
    held = [pool.acquire() for _ in range(9)]
    assert pool.slots == 16
    del held
    gc.collect()
    assert pool.acquire() is not None
    assert pool.slots == 4


def test_the_mask_lets_each_row_see_its_own_positions_only() -> None:
    mask = batch_mask([2, 0], [2, 1], 2, 4, None)  # [B, 1, widest, kv]
    assert mask[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    # Row 1 fed one token at position 0; its padding query sees what its last real one does.
    assert mask[1, 0].tolist() == [[True, False, False, False], [True, False, False, False]]
    additive = batch_mask([1], [1], 1, 3, torch.float32)
    assert additive[0, 0, 0, 0] == 0
    assert additive[0, 0, 0, 2] < -1e30


def test_models_with_sliding_windows_keep_ordinary_caches() -> None:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=0,
    )
    assert slot_shapes(config) is None
    runner = ModelRunner(Qwen2ForCausalLM(config).eval(), slots=True)
    assert runner.slots is None
    assert isinstance(runner.new_cache(), DynamicCache)


@pytest.mark.anyio
async def test_the_runtime_answers_the_same_with_and_without_slots(
    target, draft, tokenizer
) -> None:
    """Concurrent calls under a draft-model policy and under prompt lookup, greedy and sampled,
    and a conversation's next turn from a kept prefix: the tokens of ordinary caches."""
    import anyio

    policies = [
        Policy(
            name="chat",
            description="draft model",
            mode="lossless",
            drafter={"kind": "draft_model", "num_speculative_tokens": 4},
        ),
        Policy(
            name="lookup",
            description="prompt lookup",
            mode="lossless",
            drafter={"kind": "prompt_lookup", "num_speculative_tokens": 5},
        ),
    ]

    async def answers(rt: SpecRuntime) -> list[list[int]]:
        out: dict[int, list[int]] = {}
        async with rt:

            async def one(i: int) -> None:
                prompt = tokenizer.encode(f"Hello world {i}, hello there, hello world {i}")
                result = await rt.generate(
                    prompt,
                    policy=["chat", "lookup"][i % 2],
                    max_new_tokens=20,
                    temperature=0.0 if i % 3 else 0.8,
                    seed=i,
                    tenant="t",
                )
                out[i] = result.token_ids

            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
            follow = [*tokenizer.encode("Hello world 0, hello there, hello world 0"), *out[0]]
            again = await rt.generate(follow, policy="chat", max_new_tokens=12, tenant="t")
            assert again.usage.cached_input_tokens > 0
            out[8] = again.token_ids
        return [out[i] for i in range(9)]

    with_slots = SpecRuntime(target, draft, tokenizer, policies, "cpu")
    without = SpecRuntime(
        target, draft, tokenizer, policies, "cpu", engine_options={"kv_slots": False}
    )
    assert await answers(with_slots) == await answers(without)


def test_a_token_tree_over_a_slot_gives_the_logits_and_kept_path_of_an_ordinary_cache(
    model,
) -> None:
    runner, plain = ModelRunner(model, slots=True), ModelRunner(model)
    assert runner.inputs.trees
    prompt = list(range(3, 30))
    slot, ordinary = runner.new_cache(), plain.new_cache()
    runner.forward(prompt, slot, keep=1)
    plain.forward(prompt, ordinary, keep=1)
    # root 40; two branches: 41 -> 42 and 43 -> 44
    tokens, parents = [40, 41, 42, 43, 44], [-1, 0, 1, 0, 3]
    got = runner.forward(tokens, slot, tree=parents)
    want = plain.forward(tokens, ordinary, tree=parents)
    torch.testing.assert_close(got, want, **TOL)
    start = len(prompt)
    for owner, cache in ((runner, slot), (plain, ordinary)):
        owner.keep_path(cache, start, [2, 3])  # the second branch: nodes 43, 44 (rows 3, 4)
    assert slot.get_seq_length() == ordinary.get_seq_length() == start + 3
    torch.testing.assert_close(runner.forward([45], slot), plain.forward([45], ordinary), **TOL)


def test_a_call_past_the_bound_moves_to_its_own_cache_and_the_pool_stays_within_it(
    model,
) -> None:
    """Sixteen calls and one eight times longer: the pool never passes ``max_bytes`` (the long
    call leaves it for an ordinary cache of its own), and every call's logits stay those of an
    ordinary cache."""
    runner, plain = ModelRunner(model, slots=True), ModelRunner(model)
    pool = runner.slots
    assert pool is not None
    pool.max_bytes = 16 * 512 * pool.position_bytes  # 16 slots of up to 512 positions
    rng = random.Random(7)
    calls = [(runner.new_cache(), DynamicCache()) for _ in range(16)]
    largest = 0
    for step in range(12):
        requests, references = [], []
        for i, (cache, reference) in enumerate(calls):
            count = 100 if i == 0 else 12  # call 0 reaches 1,200 positions, the others 144
            tokens = _tokens(rng, count if step < 12 else 1)
            requests.append((tokens, cache))
            references.append((tokens, reference))
        got = runner.forward_batch(requests, [1] * 16)
        want = plain.forward_batch(references, [1] * 16)
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(b, a, **TOL)
        largest = max(largest, pool.nbytes)
        assert pool.nbytes <= pool.max_bytes
    long = calls[0][0]
    assert isinstance(long, SlotSequence)
    assert long.own is not None  # it left the pool
    assert long.get_seq_length() == 1200
    assert all(c.own is None for c, _ in calls[1:])
    assert pool.capacity <= 512
    # Rolled back and copied like any cache.
    long.crop(-5)
    assert long.get_seq_length() == 1195
    assert copy.deepcopy(long).get_seq_length() == 1195


def test_a_failed_reallocation_leaves_the_pool_as_it_was(model, monkeypatch) -> None:
    """Out of memory half-way through growing: no layer keeps a new buffer, the forward that
    asked fails, and the other calls go on with their logits."""
    runner, plain = ModelRunner(model, slots=True), ModelRunner(model)
    pool = runner.slots
    assert pool is not None
    short, short_ref = runner.new_cache(), DynamicCache()
    runner.forward([4, 5, 6], short, keep=1)
    plain.forward([4, 5, 6], short_ref, keep=1)
    before = [(k.shape, v.shape) for k, v in zip(pool.keys, pool.values, strict=True)]
    made = {"n": 0}
    real_zeros = torch.zeros

    def failing_zeros(*args, **kwargs):  # type: ignore[no-untyped-def]
        made["n"] += 1
        if made["n"] == 3:  # the second layer's keys
            raise torch.OutOfMemoryError("planted: no memory for the new buffers")
        return real_zeros(*args, **kwargs)

    import specagent.engines.transformers.slots as slots_module

    monkeypatch.setattr(slots_module.torch, "zeros", failing_zeros)
    long = runner.new_cache()
    with pytest.raises(torch.OutOfMemoryError, match="planted"):
        runner.forward(_tokens(random.Random(1), 300), long)  # past the first 256 positions
    monkeypatch.setattr(slots_module.torch, "zeros", real_zeros)
    assert [(k.shape, v.shape) for k, v in zip(pool.keys, pool.values, strict=True)] == before
    assert long.get_seq_length() == 0
    torch.testing.assert_close(runner.forward([7], short), plain.forward([7], short_ref), **TOL)
