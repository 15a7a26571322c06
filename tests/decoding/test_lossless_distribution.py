"""Losslessness is a statistical property: the tokens of speculative sampling must be distributed
exactly as the target's. Checked on every engine present (``engine_pairs``) against the exact
marginals of the first 4 tokens under the engine's own logits, computed by enumerating every
continuation on a small vocabulary, with a chi-square test at N = 2000."""

from __future__ import annotations

import numpy as np
import pytest
from distributions import chi_square_pvalues, exact_marginals, sample_counts

from specagent.decoding import acceptance
from specagent.decoding.costs import CostModel
from specagent.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from specagent.decoding.sampling import SamplingParams


def test_marginals_enumeration_is_a_distribution(engine_pair) -> None:
    marginals = exact_marginals(engine_pair.target, SamplingParams(temperature=1.0))
    assert np.allclose(marginals.sum(axis=1), 1.0)


def test_enumeration_of_a_module_equals_its_runners(small_target) -> None:
    """The batched enumeration over a transformers model and the one-forward-per-prefix one
    over a runner agree (the second is what the other engines use)."""
    from specagent.engines.transformers import ModelRunner

    params = SamplingParams(temperature=0.7, top_p=0.9)
    batched = exact_marginals(small_target, params)
    assert np.allclose(batched, exact_marginals(ModelRunner(small_target), params), atol=1e-5)


# Verifying 2 rows costs as much as 1 and a draft token little: drafts of every length occur.
PLANNING_COSTS = CostModel(draft_step=0.1, verify=(1.0, 1.0, 1.6, 1.7))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("k", "guesses", "costs"),
    [(2, None, None), (4, None, None), (4, (2, 3), None), (4, (2, 3), PLANNING_COSTS)],
)
def test_draft_model_sampling_matches_target(engine_pair, k, guesses, costs) -> None:
    """With ``guesses`` the draft checks n-gram lookup guesses (the prompt repeats, so they
    fire) in one forward: the proposals must still be distributed exactly as the draft's. With
    ``costs`` each draft ends where the draft's own sampled confidences say more tokens no
    longer pay: a length chosen from the draft's own samples keeps the output exact."""
    params = SamplingParams(temperature=1.0)
    marginals = exact_marginals(engine_pair.target, params)
    counts = sample_counts(
        engine_pair.target,
        lambda: DraftModelDrafter(engine_pair.draft, guess_ngrams=guesses, costs=costs),
        params,
        k,
    )
    pvalues = chi_square_pvalues(counts, marginals)
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.slow
def test_prompt_lookup_sampling_matches_target_with_top_p(engine_pair) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9)
    marginals = exact_marginals(engine_pair.target, params)
    counts = sample_counts(engine_pair.target, lambda: PromptLookupDrafter(max_ngram=2), params, 3)
    pvalues = chi_square_pvalues(counts, marginals)
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.slow
def test_the_check_detects_a_wrong_residual(engine_pair, monkeypatch) -> None:
    """Power: resampling from p instead of norm(max(0, p - q)) after a rejection is the classic
    bug; the same test must reject it, on every engine."""
    monkeypatch.setattr(acceptance, "residual_distribution", lambda p, accepted: p)
    params = SamplingParams(temperature=1.0)
    marginals = exact_marginals(engine_pair.target, params)
    counts = sample_counts(
        engine_pair.target, lambda: DraftModelDrafter(engine_pair.draft), params, 4
    )
    pvalues = chi_square_pvalues(counts, marginals)
    assert min(pvalues) < 1e-6, pvalues
