"""The settings that ship are lossless: speculative outputs distributed as plain sampling from
the target, at every one of 8 to 12 positions, for the sampling shapes the shipped policies use
(temperature 0.3 / 0.7 / 1.0 with top-p 0.9 / 0.95 and top-k), the draft model and prompt
lookup, adaptive k with drafts longer than 8, the top-p fast path on a 4,096-token vocabulary,
the shipped ``customer-reply`` policy itself (``auto`` drafting, history of the tenant's earlier
calls, adaptive k up to 16), and under a grammar. Every case runs through the public runtime,
2,000 calls 64 at a time, so verification is batched across calls with ragged acceptance.
Each family is paired with a planted bug that the same test must catch.

How: per position, a chi-square test of the speculative tokens (N = 2000) against a reference.
The reference is plain sampling, batched, written here without the library's sampling code
(temperature, top-k, then top-p over a full sort), N = 20,000: two-sample tests of independent
draws, so the reference's own noise is accounted for (under a grammar the reference is the
runtime's own plain sampling under the same grammar). With fixed seeds the drafts do not
depend on timing (the step costs are pinned, below), the pass threshold (every position
p > 1e-4) and the bug threshold (some position p < 1e-6) are far apart. Marked ``slow``: they
run by default (``pytest``, about 20 s each here); ``-m "not slow"`` leaves them out."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import numpy as np
import pytest
import torch
from conftest import PinnedCosts, make_model, perturbed_copy
from scipy.stats import chi2_contingency

from specagent import Policy, RuntimeOptions, SpecRuntime, shipped_policies
from specagent.decoding import acceptance, sampling
from specagent.decoding.sampling import SamplingParams
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
            p = reference_probs(model(input_ids=ids, logits_to_keep=1).logits[:, -1], params)
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


def runtime_for(target, draft, policies, tokenizer=None) -> SpecRuntime:
    return SpecRuntime(
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        policies=policies,
        device="cpu",
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )


def policy(name: str, drafter: dict, **sampling: float) -> Policy:
    return Policy(name=name, description=name, mode="lossless", drafter=drafter, sampling=sampling)


def runtime_samples(
    rt: SpecRuntime,
    policy_name: str,
    steps: int,
    prompt: Sequence[int] = PROMPT,
    constraint: Constraint | None = None,
) -> tuple[np.ndarray, int]:
    """N calls through ``runtime.generate``, 64 at a time (they share batched forwards), all of
    one tenant (history-drafting policies draft from the earlier calls' outputs); the tokens
    (``END`` after an end of sequence) and the longest draft any call proposed."""
    out = np.empty((N, steps), dtype=np.int64)
    eos = rt.eos_token_ids
    longest = [0]

    async def one(i: int, limiter: anyio.CapacityLimiter) -> None:
        async with limiter:
            result = await rt.generate(
                list(prompt),
                policy=policy_name,
                max_new_tokens=steps,
                seed=i,
                tenant="acme",
                constraint=constraint,
            )
        out[i] = padded(result.token_ids, steps, eos)
        longest[0] = max(longest[0], len(result.stats.accepted_per_position))

    async def main() -> None:
        limiter = anyio.CapacityLimiter(64)
        async with rt, anyio.create_task_group() as tg:
            for i in range(N):
                tg.start_soon(one, i, limiter)

    anyio.run(main)
    return np.where(np.isin(out, eos), END, out), longest[0]


def reference_for(rt: SpecRuntime, params: SamplingParams, steps: int, prompt=PROMPT):
    reference = reference_samples(rt.target, prompt, params, steps, eos=rt.eos_token_ids)
    return np.where(np.isin(reference, rt.eos_token_ids), END, reference)


def _first_rejection_one_late(accept: torch.Tensor) -> torch.Tensor:
    """Planted bug: the first rejected draft token is accepted too."""
    rejected = (~accept).nonzero()
    n = min(int(rejected[0, 0]) + 1, int(accept.shape[0])) if rejected.numel() else len(accept)
    return torch.tensor(n, device=accept.device)


def _residual_is_p(p: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Planted bug: after a rejection, resample from p instead of norm(max(0, p - q))."""
    return p


@pytest.fixture(scope="module")
def close_draft(small_target) -> torch.nn.Module:
    """A draft that mostly agrees with the target: drafts are long and mostly accepted."""
    return perturbed_copy(small_target, 0.02, seed=5)


# ---------------------------------------------------------------- the shipped policy itself


def _customer_reply(small_target, draft) -> tuple[np.ndarray, np.ndarray, int]:
    rt = runtime_for(small_target, draft, shipped_policies())
    shipped = rt.policies["customer-reply"].sampling
    params = SamplingParams(temperature=shipped.temperature, top_p=shipped.top_p)
    samples, longest = runtime_samples(rt, "customer-reply", 12)
    return samples, reference_for(rt, params, 12), longest


@pytest.mark.parametrize("which", ["close", "independent"])
def test_shipped_customer_reply_is_lossless(small_target, close_draft, small_draft, which) -> None:
    """temperature 0.3, top-p 0.9, ``auto`` drafting (history and draft model), adaptive k up
    to 16; with a draft close to the target, drafts longer than 8 occur within 12 tokens, with
    an unrelated one many drafts are rejected (the residual path)."""
    draft = close_draft if which == "close" else small_draft
    samples, reference, longest = _customer_reply(small_target, draft)
    assert longest > (8 if which == "close" else 1)
    found = pvalues(samples, reference)
    assert len(found) == 12
    assert min(found) > PASS, found


def test_shipped_customer_reply_check_catches_an_off_by_one_acceptance(
    small_target, small_draft, monkeypatch
) -> None:
    """At temperature 0.3 the target's nucleus is a token or two, so a wrong residual barely
    changes anything; accepting the first rejected draft token does."""
    monkeypatch.setattr(acceptance, "_first_rejection", _first_rejection_one_late)
    samples, reference, _ = _customer_reply(small_target, small_draft)
    assert min(pvalues(samples, reference)) < CAUGHT


# ---------------------------------------------------------------- sampling shapes and drafters

CASES = {
    "draft_model-t0.7-top_p0.95-k10": (
        {"kind": "draft_model", "num_speculative_tokens": 10, "adaptive": False},
        {"temperature": 0.7, "top_p": 0.95},
        12,
    ),
    "draft_model-t1.0-top_k4-k4": (
        {"kind": "draft_model", "num_speculative_tokens": 4, "adaptive": False},
        {"temperature": 1.0, "top_k": 4},
        8,
    ),
    "prompt_lookup-t0.7-top_p0.9-k6": (
        {"kind": "prompt_lookup", "num_speculative_tokens": 6, "adaptive": False},
        {"temperature": 0.7, "top_p": 0.9},
        8,
    ),
}


def _case(small_target, close_draft, name: str) -> tuple[np.ndarray, np.ndarray, int]:
    drafter, sampling, steps = CASES[name]
    rt = runtime_for(small_target, close_draft, [policy(name, drafter, **sampling)])
    samples, longest = runtime_samples(rt, name, steps)
    params = SamplingParams(
        temperature=sampling["temperature"],
        top_p=sampling.get("top_p", 1.0),
        top_k=int(sampling.get("top_k", 0)),
    )
    return samples, reference_for(rt, params, steps), longest


@pytest.mark.parametrize("name", sorted(CASES))
def test_sampling_shapes_and_drafters_are_lossless(small_target, close_draft, name) -> None:
    samples, reference, longest = _case(small_target, close_draft, name)
    assert longest >= (9 if "k10" in name else 2)  # the drafter really proposed
    found = pvalues(samples, reference)
    assert len(found) >= 8
    assert min(found) > PASS, found


@pytest.mark.parametrize(
    "name", ["draft_model-t0.7-top_p0.95-k10", "prompt_lookup-t0.7-top_p0.9-k6"]
)
def test_sampling_check_catches_an_off_by_one_acceptance(
    small_target, close_draft, monkeypatch, name
) -> None:
    monkeypatch.setattr(acceptance, "_first_rejection", _first_rejection_one_late)
    samples, reference, _ = _case(small_target, close_draft, name)
    assert min(pvalues(samples, reference)) < CAUGHT


# ---------------------------------------------------------------- top-p on a 4k vocabulary

BIG_VOCAB = 4096
BIG_SAMPLING = {"temperature": 0.7, "top_p": 0.9}
BIG_PARAMS = SamplingParams(**BIG_SAMPLING)


@pytest.fixture(scope="module")
def big_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """At temperature 0.7 about nine rows in ten have top_p within their 1,024 most likely
    tokens (the fast path) and the rest need the full sort."""
    target = make_model(BIG_VOCAB, layers=1, seed=21, hidden=32, init=0.25)
    return target, perturbed_copy(target, 0.02, seed=22)


def _big_run(big_pair) -> tuple[SpecRuntime, np.ndarray, np.ndarray]:
    drafter = {"kind": "draft_model", "num_speculative_tokens": 4, "adaptive": False}
    rt = runtime_for(*big_pair, [policy("big", drafter, **BIG_SAMPLING)])
    samples, longest = runtime_samples(rt, "big", 8)
    assert longest >= 2
    return rt, samples, reference_for(rt, BIG_PARAMS, 8)


@torch.no_grad()
def outside_the_nucleus(model: torch.nn.Module, samples: np.ndarray) -> int:
    """How many sampled tokens have probability 0 under top-p given their own prefix (the
    reference's top-p): under exact top-p sampling there are none, so one is a rejection at
    p = 0 whatever the sample size."""
    outside = 0
    for start in range(0, len(samples), 250):
        rows = samples[start : start + 250]
        ids = torch.tensor([PROMPT + [max(int(t), 0) for t in row] for row in rows])
        probs = reference_probs(model(input_ids=ids).logits[:, len(PROMPT) - 1 : -1], BIG_PARAMS)
        tokens = torch.tensor(np.maximum(rows, 0))
        chosen = probs.gather(-1, tokens[..., None])[..., 0]
        outside += int(((chosen == 0) & torch.tensor(rows >= 0)).sum())
    return outside


@torch.no_grad()
def test_the_4k_vocabulary_takes_both_top_p_paths(big_pair) -> None:
    """The cases below mean something only if the fast path (the 1,024 most likely tokens hold
    top_p) and the full sort both occur on the contexts they sample."""
    target, _ = big_pair
    reference = reference_samples(target, PROMPT, BIG_PARAMS, 4, n=500)
    contexts = torch.tensor([PROMPT + row for row in reference.tolist()])
    logits = target(input_ids=contexts).logits[:, len(PROMPT) - 1 :].reshape(-1, BIG_VOCAB)
    p = torch.softmax(logits.double() / BIG_PARAMS.temperature, dim=-1)
    head = torch.topk(p, 1024, dim=-1).values.sum(dim=-1)
    fast = float((head >= BIG_PARAMS.top_p).double().mean())
    assert 0.5 < fast < 0.99, fast


def test_top_p_on_a_4k_vocabulary(big_pair) -> None:
    rt, samples, reference = _big_run(big_pair)
    assert outside_the_nucleus(rt.target, samples) == 0
    found = pvalues(samples, reference)
    assert min(found) > PASS, found


def test_top_p_check_catches_a_fast_path_that_skips_the_cut(big_pair, monkeypatch) -> None:
    real = sampling._top_p

    def fast_path_without_cut(probs: torch.Tensor, top_p: float) -> torch.Tensor:
        head = torch.topk(probs, min(1024, probs.shape[-1]), dim=-1).values
        if bool((head.sum(dim=-1) >= top_p).all()):
            return probs  # planted bug: the fast path forgets to drop the tail
        return real(probs, top_p)

    monkeypatch.setattr(sampling, "_top_p", fast_path_without_cut)
    rt, samples, _ = _big_run(big_pair)
    # Tokens the target gives probability 0: rejected at p = 0 (< 1e-6), dozens of them.
    assert outside_the_nucleus(rt.target, samples) > 20


# ---------------------------------------------------------------- under a grammar

GRAMMAR = Constraint.regex(r"[a-e ]{3,16}")


def _grammar_run(target, draft, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """customer-reply under a grammar against plain sampling at its settings under the same
    grammar (both through the runtime: the constrained target is the reference)."""
    plain = policy("plain", {"kind": "none"}, temperature=0.3, top_p=0.9)
    rt = runtime_for(target, draft, [*shipped_policies().defined(), plain], tokenizer)
    prompt = tokenizer.encode("abc abd")
    samples, _ = runtime_samples(rt, "customer-reply", 8, prompt, GRAMMAR)
    rt = runtime_for(target, draft, [plain], tokenizer)
    reference, _ = runtime_samples(rt, "plain", 8, prompt, GRAMMAR)
    return samples, reference


def test_shipped_customer_reply_under_a_grammar(target, draft, tokenizer) -> None:
    found = pvalues(*_grammar_run(target, draft, tokenizer))
    assert min(found) > PASS, found


def test_grammar_check_catches_a_wrong_residual(target, draft, tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(acceptance, "residual_distribution", _residual_is_p)
    assert min(pvalues(*_grammar_run(target, draft, tokenizer))) < CAUGHT
