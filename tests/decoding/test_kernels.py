"""Linear kernels chosen by measurement: the transposed form computes the same products, applies
only where the plan says and only inside a runner's forwards, and is chosen by timing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specagent.decoding import kernels
from specagent.decoding.cache import ModelRunner
from specagent.decoding.costs import measure_costs
from specagent.decoding.draft_model import DraftModelDrafter
from specagent.decoding.kernels import LinearPlan, choose_kernels, transposed_linear
from specagent.decoding.loop import speculative_generate
from specagent.decoding.sampling import SamplingParams
from specagent.decoding.schedule import FixedSchedule


@pytest.mark.parametrize("shape", [(1, 16), (3, 16), (2, 5, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_transposed_form_computes_the_same_product(shape, with_bias) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen)
    weight = torch.randn(24, 16, generator=gen)
    bias = torch.randn(24, generator=gen) if with_bias else None
    expected = F.linear(x, weight, bias)
    got = transposed_linear(x, weight, bias)
    assert got.shape == expected.shape
    assert got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_plan_applies_at_its_rows_and_only_inside_the_context(monkeypatch) -> None:
    calls: list[int] = []
    original = kernels.transposed_linear

    def spy(x, weight, bias=None):
        calls.append(x.numel() // x.shape[-1])
        return original(x, weight, bias)

    monkeypatch.setattr(kernels, "transposed_linear", spy)
    layer = torch.nn.Linear(8, 4)
    plan = LinearPlan(frozenset({3}))
    with plan.active():
        layer(torch.randn(1, 3, 8))  # 3 rows: rerouted
        layer(torch.randn(1, 2, 8))  # 2 rows: torch's own
    layer(torch.randn(3, 8))  # outside the context: torch's own
    assert calls == [3]
    assert layer.forward.__func__ is torch.nn.Linear.forward  # the module is not changed
    assert not LinearPlan()  # an empty plan changes nothing and enters no mode


def test_runner_logits_with_a_plan_match_torch_kernels(target) -> None:
    everywhere = LinearPlan(frozenset(range(1, 65)))
    plain, planned = ModelRunner(target), ModelRunner(target, kernels=everywhere)
    ids = [5, 11, 42, 57, 99, 23, 64, 8]
    a, b = plain.forward(ids, plain.new_cache()), planned.forward(ids, planned.new_cache())
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    caches = [planned.new_cache(), planned.new_cache()]
    batched = planned.forward_batch([(ids[:5], caches[0]), (ids[:3], caches[1])])
    torch.testing.assert_close(batched[0], a[:5], rtol=1e-4, atol=1e-4)


def test_greedy_speculation_under_a_plan_equals_plain_greedy(target, draft) -> None:
    """Only the rounding order changes: greedy tokens stay the target's (tiny fp32 model)."""
    everywhere = LinearPlan(frozenset(range(1, 65)))
    prompt = [5, 11, 42, 57, 99, 23, 64, 8, 77, 31]
    expected = target.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    runner = ModelRunner(target, kernels=everywhere)
    drafter = DraftModelDrafter(ModelRunner(draft, kernels=everywhere))
    events = list(
        speculative_generate(
            runner,
            prompt,
            params=SamplingParams(temperature=0.0),
            generator=torch.Generator().manual_seed(0),
            max_new_tokens=24,
            drafter=drafter,
            schedule=FixedSchedule(5),
        )
    )
    assert events[-1].output_ids == expected


def _timer(linear: dict[int, float], transposed: dict[int, float]):
    def time_forward(n: int, plan: LinearPlan) -> float:
        return (transposed if n in plan.transposed_rows else linear)[n]

    return time_forward


def test_kernels_are_chosen_per_length_by_time() -> None:
    """Per row on torch's kernels (as on an AVX2 EPYC), flat with the transposed form from 2
    rows: chosen from 2 on, with the untimed lengths between following the timed one below."""
    lengths = [1, 2, 3, 4, 8, 12]
    per_row = {n: 1.0 * n for n in lengths}
    flat = {n: 1.0 + 0.05 * n for n in lengths}
    flat[1] = 0.98  # a tie at one row keeps torch's kernels (MIN_GAIN)
    plan, times = choose_kernels(_timer(per_row, flat), lengths)
    assert plan.transposed_rows == frozenset({2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12})
    assert times[1] == 1.0
    assert times[8] == pytest.approx(1.4)


def test_a_transposed_win_that_does_not_repeat_is_not_kept() -> None:
    """The first pair of timings caught torch's kernels in a slow moment; timed again in the
    opposite order, the transposed form is no faster: torch's kernels stay."""
    readings = iter([1.0, 0.8, 1.0, 1.0, 1.0, 0.5, 0.5, 1.0])  # length 1, then length 2

    def time_forward(n: int, plan: LinearPlan) -> float:
        return next(readings)

    plan, times = choose_kernels(time_forward, [1, 2])
    assert plan.transposed_rows == frozenset({2})
    assert times == {1: 1.0, 2: 0.5}


def test_kernels_stay_torch_where_the_transposed_form_is_slower() -> None:
    lengths = [1, 2, 4, 8]
    plan, times = choose_kernels(
        _timer(dict.fromkeys(lengths, 1.0), dict.fromkeys(lengths, 2.0)), lengths
    )
    assert not plan
    assert times == dict.fromkeys(lengths, 1.0)


def test_measured_costs_leave_each_runner_with_its_kernels(target, draft) -> None:
    target_runner, draft_runner = ModelRunner(target), ModelRunner(draft)
    costs = measure_costs(target_runner, None, 6, repeats=1)
    assert len(costs.verify) == 6
    assert costs.verify[0] == 1.0
    chosen = LinearPlan(frozenset({2, 3, 30}))  # as if the verify curve had chosen these
    target_runner.kernels = chosen
    costs = measure_costs(target_runner, draft_runner, 1, draft_tokens=4, repeats=1)
    assert len(costs.draft) == 4
    assert costs.draft_step == costs.draft[0]
    assert target_runner.kernels == chosen  # timing the unit does not re-choose them
    assert isinstance(draft_runner.kernels, LinearPlan)
