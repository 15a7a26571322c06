"""The linear kernels a runner's forwards use per forward length (``kernels``), chosen by its
first ``tune`` or taken back by ``restore``, then fixed (``KernelSet``)."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...decoding.costs import forward_timer, time_lengths
from .kernels import LinearPlan, PackedWeights, kernel_choice_steps

if TYPE_CHECKING:
    from ...decoding.engine import Runner

__all__ = ["PREFILL_LENGTHS", "KernelSet"]

PREFILL_LENGTHS = (48, 96, 192)
"""Longer forwards, timed once each way for the kernel choice only: prompt prefills (and the
draft's catch-up after plain steps) run through the same linear layers. Past the last one,
torch's kernels."""


class KernelSet:
    """Which linear-layer kernels a runner's forwards use over its models' linear modules
    (``kernels.LinearPlan``; empty: torch's own), and the weights packed for oneDNN where the
    plan reads them. Chosen once by timing the runner's forwards, or restored, then fixed."""

    def __init__(
        self,
        models: Sequence[nn.Module],
        device: torch.device,
        plan: LinearPlan | None = None,
        packed: PackedWeights | None = None,
    ) -> None:
        self.model = models[0]
        self.device = device
        self.plan = plan or LinearPlan()
        self.settled = plan is not None
        """Whether the plan is chosen (by ``tune`` or ``restore``) and fixed."""
        self.packed: PackedWeights | None = packed if self.plan.packed_rows else None
        self.linears = tuple(m for model in models for m in model.modules() if type(m) is nn.Linear)
        """The models' linear modules, which the plan reroutes (``active``)."""

    def active(self, compiled: bool) -> contextlib.AbstractContextManager[None]:
        """The context a forward runs in: the plan over the linear modules. None for forwards
        that run compiled (inductor picks the kernels, and a plan's per-length routing would
        break the compiled graphs)."""
        if compiled:
            return contextlib.nullcontext()
        return self.plan.active(self.packed, self.linears)

    def tune(
        self,
        runner: Runner,
        lengths: Sequence[int],
        *,
        compiled: bool,
        context_tokens: int = 32,
        repeats: int = 2,
        prefill_lengths: Sequence[int] | None = None,
    ) -> Generator[None, None, dict[int, float]]:
        """Time ``runner``'s forwards (whose kernels these are) over each of ``lengths`` rows.
        The first time, choose each length's kernels on the way (torch's, the transposed form,
        or packed weights where the machine can pack them and has the memory; also at
        ``prefill_lengths``, by default ``PREFILL_LENGTHS`` past the longest, since prompts run
        through the same layers: ``kernels.kernel_choice_steps``) and keep that plan; the
        packed copy is dropped where no length chose it. Once settled, the plan only runs and
        is timed. A ``compiled`` runner keeps torch's kernels and only times."""
        if compiled and not self.settled:
            self.settle(LinearPlan(), None)
        if self.settled:
            return (
                yield from time_lengths(
                    runner, lengths, context_tokens=context_tokens, repeats=repeats
                )
            )
        timer = forward_timer(runner, context_tokens=context_tokens, repeats=repeats)
        prefill_timer = forward_timer(runner, context_tokens=context_tokens, repeats=1, keep=1)
        wanted = set(lengths)

        def time_forward(n: int, plan: LinearPlan) -> float:
            before = self.plan
            self.plan = plan
            try:
                return timer(n) if n in wanted else prefill_timer(n)
            finally:
                self.plan = before

        if prefill_lengths is None:
            prefill_lengths = [n for n in PREFILL_LENGTHS if n > max(wanted)]
        prefills = [n for n in prefill_lengths if n not in wanted]
        packed = PackedWeights.of(self.model) if self.device.type == "cpu" else None
        self.packed = packed
        plan, seconds = yield from kernel_choice_steps(
            time_forward, sorted(wanted) + prefills, packed=packed is not None
        )
        self.settle(plan, packed)
        return {n: t for n, t in seconds.items() if n in wanted}

    @property
    def settings(self) -> dict[str, Any]:
        """The settled plan: its transposed and packed row counts."""
        return {
            "transposed_rows": sorted(self.plan.transposed_rows),
            "packed_rows": sorted(self.plan.packed_rows),
        }

    def restore(self, settings: Mapping[str, Any]) -> bool:
        """Take a plan an earlier process settled (``settings``). Refused where it cannot hold
        (packed rows, and the weights cannot be packed now: memory taken) and, once settled,
        unless it is the same plan."""
        try:
            plan = LinearPlan(
                transposed_rows=frozenset(int(n) for n in settings.get("transposed_rows", ())),
                packed_rows=frozenset(int(n) for n in settings.get("packed_rows", ())),
            )
        except (TypeError, ValueError):
            return False
        if self.settled:
            return plan == self.plan
        packed = PackedWeights.of(self.model) if plan.packed_rows else None
        if plan.packed_rows and packed is None:
            return False
        self.settle(plan, packed)
        return True

    def settle(self, plan: LinearPlan, packed: PackedWeights | None) -> None:
        self.plan = plan
        self.packed = packed if plan.packed_rows else None  # its memory back where unused
        self.settled = True
