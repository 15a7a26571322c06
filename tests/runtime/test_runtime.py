"""SpecRuntime through its public API: async, streaming, sync, concurrency, cancellation, bad
input, policies and overrides."""

from __future__ import annotations

import threading
import time
from collections.abc import Generator

import anyio
import numpy as np
import pytest
from conftest import make_model, make_tokenizer, perturbed_copy

from policies import make_policy
from specagent import (
    ContextLengthError,
    IncompatibleDraftError,
    InvalidRequestError,
    Policy,
    PolicyError,
    PolicyNotFoundError,
    RuntimeClosedError,
    RuntimeOptions,
    RuntimeOverloadedError,
    SpecRuntime,
    shipped_policies,
)

DRAFT_4 = {"kind": "draft_model", "num_speculative_tokens": 4, "adaptive": False}
POLICIES = [
    make_policy("exact", DRAFT_4, match={"tags": ["legal"]}),
    make_policy(
        "fast",
        DRAFT_4,
        mode="relaxed",
        acceptance={"rule": "lenience", "lenience": 0.3},
        match={"tags": ["summary"]},
    ),
    make_policy(
        "budget",
        DRAFT_4,
        mode="relaxed",
        acceptance={"rule": "lenience", "lenience": 0.05, "max_divergence": 0.001},
    ),
    make_policy("lookup", {"kind": "prompt_lookup", "num_speculative_tokens": 5}),
    make_policy(
        "self", {"kind": "early_exit", "early_exit_layers": 2, "num_speculative_tokens": 3}
    ),
]


@pytest.fixture(scope="module")
def runtime(target, draft, tokenizer):
    rt = SpecRuntime(
        target=target, draft=draft, tokenizer=tokenizer, policies=POLICIES, device="cpu"
    )
    yield rt
    rt.close()


@pytest.mark.anyio
async def test_generate_returns_text_tokens_usage_and_stats(runtime, tokenizer) -> None:
    async with runtime:
        result = await runtime.generate("Hello there", policy="exact", max_new_tokens=30, seed=1)
    assert result.finish_reason in {"stop", "length"}
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.usage.input_tokens == len(tokenizer.encode("Hello there"))
    assert result.usage.output_tokens == len(result.token_ids)
    stats = result.stats
    assert (stats.policy, stats.mode, stats.drafter) == ("exact", "lossless", "draft_model")
    assert stats.num_draft_tokens >= stats.num_accepted_tokens > 0
    assert stats.acceptance_rate == pytest.approx(
        stats.num_accepted_tokens / stats.num_draft_tokens
    )
    assert stats.mean_acceptance_length > 1.0
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert 0 < stats.ttft_s <= stats.latency_s
    assert stats.tokens_per_s > 0
    assert stats.divergence is None


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_call_awaited_whole_wakes_its_caller_once_not_every_step(
    runtime, monkeypatch
) -> None:
    """The worker wakes a streaming caller's loop for every step's tokens, a caller waiting
    for the whole result only at the end (each wake-up is a system call on the stepping
    thread and the caller's loop running beside the next forward); the time to first token
    is still when the first token came, not when the caller read it."""
    import asyncio

    loop = asyncio.get_running_loop()
    wakes = 0
    real = loop.call_soon_threadsafe

    def counted(*args, **kwargs):
        nonlocal wakes
        wakes += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
    prompt = "Hello there, how is the weather"
    async with runtime:
        await runtime.generate(prompt, policy="lookup", max_new_tokens=2)  # the worker is up
        wakes = 0
        chunks = [c async for c in runtime.stream(prompt, policy="lookup", max_new_tokens=40)]
        streamed = wakes
        wakes = 0
        started = time.perf_counter()
        result = await runtime.generate(prompt, policy="lookup", max_new_tokens=40)
        elapsed = time.perf_counter() - started
        whole = wakes
    assert len(chunks) >= 5
    assert streamed >= len(chunks) - 1
    assert whole <= 3
    assert result.text == chunks[-1].result.text
    assert 0 < result.stats.ttft_s < result.stats.latency_s <= elapsed


@pytest.mark.anyio
async def test_greedy_runtime_equals_target_greedy(runtime, target, tokenizer) -> None:
    import torch

    ids = tokenizer.encode("def f(x): return")
    expected = target.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=25,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    expected_ids = expected[0, len(ids) :].tolist()
    for policy in ("exact", "lookup", "self", "default"):
        result = await runtime.generate(ids, policy=policy, max_new_tokens=25)
        n = len(result.token_ids)
        assert result.token_ids == expected_ids[:n], policy
        assert n == 25 or expected_ids[n] in runtime.eos_token_ids


@pytest.mark.anyio
async def test_stream_chunks_add_up_to_the_result(runtime) -> None:
    chunks = [
        c async for c in runtime.stream("Stream me", policy="exact", max_new_tokens=20, seed=2)
    ]
    assert chunks[-1].result is not None
    assert chunks[-1].finish_reason is not None
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == chunks[-1].result.text
    assert sum(len(c.token_ids) for c in chunks) >= len(chunks[-1].result.token_ids)


@pytest.mark.anyio
async def test_stop_strings_end_the_call_and_are_never_emitted(runtime) -> None:
    kwargs = {"policy": "exact", "max_new_tokens": 40, "seed": 0, "temperature": 1.0}
    free = await runtime.generate("Stop here", **kwargs)
    stop = free.text[10:12]
    assert len(stop) == 2
    chunks = [c async for c in runtime.stream("Stop here", stop=[stop], **kwargs)]
    result = chunks[-1].result
    assert result.finish_reason == "stop"
    assert stop not in result.text
    assert free.text.startswith(result.text)
    assert result.text == free.text[: free.text.index(stop)]
    assert "".join(c.text for c in chunks) == result.text


def test_sync_front_door(runtime) -> None:
    a = runtime.generate_sync("Sync", policy="exact", max_new_tokens=12, seed=3)
    b = runtime.generate_sync("Sync", policy="exact", max_new_tokens=12, seed=3)
    assert a.token_ids == b.token_ids
    chunks = list(runtime.stream_sync("Sync", policy="exact", max_new_tokens=12, seed=3))
    assert chunks[-1].result.token_ids == a.token_ids


@pytest.mark.anyio
async def test_sync_front_door_refuses_to_block_an_event_loop(runtime) -> None:
    with pytest.raises(RuntimeError, match=r"await runtime\.generate"):
        runtime.generate_sync("x", max_new_tokens=2)


def test_sync_calls_from_many_threads(runtime) -> None:
    results: dict[int, list[int]] = {}

    def call(i: int) -> None:
        results[i] = runtime.generate_sync(
            f"thread {i}", policy="exact", max_new_tokens=10
        ).token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(6):
        assert (
            results[i]
            == runtime.generate_sync(f"thread {i}", policy="exact", max_new_tokens=10).token_ids
        )


@pytest.mark.anyio
async def test_chat_messages_use_the_chat_template(runtime, tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    result = await runtime.generate(messages, max_new_tokens=5, seed=0)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert result.prompt_token_ids == list(rendered["input_ids"])


@pytest.mark.anyio
async def test_concurrent_calls_match_sequential_ones(runtime) -> None:
    prompts = [f"Prompt number {i}" for i in range(8)]
    sequential = [
        (await runtime.generate(p, policy="exact", max_new_tokens=15)).token_ids for p in prompts
    ]
    results: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        results[i] = (
            await runtime.generate(prompts[i], policy="exact", max_new_tokens=15)
        ).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    assert results == sequential


@pytest.mark.anyio
async def test_same_seed_same_tokens_at_temperature(runtime) -> None:
    kwargs = {"policy": "exact", "max_new_tokens": 20, "temperature": 1.0}
    a = await runtime.generate("Seeded", seed=11, **kwargs)
    b = await runtime.generate("Seeded", seed=11, **kwargs)
    c = await runtime.generate("Seeded", seed=12, **kwargs)
    assert a.token_ids == b.token_ids != c.token_ids
    assert a.seed == 11
    d = await runtime.generate("Seeded", **kwargs)
    assert (await runtime.generate("Seeded", seed=d.seed, **kwargs)).token_ids == d.token_ids


@pytest.mark.anyio
async def test_cancelled_call_stops_at_the_next_step(runtime) -> None:
    worker = runtime._ensure_worker()
    with anyio.move_on_after(0.05):
        await runtime.generate("long " * 5, policy="exact", max_new_tokens=400, temperature=1.0)
    for _ in range(1000):  # the worker drops it before its next step (however busy it is)
        if not worker.active:
            break
        await anyio.sleep(0.01)
    assert not worker.active
    assert not worker.inbox
    result = await runtime.generate("still serving", policy="exact", max_new_tokens=5)
    assert result.usage.output_tokens > 0


@pytest.mark.anyio
async def test_timeout(runtime) -> None:
    with pytest.raises(TimeoutError):
        await runtime.generate("slow", policy="exact", max_new_tokens=400, timeout=0.02)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("prompt", "kwargs", "error", "match"),
    [
        ("", {}, InvalidRequestError, "prompt is empty"),
        ([], {}, InvalidRequestError, "prompt is empty"),
        ([5, 10_000], {}, InvalidRequestError, "outside the vocabulary"),
        ([5, -1], {}, InvalidRequestError, "outside the vocabulary"),
        ([1.5, 2], {}, InvalidRequestError, "list of token ids"),
        (42, {}, InvalidRequestError, "got int"),
        ([{"role": "wizard", "content": "x"}], {}, InvalidRequestError, "role must be one of"),
        ("ok", {"max_new_tokens": -3}, InvalidRequestError, "max_new_tokens"),
        ("ok", {"temperature": -1.0}, InvalidRequestError, "temperature"),
        ("ok", {"top_p": 0.0}, InvalidRequestError, "top_p"),
        ("x" * 600, {}, ContextLengthError, "context window is 512"),
        ("x" * 500, {"max_new_tokens": 100}, ContextLengthError, "at most 12 new tokens fit"),
        ("ok", {"policy": "legl"}, PolicyNotFoundError, "known policies: budget, default, exact"),
    ],
)
async def test_bad_input_is_refused_and_the_runtime_keeps_serving(
    runtime, prompt, kwargs, error, match
) -> None:
    with pytest.raises(error, match=match):
        await runtime.generate(prompt, **kwargs)
    assert (await runtime.generate("fine", max_new_tokens=3)).usage.output_tokens > 0


@pytest.mark.anyio
async def test_a_caller_cannot_make_a_lossless_policy_relaxed(runtime) -> None:
    with pytest.raises(TypeError):
        await runtime.generate("x", policy="exact", mode="relaxed")  # type: ignore[call-arg]
    result = await runtime.generate(
        "x", policy="exact", temperature=1.0, top_p=0.5, max_new_tokens=5
    )
    assert result.stats.mode == "lossless"
    assert result.stats.divergence is None


@pytest.mark.anyio
async def test_routing_by_tags(runtime) -> None:
    assert (await runtime.generate("x", tags=["summary"], max_new_tokens=3)).stats.policy == "fast"
    assert (await runtime.generate("x", tags=["legal"], max_new_tokens=3)).stats.policy == "exact"
    assert (await runtime.generate("x", tags=["other"], max_new_tokens=3)).stats.mode == "lossless"


@pytest.mark.anyio
async def test_relaxed_accepts_more_than_lossless_and_reports_divergence(runtime) -> None:
    totals = {"exact": [0, 0], "fast": [0, 0]}
    divergences = []
    for seed in range(12):
        for name in totals:
            r = await runtime.generate(
                f"Compare {seed}", policy=name, temperature=1.0, max_new_tokens=30, seed=seed
            )
            totals[name][0] += r.stats.num_accepted_tokens
            totals[name][1] += r.stats.num_draft_tokens
            if name == "fast":
                divergences.append(r.stats.divergence)
    lossless_rate = totals["exact"][0] / totals["exact"][1]
    relaxed_rate = totals["fast"][0] / totals["fast"][1]
    assert relaxed_rate > lossless_rate
    assert all(d is not None and 0.0 <= d <= 1.0 for d in divergences)
    assert max(divergences) > 0.0


@pytest.mark.anyio
async def test_divergence_budget_falls_back_to_lossless(runtime) -> None:
    result = await runtime.generate(
        "Budget", policy="budget", temperature=1.0, max_new_tokens=60, seed=4
    )
    assert result.stats.mode == "relaxed"
    assert result.stats.fell_back_to_lossless


@pytest.mark.slow
def test_lossless_distribution_through_the_runtime() -> None:
    """The public path (adaptive k, calibrated costs, worker, batched verification of
    concurrent calls with ragged acceptance) stays lossless: the first four tokens match the
    target's exact marginals (chi-square, N = 1500)."""
    from distributions import PROMPT, STEPS, chi_square_pvalues, exact_marginals
    from engine_pairs import SMALL_VOCAB as VOCAB

    from specagent.decoding.sampling import SamplingParams

    target = make_model(VOCAB, layers=2, seed=11, hidden=32, init=0.4)
    draft = make_model(VOCAB, layers=1, seed=12, hidden=32, init=0.4)
    policy = Policy(
        name="p",
        description="d",
        mode="lossless",
        drafter={"kind": "draft_model", "num_speculative_tokens": 3},
    )
    rt = SpecRuntime(target=target, draft=draft, policies=[policy], device="cpu")
    rt.target.generation_config.eos_token_id = None
    rt.eos_token_ids = []
    marginals = exact_marginals(target, SamplingParams(temperature=1.0))
    counts = np.zeros((STEPS, VOCAB))

    batch_sizes: list[int] = []
    real_batch = rt._decoder.target_runner.forward_batch

    def spy(requests, keep=None):  # records what the worker batched; the real forward works
        batch_sizes.append(len(requests))
        return real_batch(requests, keep)

    rt._decoder.target_runner.forward_batch = spy  # type: ignore[method-assign]

    async def one(seed: int) -> None:
        r = await rt.generate(PROMPT, policy="p", temperature=1.0, max_new_tokens=STEPS, seed=seed)
        for t, token in enumerate(r.token_ids):
            counts[t, token] += 1

    async def run_all() -> None:
        async with rt:
            for wave in range(0, 1500, 50):  # 50 calls at a time share batched steps
                async with anyio.create_task_group() as tg:
                    for seed in range(wave, wave + 50):
                        tg.start_soon(one, seed)

    anyio.run(run_all)
    assert counts.sum() == 1500 * STEPS
    assert max(batch_sizes) > 10  # batching was on
    assert min(chi_square_pvalues(counts, marginals)) > 1e-3


def test_incompatible_draft_is_refused(target, tokenizer) -> None:
    small = make_model(50, layers=1, seed=3)
    with pytest.raises(IncompatibleDraftError, match="vocabulary sizes do not fit"):
        SpecRuntime(target=target, draft=small, tokenizer=tokenizer, device="cpu")
    other_tok = make_tokenizer()
    other_tok.add_tokens(["<extra>"])
    vocab = other_tok.get_vocab()
    assert vocab["<extra>"] == len(tokenizer)
    swapped = make_tokenizer()
    swapped.add_special_tokens({"additional_special_tokens": ["<x>"]})
    draft = perturbed_copy(target, 0.01, seed=5)
    # a draft tokenizer whose ids disagree with the target's
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.WordLevel({chr(65 + i): i for i in range(26)}, unk_token="A"))
    from transformers import PreTrainedTokenizerFast

    different = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="A")
    with pytest.raises(IncompatibleDraftError, match="differs from the target's"):
        SpecRuntime(
            target=target, draft=draft, tokenizer=tokenizer, draft_tokenizer=different, device="cpu"
        )


def test_policy_needing_a_draft_model(target, tokenizer) -> None:
    with pytest.raises(PolicyError, match="draft_model needs a draft model"):
        SpecRuntime(target=target, tokenizer=tokenizer, policies=[POLICIES[0]], device="cpu")
    fallback = Policy(
        name="fb",
        description="d",
        mode="lossless",
        drafter={"kind": "draft_model", "fallback": "prompt_lookup"},
    )
    rt = SpecRuntime(target=target, tokenizer=tokenizer, policies=[fallback], device="cpu")
    assert rt.generate_sync("abab", policy="fb", max_new_tokens=4).stats.drafter == "prompt_lookup"
    rt.close()


def test_shipped_policies_load_into_a_single_model_runtime(target, tokenizer) -> None:

    rt = SpecRuntime(
        target=target,
        tokenizer=tokenizer,
        policies=shipped_policies(),
        device="cpu",
    )
    result = rt.generate_sync("Summarise: a b c", tags=["summary"], max_new_tokens=8, seed=0)
    assert (result.stats.policy, result.stats.mode) == ("internal-summary", "relaxed")
    rt.close()


def test_overload_and_shutdown(target, draft, tokenizer) -> None:
    rt = SpecRuntime(
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        policies=POLICIES,
        device="cpu",
        options=RuntimeOptions(max_active=1, max_queue=1),
    )
    errors: list[BaseException] = []
    gate = threading.Event()  # holds every decoding step until the test has looked
    real_decode = rt._decoder.decode

    def gated_decode(request, device):
        steps = real_decode(request, device)
        reply = None
        while True:
            gate.wait()
            try:
                item = steps.send(reply)
            except StopIteration:
                return
            reply = yield item

    rt._decoder.decode = gated_decode  # type: ignore[method-assign]

    def long_call() -> None:
        try:
            rt.generate_sync("long", policy="exact", max_new_tokens=50)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=long_call) for _ in range(2)]
    for t in threads:
        t.start()
    worker = rt._ensure_worker()
    deadline = time.monotonic() + 30
    while not (len(worker.active) == 1 and len(worker.inbox) == 1) and time.monotonic() < deadline:
        time.sleep(0.01)  # the first call runs, the second waits in the queue
    assert len(worker.active) == 1
    assert len(worker.inbox) == 1
    with pytest.raises(RuntimeOverloadedError, match="max_queue=1"):
        rt.generate_sync("one too many", policy="exact", max_new_tokens=5)
    closing = threading.Thread(target=rt.close, kwargs={"drain": False})
    closing.start()
    time.sleep(0.1)
    gate.set()  # the worker sees the close at its next step
    closing.join(timeout=10)
    for t in threads:
        t.join(timeout=10)
    assert len(errors) == 2
    assert all(isinstance(e, RuntimeClosedError) for e in errors)
    # a closed runtime starts a fresh worker when used again
    rt._decode = real_decode  # type: ignore[method-assign]
    assert rt.generate_sync("again", policy="exact", max_new_tokens=3).usage.output_tokens > 0
    rt.close()


@pytest.mark.anyio
async def test_a_failing_call_does_not_take_others_down(
    target, draft, tokenizer, monkeypatch
) -> None:
    """Out of device memory (or any error) in one call fails that call with a clear error; the
    worker frees what it held and keeps serving the rest. The fault is in the target model
    itself, wherever a forward feeds the poisoned prompt: the calls' first forwards are one
    batch (the prompts are short), which fails, and the worker retries them one by one to
    find the culprit."""
    import torch

    from specagent import GenerationError

    rt = SpecRuntime(
        target=target, draft=draft, tokenizer=tokenizer, policies=POLICIES, device="cpu"
    )
    poison = tokenizer.encode("POISON")
    embedding = target.get_input_embeddings()
    real_forward = embedding.forward

    def forward(input_ids):  # type: ignore[no-untyped-def]
        if any(row[: len(poison)] == poison for row in input_ids.tolist()):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_forward(input_ids)

    monkeypatch.setattr(embedding, "forward", forward)
    outcomes: dict[str, object] = {}

    async def call(name: str, prompt: list[int] | str) -> None:
        try:
            outcomes[name] = await rt.generate(prompt, policy="exact", max_new_tokens=15)
        except GenerationError as exc:
            outcomes[name] = exc

    async with rt, anyio.create_task_group() as tg:
        tg.start_soon(call, "ok-1", "Hello there")
        tg.start_soon(call, "bad", [*poison, *poison])
        tg.start_soon(call, "ok-2", "General Kenobi")
    assert isinstance(outcomes["bad"], GenerationError)
    assert "out of device memory" in str(outcomes["bad"])
    assert outcomes["ok-1"].usage.output_tokens > 0  # type: ignore[union-attr]
    assert outcomes["ok-2"].usage.output_tokens > 0  # type: ignore[union-attr]
    assert rt._worker is None  # closed cleanly by the async with


def test_workers_still_busy_are_stopped_at_interpreter_exit() -> None:
    """A worker still measuring in the background when the interpreter exits is stopped by the
    exit hook (between two slices of its work), not unwound mid-forward at finalization."""
    from specagent.runtime._worker import Worker, _stop_at_exit

    slices = 0

    def measuring() -> Generator[None, None, None]:
        nonlocal slices
        while True:  # never done on its own
            slices += 1
            time.sleep(0.01)
            yield

    worker = Worker(
        lambda request: None, max_active=1, max_queue=1, batching=False, background=measuring()
    )
    while slices < 3:
        time.sleep(0.01)
    _stop_at_exit()
    assert not worker.thread.is_alive()
    assert worker.background is None  # closed, to be measured again by a later worker


@pytest.mark.anyio
async def test_admission_never_pauses_the_event_loop(runtime) -> None:
    """A call whose admission is slow (a huge prompt to tokenize, a grammar to compile: here
    a planted 0.6 s, by wrapping the runtime's admission, which no public hook slows) runs
    it off the event loop: a heartbeat on the loop keeps its pace, and the call answers."""
    import time

    real = runtime._calls.admission

    class Slow:
        def __getattr__(self, name):
            return getattr(real, name)

        def plan(self, *args, **kwargs):
            time.sleep(0.6)
            return real.plan(*args, **kwargs)

    runtime._calls.admission = Slow()
    gaps: list[float] = []
    try:

        async def heartbeat() -> None:
            last = time.perf_counter()
            for _ in range(12):
                await anyio.sleep(0.05)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat)
            result = await runtime.generate("Slow to admit", policy="exact", max_new_tokens=2)
        assert result.token_ids
        assert max(gaps) < 0.4, gaps
    finally:
        runtime._calls.admission = real


def test_calls_cancelled_in_the_queue_free_their_place() -> None:
    """``max_queue`` bounds calls that wait: one given up while it waited (its caller
    cancelled) no longer counts, so a new call is taken instead of a 429."""
    from specagent.runtime._worker import Job, Worker

    class Sink:  # what the worker delivers to a caller, dropped: no caller is listening
        def put(self, item) -> None:
            pass

    gate = threading.Event()

    def blocked(request):  # the running call holds the only slot until the gate opens
        def steps():
            gate.wait(30)
            return
            yield

        return steps()

    worker = Worker(blocked, max_active=1, max_queue=1, batching=False, background=None)
    try:
        running = Job(object(), Sink())
        worker.submit(running)
        deadline = time.monotonic() + 10
        while worker.inbox and time.monotonic() < deadline:
            time.sleep(0.01)  # the first call leaves the queue for the slot
        waiting = Job(object(), Sink())
        worker.submit(waiting)
        with pytest.raises(RuntimeOverloadedError):
            worker.submit(Job(object(), Sink()))
        waiting.cancelled.set()
        worker.submit(Job(object(), Sink()))  # takes the cancelled call's place
    finally:
        gate.set()
        worker.stop(drain=False)
