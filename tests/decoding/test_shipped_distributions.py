"""The settings that ship are lossless: speculative outputs distributed as plain sampling from
the target, at every one of 8 to 12 positions, for the sampling shapes the shipped policies use
(temperature 0.3 / 0.7 / 1.0 with top-p 0.9 / 0.95 and top-k), adaptive k with drafts longer
than 8, the top-p fast path on a 4,096-token vocabulary, the shipped ``customer-reply`` policy
through the public runtime with concurrent batched calls and history drafting, and under a
grammar. Each family is paired with a planted bug that the same test must catch.

How: per position, a chi-square test of the speculative tokens (N = 2000) against a reference.
The reference is plain sampling, batched, written here without the library's sampling code
(temperature, top-k, then top-p over a full sort), N = 20,000: two-sample tests of independent
draws, so the reference's own noise is accounted for. With fixed seeds each test is
deterministic; the pass threshold (every position p > 1e-4) and the bug threshold (some
position p < 1e-6) are far apart. Marked ``slow``: they run by default (``pytest``) and take
about N forwards per case; ``-m "not slow"`` leaves them out of a quick run."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import anyio
import numpy as np
import pytest
import torch
from conftest import make_model, perturbed_copy
from scipy.stats import chi2_contingency

from specagent import Policy, SpecRuntime, shipped_policies
from specagent.decoding import acceptance, sampling
from specagent.decoding.cache import ModelRunner
from specagent.decoding.costs import CostModel
from specagent.decoding.draft_model import DraftModelDrafter
from specagent.decoding.drafters import PromptLookupDrafter
from specagent.decoding.loop import speculative_generate
from specagent.decoding.sampling import SamplingParams, make_generator
from specagent.decoding.schedule import AdaptiveSchedule, FixedSchedule
from specagent.grammar import Constraint

pytestmark = pytest.mark.slow

N = 2000
N_REFERENCE = 20_000
PASS = 1e-4
CAUGHT = 1e-6
END = -1
"""The symbol for 'the call had ended' (after an end-of-sequence token)."""

VOCAB = 12
PROMPT = [3, 7, 3, 7, 3, 7, 3]


# ---------------------------------------------------------------- the reference, independent


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (keep the most likely tokens while the mass before
    each is below top_p) over a full sort, in float64."""
    x = logits.double() / params.temperature
    if params.top_k:
        kth = torch.sort(x, dim=-1, descending=True).values[..., params.top_k - 1 : params.top_k]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        ordered, order = torch.sort(p, dim=-1, descending=True)
        before = torch.cumsum(ordered, dim=-1) - ordered
        ordered = ordered.masked_fill(before >= params.top_p, 0.0)
        p = torch.zeros_like(p).scatter(-1, order, ordered)
    return p / p.sum(dim=-1, keepdim=True)


@torch.no_grad()
def reference_samples(
    model: torch.nn.Module,
    prompt: Sequence[int],
    params: SamplingParams,
    steps: int,
    eos: Sequence[int] = (),
    n: int = N_REFERENCE,
    batch: int = 5000,
) -> np.ndarray:
    """``[n, steps]`` tokens of plain sampling from ``model`` (``END`` after an eos)."""
    generator = torch.Generator().manual_seed(12345)
    out = np.empty((n, steps), dtype=np.int64)
    eos_ids = torch.tensor(list(eos) or [-2])
    for start in range(0, n, batch):
        b = min(batch, n - start)
        ids = torch.tensor([list(prompt)] * b)
        ended = torch.zeros(b, dtype=torch.bool)
        for t in range(steps):
            p = reference_probs(model(input_ids=ids).logits[:, -1], params)
            token = torch.multinomial(p, 1, generator=generator)[:, 0]
            out[start : start + b, t] = torch.where(ended, END, token).numpy()
            ended |= torch.isin(token, eos_ids)
            ids = torch.cat([ids, token[:, None]], dim=1)
    return out


def padded(tokens: Sequence[int], steps: int, eos: Sequence[int] = ()) -> list[int]:
    """A sample's first ``steps`` tokens, ``END`` after an eos (kept or not by the caller)."""
    row: list[int] = []
    for token in tokens[:steps]:
        row.append(token)
        if token in eos:
            break
    return row + [END] * (steps - len(row))


def pvalues(samples: np.ndarray, reference: np.ndarray) -> list[float]:
    """Per position: chi-square test of homogeneity between the two samples' token counts;
    tokens expected fewer than 5 times in either sample are pooled into one bin."""
    result = []
    for t in range(samples.shape[1]):
        tokens = np.union1d(samples[:, t], reference[:, t])
        table = np.array([[np.sum(s[:, t] == v) for v in tokens] for s in (samples, reference)])
        expected = table.sum(axis=0) * table.sum(axis=1, keepdims=True) / table.sum()
        big = expected.min(axis=0) >= 5
        pooled = np.column_stack([table[:, big], table[:, ~big].sum(axis=1)])
        pooled = pooled[:, pooled.sum(axis=0) > 0]
        if pooled.shape[1] < 2:
            result.append(1.0)
            continue
        result.append(float(chi2_contingency(pooled, correction=False).pvalue))
    return result


# ---------------------------------------------------------------- speculative samples


def loop_samples(
    target: torch.nn.Module,
    params: SamplingParams,
    steps: int,
    drafter: Callable[[], object],
    schedule: Callable[[], object],
    prompt: Sequence[int] = PROMPT,
) -> tuple[np.ndarray, int]:
    """N outputs of the decoding loop, and the longest draft any step proposed."""
    runner = ModelRunner(target)
    out = np.empty((N, steps), dtype=np.int64)
    longest = 0
    for seed in range(N):
        events = list(
            speculative_generate(
                runner,
                list(prompt),
                params=params,
                generator=make_generator(seed),
                max_new_tokens=steps,
                drafter=drafter(),  # type: ignore[arg-type]
                schedule=schedule(),  # type: ignore[arg-type]
            )
        )
        longest = max(longest, len(events[-1].counters.accepted_per_position))
        out[seed] = padded(events[-1].output_ids, steps)
    return out, longest


@pytest.fixture(scope="module")
def close_draft(small_target) -> torch.nn.Module:
    """A draft that mostly agrees with the target: adaptive k reaches long drafts."""
    return perturbed_copy(small_target, 0.02, seed=5)


def _first_rejection_one_late(accept: torch.Tensor) -> int:
    """Planted bug: the first rejected draft token is accepted too."""
    rejected = (~accept).nonzero()
    return min(int(rejected[0, 0]) + 1, int(accept.shape[0])) if rejected.numel() else len(accept)


def _residual_is_p(p: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Planted bug: after a rejection, resample from p instead of norm(max(0, p - q))."""
    return p


# Drafting nearly free and verifying flat up to 17 rows (a GPU's curve): adaptive k goes long.
CHEAP_DRAFTS = CostModel(draft_step=0.02, verify=(1.0,) * 17)

DRAFT_MODEL_CASES = {
    # customer-reply's sampling, adaptive k up to 16: drafts of up to 9 tokens in 10.
    "t0.3-top_p0.9-adaptive16": (SamplingParams(temperature=0.3, top_p=0.9), 10, None),
    "t0.7-top_p0.95-k10": (SamplingParams(temperature=0.7, top_p=0.95), 10, 10),
    "t1.0-top_k4-k4": (SamplingParams(temperature=1.0, top_k=4), 8, 4),
}


def _draft_model_run(small_target, close_draft, case: str) -> tuple[np.ndarray, np.ndarray, int]:
    params, steps, k = DRAFT_MODEL_CASES[case]
    draft = ModelRunner(close_draft)
    samples, longest = loop_samples(
        small_target,
        params,
        steps,
        lambda: DraftModelDrafter(draft),
        (lambda: AdaptiveSchedule(max_k=16, costs=CHEAP_DRAFTS))
        if k is None
        else (lambda: FixedSchedule(k)),
    )
    return samples, _reference(small_target, params, steps), longest


@functools.cache
def _reference_cached(model_id: int, params: SamplingParams, steps: int) -> np.ndarray:
    return reference_samples(_MODELS[model_id], PROMPT, params, steps)


_MODELS: dict[int, torch.nn.Module] = {}


def _reference(model: torch.nn.Module, params: SamplingParams, steps: int) -> np.ndarray:
    _MODELS[id(model)] = model
    return _reference_cached(id(model), params, steps)


@pytest.mark.parametrize("case", sorted(DRAFT_MODEL_CASES))
def test_draft_model_at_shipped_sampling_settings(small_target, close_draft, case) -> None:
    samples, reference, longest = _draft_model_run(small_target, close_draft, case)
    if case.startswith("t0.3") or "k10" in case:
        assert longest > 8  # drafts longer than 8 really ran
    found = pvalues(samples, reference)
    assert len(found) >= 8
    assert min(found) > PASS, found


@pytest.mark.parametrize(
    ("case", "target", "bug"),
    [
        ("t0.3-top_p0.9-adaptive16", "residual_distribution", _residual_is_p),
        ("t0.7-top_p0.95-k10", "_first_rejection", _first_rejection_one_late),
    ],
)
def test_draft_model_check_catches_a_planted_bug(
    small_target, close_draft, monkeypatch, case, target, bug
) -> None:
    monkeypatch.setattr(acceptance, target, bug)
    samples, reference, _ = _draft_model_run(small_target, close_draft, case)
    assert min(pvalues(samples, reference)) < CAUGHT


def _lookup_run(small_target) -> tuple[np.ndarray, np.ndarray]:
    params = SamplingParams(temperature=0.7, top_p=0.9)
    samples, longest = loop_samples(
        small_target,
        params,
        8,
        lambda: PromptLookupDrafter(max_ngram=2),
        lambda: FixedSchedule(6),
    )
    assert longest >= 2  # the repeating prompt made lookup propose
    return samples, _reference(small_target, params, 8)


def test_prompt_lookup_at_shipped_sampling_settings(small_target) -> None:
    found = pvalues(*_lookup_run(small_target))
    assert min(found) > PASS, found


def test_prompt_lookup_check_catches_a_planted_bug(small_target, monkeypatch) -> None:
    monkeypatch.setattr(acceptance, "_first_rejection", _first_rejection_one_late)
    assert min(pvalues(*_lookup_run(small_target))) < CAUGHT


# ---------------------------------------------------------------- top-p on a 4k vocabulary

BIG_VOCAB = 4096
BIG_PARAMS = SamplingParams(temperature=0.5, top_p=0.9)


@pytest.fixture(scope="module")
def big_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = make_model(BIG_VOCAB, layers=1, seed=21, hidden=32, init=0.35)
    return target, perturbed_copy(target, 0.02, seed=22)


def _big_run(big_pair) -> tuple[np.ndarray, np.ndarray]:
    target, draft = big_pair
    runner = ModelRunner(draft)
    samples, _ = loop_samples(
        target, BIG_PARAMS, 8, lambda: DraftModelDrafter(runner), lambda: FixedSchedule(4)
    )
    return samples, _reference(target, BIG_PARAMS, 8)


@torch.no_grad()
def test_the_4k_vocabulary_takes_both_top_p_paths(big_pair) -> None:
    """The case below is meaningful only if the fast path (the 1,024 most likely tokens hold
    top_p) and the full sort both occur on the contexts it samples."""
    target, _ = big_pair
    reference = _reference(target, BIG_PARAMS, 8)[:500]
    contexts = torch.tensor([PROMPT + list(row[:4]) for row in reference.tolist()])
    logits = target(input_ids=contexts).logits[:, len(PROMPT) - 1 :].reshape(-1, BIG_VOCAB)
    p = torch.softmax(logits.double() / BIG_PARAMS.temperature, dim=-1)
    head = torch.topk(p, 1024, dim=-1).values.sum(dim=-1)
    fast = float((head >= BIG_PARAMS.top_p).double().mean())
    assert 0.2 < fast < 1.0, fast


def test_top_p_fast_path_on_a_4k_vocabulary(big_pair) -> None:
    found = pvalues(*_big_run(big_pair))
    assert min(found) > PASS, found


def test_top_p_check_catches_a_fast_path_that_skips_the_cut(big_pair, monkeypatch) -> None:
    real = sampling._top_p

    def fast_path_without_cut(probs: torch.Tensor, top_p: float) -> torch.Tensor:
        head = torch.topk(probs, min(1024, probs.shape[-1]), dim=-1).values
        if bool((head.sum(dim=-1) >= top_p).all()):
            return probs  # planted bug: the fast path forgets to drop the tail
        return real(probs, top_p)

    monkeypatch.setattr(sampling, "_top_p", fast_path_without_cut)
    assert min(pvalues(*_big_run(big_pair))) < CAUGHT


# ---------------------------------------------------------------- the public runtime

RUNTIME_PROMPT = [40, 41, 42, 43, 40, 41, 42]


def _runtime_samples(
    rt: SpecRuntime, policy: str, steps: int, constraint: Constraint | None = None
) -> np.ndarray:
    """N calls through ``runtime.generate``, 64 at a time (they share batched forwards), all of
    one tenant (history-drafting policies draft from the earlier calls' outputs)."""
    out = np.empty((N, steps), dtype=np.int64)
    eos = rt.eos_token_ids

    async def one(i: int, limiter: anyio.CapacityLimiter) -> None:
        async with limiter:
            result = await rt.generate(
                list(RUNTIME_PROMPT),
                policy=policy,
                max_new_tokens=steps,
                seed=i,
                tenant="acme",
                constraint=constraint,
            )
        out[i] = padded(result.token_ids, steps, eos)

    async def main() -> None:
        limiter = anyio.CapacityLimiter(64)
        async with anyio.create_task_group() as tg:
            for i in range(N):
                tg.start_soon(one, i, limiter)

    anyio.run(main)
    return np.where(np.isin(out, eos), END, out)


@pytest.fixture
def shipped_runtime(target, draft, tokenizer):
    """The shipped policies on a target/draft pair (``customer-reply``: ``auto`` drafting from
    the tenant's history and the draft model, adaptive k up to 16, temperature 0.3, top-p 0.9),
    plus plain sampling for the grammar's reference."""
    plain = Policy(
        name="plain-t0.3",
        description="plain sampling at customer-reply's settings",
        mode="lossless",
        drafter={"kind": "none"},
        sampling={"temperature": 0.3, "top_p": 0.9},
    )
    policies = [*shipped_policies().defined(), plain]
    rt = SpecRuntime(
        target=target, draft=draft, tokenizer=tokenizer, policies=policies, device="cpu"
    )
    yield rt
    rt.close()


def _customer_reply_run(rt: SpecRuntime, target) -> tuple[np.ndarray, np.ndarray]:
    policy = rt.policies["customer-reply"]
    params = SamplingParams(temperature=policy.sampling.temperature, top_p=policy.sampling.top_p)
    samples = _runtime_samples(rt, "customer-reply", 8)
    reference = reference_samples(target, RUNTIME_PROMPT, params, 8, eos=rt.eos_token_ids)
    return samples, np.where(np.isin(reference, rt.eos_token_ids), END, reference)


def test_shipped_customer_reply_through_the_runtime(shipped_runtime, target) -> None:
    found = pvalues(*_customer_reply_run(shipped_runtime, target))
    assert min(found) > PASS, found


def test_runtime_check_catches_a_planted_bug(shipped_runtime, target, monkeypatch) -> None:
    monkeypatch.setattr(acceptance, "residual_distribution", _residual_is_p)
    assert min(pvalues(*_customer_reply_run(shipped_runtime, target))) < CAUGHT


GRAMMAR = Constraint.regex(r"[a-e ]{3,16}")


def _grammar_run(rt: SpecRuntime) -> tuple[np.ndarray, np.ndarray]:
    """customer-reply under a grammar against plain sampling under the same grammar (both
    through the runtime: the constrained target is the reference)."""
    return (
        _runtime_samples(rt, "customer-reply", 8, GRAMMAR),
        _runtime_samples(rt, "plain-t0.3", 8, GRAMMAR),
    )


def test_shipped_customer_reply_under_a_grammar(shipped_runtime) -> None:
    samples, reference = _grammar_run(shipped_runtime)
    found = pvalues(samples, reference)
    assert min(found) > PASS, found


def test_grammar_check_catches_a_planted_bug(shipped_runtime, monkeypatch) -> None:
    monkeypatch.setattr(acceptance, "residual_distribution", _residual_is_p)
    assert min(pvalues(*_grammar_run(shipped_runtime))) < CAUGHT
