"""Compiled forwards over the KV slots give the eager path's logits and tokens: random ragged
rounds of batched forwards with rollbacks equal eager ones (one graph per shape bucket, none
compiled again for calls of other lengths), a call that outgrows the pool continues, a compiled
runner's speculative decoding equals the target's own greedy decode, and the runtime measures,
records and reuses the decision."""

from __future__ import annotations

import copy
import functools
import threading
from typing import Any

import anyio
import pytest
import torch
from conftest import MemoryStore, hf_greedy, make_model, ragged_rounds

from specagent import Policy, RuntimeOptions, SpecRuntime
from specagent.chat import render_prompt
from specagent.decoding.costs import CostModel
from specagent.decoding.drafters import DraftModelDrafter
from specagent.decoding.loop import speculative_generate
from specagent.decoding.sampling import SamplingParams, make_generator
from specagent.decoding.schedule import AdaptiveSchedule, FixedSchedule
from specagent.engines.transformers import ModelRunner, PrefillTwin, build_runner
from specagent.engines.transformers.attention import NAME
from specagent.engines.transformers.compiled import WIDTHS, choose_compiled_step
from specagent.engines.transformers.keys import model_key

PROMPTS = ["Hello world, hello", "def f(x):\n    return x", "The quick brown fox"]
VOCAB = 64
TOL = {"atol": 1e-4, "rtol": 1e-4}


class Graphs:
    """A ``torch.compile`` backend that runs each graph as traced and counts the graphs: what a
    compile costs is beside the point here, how often one happens is the point."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, graph: torch.fx.GraphModule, inputs: Any) -> Any:
        self.count += 1
        return graph.forward


def counted_runner(model: torch.nn.Module) -> tuple[ModelRunner, Graphs]:
    runner = ModelRunner(model, slots=True)
    graphs = Graphs()
    runner._use_compiled(runner.compiler(backend=graphs))
    return runner, graphs


@pytest.fixture(params=["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
def small(request: pytest.FixtureRequest) -> torch.nn.Module:
    """A Llama with sdpa (a boolean mask) and with eager attention (an additive one; with
    ``--full``: tracing each again takes seconds)."""
    model = make_model(VOCAB, layers=2, seed=3, hidden=64, max_positions=4096)
    model.config._attn_implementation = request.param
    return model


def test_compiled_forwards_over_slots_give_the_eager_logits(small) -> None:
    """Six calls, twenty-five rounds: a random subset feeds 1-5 tokens (or a prompt, which runs
    eagerly) in one batched forward, some roll back; every logit equals the eager runner's over
    the same slots, and each (rows, width) bucket compiled one graph, never a second. A third
    of the feeds are tensors (a drafter's tokens on the device): the same graphs take them."""
    eager = ModelRunner(small, slots=True)
    compiled, graphs = counted_runner(small)
    ragged_rounds(eager, compiled, calls=6, rounds=25, vocab=VOCAB, tol=TOL, tensors=0.3)
    assert compiled.compiled is not None
    assert len(compiled.compiled.buckets) >= 4  # several shapes were met...
    assert graphs.count == len(compiled.compiled.buckets)  # ...each compiled once
    assert not compiled.compiled.failed


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    cache = runner.new_cache()
    logits = runner.forward(prompt, cache, keep=1)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = runner.forward([out[-1]], cache, keep=1)
    return out


def test_calls_of_other_lengths_compile_nothing_new(small) -> None:
    """Calls of 37 to 133 tokens: their rounds attend spans of 64 to 256 positions, a
    dynamic size of one graph."""
    compiled, graphs = counted_runner(small)
    eager = ModelRunner(small, slots=True)
    first = greedy(compiled, list(range(3, 40)), 12)
    assert graphs.count == 1  # the single-token step of one call
    for length in (33, 70, 121):
        prompt = [(5 * i) % (VOCAB - 1) + 1 for i in range(length)]
        assert greedy(compiled, prompt, 12) == greedy(eager, prompt, 12)
    assert graphs.count == 1
    assert first == greedy(eager, list(range(3, 40)), 12)
    assert compiled.compiled is not None
    assert not compiled.compiled.failed


@pytest.mark.parametrize("attention", ["sdpa", "eager", NAME])
def test_sixteen_calls_attending_the_whole_pool_run_compiled(attention) -> None:
    """Sixteen calls whose round attends every position of every slot (the span is the pool's
    capacity, a slice of the whole buffer, which fixes the span in a graph of its own): the
    logits are eager's, nothing falls back."""
    model = make_model(VOCAB, layers=2, seed=3, hidden=64, max_positions=4096)
    model.config._attn_implementation = attention
    compiled, graphs = counted_runner(model)
    eager = ModelRunner(model, slots=True)
    assert compiled.slots is not None
    pairs = [(compiled.new_cache(), eager.new_cache()) for _ in range(16)]
    for i, (ours, theirs) in enumerate(pairs):
        prompt = [(i + j) % (VOCAB - 1) + 1 for j in range(180 + i)]
        compiled.forward(prompt, ours, keep=1)
        eager.forward(prompt, theirs, keep=1)
    for step in range(3):  # spans of 256 positions: the capacity
        assert compiled.slots.capacity == 256
        feeds = [[(step + i) % (VOCAB - 1) + 1] for i in range(16)]
        got = compiled.forward_batch(list(zip(feeds, [a for a, _ in pairs], strict=True)))
        want = eager.forward_batch(list(zip(feeds, [b for _, b in pairs], strict=True)))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **TOL)
    assert compiled.compiled is not None
    assert not compiled.compiled.failed
    assert graphs.count == 1


def test_a_recorded_decision_warms_one_calls_buckets_at_load(small) -> None:
    """Compiled forwards taken from the store compile one call's buckets (one row, every
    width) before any call: a call's plain steps and verifications then compile nothing, and
    the slot the warm-up used is free again."""
    runner = ModelRunner(small, slots=True)
    graphs = Graphs()
    runner.compiler = functools.partial(ModelRunner.compiler, runner, backend=graphs)  # type: ignore[method-assign]
    store = MemoryStore({"compiled-step:k": {"compiled": True}})
    assert choose_compiled_step(runner, key="k", store=store, measure=False).compiled
    assert runner.compiled is not None
    assert runner.compiled.buckets == [(1, width) for width in WIDTHS]
    assert graphs.count == len(WIDTHS)
    eager = ModelRunner(small, slots=True)
    prompt = list(range(3, 40))
    assert greedy(runner, prompt, 6) == greedy(eager, prompt, 6)
    cache, reference = runner.new_cache(), eager.new_cache()
    assert cache.slot == 0  # the warm-up's slot was handed back
    for fed in (prompt, [5, 6, 7], [8] * 9, [9] * 16):
        torch.testing.assert_close(runner.forward(fed, cache), eager.forward(fed, reference), **TOL)
    assert graphs.count == len(WIDTHS)


def test_a_call_that_outgrows_the_pool_continues_as_eager(small) -> None:
    """The pool starts at 256 positions; a call decoding past them grows it (a reallocation:
    new shapes, so its bucket compiles once more) and keeps the eager runner's tokens."""
    compiled, graphs = counted_runner(small)
    eager = ModelRunner(small, slots=True)
    prompt = [(3 * i) % (VOCAB - 1) + 1 for i in range(200)]
    assert compiled.slots is not None
    assert compiled.slots.capacity <= 256
    assert greedy(compiled, prompt, 100) == greedy(eager, prompt, 100)
    assert compiled.slots.capacity >= 300
    assert graphs.count == 2  # the step before and after the pool grew
    assert compiled.compiled is not None
    assert not compiled.compiled.failed


@pytest.mark.slow  # compiles with inductor
def test_forwards_on_other_threads_take_turns_with_compiled_ones() -> None:
    """A compiled graph replays writes to module-level state it traced (transformers' hub-kernel
    wrapper keeps one); a second runtime's eager forwards on another thread must not run in the
    middle of that, nor of a compile. One thread compiles and runs forwards of several widths
    over slots while another decodes eagerly on another model: nothing fails, and both give
    their single-threaded logits."""
    first = make_model(VOCAB, layers=2, seed=3, hidden=64, max_positions=4096)
    second = make_model(VOCAB, layers=2, seed=4, hidden=64, max_positions=4096)
    compiled = ModelRunner(first, slots=True)
    compiled._use_compiled(compiled.compiler())  # inductor, compiled on its thread below
    reference = ModelRunner(first, slots=True)
    eager = ModelRunner(second)  # ordinary caches: the model's full forward
    feeds = [list(range(3, 40)), *[list(range(4, 4 + w)) for w in (1, 2, 3, 5, 9, 1, 2)]]
    errors: list[BaseException] = []
    done = threading.Event()
    got: list[torch.Tensor] = []

    def compiled_forwards() -> None:
        try:
            cache = compiled.new_cache()
            got.extend(compiled.forward(feed, cache) for feed in feeds)
        except BaseException as error:  # reported below, not lost in the thread
            errors.append(error)
        finally:
            done.set()

    def eager_forwards() -> None:
        try:
            while not done.is_set():
                cache = eager.new_cache()
                eager.forward(list(range(3, 20)), cache)
                for _ in range(10):
                    eager.forward([5, 6], cache)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=compiled_forwards), threading.Thread(target=eager_forwards)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    cache = reference.new_cache()
    for feed, logits in zip(feeds, got, strict=True):
        torch.testing.assert_close(logits, reference.forward(feed, cache), **TOL)


def test_a_bucket_that_fails_to_compile_runs_eagerly(small) -> None:
    def refusing(graph: torch.fx.GraphModule, inputs: Any) -> Any:
        raise RuntimeError("no compiler here")

    runner = ModelRunner(small, slots=True)
    runner._use_compiled(runner.compiler(backend=refusing))
    prompt = list(range(3, 40))
    assert greedy(runner, prompt, 8) == greedy(ModelRunner(small, slots=True), prompt, 8)
    assert runner.compiled is not None
    assert list(runner.compiled.failed) == [(1, 1)]
    assert "no compiler here" in runner.compiled.failed[(1, 1)]


def test_compiled_forwards_need_slots() -> None:
    runner = ModelRunner(make_model(VOCAB, layers=1), slots=False)
    with pytest.raises(ValueError, match="KV slots"):
        runner.compiler()
    choice = choose_compiled_step(
        runner, key="k", store=MemoryStore({"compiled-step:k": {"compiled": True}})
    )
    assert not choice.compiled
    assert "slots" in choice.reason
    assert runner.compiled is None


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


@pytest.fixture(scope="module")
def compiled_pair(target, draft) -> tuple[ModelRunner, ModelRunner]:
    """Runners whose few-token forwards run compiled (inductor), compiled once per module."""
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
        hidden = runner.compiled.hidden

        def counted(*args: Any, _hidden: Any = hidden, _role: str = role) -> Any:
            steps[_role] += 1
            return _hidden(*args)

        monkeypatch.setattr(runner.compiled, "hidden", counted)
    ids = tokenizer.encode(prompt)
    expected = hf_greedy(target, ids, 40)
    for schedule in (
        FixedSchedule(0),  # plain steps: every target forward is the compiled one
        FixedSchedule(3),
        AdaptiveSchedule(max_k=5, costs=CostModel(draft_step=0.1, verify=(1.0, 1.05, 1.1))),
    ):
        last = run(target_runner, ids, DraftModelDrafter(draft_runner), schedule)
        assert last.output_ids == expected, schedule
    # Plain steps of the target and the draft's steps did run compiled (all 40 tokens of the
    # plain run but the first, which the forward over the prompt gives).
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
        options=RuntimeOptions(probe_store=store),
        engine_options={"compile_steps": True},
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
        target,
        draft,
        tokenizer,
        policies=[conversation_policy()],
        device="cpu",
        options=RuntimeOptions(probe_store=store),
    )  # type: ignore[arg-type]
    assert store.puts == puts
    for role, choice in later.compiled_steps.items():
        assert choice["compiled"] == measured[role]["compiled"]
        assert "measured earlier" in choice["reason"]
    eager = SpecRuntime(
        target, draft, tokenizer, device="cpu", engine_options={"compile_steps": False}
    )
    assert eager.compiled_steps == {}


@pytest.mark.slow  # compiles both models with inductor
def test_a_runtime_with_compiled_steps_answers_as_an_eager_one(target, draft, tokenizer) -> None:
    """Concurrent calls (batched forwards over slots) and a conversation's next turn (a kept
    prefix copied back into a slot) give the eager runtime's tokens."""
    policies = [conversation_policy()]
    eager = SpecRuntime(
        target, draft, tokenizer, policies, "cpu", engine_options={"compile_steps": False}
    )
    compiled = SpecRuntime(
        target,
        draft,
        tokenizer,
        policies,
        "cpu",
        options=RuntimeOptions(probe_store=recorded_compiled(target, draft)),
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
    runner = ModelRunner(target, slots=True)
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
