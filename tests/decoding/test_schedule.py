"""The adaptive schedule and the cost model it plans with: how long a draft each step gets."""

from __future__ import annotations

import math

import pytest
import torch
from fake_engine import TokenSequence

from specagent.decoding.costs import CostModel, SettlesNothing, interpolate_costs
from specagent.decoding.drafters import DraftModelDrafter
from specagent.decoding.proposal import DraftRequest
from specagent.decoding.sampling import SamplingParams
from specagent.decoding.schedule import AdaptiveSchedule
from specagent.engines.transformers import ModelRunner

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
    drafter._calibration.last = [0.99, 0.99, 0.99, 0.99]
    drafter.observe(4, 0)  # confident and rejected at once
    assert drafter._calibration.ratio() < 0.7
    drafter._calibration.last = [0.6, 0.6, 0.6]
    for _ in range(10):
        drafter.observe(3, 3)  # unsure and always right
    assert drafter._calibration.ratio() > 1.3


def test_cost_planned_drafts_are_prefixes_of_the_full_draft(target, draft) -> None:
    """The plan only decides where a draft ends: greedy proposals are the draft's own tokens."""
    runner = ModelRunner(draft)
    context = [5, 11, 42, 57, 99, 23, 64, 8, 77, 31]
    params, generator = SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)
    full = DraftModelDrafter(runner).propose(DraftRequest(context, 8, params, generator)).tokens
    planned = DraftModelDrafter(runner, costs=CPU_LIKE).propose(
        DraftRequest(context, 8, params, generator)
    )
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


def _curve(kind: str, longest: int = 21) -> tuple[float, ...]:
    """Synthetic verify curves (cost of n rows relative to one)."""
    if kind == "flat_then_cliff":  # 1-3 rows at the price of one, then twice as much
        return tuple(1.0 if n <= 3 else 2.0 + 0.05 * (n - 4) for n in range(1, longest + 1))
    if kind == "per_row_then_flat":  # the AVX2 EPYC's fp32 curve before the transposed kernels
        return tuple(float(min(n, 3)) for n in range(1, longest + 1))
    if kind == "linear":
        return tuple(1.0 + 0.3 * (n - 1) for n in range(1, longest + 1))
    assert kind == "flat"
    return tuple(1.0 for _ in range(longest))


def _brute_best_k(acceptance: float, draft_step: float, verify: tuple[float, ...], max_k: int):
    """Expected tokens per unit of cost for every k, written out term by term."""
    rates = {}
    for k in range(max_k + 1):
        tokens = sum(acceptance**i for i in range(k + 1))  # 1 + a + ... + a^k
        rates[k] = tokens / (k * draft_step + verify[k])
    best = max(rates.values())
    return {k for k, r in rates.items() if r >= best / 1.0001}, rates


CURVES = ["flat_then_cliff", "per_row_then_flat", "linear", "flat"]


@pytest.mark.parametrize("kind", CURVES)
@pytest.mark.parametrize("acceptance", [0.2, 0.5, 0.7, 0.8, 0.9, 0.97])
@pytest.mark.parametrize("draft_step", [0.0, 0.2, 0.5])
def test_best_k_matches_brute_force_on_any_curve(kind, acceptance, draft_step) -> None:
    costs = CostModel(draft_step=draft_step, verify=_curve(kind))
    schedule = AdaptiveSchedule(max_k=20, costs=costs, prior_acceptance=acceptance)
    assert schedule.acceptance == pytest.approx(acceptance)
    best, rates = _brute_best_k(acceptance, draft_step, costs.verify, 20)
    chosen = schedule.best_k()
    assert chosen in best, (chosen, sorted(best), rates)


def test_brute_force_cases_cover_cheap_row_counts_and_plain_decoding() -> None:
    """The curves above do make the answers differ: a cliff keeps k where rows are cheap (k = 2:
    three rows), a per-row curve makes drafting a loss unless nearly everything is accepted
    (then long drafts, past the flat part), a flat one asks for the longest draft."""
    assert _brute_best_k(0.8, 0.2, _curve("flat_then_cliff"), 20)[0] == {2}
    assert _brute_best_k(0.8, 0.2, _curve("per_row_then_flat"), 20)[0] == {0}
    assert _brute_best_k(0.97, 0.05, _curve("per_row_then_flat"), 20)[0] == {20}
    assert _brute_best_k(0.97, 0.0, _curve("flat"), 20)[0] == {20}


@pytest.mark.parametrize("kind", CURVES)
@pytest.mark.parametrize("acceptance", [0.3, 0.7, 0.9, 0.99])
def test_drafter_plan_matches_brute_force_before_its_first_token(draft, kind, acceptance) -> None:
    """Before drafting, the drafter's planned length maximises the same quantity as the
    schedule, at the call's acceptance (at least one token: the schedule decided to draft)."""
    costs = CostModel(draft_step=0.2, verify=_curve(kind))
    drafter = DraftModelDrafter(ModelRunner(draft), costs=costs)
    drafter._call_hits, drafter._call_trials = acceptance * 100, 100.0
    best, rates = _brute_best_k(acceptance, 0.2, costs.verify, 20)
    planned = drafter._planned_length(0, 20, 1.0, 1.0)
    assert planned in best or (best == {0} and planned == 0), (planned, sorted(best), rates)


@pytest.mark.parametrize(("draft_step", "verify_two"), [(0.05, 1.0), (0.4, 1.05), (0.3, 2.0)])
def test_probes_cost_a_call_that_never_drafts_at_most_the_budget(draft_step, verify_two) -> None:
    costs = CostModel(draft_step=draft_step, verify=(1.0, verify_two, 3.0))
    schedule = AdaptiveSchedule(max_k=2, costs=costs, probe_every=8)
    ks = []
    for _ in range(400):
        k = schedule.next_k(100)
        ks.append(k)
        schedule.observe(k, 0)
    plain_cost = len(ks)
    spent = sum(costs.step_cost(k) for k in ks)
    tail = ks[50:]  # past the prior's first drafts
    assert 1 in tail  # still probing, so the estimate can recover
    probes = sum(1 for k in tail if k)
    extra = costs.step_cost(1) - 1.0
    assert probes <= len(tail) / schedule.probe_interval + 1
    # Dear probes are rare (cheap ones come every probe_every steps and cost little).
    assert probes * extra / len(tail) <= schedule.probe_budget + extra / len(tail)
    assert spent / plain_cost < 1.0 + schedule.probe_budget + 0.05  # the prior's first steps
    assert schedule.probe_interval == max(8, math.ceil(extra / 0.02))


class _Clock:
    """The costs module's clock, advanced only by the forwards of ``_SpelledRunner``s: the
    host runs three times slower for the forwards numbered in ``slow`` (from 1), and from the
    moment ``spell`` is set (another process starting beside it)."""

    def __init__(self, slow: range = range(0)) -> None:
        self.now, self.slow, self.forwards, self.spell = 0.0, slow, 0, False

    def perf_counter(self) -> float:
        return self.now

    def run(self, work: float) -> None:
        self.forwards += 1
        slow = self.spell or self.forwards in self.slow
        self.now += work * (3.0 if slow else 1.0)


class _SpelledRunner(SettlesNothing):
    """A forward over n tokens takes ``per_token`` units each on ``clock``; ``starts_spell``:
    its first forward starts the clock's slow spell."""

    vocab_size = 8

    def __init__(self, clock: _Clock, per_token: float = 1.0, starts_spell: bool = False) -> None:
        self.clock, self.per_token, self.starts_spell = clock, per_token, starts_spell

    def new_cache(self) -> TokenSequence:
        return TokenSequence()

    def forward(self, tokens, cache, keep=None):
        self.clock.spell |= self.starts_spell
        self.clock.run(len(tokens) * self.per_token)
        cache.tokens.extend(tokens)
        return torch.zeros(len(tokens), self.vocab_size)


def test_a_curve_is_timed_length_beside_unit_so_a_slow_spell_does_not_skew_it(
    monkeypatch,
) -> None:
    """A spell of slowness while the single-token unit alone was timed made every ratio
    three times too small (measured on a 2-core host: 33 rows at 5.3 single steps with a busy
    loop running at the start, 14 without); timed in turns, each ratio comes out right."""
    from specagent.decoding import costs as costs_module
    from specagent.decoding.costs import finish, time_lengths

    clock = _Clock(slow=range(1, 5))
    monkeypatch.setattr(costs_module, "time", clock)
    runner = _SpelledRunner(clock)
    seconds = finish(time_lengths(runner, [1, 2, 4, 8, 16]))
    for n in (2, 4, 8, 16):
        assert seconds[n] / seconds[1] == pytest.approx(n)


def test_a_draft_step_is_priced_in_turns_with_the_target_s(monkeypatch) -> None:
    """A draft's curve and the target's unit are timed minutes apart: a spell of slowness over
    the draft's curve alone priced its step three times too dear. Its price in target steps
    is timed in turns with the target's unit; its curve keeps its own ratios."""
    from specagent.decoding import costs as costs_module
    from specagent.decoding.costs import measure_costs

    clock = _Clock()
    monkeypatch.setattr(costs_module, "time", clock)
    target = _SpelledRunner(clock)
    draft = _SpelledRunner(clock, per_token=0.25, starts_spell=True)
    costs = measure_costs(target, draft, 1, draft_tokens=8)
    assert clock.spell  # the premise: the draft was timed in the spell, the target's curve not
    assert costs.draft_step == pytest.approx(0.25)
    assert costs.draft_cost(8) == pytest.approx(2.0)
