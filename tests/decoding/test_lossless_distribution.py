"""Losslessness is a statistical property: the tokens of speculative sampling must be distributed
exactly as the target's. Checked against the exact marginals of the first 4 tokens, computed by
enumerating every continuation on a small vocabulary, with a chi-square test at N = 2000."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specagent.decoding import acceptance
from specagent.decoding.cache import ModelRunner
from specagent.decoding.costs import CostModel
from specagent.decoding.draft_model import DraftModelDrafter
from specagent.decoding.drafters import PromptLookupDrafter
from specagent.decoding.loop import speculative_generate
from specagent.decoding.sampling import SamplingParams, make_generator
from specagent.decoding.schedule import FixedSchedule

VOCAB = 12
PROMPT = [3, 7, 3, 7, 3]
STEPS = 4
N = 2000


def exact_marginals(model: torch.nn.Module, params: SamplingParams) -> np.ndarray:
    """``[STEPS, VOCAB]``: P(token t = v) under plain sampling from the target."""
    from specagent.decoding.sampling import logits_to_probs

    prefixes = list(itertools.product(range(VOCAB), repeat=STEPS - 1))
    ids = torch.tensor([PROMPT + list(p) for p in prefixes])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double()
    probs = logits_to_probs(logits[:, len(PROMPT) - 1 :], params).double()  # [P, STEPS, V]
    marginals = np.zeros((STEPS, VOCAB))
    path = torch.ones(len(prefixes), dtype=torch.float64)
    for t in range(STEPS):
        # Every prefix row covers the same first t tokens once per (STEPS-1-t) suffix; weight
        # each row by the probability of its first t tokens and divide out the repetition.
        repeat = VOCAB ** (STEPS - 1 - t)
        marginals[t] = (path[:, None] * probs[:, t]).sum(0).numpy() / repeat
        if t < STEPS - 1:
            chosen = ids[:, len(PROMPT) + t]
            path = path * probs[torch.arange(len(prefixes)), t, chosen]
    return marginals


def sample_counts(target, drafter, params: SamplingParams, k: int) -> np.ndarray:
    counts = np.zeros((STEPS, VOCAB))
    runner = ModelRunner(target)
    for seed in range(N):
        events = list(
            speculative_generate(
                runner,
                PROMPT,
                params=params,
                generator=make_generator(seed),
                max_new_tokens=STEPS,
                drafter=drafter() if drafter else None,
                schedule=FixedSchedule(k),
            )
        )
        for t, token in enumerate(events[-1].output_ids):
            counts[t, token] += 1
    return counts


def chi_square_pvalues(counts: np.ndarray, marginals: np.ndarray) -> list[float]:
    pvalues = []
    for t in range(STEPS):
        expected = marginals[t] * counts[t].sum()
        big = expected >= 5  # pool rare tokens into one bin, as the test requires
        obs = np.append(counts[t][big], counts[t][~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        pvalues.append(float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue))
    return pvalues


def test_marginals_enumeration_is_a_distribution(small_target) -> None:
    marginals = exact_marginals(small_target, SamplingParams(temperature=1.0))
    assert np.allclose(marginals.sum(axis=1), 1.0)


# Verifying 2 rows costs as much as 1 and a draft token little: drafts of every length occur.
PLANNING_COSTS = CostModel(draft_step=0.1, verify=(1.0, 1.0, 1.6, 1.7))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("k", "guesses", "costs"),
    [(2, None, None), (4, None, None), (4, (2, 3), None), (4, (2, 3), PLANNING_COSTS)],
)
def test_draft_model_sampling_matches_target(small_target, small_draft, k, guesses, costs) -> None:
    """With ``guesses`` the draft checks n-gram lookup guesses (the prompt repeats, so they
    fire) in one forward: the proposals must still be distributed exactly as the draft's. With
    ``costs`` each draft ends where the draft's own sampled confidences say more tokens no
    longer pay: a length chosen from the draft's own samples keeps the output exact."""
    params = SamplingParams(temperature=1.0)
    marginals = exact_marginals(small_target, params)
    runner = ModelRunner(small_draft)
    counts = sample_counts(
        small_target,
        lambda: DraftModelDrafter(runner, guess_ngrams=guesses, costs=costs),
        params,
        k,
    )
    pvalues = chi_square_pvalues(counts, marginals)
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.slow
def test_prompt_lookup_sampling_matches_target_with_top_p(small_target) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9)
    marginals = exact_marginals(small_target, params)
    counts = sample_counts(small_target, lambda: PromptLookupDrafter(max_ngram=2), params, 3)
    pvalues = chi_square_pvalues(counts, marginals)
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.slow
def test_the_check_detects_a_wrong_residual(small_target, small_draft, monkeypatch) -> None:
    """Power: resampling from p instead of norm(max(0, p - q)) after a rejection is the classic
    bug; the same test must reject it."""
    monkeypatch.setattr(acceptance, "residual_distribution", lambda p, accepted: p)
    params = SamplingParams(temperature=1.0)
    marginals = exact_marginals(small_target, params)
    counts = sample_counts(
        small_target, lambda: DraftModelDrafter(ModelRunner(small_draft)), params, 4
    )
    pvalues = chi_square_pvalues(counts, marginals)
    assert min(pvalues) < 1e-6, pvalues
