"""The runtime's decoding side (``Decoder``): its models' runners, the step costs they plan
with, and each call's decoding coroutine, assembled from ``decoding.registry``. Used on the
worker thread (the cost book is thread-safe for ``step_costs`` from elsewhere)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Generator, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from ..decoding.costs import CostModel
from ..decoding.drafters.base import DrafterBlock
from ..decoding.drafters.predicted import PredictedDrafter
from ..decoding.engine import Runner
from ..decoding.loop import DecodeEvent, DecodeSteps, Decoding, speculative_steps
from ..decoding.registry import DRAFTERS, DraftingParts
from ..decoding.sampling import make_generator
from ..decoding.schedule import FixedSchedule
from ..decoding.stopping import StopStrings
from ..engines import EngineModel, RunnerNeeds
from ..grammar import prepare
from ..machine import ProbeStore
from ._admission import CallPlan
from ._worker import Worker
from .memory import CostBook, HistoryStore, PrefixCache
from .options import RuntimeOptions

__all__ = ["Decoder"]

log = logging.getLogger("specagent.runtime")
T = TypeVar("T")


class Decoder:
    """Runners over the target (and draft), a ``CostBook`` and the calls' decoding coroutines."""

    def __init__(
        self,
        target: EngineModel,
        draft: EngineModel | None,
        *,
        eos_token_ids: Sequence[int],
        prefixes: PrefixCache | None,
        store: ProbeStore | None,
        longest: int,
        decode_text: Callable[[Sequence[int]], str],
        history: HistoryStore | None = None,
        tokenizer: Any | None = None,
    ) -> None:
        self.target = target
        self.draft = draft
        self.vocab_size = vocab_size = target.vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.context_window = target.context_window
        self.prefixes = prefixes
        self.decode_text = decode_text
        self.history = history
        """Earlier calls' text, per scope key (``drafter.history``)."""
        self.num_layers = target.num_layers
        self.store = store
        self.tokenizer = tokenizer
        needs = RunnerNeeds("target", None, self.eos_token_ids, tokenizer, store)
        target_runner, target_choice = target.build_runner(needs)
        self.target_runner: Runner = target_runner
        self.draft_runner: Runner | None = None
        self.step_choices: dict[str, Any] = {"target": target_choice}
        if draft is not None:
            needs = dataclasses.replace(needs, role="draft", vocab_size=vocab_size)
            self.draft_runner, self.step_choices["draft"] = draft.build_runner(needs)
        # Per model: what its engine decided about its steps at load (the transformers
        # engine's compiled steps; nothing where steps stay eager or the engine decides none).
        self.step_choices = {k: v for k, v in self.step_choices.items() if v is not None}
        self.shallow_runners: dict[int, Runner] = {}
        self.use_costs(CostBook(self.target_runner, longest, store))

    def share(self, other: Decoder) -> None:
        """Use ``other``'s runners (same models: kernels and caches of shapes are kept) and its
        measured costs where they cover this decoder's longest draft. The history is not shared:
        each runtime drafts only from the calls it served."""
        self.target_runner, self.draft_runner = other.target_runner, other.draft_runner
        self.shallow_runners = other.shallow_runners
        self.step_choices = other.step_choices
        longest = self.costs.longest
        if other.costs.covers(longest):
            self.use_costs(other.costs)
        else:
            self.use_costs(CostBook(self.target_runner, longest, self.store))

    def use_costs(self, book: CostBook) -> None:
        self.costs = book
        self.parts = DraftingParts(
            target=self.target_runner,
            draft=self.draft_runner,
            prefixes=self.prefixes,
            costs=book.model,
            shallow=self.shallow_runner,
            num_layers=self.num_layers,
        )

    def shallow_runner(self, layers: int) -> Runner:
        """A runner over the target's first ``layers`` layers (early exit), made once."""
        if layers not in self.shallow_runners:
            runner = self.target.shallow_runner(layers, self.vocab_size)
            self.shallow_runners[layers] = runner
        return self.shallow_runners[layers]

    def cost_runner(self, block: DrafterBlock) -> Runner | None:
        """The model whose forwards drafting costs with ``block`` (None: a free drafter)."""
        return DRAFTERS[block.kind].cost_runner(block, self.parts)

    def measurement(self, blocks: Iterable[DrafterBlock]) -> Generator[None, None, None] | None:
        """The background measurement of the costs the drafting blocks plan with."""
        drafting = [block for block in blocks if DRAFTERS[block.kind].drafts]
        if not drafting:
            return None
        return self.costs.measurement([self.cost_runner(block) for block in drafting])

    def _reproducible_parts(self, parts: DraftingParts, tokens: int) -> DraftingParts:
        """``parts`` over runners whose forwards depend on nothing other calls hold
        (``Runner.reproducible``), planning with the costs measured for the shared ones."""
        target = self.target_runner.reproducible(tokens)
        shared_draft = self.draft_runner
        draft = shared_draft.reproducible(tokens) if shared_draft is not None else None

        def costs(runner: Runner | None) -> CostModel:
            return self.costs.model(shared_draft if runner is draft else runner)

        return dataclasses.replace(parts, target=target, draft=draft, prefixes=None, costs=costs)

    def kv_budget(self) -> int | None:
        """The KV positions the running calls may hold together (``EngineModel.kv_budget``; the
        smaller of target's and draft's)."""
        budgets = [m.kv_budget() for m in (self.target, self.draft) if m is not None]
        known = [b for b in budgets if b is not None]
        return min(known) if known else None

    def compute(self, work: Callable[[], T]) -> T:
        """Run ``work`` (a worker's round, a measurement) where the target's engine computes
        (``EngineModel.compute``)."""
        return self.target.compute(work)

    def compute_wanted(self) -> bool:
        """Whether other work waits where the target computes (``EngineModel.compute_wanted``)."""
        return self.target.compute_wanted()

    def kv_need(self, plan: CallPlan) -> int:
        """What a call may come to hold of the KV: its prompt, its new tokens and its longest
        draft. A reproducible call counts as much though its KV may be a context of its own
        (llama.cpp): that is memory too, and a flood of such calls must wait its turn like any
        other, not hold KV past the budget beside the calls of the pool."""
        return len(plan.prompt_ids) + plan.max_new_tokens + self.costs.longest

    def background(self, drafters: Iterable[DrafterBlock]) -> Generator[None, None, None]:
        """What the worker does between rounds from its start: the tokenizer's conversion for
        constrained output (a slice of its own: it holds the GIL for about a second, better at
        start than in the middle of other calls' streams), then the step costs."""
        if self.tokenizer is not None:
            prepare(self.tokenizer, self.vocab_size, self.eos_token_ids)
            yield
        measurement = self.measurement(drafters)
        if measurement is None:
            return
        started, timings = time.perf_counter(), 0
        for _ in measurement:  # each slice is one timed forward; none where all was stored
            if timings == 0:
                log.info(
                    "measuring what drafting costs on this machine, in the background between "
                    "calls (once per machine and model; calls plan with estimates meanwhile)"
                )
            timings += 1
            yield
        if timings:
            log.info(
                "step costs measured in %.0f s (%d timed forwards); kept for this machine",
                time.perf_counter() - started,
                timings,
            )

    def worker(
        self, options: RuntimeOptions, drafters: Iterable[DrafterBlock], device: torch.device
    ) -> Worker:
        """A worker that decodes calls with this decoder's runners, measuring the step costs
        ``drafters`` plan with in the background from its start."""
        return Worker(
            lambda plan: self.decode(plan, device),
            max_active=options.max_active,
            max_queue=options.max_queue,
            batching=options.batching,
            background=self.background(drafters),
            kv_budget=self.kv_budget(),
            need=self.kv_need,
            compute=self.compute,
            compute_wanted=self.compute_wanted,
        )

    def step_costs(self, block: DrafterBlock, measure: bool) -> CostModel:
        """The step costs drafting with ``block`` plans with: measured now where missing
        (``measure``, on the thread the worker's rounds run on: the book's lock is held around
        each timing, and a timing asked from elsewhere must not wait for a round that waits
        for that lock), else what the book has now (a prior until measured)."""
        runner = self.cost_runner(block)
        if measure:
            return self.compute(lambda: self.costs.measured(runner))
        return self.costs.model(runner)

    def decode(self, plan: CallPlan, device: torch.device) -> DecodeSteps:
        """The decoding coroutine of one call."""
        policy, block = plan.policy, plan.drafter
        key, history = plan.history_key, self.history
        # KV is reused within the call's tenant only: one tenant's prompts and outputs never
        # seed another's forwards (nor, by timing, tell that they were sent). A call with no
        # tenant reuses none: anonymous callers are not known to be one party.
        prefixes = None
        if self.prefixes is not None and plan.tenant is not None:
            prefixes = self.prefixes.scoped(plan.tenant)
        call_end = len(plan.prompt_ids) + plan.max_new_tokens
        parts = dataclasses.replace(
            self.parts, prefixes=prefixes, call_end=call_end, prediction=plan.prediction_ids
        )
        target = self.target_runner
        if plan.reproducible:
            # No KV from other calls' forwards, and none beside theirs: either would change
            # its rounding. Its runners plan with the measured costs of the shared ones.
            parts = self._reproducible_parts(parts, call_end + self.costs.longest)
            target, prefixes = parts.target, None
        if key is not None and history is not None:
            parts = dataclasses.replace(parts, history=history.indexes(key))
        kind = DRAFTERS[block.kind]
        drafter, schedule = kind.build(block, parts)
        if plan.prediction_ids and drafter is not None and kind.drafts and not kind.reads_history:
            # Kinds that read text weigh the prediction themselves (``parts.prediction``).
            drafter = PredictedDrafter(drafter, schedule, plan.prediction_ids, parts.costs(None))
            schedule = FixedSchedule(block.num_speculative_tokens)
        acceptance = policy.acceptance
        stops: Any = StopStrings(plan.stop, self.decode_text) if plan.stop else None
        how = Decoding(
            params=plan.params,
            generator=make_generator(plan.seed, device),
            max_new_tokens=plan.max_new_tokens,
            drafter=drafter,
            schedule=schedule,
            rule=policy.relaxed_rule(),
            max_divergence=acceptance.max_divergence if acceptance is not None else None,
            eos_token_ids=self.eos_token_ids,
            stop_check=stops.tokens_to_keep if stops is not None else None,
            max_context=self.context_window,
            constraint=plan.grammar,
            prefixes=prefixes,
            logprobs=plan.logprobs,
        )
        steps = speculative_steps(target, plan.prompt_ids, how)
        if key is None or history is None:
            return steps
        return _recorded(steps, history, key, plan.prompt_ids)


def _recorded(
    steps: DecodeSteps, history: HistoryStore, key: Hashable, prompt: list[int]
) -> DecodeSteps:
    """``steps``, keeping the call's prompt and output in ``history`` when it finishes (a call
    that fails or is cancelled leaves nothing)."""
    try:
        reply: torch.Tensor | None = None
        while True:
            item = steps.send(reply)
            if isinstance(item, DecodeEvent) and item.finish_reason is not None:
                history.record(key, prompt, item.output_ids or [])
            reply = yield item
    except StopIteration:
        return
    finally:
        steps.close()
