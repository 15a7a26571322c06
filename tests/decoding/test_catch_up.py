"""A draft model's catch-up is priced: a call drafts with the draft model only where what it can
still save covers feeding the draft the context it has not seen (a long prompt's prefill)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, make_model
from test_greedy_and_cache import run

from specagent.decoding.costs import CostModel
from specagent.decoding.drafters import AutoDrafter, DraftModelDrafter, SuffixDrafter
from specagent.decoding.schedule import AdaptiveSchedule, FixedSchedule
from specagent.engines.transformers import ModelRunner
from specagent.runtime.memory import PrefixCache

# A draft step costs a fifth of a target step, each further token fed 0.05: a 200-token prompt
# costs the draft about ten target steps to catch up on.
COSTS = CostModel(
    draft_step=0.2,
    verify=(1.0, 1.05, 1.1, 1.15, 1.2),
    draft=tuple(round(0.2 + 0.05 * i, 2) for i in range(6)),
)


def long_prompt(vocab: int, n: int = 200) -> list[int]:
    generator = torch.Generator().manual_seed(3)
    return torch.randint(3, vocab, (n,), generator=generator).tolist()


def decode(target, ids, drafter, n, schedule=None):
    """Greedy, up to n tokens; the last event."""
    return run(ModelRunner(target), ids, drafter, 3, n=n, schedule=schedule)


def test_catch_up_cost_follows_the_measured_curve_then_its_slope() -> None:
    assert COSTS.catch_up_cost(0) == 0.0
    assert COSTS.catch_up_cost(3) == pytest.approx(0.15)  # draft_cost(4) - draft_step
    # Past the curve: its upper half's slope (0.05 per token), not a quarter step per token.
    assert COSTS.catch_up_cost(199) == pytest.approx(0.45 + 0.05 * 194 - 0.2)
    flat = CostModel(draft_step=0.2, draft=(0.2,) * 6)
    assert 0 < flat.catch_up_cost(1000) <= 0.01 * 0.2 * 1000  # never free
    assert CostModel(draft_step=0.4).catch_up_cost(2) == pytest.approx(0.25 * 0.4 * 2)


def test_a_short_call_after_a_long_unseen_prompt_never_prefills_the_draft(target, draft) -> None:
    ids = long_prompt(target.config.vocab_size)
    drafter = DraftModelDrafter(ModelRunner(draft), costs=COSTS, call_end=len(ids) + 8)
    last = decode(target, ids, drafter, 8)
    assert last.output_ids == hf_greedy(target, ids, 8)
    assert drafter.draft_forwards == 0
    assert not drafter._cached  # the prompt was never fed to the draft
    assert last.counters.num_draft_tokens == 0


def test_a_long_call_drafts_after_the_same_prompt(target, draft) -> None:
    ids = long_prompt(target.config.vocab_size)
    drafter = DraftModelDrafter(ModelRunner(draft), costs=COSTS, call_end=len(ids) + 64)
    last = decode(target, ids, drafter, 64)
    assert last.output_ids == hf_greedy(target, ids, 64)
    assert drafter.draft_forwards > 0
    assert last.counters.num_draft_tokens > 0


def test_a_prompt_the_draft_holds_already_is_cheap_to_catch_up(target, draft) -> None:
    """The prefix cache holds the draft's KV of the prompt (an agent's earlier turn): a short
    call drafts, since only the last token is new to the draft."""
    ids = long_prompt(target.config.vocab_size)
    runner, prefixes = ModelRunner(draft), PrefixCache()
    earlier = runner.new_cache()
    runner.forward(ids[:-1], earlier, keep=1)
    prefixes.store(runner, ids[:-1], earlier)
    drafter = DraftModelDrafter(runner, prefixes, costs=COSTS, call_end=len(ids) + 8)
    assert prefixes.matched(runner, ids[:-1]) == len(ids) - 1
    hits = prefixes.hits
    last = decode(target, ids, drafter, 8)
    assert last.output_ids == hf_greedy(target, ids, 8)
    assert drafter.draft_forwards > 0
    assert prefixes.hits == hits + 1  # ``matched`` alone copies and counts nothing


def test_a_drafter_without_prices_or_end_always_catches_up(target, draft) -> None:
    ids = long_prompt(target.config.vocab_size)
    unpriced = DraftModelDrafter(ModelRunner(draft), call_end=len(ids) + 4)
    unbounded = DraftModelDrafter(ModelRunner(draft), costs=COSTS)
    assert unpriced.catch_up_pays(ids)
    assert unbounded.catch_up_pays(ids)


def test_auto_takes_history_where_the_draft_model_would_not_pay(target, draft) -> None:
    """``auto`` with a draft model whose catch-up does not pay still drafts from the call's
    own context (free), and its output stays the target's greedy output."""
    vocab = target.config.vocab_size
    ids = long_prompt(vocab, 120) * 2  # the second half repeats the first: lookups find it
    model = DraftModelDrafter(ModelRunner(draft), costs=COSTS, call_end=len(ids) + 12)
    schedule = AdaptiveSchedule(max_k=4, costs=COSTS, drafter_stops=True, prior_weight=2.0)
    auto = AutoDrafter(SuffixDrafter(costs=COSTS, own_context=True), model, schedule)
    last = decode(target, ids, auto, 12, schedule=FixedSchedule(4))
    assert last.output_ids == hf_greedy(target, ids, 12)
    assert model.draft_forwards == 0
    assert last.counters.num_draft_tokens > 0  # the history drafted
    assert "model" not in last.counters.accepted_by_source


class _Recording(DraftModelDrafter):
    """Notes the context length of every step at which the draft model ran a forward."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drafted_at: list[int] = []

    def propose_steps(self, ask):
        before = self.draft_forwards
        proposal = yield from super().propose_steps(ask)
        if self.draft_forwards > before:
            self.drafted_at.append(len(ask.context))
        return proposal


def test_a_bad_start_does_not_turn_the_draft_off_for_the_rest_of_the_call(target) -> None:
    """A draft that disagrees at first: the schedule falls back to plain steps and probes the
    draft every ``probe_interval`` steps. Catching the draft up on the plain steps' few tokens
    must not be priced at that low acceptance (no saving at all), or the first probe is
    refused and the draft model never runs again in the call."""
    unrelated = make_model(target.config.vocab_size, layers=1, seed=5, init=0.1)
    ids = long_prompt(target.config.vocab_size, 20)
    drafter = _Recording(ModelRunner(unrelated), costs=COSTS, call_end=len(ids) + 64)
    schedule = AdaptiveSchedule(max_k=4, costs=COSTS, drafter_stops=True, prior_weight=2.0)
    last = decode(target, ids, drafter, 64, schedule=schedule)
    assert last.output_ids == hf_greedy(target, ids, 64)
    at = drafter.drafted_at
    assert len(at) < 64  # plain steps ran in between: drafting did not pay
    assert max(at) - min(at) > schedule.probe_interval  # and probes drafted after them
