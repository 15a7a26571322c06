"""The adaptive schedule and the cost model it plans with: how long a draft each step gets."""

from __future__ import annotations

import pytest
import torch

from specagent.decoding.cache import ModelRunner
from specagent.decoding.drafters import DraftModelDrafter
from specagent.decoding.sampling import SamplingParams
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


def test_drafter_plans_long_drafts_when_confident_and_short_when_not(draft) -> None:
    """The plan looks past the cliff at 4 rows: with every token likely accepted, one more
    token after 3 is a loss on this curve but 16 more are a gain."""
    drafter = DraftModelDrafter(ModelRunner(draft), costs=CPU_LIKE)
    drafter._call_hits, drafter._call_trials = 9.9, 10.0  # a call that accepted nearly all
    sure = 1.0 + 0.99 + 0.99**2 + 0.99**3
    assert drafter._planned_length(3, 20, sure, 0.99**3) >= 15
    unsure = 1.0 + 0.5 + 0.25 + 0.125
    assert drafter._planned_length(3, 20, unsure, 0.125) == 3
    assert drafter._planned_length(0, 20, 1.0, 1.0) >= 15
    drafter._call_hits, drafter._call_trials = 3.0, 10.0  # a call the target mostly rejects
    assert drafter._planned_length(0, 20, 1.0, 1.0) <= 2
    assert DraftModelDrafter(ModelRunner(draft))._planned_length(3, 20, unsure, 0.125) == 20
    fixed = DraftModelDrafter(ModelRunner(draft), costs=CPU_LIKE, plan_lengths=False)
    assert fixed._planned_length(3, 20, unsure, 0.125) == 20  # a fixed schedule's k stands


def test_drafter_calibrates_its_confidence_by_what_the_target_accepted(draft) -> None:
    drafter = DraftModelDrafter(ModelRunner(draft), costs=CPU_LIKE)
    drafter._last_confidences = [0.99, 0.99, 0.99, 0.99]
    drafter.observe(4, 0)  # confident and rejected at once
    assert drafter._tested_hits / drafter._tested_confidence < 0.7
    drafter._last_confidences = [0.6, 0.6, 0.6]
    for _ in range(10):
        drafter.observe(3, 3)  # unsure and always right
    assert drafter._tested_hits / drafter._tested_confidence > 1.3


def test_cost_planned_drafts_are_prefixes_of_the_full_draft(target, draft) -> None:
    """The plan only decides where a draft ends: greedy proposals are the draft's own tokens."""
    runner = ModelRunner(draft)
    context = [5, 11, 42, 57, 99, 23, 64, 8, 77, 31]
    params, generator = SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)
    full = DraftModelDrafter(runner).propose(context, 8, params, generator).tokens
    planned = DraftModelDrafter(runner, costs=CPU_LIKE).propose(context, 8, params, generator)
    assert 1 <= len(planned.tokens) <= 8
    assert planned.tokens == full[: len(planned.tokens)]


def test_schedule_leaves_the_draft_length_to_a_stopping_drafter() -> None:
    schedule = AdaptiveSchedule(max_k=20, costs=CPU_LIKE, drafter_stops=True, prior_weight=2.0)
    assert schedule.next_k(100) == 20
    assert schedule.next_k(7) == 7  # never past the room left
    schedule.observe(1, 0)
    assert schedule.next_k(100) == 20  # one early rejection does not switch drafting off
    for _ in range(10):
        schedule.observe(1, 0)
    assert schedule.next_k(100) == 0
