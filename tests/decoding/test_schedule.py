"""The adaptive schedule and the cost model it plans with: how long a draft each step gets."""

from __future__ import annotations

import pytest

from specagent.decoding.cache import ModelRunner
from specagent.decoding.drafters import DraftModelDrafter
from specagent.decoding.schedule import AdaptiveSchedule, CostModel, interpolate_costs

# Shaped like a 2-core CPU with MKL: 1-3 rows nearly free, a jump at 4, 16 rows cheaper than 12.
CPU_LIKE = CostModel(
    draft_step=0.4,
    verify=tuple(interpolate_costs({1: 1.0, 3: 1.1, 4: 1.9, 12: 3.4, 16: 2.6, 21: 2.8}, 21)),
)


def test_interpolation_keeps_measured_points_and_fills_between() -> None:
    costs = interpolate_costs({1: 1.0, 4: 2.5, 8: 1.5}, 10)
    assert costs[0] == 1.0
    assert costs[3] == 2.5
    assert costs[7] == 1.5  # a curve that falls stays as measured
    assert costs[5] == pytest.approx(2.0)  # halfway between 4 and 8
    assert costs[9] == 1.5  # past the last point: flat
    assert min(interpolate_costs({1: 1.0, 2: 0.7}, 2)) == 1.0  # never below one token


def test_draft_cost_curve_and_its_fallback() -> None:
    measured = CostModel(draft_step=0.4, draft=(0.4, 0.45, 0.5))
    assert measured.draft_cost(2) == 0.45
    assert measured.draft_cost(5) == pytest.approx(0.5 + 0.25 * 0.4 * 2)
    assert CostModel(draft_step=0.4).draft_cost(3) == pytest.approx(0.4 + 0.25 * 0.4 * 2)


def test_fully_accepted_drafts_reach_long_k_within_a_few_steps() -> None:
    """Deterministic text: every draft accepted. The schedule must leave short drafts quickly,
    since the long ones are what pay on this cost curve."""
    schedule = AdaptiveSchedule(max_k=20, costs=CPU_LIKE)
    ks = []
    for _ in range(6):
        k = schedule.next_k(100)
        ks.append(k)
        schedule.observe(k, k)
    assert ks[0] >= 1
    assert max(ks[:4]) >= 15, ks
    assert ks[-1] >= 15, ks


def test_rejected_drafts_fall_back_to_plain_decoding_with_probes() -> None:
    schedule = AdaptiveSchedule(max_k=20, costs=CPU_LIKE, probe_every=4)
    ks = []
    for _ in range(30):
        k = schedule.next_k(100)
        ks.append(k)
        schedule.observe(k, 0)
    assert ks[-12:].count(0) >= 8  # mostly plain steps
    assert 1 in ks[-12:]  # with a probe now and then, so the estimate can recover


def test_guesses_are_cut_to_what_the_draft_cost_curve_pays_for(target, draft) -> None:
    """A lookup guess widens the draft forward: worth it when wide forwards are cheap, not when
    every extra row costs as much as a step."""
    context = [5, 11, 42, 57, 99, 23, 64, 8, 77, 31, 11, 42]  # "11 42" recurs: lookup guesses
    runner = ModelRunner(draft)
    cheap = CostModel(draft_step=0.4, draft=tuple(0.4 + 0.01 * n for n in range(8)))
    dear = CostModel(draft_step=0.4, draft=tuple(0.4 * (n + 1) for n in range(8)))
    free_guess = DraftModelDrafter(runner, guess_ngrams=(2, 3))._guess(context, 6)
    assert free_guess == [57, 99, 23, 64, 8, 77]
    assert DraftModelDrafter(runner, guess_ngrams=(2, 3), costs=cheap)._guess(context, 6)
    assert DraftModelDrafter(runner, guess_ngrams=(2, 3), costs=dear)._guess(context, 6) == []
    assert DraftModelDrafter(runner, guess_ngrams=None, costs=cheap)._guess(context, 6) == []
