"""Linear kernels chosen by measurement: the transposed form and the packed weights compute the
same products, apply only where the plan says and only inside a runner's forwards, and are chosen
by timing."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from specagent.decoding.costs import measure_costs
from specagent.decoding.drafters import DraftModelDrafter
from specagent.decoding.loop import speculative_generate
from specagent.decoding.sampling import SamplingParams
from specagent.decoding.schedule import FixedSchedule
from specagent.engines.transformers import ModelRunner, kernels
from specagent.engines.transformers.kernels import (
    LinearPlan,
    PackedWeights,
    choose_kernels,
    transposed_linear,
)


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


def _spy_on_transposed(monkeypatch) -> list[int]:
    """The row counts of the products the transposed form computes from now on."""
    calls: list[int] = []
    original = kernels.transposed_linear

    def spy(x, weight, bias=None):
        calls.append(x.numel() // x.shape[-1])
        return original(x, weight, bias)

    monkeypatch.setattr(kernels, "transposed_linear", spy)
    return calls


def test_plan_applies_at_its_rows_and_only_inside_the_context(monkeypatch) -> None:
    calls = _spy_on_transposed(monkeypatch)
    layer = torch.nn.Linear(8, 4)
    plan = LinearPlan(frozenset({3}))
    with plan.active():
        layer(torch.randn(1, 3, 8))  # 3 rows: rerouted
        layer(torch.randn(1, 2, 8))  # 2 rows: torch's own
    layer(torch.randn(3, 8))  # outside the context: torch's own
    assert calls == [3]
    assert layer.forward.__func__ is torch.nn.Linear.forward  # the module is not changed
    assert not LinearPlan()  # an empty plan changes nothing and enters no mode


def test_plan_over_given_modules_applies_in_this_thread_only(monkeypatch) -> None:
    """With the modules given, their forwards are rerouted while the context lasts, in the
    thread that entered it; the modules are as before afterwards, also after an error and
    with contexts nested."""
    calls = _spy_on_transposed(monkeypatch)
    layer, other = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    plan = LinearPlan(frozenset({3}))
    x = torch.randn(3, 8)
    elsewhere: list[torch.Tensor] = []
    with plan.active(linears=[layer]):
        got = layer(x)  # rerouted
        other(x)  # not a given module: torch's own
        thread = threading.Thread(target=lambda: elsewhere.append(layer(x)))
        thread.start()
        thread.join()  # another thread's use of the same module: torch's own
        with plan.active(linears=[layer]):
            layer(x)
        layer(x)  # the inner context's end leaves the outer one's routing
        copied = copy.deepcopy(layer).double()  # copied meanwhile (another thread may)
        own = F.linear(x.double(), copied.weight, copied.bias)
        torch.testing.assert_close(copied(x.double()), own)
    assert calls == [3, 3, 3]
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))
    copied(x.double())  # the copy's own product, after the context too
    torch.testing.assert_close(elsewhere[0], got)
    assert "forward" not in layer.__dict__  # the module is as it was
    with pytest.raises(RuntimeError), plan.active(linears=[layer]):
        raise RuntimeError("a forward failed")
    assert "forward" not in layer.__dict__
    layer(x)
    assert calls == [3, 3, 3]


def test_runner_forwards_reroute_modules_without_a_torch_function_mode(target, monkeypatch) -> None:
    """A mode sees every torch call of a forward (3-13% of a bf16 1.5B forward on a
    2-core EPYC): a runner gives its plan its linear modules instead."""

    def no_mode(*args, **kwargs):
        raise AssertionError("a runner's forward entered the F.linear mode")

    monkeypatch.setattr(kernels._PlannedLinears, "__init__", no_mode)
    calls = _spy_on_transposed(monkeypatch)
    runner = ModelRunner(target, kernels=LinearPlan(frozenset({3, 6})))
    runner.forward(TOKENS[:3], runner.new_cache())
    linears = [m for m in target.modules() if type(m) is torch.nn.Linear]
    assert calls == [3] * len(linears)  # every product of the 3-row forward, rerouted
    calls.clear()
    runner.forward_batch([(TOKENS[:3], runner.new_cache()), (TOKENS[:2], runner.new_cache())])
    assert set(calls) == {6}  # the batch's 2 x 3 rows, rerouted as one product
    assert all("forward" not in m.__dict__ for m in linears)


TOKENS = [5, 11, 42, 57, 99, 23, 64, 8]
"""The tokens the logits comparisons feed."""


def test_runner_logits_with_a_plan_match_torch_kernels(target) -> None:
    everywhere = LinearPlan(frozenset(range(1, 65)))
    _assert_logits_match_torch(target, ModelRunner(target, kernels=everywhere))


def _assert_logits_match_torch(target, planned: ModelRunner) -> torch.Tensor:
    """``planned``'s logits, alone and batched, against torch's kernels; returns torch's."""
    plain = ModelRunner(target)
    ids = TOKENS
    a, b = plain.forward(ids, plain.new_cache()), planned.forward(ids, planned.new_cache())
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    caches = [planned.new_cache(), planned.new_cache()]
    batched = planned.forward_batch([(ids[:5], caches[0]), (ids[:3], caches[1])])
    torch.testing.assert_close(batched[0], a[:5], rtol=1e-4, atol=1e-4)
    return a


def test_greedy_speculation_under_a_plan_equals_plain_greedy(target, draft) -> None:
    """Only the rounding order changes: greedy tokens stay the target's (tiny fp32 model)."""
    everywhere = LinearPlan(frozenset(range(1, 65)))
    runner = ModelRunner(target, kernels=everywhere)
    _assert_greedy_equals_plain(target, runner, ModelRunner(draft, kernels=everywhere))


def _assert_greedy_equals_plain(target, runner: ModelRunner, draft_runner: ModelRunner) -> None:
    prompt = [5, 11, 42, 57, 99, 23, 64, 8, 77, 31]
    expected = target.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    events = list(
        speculative_generate(
            runner,
            prompt,
            params=SamplingParams(temperature=0.0),
            generator=torch.Generator().manual_seed(0),
            max_new_tokens=24,
            drafter=DraftModelDrafter(draft_runner),
            schedule=FixedSchedule(5),
        )
    )
    assert events[-1].output_ids == expected


def _timer(
    linear: dict[int, float],
    transposed: dict[int, float],
    packed: dict[int, float] | None = None,
):
    def time_forward(n: int, plan: LinearPlan) -> float:
        if n in plan.packed_rows:
            assert packed is not None, "packed weights timed where there are none"
            return packed[n]
        return (transposed if n in plan.transposed_rows else linear)[n]

    return time_forward


def _packed(model: torch.nn.Module) -> PackedWeights:
    packed = PackedWeights.of(model)
    if packed is None:
        pytest.skip("oneDNN cannot pack float32 weights on this machine")
    return packed


@pytest.mark.parametrize("shape", [(1, 16), (3, 16), (2, 5, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_weights_compute_the_same_product(shape, with_bias) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(16, 24, bias=with_bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 16, generator=gen))
    x = torch.randn(*shape, generator=gen)
    packed = _packed(layer)
    assert len(packed) == 1
    assert layer.weight in packed
    assert torch.nn.Linear(16, 24).weight not in packed  # another weight: not this copy
    assert packed.nbytes == 24 * 16 * 4
    got = packed.linear(x, layer.weight, layer.bias)
    expected = F.linear(x, layer.weight, layer.bias)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # changed in place: the copy is stale, so no longer held
    assert layer.weight not in packed
    with LinearPlan(packed_rows=frozenset({1, 3, 10})).active(packed):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_packed_rows_apply_to_packed_weights_only(monkeypatch) -> None:
    calls: list[tuple[int, int]] = []
    original = PackedWeights.linear

    def spy(self, x, weight, bias=None):
        calls.append((x.numel() // x.shape[-1], weight.shape[0]))
        return original(self, x, weight, bias)

    monkeypatch.setattr(PackedWeights, "linear", spy)
    packed_layer, other_layer = torch.nn.Linear(8, 4), torch.nn.Linear(8, 6)
    packed = _packed(packed_layer)
    plan = LinearPlan(packed_rows=frozenset({3}))
    with plan.active(packed):
        packed_layer(torch.randn(1, 3, 8))  # 3 rows of a packed weight: from the packed copy
        packed_layer(torch.randn(2, 8))  # 2 rows: torch's own
        other_layer(torch.randn(3, 8))  # a weight the copy does not hold: torch's own
    with plan.active():  # no packed weights given: the plan's packed rows change nothing
        packed_layer(torch.randn(3, 8))
    assert calls == [(3, 4)]
    assert not plan.transposed_rows
    assert plan


def test_weights_are_not_packed_without_the_memory_for_the_copy(monkeypatch) -> None:
    layer = torch.nn.Linear(64, 64)
    monkeypatch.setattr(kernels, "available_memory", lambda: 64 * 64 * 4)  # less than 1.5x
    assert PackedWeights.of(layer) is None
    monkeypatch.setattr(kernels, "available_memory", lambda: None)  # unknown: not packed either
    assert PackedWeights.of(layer) is None
    assert PackedWeights.of(torch.nn.ReLU()) is None  # nothing to pack


def test_runner_logits_with_packed_weights_match_torch_kernels(target, draft) -> None:
    _packed(target)  # skips where the weights cannot be packed here
    planned = ModelRunner(target)
    assert planned.restore({"packed_rows": list(range(1, 65))})  # as a stored plan is taken
    assert planned.packed is not None
    a = _assert_logits_match_torch(target, planned)
    ids = TOKENS
    # Decoding on, one token at a time and then a verification's rows, from the packed copy.
    cache = planned.new_cache()
    planned.forward(ids[:4], cache)
    step = planned.forward(ids[4:5], cache)
    rows = planned.forward(ids[5:], cache)
    torch.testing.assert_close(torch.cat([step, rows]), a[4:], rtol=1e-4, atol=1e-4)
    _assert_greedy_equals_plain(target, planned, ModelRunner(draft))


def test_packed_weights_are_chosen_where_fastest() -> None:
    """Three forms timed per length: packed weights win one row and 4+, the transposed form 2-3
    (as each measured somewhere on the EPYC); the untimed lengths follow the timed one below."""
    lengths = [1, 2, 3, 4, 8]
    torch_times = {n: 1.0 * n for n in lengths}
    transposed = {1: 1.2, 2: 1.0, 3: 1.05, 4: 1.3, 8: 1.9}
    packed = {1: 0.8, 2: 1.2, 3: 1.3, 4: 1.1, 8: 1.4}
    plan, times = choose_kernels(_timer(torch_times, transposed, packed), lengths, packed=True)
    assert plan.packed_rows == frozenset({1, 4, 5, 6, 7, 8})
    assert plan.transposed_rows == frozenset({2, 3})
    assert times == {1: 0.8, 2: 1.0, 3: 1.05, 4: 1.1, 8: 1.4}
    # Without packed weights the packed form is never timed.
    plan, _ = choose_kernels(_timer(torch_times, transposed), lengths)
    assert not plan.packed_rows


def test_measured_costs_keep_packed_weights_only_where_chosen(target, monkeypatch) -> None:
    if PackedWeights.of(target) is None:
        pytest.skip("oneDNN cannot pack float32 weights on this machine")
    monkeypatch.setattr(kernels, "MIN_GAIN", 0.0)  # no form can win: torch's kernels stay
    runner = ModelRunner(target)
    measure_costs(runner, None, 4, repeats=1)
    assert not runner.kernels
    assert runner.packed is None
    monkeypatch.setattr(kernels, "MIN_GAIN", 1e9)  # every form wins over torch's
    measure_costs(runner, None, 4, repeats=1)
    assert not runner.kernels  # settled once: measuring again only times it
    other = ModelRunner(target)
    measure_costs(other, None, 4, repeats=1)
    assert other.kernels
    assert (other.packed is not None) == bool(other.kernels.packed_rows)
    assert not other.restore({"transposed_rows": [2]})  # another plan is refused once settled
    assert other.restore(other.settings)


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


def _readings(*values: float) -> Callable[[int, LinearPlan], float]:
    """A ``time_forward`` that answers these readings in order, whatever it is asked."""
    answers = iter(values)
    return lambda n, plan: next(answers)


def test_a_transposed_win_that_does_not_repeat_is_not_kept() -> None:
    """The first pass caught torch's kernels in a slow moment; the second, in the opposite
    order, finds the transposed form no faster and the third agrees: torch's kernels stay. At
    two rows both passes agree, so there is no third."""
    readings = _readings(
        *(1.0, 0.8, 1.0, 1.0, 1.0, 1.0),  # one row: torch, transposed; transposed, torch; ...
        *(1.0, 0.5, 0.5, 1.0),  # two rows
    )
    plan, times = choose_kernels(readings, [1, 2])
    assert plan.transposed_rows == frozenset({2})
    assert times == {1: 1.0, 2: 0.5}


def test_a_win_hidden_by_one_slow_pass_is_kept() -> None:
    """A burst slowed the packed weights in the first pass only: the two later passes find
    them clearly fastest, and the kept time is their fastest reading."""
    readings = _readings(
        *(1.0, 1.1, 1.3),  # torch, transposed, packed (the burst)
        *(0.6, 1.1, 1.0),  # packed, transposed, torch
        *(1.0, 1.1, 0.7),  # torch, transposed, packed
    )
    plan, times = choose_kernels(readings, [3], packed=True)
    assert plan.packed_rows == frozenset({3})
    assert times == {3: 0.6}


def test_a_three_way_split_keeps_torch() -> None:
    """Each pass votes for another form (transposed, packed, torch's): no form has two votes,
    so torch's kernels stay, at their fastest reading."""
    readings = _readings(
        *(1.0, 0.5, 1.0),  # torch, transposed, packed
        *(0.5, 1.0, 1.0),  # packed, transposed, torch
        *(0.9, 1.0, 1.0),  # torch, transposed, packed
    )
    plan, times = choose_kernels(readings, [2], packed=True)
    assert not plan
    assert times == {2: 0.9}


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
    chosen = LinearPlan(frozenset({2, 3, 30}))  # as if an earlier process had chosen these
    target_runner = ModelRunner(target)
    assert target_runner.restore({"transposed_rows": [2, 3, 30]})
    costs = measure_costs(target_runner, draft_runner, 1, draft_tokens=4, repeats=1)
    assert len(costs.draft) == 4
    assert costs.draft_step == costs.draft[0]
    assert target_runner.kernels == chosen  # timing the unit does not re-choose them
    assert isinstance(draft_runner.kernels, LinearPlan)


def test_plans_on_two_threads_leave_the_modules_as_they_were() -> None:
    """Runtimes over one model object step on threads of their own: one thread's plan may end
    while the other's runs, in any order, and the modules get back what they had only when the
    last ends (a racy save-and-restore left a rerouted forward behind)."""
    import threading

    layer = torch.nn.Linear(16, 16)
    plan = LinearPlan(frozenset({3}))
    inside, release = threading.Event(), threading.Event()

    def other_thread() -> None:
        with plan.active(linears=[layer]):
            inside.set()
            release.wait(5)

    thread = threading.Thread(target=other_thread)
    thread.start()
    inside.wait(5)
    with plan.active(linears=[layer]):
        release.set()  # the other thread's plan ends first, while this one runs
        thread.join(5)
        assert "forward" in layer.__dict__  # still rerouted for this thread
        layer(torch.randn(3, 16))
    assert "forward" not in layer.__dict__
