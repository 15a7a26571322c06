"""The llama.cpp engine on a GGUF written in the test from the seeded tiny Qwen2: its logits
match transformers' on the same weights, sequences crop and copy as caches do, a batched
forward equals the forwards one by one and is all or nothing, and speculative decoding through
it is exact (greedy equality here; the chi-square tests of sampled outputs against its own
logits run on every engine in ``tests/decoding/test_lossless_distribution.py``)."""

from __future__ import annotations

import copy
import itertools
import threading
import time

import anyio
import pytest
import torch
from conftest import PinnedCosts
from tiny_gguf import make_qwen2, write_gguf

from policies import make_policy
from specagent import RuntimeOptions, SpecRuntime
from specagent.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from specagent.decoding.loop import speculative_generate
from specagent.decoding.sampling import SamplingParams, make_generator
from specagent.decoding.schedule import FixedSchedule
from specagent.errors import GenerationError, ModelLoadError
from specagent.policy import Policy

llama_cpp = pytest.importorskip("llama_cpp")

from specagent.engines.llama_cpp import LlamaCppModel, check_vocabulary, compute_thread  # noqa: E402

TEXTS = ["Hello world, hello", "def f(x):\n    return x", "The quick brown fox jumps"]


@pytest.fixture(scope="module")
def qwen(tokenizer):
    return make_qwen2(len(tokenizer), layers=2, seed=3)


@pytest.fixture(scope="module")
def gguf_file(qwen, tokenizer, tmp_path_factory):
    return write_gguf(qwen, tokenizer, tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf")


@pytest.fixture(scope="module")
def engine_model(gguf_file):
    return LlamaCppModel(gguf_file, context_tokens=4096, max_sequences=16, threads=1)


def test_logits_match_transformers_on_the_same_weights(engine_model, qwen, tokenizer) -> None:
    runner = engine_model.runner()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        ours = runner.forward(ids, runner.new_cache())
        with torch.no_grad():
            reference = qwen(input_ids=torch.tensor([ids])).logits[0].float()
        assert ours.shape == reference.shape
        assert ours.dtype == torch.float32
        # llama.cpp keeps its KV in f16 (its default): close, and the same argmax.
        assert torch.allclose(ours, reference, atol=2e-2), (ours - reference).abs().max()
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_keep_returns_only_the_last_rows(engine_model, tokenizer) -> None:
    runner = engine_model.runner()
    ids = tokenizer.encode(TEXTS[1])
    full = runner.forward(ids, runner.new_cache())
    last = runner.forward(ids, runner.new_cache(), keep=2)
    none = runner.forward(ids, runner.new_cache(), keep=0)
    assert torch.allclose(last, full[-2:], atol=1e-4)
    assert none.shape == (0, full.shape[1])


def test_crop_rolls_back_and_a_copy_is_independent(engine_model, tokenizer) -> None:
    runner = engine_model.runner()
    ids = tokenizer.encode(TEXTS[0])
    seq = runner.new_cache()
    runner.forward(ids[:5], seq)
    assert seq.get_seq_length() == 5
    runner.forward([7, 8, 9], seq)
    seq.crop(-3)  # transformers' convention: drop the last three
    assert seq.get_seq_length() == 5
    after_crop = runner.forward(ids[5:], seq)
    fresh = runner.forward(ids, runner.new_cache())[5:]
    assert torch.allclose(after_crop, fresh, atol=1e-4)

    kept = copy.deepcopy(seq)  # the prefix cache's copy
    assert kept.get_seq_length() == len(ids)
    assert kept.seq_id != seq.seq_id
    runner.forward([11, 12], seq)  # the original moves on ...
    seq.crop(2)  # ... and is cut to almost nothing
    tail = runner.forward([5], kept)  # the copy still holds the whole prompt
    reference = runner.forward([*ids, 5], runner.new_cache())[-1:]
    assert torch.allclose(tail, reference, atol=1e-4)


def test_kept_prefixes_hold_no_cell_of_the_pool(gguf_file) -> None:
    """Kept prefixes are saved outside the pool: four of 300 positions are kept beside a pool
    of 512 cells and two sequence ids, a call still finds room for 400 positions, and each
    prefix restores (cut to its kept length) to what its sequence computed."""
    model = LlamaCppModel(gguf_file, context_tokens=512, max_sequences=2, threads=1)
    runner = model.runner()
    kept, expected = [], []
    for start in range(4):
        ids = [10 + (start * 7 + j * 13) % 200 for j in range(300)]
        seq = runner.new_cache()
        runner.forward(ids, seq, keep=0)
        expected.append(runner.forward([5, 6], seq, keep=1))
        state = runner.kept(seq, copied=False)  # its call is done: the cells go back now
        assert seq.get_seq_length() == 0
        state.crop(300)  # the prefix cache keeps the prompt, not what followed
        kept.append(state)
        del seq
    call = runner.new_cache()
    runner.forward([10 + j % 200 for j in range(400)], call, keep=1)  # no kept prefix in the pool
    with pytest.raises(GenerationError, match="no room in its KV pool of 512 tokens"):
        copy.deepcopy(kept[0])  # but no room beside this call for a restored one
    del call
    for state, logits in zip(kept, expected, strict=True):
        restored = copy.deepcopy(state)  # the prefix cache's copy of an entry
        assert restored.get_seq_length() == 300
        torch.testing.assert_close(runner.forward([5, 6], restored, keep=1), logits)
        del restored
    assert state.get_seq_length() == 300  # the entry itself is unchanged by its copies
    private = runner.reproducible(64).new_cache()
    with pytest.raises(GenerationError, match="private"):
        runner.kept(private, copied=True)


def test_dropped_sequences_give_their_ids_back(gguf_file) -> None:
    model = LlamaCppModel(gguf_file, context_tokens=512, max_sequences=2, threads=1)
    runner = model.runner()
    for _ in range(10):  # more sequences than ids, each dropped after use
        seq = runner.new_cache()
        runner.forward([4, 5, 6], seq)
        del seq
    held = [runner.new_cache(), runner.new_cache()]
    with pytest.raises(GenerationError, match="sequences are in use"):
        runner.new_cache()
    del held


def test_a_batch_equals_the_forwards_one_by_one(engine_model, tokenizer) -> None:
    runner = engine_model.runner()
    prompts = [tokenizer.encode(t) for t in TEXTS]
    singles, batched_seqs = [], []
    for ids in prompts:
        single = runner.new_cache()
        runner.forward(ids, single)
        singles.append((single, runner.forward([9, 10, 11][: len(ids) % 3 + 1], single)))
        seq = runner.new_cache()
        runner.forward(ids, seq)
        batched_seqs.append(seq)
    requests = [
        ([9, 10, 11][: len(ids) % 3 + 1], seq)
        for ids, seq in zip(prompts, batched_seqs, strict=True)
    ]
    before = engine_model.decodes
    batched = runner.forward_batch(requests, [None, 1, None])
    assert engine_model.decodes == before + 1  # one llama_decode for all three calls
    for (_, expected), got, keep in zip(singles, batched, [None, 1, None], strict=True):
        want = expected if keep is None else expected[-1:]
        assert torch.allclose(got, want, atol=1e-4)
    assert [s.get_seq_length() for s in batched_seqs] == [s.get_seq_length() for s, _ in singles]


def test_long_forwards_are_split_to_the_batch_size(gguf_file, tokenizer) -> None:
    model = LlamaCppModel(gguf_file, context_tokens=1024, batch_tokens=16, threads=1)
    runner = model.runner()
    ids = (tokenizer.encode(TEXTS[2]) * 8)[:70]
    logits = runner.forward(ids, runner.new_cache(), keep=3)
    assert model.decodes == 5  # 70 tokens in forwards of 16
    whole = LlamaCppModel(gguf_file, context_tokens=1024, batch_tokens=128, threads=1).runner()
    # Chunks attend to the earlier chunks' f16 KV, one forward to its own f32 rows: close.
    assert torch.allclose(logits, whole.forward(ids, whole.new_cache(), keep=3), atol=2e-2)


def test_a_forward_that_does_not_fit_leaves_every_sequence_as_it_was(gguf_file) -> None:
    model = LlamaCppModel(gguf_file, context_tokens=256, batch_tokens=64, threads=1)
    runner = model.runner()
    small, big = runner.new_cache(), runner.new_cache()
    runner.forward([4, 5, 6], small)
    with pytest.raises(GenerationError, match="no room"):
        runner.forward_batch([([7], small), ([8] * 60 * 5, big)])
    assert (small.get_seq_length(), big.get_seq_length()) == (3, 0)
    again = runner.forward([7], small)  # retried alone: as if the batch never ran
    fresh = runner.forward([4, 5, 6, 7], runner.new_cache())[-1:]
    assert torch.allclose(again, fresh, atol=1e-4)


def test_vocabulary_check_refuses_another_tokenizer(engine_model, tokenizer) -> None:
    check_vocabulary(engine_model, tokenizer)
    with pytest.raises(ModelLoadError, match="vocabulary"):
        check_vocabulary(LlamaCppModel(engine_model.path, threads=1), _Shifted(tokenizer))


class _Shifted:
    """A tokenizer whose ids are the tiny one's shifted by one (a different model's)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __len__(self) -> int:
        return len(self.tokenizer)

    def convert_ids_to_tokens(self, ids):
        texts = self.tokenizer.convert_ids_to_tokens(ids)
        return texts[1:] + texts[:1]


GREEDY = SamplingParams(0.0)


def _generate(runner, ids, drafter=None, k=0, params=GREEDY, seed=0, n=40):
    events = list(
        speculative_generate(
            runner,
            ids,
            params=params,
            generator=make_generator(seed),
            max_new_tokens=n,
            drafter=drafter,
            schedule=FixedSchedule(k),
        )
    )
    return events[-1]


def _plain_greedy(runner, ids, n):
    """Greedy decoding written out against the engine, one token a forward."""
    seq, out = runner.new_cache(), []
    logits = runner.forward(ids, seq, keep=1)
    for _ in range(n):
        token = int(logits[-1].argmax())
        out.append(token)
        logits = runner.forward([token], seq)
    return out


@pytest.fixture(scope="module")
def draft_gguf(tokenizer, tmp_path_factory):
    draft = make_qwen2(len(tokenizer), layers=1, seed=4)
    return write_gguf(draft, tokenizer, tmp_path_factory.mktemp("draft") / "tiny-draft.gguf")


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_equals_the_engines_plain_greedy(
    engine_model, draft_gguf, tokenizer, k
) -> None:
    runner = engine_model.runner()
    draft = LlamaCppModel(draft_gguf, context_tokens=2048, max_sequences=4, threads=1).runner()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        expected = _plain_greedy(runner, ids, 30)
        for drafter in (PromptLookupDrafter(), DraftModelDrafter(draft)):
            out = _generate(runner, ids, drafter, k, n=30)
            assert out.output_ids == expected, drafter.name


# ---------------------------------------------------------------------- the runtime

GREEDY_24 = {"temperature": 0.0, "max_new_tokens": 24}
LOOKUP_4 = {"kind": "prompt_lookup", "num_speculative_tokens": 4}
RELAXED = make_policy(
    "relaxed-lookup",
    LOOKUP_4,
    mode="relaxed",
    acceptance={"rule": "typical", "epsilon": 0.3, "delta": 0.09},
    sampling=GREEDY_24,
)
LOOKUP = make_policy("lookup", LOOKUP_4, sampling=GREEDY_24)
PLAIN = make_policy("plain", sampling=GREEDY_24)


@pytest.fixture
def runtime(gguf_file, tokenizer):
    model = LlamaCppModel(gguf_file, context_tokens=4096, max_sequences=32, threads=1)
    rt = SpecRuntime(
        model,
        tokenizer=tokenizer,
        policies=[LOOKUP, PLAIN, RELAXED],
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    yield rt
    rt.close()


def test_logprobs_on_llama_cpp_are_a_plain_forwards(runtime, tokenizer) -> None:
    """Each emitted token's log-probability, read from the verification that accepted it
    (drafted chains included), equals one plain forward's log-softmax over the same text."""
    runner = runtime._decoder.target_runner
    for text in TEXTS:
        ids = tokenizer.encode(f"{text} {text}")
        result = runtime.generate_sync(ids, policy="lookup", max_new_tokens=16, logprobs=2)
        assert result.logprobs is not None
        assert [each.token_id for each in result.logprobs] == result.token_ids
        full = runner.forward(ids + result.token_ids, runner.new_cache())
        rows = torch.log_softmax(full[len(ids) - 1 : len(ids) - 1 + len(result.token_ids)], -1)
        for row, each in zip(rows, result.logprobs, strict=True):
            assert each.logprob == pytest.approx(float(row[each.token_id]), abs=1e-3)
            assert [t.logprob for t in each.top] == pytest.approx(
                row.topk(2).values.tolist(), abs=1e-3
            )


def test_a_first_token_tie_is_judged_along_a_split_prefill(runtime, tokenizer) -> None:
    """A lossless call that reused a kept prefix prefilled the rest of its prompt apart, so its
    first token can part from plain's at a tie: the explanation measures the engine's rounding
    along such a split prefill, not along the same whole-prompt forward twice (an error of 0
    that read every first-token tie as a real difference)."""
    from specagent.measuring.divergence import explain_divergence

    runner = runtime._decoder.target_runner
    prompt = tokenizer.encode(f"{TEXTS[0]} {TEXTS[1]}")
    whole = runner.forward(prompt, runner.new_cache(), keep=1)[-1]
    first, second = whole.topk(2).indices.tolist()
    model = runner.model
    before = model.decodes
    (report,) = explain_divergence(runtime, [(prompt, [first], [second])])
    assert report["at"] == 0
    assert report["plain_margin"] == pytest.approx(float(whole[first] - whole[second]), abs=1e-4)
    # Plain's path (the prompt whole), then the split one (its two halves): three forwards.
    # (This tiny model on one thread rounds both alike, so its error is not asserted.)
    assert model.decodes - before == 3


def test_a_reference_the_engine_would_not_write_is_judged_by_its_own_rounding(
    runtime, tokenizer
) -> None:
    """The reference is another program's greedy output (llama-cpp-python's ``Llama``): where
    the engine, fed the reference's very tokens, prefers the output's token, the reference
    rounded differently by at least that margin, and a difference within it is a near tie. An
    output that took a token the engine ranks below the reference's (what a drafting bug
    writes) is not."""
    from specagent.measuring.divergence import explain_divergence

    runner = runtime._decoder.target_runner
    prompt = tokenizer.encode(f"{TEXTS[1]} {TEXTS[2]}")
    row = runner.forward(prompt, runner.new_cache(), keep=1)[-1]
    top = row.topk(3)
    first, second, third = top.indices.tolist()
    gap = float(top.values[0] - top.values[1])
    assert gap > 2 * 1e-3  # a real gap, not a tie in this tiny model's rounding
    # The reference (its runner-up, as another program's rounding may pick) against the
    # engine's own choice: the engine's margin along plain's path is the reference's error.
    (other_rounding,) = explain_divergence(runtime, [(prompt, [second], [first])])
    assert other_rounding["plain_margin"] == pytest.approx(-gap, abs=1e-4)
    assert other_rounding["reference_error"] == pytest.approx(gap, abs=1e-4)
    assert other_rounding["near_tie"]
    # The engine's choice as the reference, a lower-ranked token as the output: no error of the
    # reference's to excuse it.
    (bug,) = explain_divergence(runtime, [(prompt, [first], [third])])
    assert bug["plain_margin"] > 0
    assert bug["reference_error"] == 0
    assert not bug["near_tie"]


@pytest.mark.anyio
async def test_concurrent_calls_through_the_runtime_equal_plain_greedy(runtime, tokenizer) -> None:
    assert runtime.engine == "llama.cpp"
    prompts = [f"{t} {t}" for t in TEXTS] * 3
    expected = {}
    runner = runtime._decoder.target_runner  # the engine's own plain greedy, written out
    for text in set(prompts):
        expected[text] = _plain_greedy(runner, tokenizer.encode(text), 24)
    results: dict[int, list[int]] = {}

    async def one(i: int, text: str) -> None:
        result = await runtime.generate(tokenizer.encode(text), policy="lookup", tenant=str(i))
        results[i] = result.token_ids

    before = runtime.target.decodes
    async with anyio.create_task_group() as tg:
        for i, text in enumerate(prompts):
            tg.start_soon(one, i, text)
    for i, text in enumerate(prompts):
        out = results[i]
        assert out == expected[text][: len(out)], text
    # Nine calls share batched forwards: far fewer decodes than their forwards one by one.
    forwards = sum(len(v) for v in results.values())
    assert runtime.target.decodes - before < forwards / 2


@pytest.mark.anyio
async def test_relaxed_calls_report_divergence_on_llama_cpp(runtime, tokenizer) -> None:
    text = TEXTS[0] + " " + TEXTS[0]
    relaxed = await runtime.generate(text, policy="relaxed-lookup")
    plain = await runtime.generate(text, policy="plain")
    assert relaxed.stats.divergence >= 0.0
    assert plain.stats.num_draft_tokens == 0
    assert relaxed.stats.policy == "relaxed-lookup"


@pytest.mark.anyio
async def test_a_kept_prefix_is_reused_by_the_next_call(runtime, tokenizer) -> None:
    text = " ".join(TEXTS) * 3
    first = await runtime.generate(text, policy="plain", tenant="a")
    second = await runtime.generate(text, policy="plain", tenant="a")
    other = await runtime.generate(text, policy="plain", tenant="b")
    assert first.token_ids == second.token_ids == other.token_ids
    assert second.usage.cached_input_tokens > 0
    assert other.usage.cached_input_tokens == 0  # never another tenant's KV


@pytest.mark.anyio
async def test_a_kept_prefix_needs_no_sequence_of_its_own(gguf_file, tokenizer) -> None:
    """One sequence in all: a kept prefix is saved outside the pool, so the call holding the
    only sequence still keeps its prompt, and the next call reuses it."""
    model = LlamaCppModel(gguf_file, context_tokens=2048, max_sequences=1, threads=1)
    rt = SpecRuntime(
        model,
        tokenizer=tokenizer,
        policies=[PLAIN],
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    try:
        text = " ".join(TEXTS) * 3
        first = await rt.generate(text, policy="plain", tenant="t")
        second = await rt.generate(text, policy="plain", tenant="t")
        assert first.token_ids == second.token_ids
        assert second.usage.cached_input_tokens > 0
        # Each kept token is a copy of a cell's KV in host memory: never more than the pool.
        assert rt.prefix_cache is not None
        assert (
            rt.prefix_cache.max_tokens == model.kv_budget() < RuntimeOptions().prefix_cache_tokens
        )
    finally:
        rt.close()


def test_early_exit_is_refused_on_llama_cpp(gguf_file, tokenizer) -> None:
    from specagent.errors import PolicyError

    early = Policy.model_validate(
        {
            "name": "shallow",
            "description": "test",
            "mode": "lossless",
            "drafter": {"kind": "early_exit", "early_exit_layers": 1},
        }
    )
    model = LlamaCppModel(gguf_file, threads=1)
    with pytest.raises(PolicyError, match="transformers engine"):
        SpecRuntime(model, tokenizer=tokenizer, policies=[early])


def test_runtimes_sharing_one_model_step_on_their_own_threads(gguf_file, tokenizer) -> None:
    """Two runtimes over one llama.cpp model (``with_policies``) each step on a worker thread
    of its own: their forwards, copies and crops of the one context never overlap (this once
    crashed the process), and each call's tokens equal the engine's plain greedy ones."""
    model = LlamaCppModel(gguf_file, context_tokens=4096, max_sequences=24, threads=1)
    first = SpecRuntime(
        model,
        tokenizer=tokenizer,
        policies=[LOOKUP, PLAIN],
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    second = first.with_policies([LOOKUP, PLAIN])
    try:
        runner = first._decoder.target_runner  # the engine's own plain greedy, written out
        prompts = [f"{t} {t} {t}" for t in TEXTS]
        expected = {t: _plain_greedy(runner, tokenizer.encode(t), 16) for t in prompts}
        failures: list[BaseException] = []

        def caller(rt: SpecRuntime, n: int) -> None:
            try:
                for i in range(n):
                    text = prompts[i % len(prompts)]
                    out = rt.generate_sync(
                        tokenizer.encode(text),
                        policy="lookup" if i % 2 else "plain",
                        max_new_tokens=16,
                        tenant=f"t{i % 2}",
                    ).token_ids
                    assert out == expected[text][: len(out)], text
            except BaseException as exc:  # reported below, on the test's thread
                failures.append(exc)

        threads = [
            threading.Thread(target=caller, args=(rt, 6)) for rt in (first, second, first, second)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert not failures, failures
    finally:
        second.close()
        first.close()


def test_every_forward_of_the_process_runs_on_one_thread(gguf_file, tokenizer, monkeypatch) -> None:
    """OpenMP keeps a thread team per thread that computes, and a second team stops libgomp
    spinning between regions (every step then pays for waking threads: 34 -> 48 ms a token on
    a 2-core Zen 4). So two runtimes' workers, a forward asked from the test's own thread and
    the runtimes' rounds (the torch operations on the logits: torch and ggml share one
    libgomp) all run on one thread; an error raised there reaches the caller."""
    model = LlamaCppModel(gguf_file, context_tokens=4096, max_sequences=24, threads=1)
    decoding: set[int] = set()
    rounds: set[int] = set()
    decode = llama_cpp.llama_decode

    def recorded(*args):
        decoding.add(threading.get_ident())
        return decode(*args)

    monkeypatch.setattr(model._lib, "llama_decode", recorded)
    first = SpecRuntime(
        model,
        tokenizer=tokenizer,
        policies=[LOOKUP, PLAIN],
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    second = first.with_policies([LOOKUP, PLAIN])
    try:
        for rt in (first, second):
            work = rt._ensure_worker()._round
            monkeypatch.setattr(
                rt._worker, "_round", lambda s, w=work: (rounds.add(threading.get_ident()), w(s))
            )
        ids = tokenizer.encode(TEXTS[0])
        runner = model.runner()
        runner.forward(ids, runner.new_cache())
        for rt in (first, second):
            for policy in ("lookup", "plain"):
                rt.generate_sync(ids, policy=policy, max_new_tokens=8)
        assert len(decoding) == 1, decoding
        assert decoding == rounds
        assert threading.get_ident() not in decoding
        own = model.private_sequence(8)
        with pytest.raises(GenerationError, match="no room in the call's own KV"):
            runner.forward(list(range(1, 300)), own)
    finally:
        second.close()
        first.close()


def _equal_but_for_a_near_tie(
    model: LlamaCppModel, prompt: list[int], first: list[int], second: list[int]
) -> None:
    """Two greedy outputs over one model are equal, or part where the target's top two
    logits lie within 0.01 (ggml's sums depend on which other sequences share the KV pool,
    and a random tiny model has such ties: 2.12839 against 2.12794 once in ~15 runs)."""
    if first == second:
        return
    at = next(n for n, (a, b) in enumerate(zip(first, second, strict=True)) if a != b)
    runner = model.runner()
    logits = runner.forward(prompt + first[:at], runner.new_cache())[-1].float()
    top = torch.topk(logits, 2)
    assert {first[at], second[at]} == set(top.indices.tolist()), (at, top)
    assert float(top.values[0] - top.values[1]) < 0.01, (at, top)


def test_runtimes_sharing_the_llama_cpp_thread_take_turns_round_by_round(
    gguf_file, tokenizer, monkeypatch
) -> None:
    """A worker runs its rounds back to back on the llama.cpp thread (one hand-off per burst,
    not per step), but hands the thread back after a round as soon as another runtime's work
    waits for it: two long calls on two runtimes over one model advance in turns, neither
    waits for the other to finish."""
    model = LlamaCppModel(gguf_file, context_tokens=4096, max_sequences=24, threads=1)
    first = SpecRuntime(
        model,
        tokenizer=tokenizer,
        policies=[PLAIN],
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    second = first.with_policies([PLAIN])
    order: list[int] = []
    try:
        for index, rt in enumerate((first, second)):
            rt.wait_measured()
            work = rt._ensure_worker()._round
            monkeypatch.setattr(
                rt._worker, "_round", lambda s, w=work, i=index: (order.append(i), w(s))
            )
        ids = tokenizer.encode(TEXTS[0])
        results: dict[int, list[int]] = {}
        eos: list[int] = []
        for rt in (first, second):
            rt.eos_token_ids = eos  # both run their whole budget
        threads = [
            threading.Thread(
                target=lambda i=i, rt=rt: results.__setitem__(
                    i, rt.generate_sync(ids, policy="plain", max_new_tokens=48).token_ids
                )
            )
            for i, rt in enumerate((first, second))
        ]
        # Both calls wait for the llama.cpp thread before either steps (held by a job of
        # the test's own), so the turns do not depend on when each thread got going.
        gate = threading.Event()
        holder = threading.Thread(target=compute_thread.run, args=(gate.wait,))
        holder.start()
        for thread in threads:
            thread.start()
        # Until both calls wait, or one ended without needing the thread (its failure shows
        # in the assertions below).
        while compute_thread.waiting() < 2 and all(thread.is_alive() for thread in threads):
            time.sleep(0.005)
        gate.set()
        holder.join(timeout=60)
        for thread in threads:
            thread.join(timeout=300)
        assert len(results[0]) == len(results[1]) == 48
        _equal_but_for_a_near_tie(model, ids, results[0], results[1])
        switches = sum(a != b for a, b in itertools.pairwise(order))
        assert switches >= 20, "".join(map(str, order))
    finally:
        second.close()
        first.close()


def test_costs_asked_while_the_worker_measures_them_do_not_deadlock(
    gguf_file, tokenizer, tmp_path
) -> None:
    """``step_costs`` asked from a caller's thread while the worker's rounds measure the same
    curves on the llama.cpp thread: the book's lock is held around each timing, so a timing
    that waited for the compute thread while the compute thread waited for that lock would
    hang both for ever. Each of several runtimes (nothing stored: everything measured) answers."""
    from specagent.machine import ProbeStore

    for attempt in range(3):
        model = LlamaCppModel(gguf_file, context_tokens=4096, max_sequences=24, threads=1)
        rt = SpecRuntime(
            model,
            tokenizer=tokenizer,
            policies=[LOOKUP, PLAIN],
            options=RuntimeOptions(probe_store=ProbeStore(tmp_path / str(attempt))),
        )
        answers: list[object] = []
        try:
            rt._ensure_worker()  # its background measurement starts now
            asking = threading.Thread(
                target=lambda rt=rt, answers=answers: answers.append(rt.step_costs("lookup"))
            )
            asking.start()
            out = rt.generate_sync(tokenizer.encode(TEXTS[0]), policy="lookup", max_new_tokens=8)
            asking.join(timeout=120)
            assert not asking.is_alive(), "step_costs and the worker wait for each other"
            assert answers
            assert answers[0].verify
            assert out.token_ids
        finally:
            rt.close()


def _drafting_run(model: LlamaCppModel, seq, others: bool) -> list:
    """A call's forwards (a prompt, then drafts of 5 with 3 rejected each time), optionally
    while other sequences come, go and leave holes in the shared pool."""
    import numpy as np

    rng, other_rng = np.random.default_rng(0), np.random.default_rng(1)
    kept = []
    out = [model.decode([(seq, list(range(10, 40)), 1)])[0]]
    for _ in range(12):
        if others:
            other = model.sequence()
            model.decode([(other, [int(t) for t in other_rng.integers(5, 300, 7)], 1)])
            kept.append(other)
            if len(kept) > 2:
                kept.pop(0).crop(2)
        out.append(model.decode([(seq, [int(t) for t in rng.integers(5, 300, 5)], 5)])[0])
        seq.crop(seq.length - 3)
    return out


def test_a_private_sequence_computes_the_same_logits_whatever_the_pool_holds(gguf_file) -> None:
    """Bit for bit: in the shared pool a call's cells land where others left room, which
    changes the order its attention sums them in (a reproducible call gets its own)."""
    import numpy as np

    runs = []
    for others in (False, True):
        model = LlamaCppModel(gguf_file, context_tokens=1024, max_sequences=8, threads=1)
        seq = model.private_sequence(512)
        assert seq.private
        runs.append(_drafting_run(model, seq, others))
    for a, b in zip(*runs, strict=True):
        assert np.array_equal(a, b)
    with pytest.raises(GenerationError, match="not copied"):
        copy.deepcopy(seq)
    runner = model.runner().reproducible(300)
    private = runner.new_cache()
    assert private.private
    with pytest.raises(GenerationError, match="the call's own KV of 512 tokens"):
        runner.forward(list(range(600)), private)


@pytest.mark.anyio
async def test_one_call_never_takes_the_pool_another_call_needs(gguf_file, tokenizer) -> None:
    """A pool of 1,024 cells: a call may hold at most half (longer ones are refused, saying
    so); calls that would not fit beside the running ones wait for them instead of failing,
    and every call runs to its budget (its tokens may differ from alone at a rounding tie: a
    shared pool's cells change the sums' order, as ``reproducible`` policies avoid)."""
    from specagent import ContextLengthError

    model = LlamaCppModel(gguf_file, context_tokens=1024, max_sequences=32, threads=1)
    assert model.context_window == 512
    rt = SpecRuntime(
        model,
        tokenizer=tokenizer,
        policies=[PLAIN],
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    try:
        hog = [i % 300 + 10 for i in range(400)]  # 400 prompt tokens + 80 new: within half
        others = [[(i * 13 + j) % 300 + 5 for j in range(180)] for i in range(5)]
        alone = {}
        for i, prompt in enumerate([hog, *others]):
            budget = 80 if i == 0 else 40
            alone[i] = (await rt.generate(prompt, policy="plain", max_new_tokens=budget)).token_ids
        results: dict[int, list[int]] = {}

        async def one(i: int, prompt: list[int]) -> None:
            budget = 80 if i == 0 else 40
            out = await rt.generate(prompt, policy="plain", max_new_tokens=budget, tenant=f"t{i}")
            results[i] = out.token_ids

        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate([hog, *others]):
                tg.start_soon(one, i, prompt)
        assert {i: len(t) for i, t in results.items()} == {i: len(t) for i, t in alone.items()}
        with pytest.raises(ContextLengthError, match="context window"):
            await rt.generate([i % 300 + 10 for i in range(520)], policy="plain", max_new_tokens=4)
    finally:
        rt.close()


def test_a_private_context_is_reused_cleared_and_computes_what_a_new_one_does(
    gguf_file,
) -> None:
    """Creating a context costs the stepping thread tens of milliseconds: a reproducible
    call's context, once its call ended, is cleared and kept for the next one, which computes
    bit for bit what it would in a new context."""
    import numpy as np

    from specagent.engines.llama_cpp.model import SPARE_CONTEXTS

    model = LlamaCppModel(gguf_file, context_tokens=1024, max_sequences=8, threads=1)
    first = model.private_sequence(300)
    context = first._context
    fresh = _drafting_run(model, first, others=False)
    del first
    second = model.private_sequence(280)  # the same size class
    assert second._context is context
    again = _drafting_run(model, second, others=True)
    for a, b in zip(fresh, again, strict=True):
        assert np.array_equal(a, b)
    held = [model.private_sequence(300) for _ in range(SPARE_CONTEXTS + 3)]
    assert held[0]._context is not context  # in use by ``second``: never shared
    del held, second
    model.private_sequence(300)
    # Spares are bounded: the rest were freed.
    assert len(model._private) <= SPARE_CONTEXTS + 1


@pytest.mark.anyio
async def test_reproducible_calls_count_against_the_kv_budget(gguf_file, tokenizer) -> None:
    """A flood of reproducible calls, each in a context of its own, waits for room in the
    budget as ordinary calls do, instead of holding KV past it beside the pool."""
    model = LlamaCppModel(gguf_file, context_tokens=1024, max_sequences=32, threads=1)
    exact = make_policy("exact", sampling={"temperature": 0.0, "max_new_tokens": 24})
    exact = exact.model_copy(update={"reproducible": True})
    rt = SpecRuntime(
        model,
        tokenizer=tokenizer,
        policies=[exact],
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, sum(1 for c in list(model._private) if not c.free))
            stop.wait(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        prompts = [[(i * 7 + j) % 300 + 5 for j in range(300)] for i in range(8)]

        async def one(i: int) -> None:
            await rt.generate(prompts[i], policy="exact", tenant=f"t{i}")

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    finally:
        stop.set()
        watcher.join()
        rt.close()
    # Each may hold 300 + 24 + its drafts of a 1,024-cell budget: three at once at most.
    assert 1 <= peak <= 3
