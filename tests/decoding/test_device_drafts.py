"""Drafts decided on the device (``DraftModelDrafter.on_device``) and verification read once.

On an accelerator every read of a device value on the host waits for the device's queue to
drain: a draft that reads each token before feeding it stalls the device once per token. The
drafter can instead feed each token to the next draft forward where it lies and read the draft
once; verification reads its outcome once. Here, on the CPU, the reads are counted (a torch
function mode sees every ``int``, ``float``, ``bool`` and ``tolist`` of a tensor) and the
tokens compared with the host loop's, on every engine."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from distributions import PROMPT, chi_square_pvalues, exact_marginals, sample_counts
from engine_pairs import SMALL_VOCAB
from torch.overrides import TorchFunctionMode

from specagent.decoding.acceptance import TopKRule, verify_greedy, verify_lossless, verify_relaxed
from specagent.decoding.costs import CostModel
from specagent.decoding.drafters import DraftModelDrafter
from specagent.decoding.engine import advance
from specagent.decoding.loop import speculative_generate
from specagent.decoding.proposal import DraftRequest
from specagent.decoding.sampling import SamplingParams, make_generator
from specagent.decoding.schedule import FixedSchedule

PLANNING_COSTS = CostModel(draft_step=0.05, verify=(1.0, 1.0, 1.05, 1.1, 1.3, 1.6))
"""Verifying a few rows costs about as much as one and a draft token little: the plan and the
confidence threshold end drafts at every length."""


class HostReads(TorchFunctionMode):
    """Counts the reads of tensor values on the host while active."""

    READS = frozenset({"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        self.count += getattr(func, "__name__", "") in self.READS
        return func(*args, **(kwargs or {}))


def propose(drafter: DraftModelDrafter, context: list[int], k: int, params: SamplingParams, seed=0):
    """One draft, its forwards run inline; returns the proposal."""
    steps = drafter.propose_steps(DraftRequest(context, k, params, make_generator(seed)))
    try:
        while True:
            advance(steps, None, inline=True)
    except StopIteration as stop:
        return stop.value


def decode(pair, on_device: bool, params: SamplingParams, seed: int, **options) -> list[int]:
    drafter = DraftModelDrafter(pair.draft, on_device=on_device, **options)
    events = list(
        speculative_generate(
            pair.target,
            PROMPT,
            params=params,
            generator=make_generator(seed),
            max_new_tokens=10,
            drafter=drafter,
            schedule=FixedSchedule(4),
        )
    )
    return events[-1].output_ids


@pytest.mark.parametrize(
    "params",
    [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.8, top_k=6, top_p=0.9)],
    ids=["greedy", "sampled", "top-p"],
)
def test_drafts_on_the_device_give_the_host_loops_tokens(engine_pair, params) -> None:
    """Fixed k, no confidence stop: the same draft tokens, q and random draws as the host
    loop, so the same output token for token, greedy and sampled alike."""
    for seed in range(6):
        host = decode(engine_pair, False, params, seed)
        assert decode(engine_pair, True, params, seed) == host


def test_the_host_loops_stops_are_kept_on_the_device(engine_pair) -> None:
    """With the confidence threshold and planned lengths, a draft on the device keeps the
    tokens the host loop keeps (up to the length planned before its first token, which the host
    may extend), and its cache ends where the host loop's does: after all but the last."""
    options = {"confidence_threshold": 0.4, "costs": PLANNING_COSTS}
    rng = random.Random(0)
    lengths = set()
    for _ in range(8):
        context = [rng.randrange(3, SMALL_VOCAB) for _ in range(6)]
        host_drafter = DraftModelDrafter(engine_pair.draft, on_device=False, **options)
        device_drafter = DraftModelDrafter(engine_pair.draft, on_device=True, **options)
        host = propose(host_drafter, context, 5, SamplingParams(0.0)).tokens
        ours = propose(device_drafter, context, 5, SamplingParams(0.0)).tokens
        assert ours
        assert ours == host[: len(ours)]
        if len(ours) < len(host):  # only where the host extended its first plan
            assert len(ours) == max(1, device_drafter._planned_length(0, 5, 1.0, 1.0))
        lengths.add(len(ours))
        for drafter, tokens in ((host_drafter, host), (device_drafter, ours)):
            assert drafter.cache.get_seq_length() == len(context) + len(tokens) - 1
            assert drafter._cached == [*context, *tokens[:-1]]
    assert len(lengths) > 1  # the stops did cut some drafts short


@pytest.mark.slow
def test_drafts_on_the_device_with_stops_sample_as_the_target(engine_pair) -> None:
    """Sampled drafts decided on the device, cut afterwards by the confidence threshold and
    the planned length (stops chosen from the draft's own samples): the output is still
    distributed exactly as the target's."""
    params = SamplingParams(temperature=1.0)
    marginals = exact_marginals(engine_pair.target, params)
    counts = sample_counts(
        engine_pair.target,
        lambda: DraftModelDrafter(
            engine_pair.draft, confidence_threshold=0.4, costs=PLANNING_COSTS, on_device=True
        ),
        params,
        4,
    )
    pvalues = chi_square_pvalues(counts, marginals)
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.parametrize("slots", [False, True])
@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0, top_p=0.9)])
def test_a_draft_on_the_device_is_read_once(small_target, small_draft, slots, params) -> None:
    """Five draft forwards through the transformers engine, ordinary caches or KV slots: one
    read of the device, against two per token in the host loop."""
    from specagent.engines.transformers import ModelRunner

    context = [*PROMPT, 3, 5]
    reads = {}
    for on_device in (False, True):
        runner = ModelRunner(small_draft, slots=slots)
        drafter = DraftModelDrafter(runner, on_device=on_device)
        propose(drafter, PROMPT, 1, params)  # the prompt's prefill, outside the count
        with HostReads() as counted:
            proposal = propose(drafter, context, 5, params)
        assert len(proposal.tokens) == 5
        reads[on_device] = counted.count
    assert reads[True] == 1
    assert reads[False] >= 2 * 5


def test_verification_reads_the_device_once() -> None:
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 12, generator=generator), dim=-1)
    q = torch.softmax(torch.randn(4, 12, generator=generator), dim=-1)
    drafts = torch.multinomial(q, 1, generator=generator).view(-1)
    checks = [
        lambda: verify_lossless(drafts, q, p, generator),
        lambda: verify_relaxed(drafts, q, p, TopKRule(), generator),
        lambda: verify_greedy(drafts, torch.log(p)),
    ]
    for check in checks:
        with HostReads() as counted:
            check()
        assert counted.count == 1
