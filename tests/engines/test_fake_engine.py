"""The seam alone: an engine written here, with no transformers model or cache anywhere (its KV
is a list of tokens, its logits a fixed function of the last two), runs every part of the
decoding core through the public runtime: drafting, lossless and relaxed acceptance, prefix
reuse, batching of concurrent calls. What it must offer is what ``docs/architecture.md`` says a
new engine offers, and nothing more."""

from __future__ import annotations

import copy
import itertools

import anyio
import numpy as np
import pytest
from conftest import PinnedCosts
from fake_engine import VOCAB, FakeModel, TokenSequence, table_logits
from scipy.stats import chisquare

from policies import make_policy
from specagent import RuntimeOptions, SpecRuntime
from specagent.decoding.sampling import SamplingParams, logits_to_probs

LOOKUP = make_policy("lookup", {"kind": "prompt_lookup", "num_speculative_tokens": 3})
PLAIN = make_policy("plain", {"kind": "none"})
RELAXED = make_policy(
    "relaxed",
    {"kind": "prompt_lookup", "num_speculative_tokens": 3},
    mode="relaxed",
    acceptance={"rule": "typical", "epsilon": 0.3, "delta": 0.09},
)


@pytest.fixture
def runtime():
    rt = SpecRuntime(
        FakeModel(),
        policies=[LOOKUP, PLAIN, RELAXED],
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    yield rt
    rt.close()


def _greedy(prompt: list[int], n: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(n):
        token = int(table_logits(context).argmax())
        out.append(token)
        context.append(token)
    return out


PROMPT = [3, 7, 3, 7, 3]


@pytest.mark.anyio
async def test_greedy_calls_on_the_fake_engine_equal_its_greedy(runtime) -> None:
    prompts = [[*PROMPT, i % VOCAB, 4, 5, 4, 5] for i in range(6)]
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        result = await runtime.generate(prompts[i], policy="lookup", max_new_tokens=20, seed=0)
        results[i] = result.token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    for i, prompt in enumerate(prompts):
        assert results[i] == _greedy(prompt, 20)
    assert max(runtime.target.batches) > 1  # concurrent calls shared the engine's forwards


@pytest.mark.anyio
async def test_prefix_reuse_and_relaxed_divergence_on_the_fake_engine(runtime) -> None:
    long = PROMPT * 8
    first = await runtime.generate(long, policy="plain", max_new_tokens=8, tenant="t")
    again = await runtime.generate(long, policy="plain", max_new_tokens=8, tenant="t")
    assert first.token_ids == again.token_ids == _greedy(long, 8)
    assert again.usage.cached_input_tokens >= 32  # the first call's KV, copied by deepcopy
    relaxed = await runtime.generate(long, policy="relaxed", max_new_tokens=8, temperature=0.8)
    assert relaxed.stats.divergence is not None
    assert copy.deepcopy(TokenSequence()).tokens == []


STEPS, N = 3, 2000


@pytest.mark.slow
def test_sampling_on_the_fake_engine_matches_its_distribution(runtime) -> None:
    """Chi-square of 2,000 sampled calls (prompt lookup drafting, T 0.9, top-p 0.95) against
    the exact marginals of the fake model's distribution, by enumeration."""
    params = SamplingParams(temperature=0.9, top_p=0.95)
    marginals = np.zeros((STEPS, VOCAB))
    for prefix in itertools.product(range(VOCAB), repeat=STEPS - 1):
        path = 1.0
        for t in range(STEPS):
            probs = logits_to_probs(table_logits([*PROMPT, *prefix[:t]])[None], params)[0]
            probs = probs.double().numpy()
            marginals[t] += path * probs / VOCAB ** (STEPS - 1 - t)
            if t < STEPS - 1:
                path *= probs[prefix[t]]
    counts = np.zeros((STEPS, VOCAB))
    for seed in range(N):
        result = runtime.generate_sync(
            PROMPT, policy="lookup", max_new_tokens=STEPS, temperature=0.9, top_p=0.95, seed=seed
        )
        for t, token in enumerate(result.token_ids):
            counts[t, token] += 1
    for t in range(STEPS):
        expected = marginals[t] * N
        big = expected >= 5
        obs = np.append(counts[t][big], counts[t][~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3, t
