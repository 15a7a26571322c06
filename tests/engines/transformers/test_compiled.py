"""Static KV caches and compiled single-token steps give the eager path's tokens: forwards over a
static cache equal those over a dynamic one (after rollbacks, growth and batching), a compiled
runner's speculative decoding equals the target's own greedy decode, and the runtime measures,
records and reuses the decision."""

from __future__ import annotations

import copy
from typing import Any

import anyio
import pytest
import torch
from conftest import MemoryStore, hf_greedy
from transformers import DynamicCache

from specagent import Policy, SpecRuntime
from specagent.chat import render_prompt
from specagent.decoding.costs import CostModel
from specagent.decoding.draft_model import DraftModelDrafter
from specagent.decoding.engine import crop_to
from specagent.decoding.loop import speculative_generate
from specagent.decoding.prefix import PrefixCache
from specagent.decoding.sampling import SamplingParams, make_generator
from specagent.decoding.schedule import AdaptiveSchedule, FixedSchedule
from specagent.engines.transformers import ModelRunner, PrefillTwin, build_runner
from specagent.engines.transformers.compiled import (
    STATIC_TOKENS,
    as_dynamic,
    choose_compiled_step,
    is_static,
    new_static,
)
from specagent.machine import model_key

PROMPTS = ["Hello world, hello", "def f(x):\n    return x", "The quick brown fox"]


def test_static_cache_forwards_equal_dynamic_ones_through_rollback_and_growth(target) -> None:
    runner = ModelRunner(target)
    static = new_static(target.config, 32)
    assert static is not None
    assert is_static(static)
    dynamic = runner.new_cache()
    prompt = list(range(3, 23))
    for cache in (static, dynamic):
        runner.forward(prompt, cache, keep=1)
    feeds = [[5], [7, 8, 9], [11], [4, 6]]
    for step, feed in enumerate(feeds * 4):  # 20 positions + 28 fed: past the 32 slots
        a = runner.forward(feed, static)
        b = runner.forward(feed, dynamic)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert int(static.get_seq_length()) == dynamic.get_seq_length()
        if step % 3 == 2:  # a rejected draft: both roll back two positions
            for cache in (static, dynamic):
                crop_to(cache, int(cache.get_seq_length()) - 2)
    assert static.layers[0].max_cache_len == 64  # grown by doubling, contents kept


def recorded_compiled(*models) -> MemoryStore:
    """A store of a machine that measured these models' compiled steps faster earlier."""
    store = MemoryStore()
    for model in models:
        key = ModelRunner(model).speed_key()
        store.put(f"compiled-step:{key}", {"compiled": True, "reason": "recorded here"})
    return store


def compiled_runner(model) -> ModelRunner:
    """A runner built as a runtime builds one on such a machine (the decision read from the
    store, not measured again)."""
    runner, choice = build_runner(model, compile_steps=None, store=recorded_compiled(model))
    assert choice is not None
    assert choice.compiled
    return runner


def test_batched_forwards_over_static_caches_equal_single_ones(target) -> None:
    runner = compiled_runner(target)  # batches run eagerly: nothing is compiled here
    caches = [new_static(target.config, 64), new_static(target.config, 64), runner.new_cache()]
    prompts = [list(range(3, 13)), list(range(20, 41)), list(range(7, 22))]
    for cache, prompt in zip(caches, prompts, strict=True):
        runner.forward(prompt, cache, keep=1)
    twins = [as_dynamic(cache) for cache in caches]
    feeds = [[5], [7, 8, 9], [11, 12]]
    batched = runner.forward_batch(list(zip(feeds, caches, strict=True)))
    for feed, twin, logits in zip(feeds, twins, batched, strict=True):
        torch.testing.assert_close(logits, runner.forward(feed, twin), atol=1e-4, rtol=1e-4)
    for cache, twin in zip(caches, twins, strict=True):
        assert int(cache.get_seq_length()) == twin.get_seq_length()
        torch.testing.assert_close(
            as_dynamic(cache).layers[0].keys, twin.layers[0].keys, atol=1e-5, rtol=1e-5
        )


def test_the_prefix_cache_keeps_static_caches_as_ordinary_ones(target) -> None:
    runner = ModelRunner(target)
    static = new_static(target.config, STATIC_TOKENS)
    tokens = list(range(3, 43))
    runner.forward(tokens, static, keep=1)
    prefixes = PrefixCache(min_tokens=8)
    prefixes.store("t", tokens, static, copy=False)
    cached, reused = prefixes.lookup("t", [*tokens, 50, 51])
    assert reused == 40
    assert isinstance(cached, DynamicCache)
    assert not is_static(cached)
    assert cached.layers[0].keys.shape[2] == 40  # its length, not its 2,048 slots
    torch.testing.assert_close(cached.layers[0].keys, static.layers[0].keys[:, :, :40])


@pytest.fixture(scope="module")
def compiled_pair(target, draft) -> tuple[ModelRunner, ModelRunner]:
    """Runners whose single-token steps run compiled (inductor), compiled once per module."""
    return compiled_runner(target), compiled_runner(draft)


def run(target_runner, ids, drafter, schedule, n=40):
    events = list(
        speculative_generate(
            target_runner,
            ids,
            params=SamplingParams(0.0),
            generator=make_generator(0),
            max_new_tokens=n,
            drafter=drafter,
            schedule=schedule,
        )
    )
    return events[-1]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.slow  # compiles both models with inductor
def test_compiled_steps_give_the_target_greedy_tokens(
    compiled_pair, target, tokenizer, prompt, monkeypatch
) -> None:
    target_runner, draft_runner = compiled_pair
    steps = {"target": 0, "draft": 0}
    for role, runner in (("target", target_runner), ("draft", draft_runner)):
        step = runner.compiled.step

        def counted(*args: Any, _step: Any = step, _role: str = role) -> torch.Tensor:
            steps[_role] += 1
            return _step(*args)

        monkeypatch.setattr(runner.compiled, "step", counted)
    ids = tokenizer.encode(prompt)
    expected = hf_greedy(target, ids, 40)
    for schedule in (
        FixedSchedule(0),  # plain steps: every target forward is the compiled one
        FixedSchedule(3),
        AdaptiveSchedule(max_k=5, costs=CostModel(draft_step=0.1, verify=(1.0, 1.05, 1.1))),
    ):
        last = run(target_runner, ids, DraftModelDrafter(draft_runner), schedule)
        assert last.output_ids == expected, schedule
    # Plain steps of the target and the draft's single-token steps did run compiled (all 40
    # tokens of the plain run but the first, which the forward over the prompt gives).
    assert steps["target"] >= 39
    assert steps["draft"] > 0


def conversation_policy() -> Policy:
    return Policy(
        name="chat",
        description="greedy draft-model chat",
        mode="lossless",
        drafter={"kind": "draft_model", "num_speculative_tokens": 4},
        sampling={"temperature": 0.0, "max_new_tokens": 24},
    )


@pytest.mark.slow  # compiles both models with inductor
def test_the_runtime_measures_records_and_reuses_the_decision(target, draft, tokenizer) -> None:
    store = MemoryStore()
    rt = SpecRuntime(
        target,
        draft,
        tokenizer,
        policies=[conversation_policy()],
        device="cpu",
        probe_store=store,  # type: ignore[arg-type]
        compile_steps=True,
    )
    measured = rt.compiled_steps
    assert set(measured) == {"target", "draft"}
    for choice in measured.values():
        assert choice["eager_seconds"] > 0
        assert choice["compiled_seconds"] > 0
        assert choice["compile_seconds"] is not None
    # Kept per machine and model shape (the draft here has the target's shape: one entry).
    shapes = {model_key(target), model_key(draft)}
    assert {key for key in store.entries if key.startswith("compiled-step:")} == {
        f"compiled-step:{shape}" for shape in shapes
    }
    # A later runtime on this machine reads the decision instead of compiling to measure.
    puts = store.puts
    later = SpecRuntime(
        target, draft, tokenizer, policies=[conversation_policy()], device="cpu", probe_store=store
    )  # type: ignore[arg-type]
    assert store.puts == puts
    for role, choice in later.compiled_steps.items():
        assert choice["compiled"] == measured[role]["compiled"]
        assert "measured earlier" in choice["reason"]
    eager = SpecRuntime(target, draft, tokenizer, device="cpu", compile_steps=False)
    assert eager.compiled_steps == {}


@pytest.mark.slow  # compiles both models with inductor
def test_a_runtime_with_compiled_steps_answers_as_an_eager_one(target, draft, tokenizer) -> None:
    """Concurrent calls (batched forwards over static caches) and a conversation's next turn (a
    kept prefix copied back into a static cache) give the eager runtime's tokens."""
    policies = [conversation_policy()]
    eager = SpecRuntime(target, draft, tokenizer, policies, "cpu", compile_steps=False)
    compiled = SpecRuntime(
        target, draft, tokenizer, policies, "cpu", probe_store=recorded_compiled(target, draft)
    )  # type: ignore[arg-type]
    assert all(choice["compiled"] for choice in compiled.compiled_steps.values())
    system = {"role": "system", "content": "You are a support agent. Tools: lookup_order. " * 3}
    questions = [[system, {"role": "user", "content": f"Where is order {i}?"}] for i in range(5)]

    async def answers(rt: SpecRuntime) -> list[list[int]]:
        out: dict[int, list[int]] = {}
        async with rt:

            async def one(i: int) -> None:
                out[i] = (await rt.generate(questions[i], max_new_tokens=16, tenant="t")).token_ids

            async with anyio.create_task_group() as tg:
                for i in range(len(questions)):
                    tg.start_soon(one, i)
            prompt = render_prompt(questions[0], tokenizer, vocab_size=rt.vocab_size)
            follow_up = [*prompt, *out[0], *tokenizer.encode("<|user|>And B-2?<|assistant|>")]
            second = await rt.generate(follow_up, max_new_tokens=16, tenant="t")
            out[len(questions)] = second.token_ids
            assert second.usage.cached_input_tokens > len(prompt)  # the kept turn was reused
        return [out[i] for i in range(len(questions) + 1)]

    assert anyio.run(answers, compiled) == anyio.run(answers, eager)


def test_compiling_is_not_tried_where_nothing_was_measured(target) -> None:
    runner = ModelRunner(target)
    choice = choose_compiled_step(runner, key="k", store=MemoryStore(), measure=False)
    assert not choice.compiled
    assert runner.compiled is None
    refused = MemoryStore({"compiled-step:k": {"compiled": False, "reason": "slower here"}})
    choice = choose_compiled_step(runner, key="k", store=refused, measure=True)
    assert not choice.compiled
    assert runner.compiled is None
    assert refused.puts == 0


def test_a_prefill_twin_runs_long_forwards_and_keeps_the_cache_in_the_models_dtype(
    target, draft, tokenizer
) -> None:
    """A bf16 draft whose prompts are prefilled by its float32 copy: its cache stays bf16, the
    logits of a long forward are the float32 model's, short forwards stay bf16, and greedy
    speculative decoding still gives the target's own tokens (a draft never decides them)."""
    low = copy.deepcopy(draft).to(torch.bfloat16)
    twin = PrefillTwin(copy.deepcopy(draft), from_rows=8)
    runner = ModelRunner(low, prefill_twin=twin)
    prompt = list(range(3, 23))
    cache = runner.new_cache()
    logits = runner.forward(prompt, cache, keep=1)
    reference = ModelRunner(draft).forward(prompt, ModelRunner(draft).new_cache(), keep=1)
    torch.testing.assert_close(logits, reference)  # computed by the float32 copy
    assert cache.get_seq_length() == len(prompt)
    assert cache.layers[0].keys.dtype == torch.bfloat16
    step = runner.forward([5], cache)  # one token: the bf16 model, over the cast KV
    own = ModelRunner(low)
    own_cache = own.new_cache()
    own.forward(prompt, own_cache, keep=1)
    torch.testing.assert_close(step, own.forward([5], own_cache), atol=0.1, rtol=0.05)
    # Batched: the long request through the twin, the short ones together, each as alone.
    caches = [runner.new_cache(), runner.new_cache()]
    runner.forward(prompt[:5], caches[1], keep=1)
    batch = runner.forward_batch([(prompt, caches[0]), ([7], caches[1])], [1, None])
    torch.testing.assert_close(batch[0], reference)
    assert [c.get_seq_length() for c in caches] == [20, 6]
    ids = tokenizer.encode(PROMPTS[1])
    last = run(ModelRunner(target), ids, DraftModelDrafter(runner), FixedSchedule(4))
    assert last.output_ids == hf_greedy(target, ids, 40)


def test_the_draft_prefills_in_float32_where_that_measured_faster(tmp_path, monkeypatch) -> None:
    from conftest import make_model

    import specagent.engines.transformers.precision as precision

    def timed(model: torch.nn.Module, lengths: tuple[int, ...]) -> dict[int, float]:
        # As measured on a CPU without native bf16: bf16 wins one token, loses per row.
        low = next(model.parameters()).dtype == torch.bfloat16
        return {
            n: (0.4 if n == 1 else 0.04 * n) if low else (1.0 if n == 1 else 0.01 * n)
            for n in lengths
        }

    monkeypatch.setattr(precision, "_time", timed)
    store = MemoryStore()
    load = lambda dtype: make_model(64).to(dtype)  # noqa: E731
    _, choice = precision.choose_dtype(load, "draft", torch.device("cpu"), key="d", store=store)
    assert choice.dtype == torch.bfloat16
    assert choice.prefill_dtype == torch.float32
    assert choice.prefill_from == 16
    assert "run in float32" in choice.reason
    _, again = precision.choose_dtype(load, "draft", torch.device("cpu"), key="d", store=store)
    assert (again.prefill_dtype, again.prefill_from) == (torch.float32, 16)
    # A target never gets one: its numbers define what lossless means.
    _, target_choice = precision.choose_dtype(load, "target", torch.device("cpu"), key="t")
    assert target_choice.prefill_dtype is None
