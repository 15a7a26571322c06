"""What the runner settles by timing its forwards or was given at load: the linear kernels per
forward length (``kernels``: chosen by its first ``tune`` or taken back by ``restore``) and a
draft's head rows (``head``: its logits projected onto the head's first rows)."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ...decoding.costs import forward_timer, time_lengths
from ...decoding.engine import to_device
from .head import restricted_logits
from .kernels import LinearPlan, PackedWeights, kernel_choice_steps
from .quantized import Int8Linear
from .state import RunnerState

if TYPE_CHECKING:
    from ...decoding.engine import Runner

__all__ = ["PREFILL_LENGTHS", "TunedForwards"]

PREFILL_LENGTHS = (48, 96, 192)
"""Longer forwards, timed once each way for the kernel choice only: prompt prefills (and the
draft's catch-up after plain steps) run through the same linear layers. Past the last one,
torch's kernels."""


class TunedForwards(RunnerState):
    """``ModelRunner``'s kernel plan and head rows (a part of it: ``state.RunnerState``)."""

    @property
    def kernels(self) -> LinearPlan:
        """Which linear-layer kernels this runner's forwards use (``kernels.LinearPlan``; empty:
        torch's own), for the runner's own forwards only (``LinearPlan.active``)."""
        return self._kernels

    @property
    def packed(self) -> PackedWeights | None:
        """The model's weights packed for oneDNN, where the plan's ``packed_rows`` read them
        (``kernels.PackedWeights``; None: not packed)."""
        return self._packed

    @property
    def settled(self) -> bool:
        """Whether the linear kernels are chosen (by ``tune`` or ``restore``) and fixed."""
        return self._settled

    def tune(
        self,
        lengths: Sequence[int],
        *,
        context_tokens: int = 32,
        repeats: int = 2,
        prefill_lengths: Sequence[int] | None = None,
    ) -> Generator[None, None, dict[int, float]]:
        """Time forwards over each of ``lengths`` rows. The first time, choose each length's
        linear kernels on the way (torch's, the transposed form, or packed weights where the
        machine can pack them and has the memory; also at ``prefill_lengths``, by default
        ``PREFILL_LENGTHS`` past the longest, since prompts run through the same layers:
        ``kernels.kernel_choice_steps``) and keep that plan; the packed copy is dropped where
        no length chose it. Once settled, the plan only runs and is timed. A runner whose
        forwards run compiled keeps torch's kernels (``_planned``) and only times."""
        if self.compiled is not None and not self._settled:
            self._settle(LinearPlan(), None)
        runner = cast("Runner", self)  # the runner these parts make up
        if self._settled:
            return (
                yield from time_lengths(
                    runner, lengths, context_tokens=context_tokens, repeats=repeats
                )
            )
        timer = forward_timer(runner, context_tokens=context_tokens, repeats=repeats)
        prefill_timer = forward_timer(runner, context_tokens=context_tokens, repeats=1, keep=1)
        wanted = set(lengths)

        def time_forward(n: int, plan: LinearPlan) -> float:
            before = self._kernels
            self._kernels = plan
            try:
                return timer(n) if n in wanted else prefill_timer(n)
            finally:
                self._kernels = before

        if prefill_lengths is None:
            prefill_lengths = [n for n in PREFILL_LENGTHS if n > max(wanted)]
        prefills = [n for n in prefill_lengths if n not in wanted]
        packed = PackedWeights.of(self.model) if self.device.type == "cpu" else None
        self._packed = packed
        plan, seconds = yield from kernel_choice_steps(
            time_forward, sorted(wanted) + prefills, packed=packed is not None
        )
        self._settle(plan, packed)
        return {n: t for n, t in seconds.items() if n in wanted}

    @property
    def settings(self) -> dict[str, Any]:
        """The settled kernel plan: its transposed and packed row counts."""
        return {
            "transposed_rows": sorted(self._kernels.transposed_rows),
            "packed_rows": sorted(self._kernels.packed_rows),
        }

    def restore(self, settings: Mapping[str, Any]) -> bool:
        """Take a plan an earlier process settled (``settings``). Refused where it cannot hold
        (packed rows, and the weights cannot be packed now: memory taken) and, once this runner
        has settled, unless it is the same plan."""
        try:
            plan = LinearPlan(
                transposed_rows=frozenset(int(n) for n in settings.get("transposed_rows", ())),
                packed_rows=frozenset(int(n) for n in settings.get("packed_rows", ())),
            )
        except (TypeError, ValueError):
            return False
        if self._settled:
            return plan == self._kernels
        packed = PackedWeights.of(self.model) if plan.packed_rows else None
        if plan.packed_rows and packed is None:
            return False
        self._settle(plan, packed)
        return True

    def _settle(self, plan: LinearPlan, packed: PackedWeights | None) -> None:
        self._kernels = plan
        self._packed = packed if plan.packed_rows else None  # its memory back where unused
        self._settled = True

    def _planned(self) -> contextlib.AbstractContextManager[None]:
        """The context this runner's forwards run in: its kernel plan over its models' linear
        modules. A runner whose forwards run compiled has none (inductor picks the kernels, and
        a plan's per-length routing would break the compiled graphs)."""
        if self.compiled is not None:
            return contextlib.nullcontext()
        return self.kernels.active(self.packed, self._linears)

    def _use_head_rows(self, rows: int, always: Sequence[int]) -> None:
        """Project this runner's logits onto the head's first ``rows`` rows, the ``always``
        ids (end of sequence) and each request's own ids (``vocab``). Only for a draft: a
        target's logits define the output. Kept only where the head is a plain ``nn.Linear``
        or ``Int8Linear`` over the decoder body's last hidden state (checked on a short
        forward against the model's own logits) and ``rows`` is fewer than it has; elsewhere
        the whole head stays (``head_rows`` None)."""
        head = self.model.get_output_embeddings()
        if self._body is None or not isinstance(head, nn.Linear | Int8Linear):
            return
        vocab = int(head.weight.shape[0])
        if not 0 < rows < vocab:
            return
        ids = torch.arange(1, 9, device=self.device)[None] % vocab
        with torch.inference_mode():
            full = self.model(input_ids=ids, use_cache=False).logits[0].float()
            hidden = self._body(input_ids=ids, use_cache=False).last_hidden_state[0]
            projected = head(hidden).float()
        if not torch.allclose(projected, full, atol=1e-3, rtol=1e-3):
            return
        self._head_rows = rows
        self._head_always = torch.tensor(
            sorted({int(i) for i in always if rows <= int(i) < vocab}), dtype=torch.long
        )

    def _restricted(
        self,
        head: nn.Module,
        hidden: torch.Tensor,
        pieces: list[tuple[int, torch.Tensor | None]],
    ) -> torch.Tensor:
        assert self.head_rows is not None
        return restricted_logits(head, hidden, self.head_rows, self._head_always, pieces)

    def _masked(self, logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """Full logits cut to what ``_restricted`` would cover (paths that run the whole
        head: a compiled step, a model whose gathered projection differs)."""
        if self.head_rows is None:
            return logits
        kept = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        kept[: self.head_rows] = True
        kept[to_device(self._head_always, logits.device)] = True
        if vocab is not None:
            kept[to_device(vocab, logits.device)] = True
        return logits.masked_fill(~kept, float("-inf"))

    @property
    def head_rows(self) -> int | None:
        """A draft's logits cover only its head's first ``head_rows`` rows, the always-kept ids
        and each request's own ids (``vocab``), projected onto those alone; -inf elsewhere
        (``head``). None: the whole vocabulary."""
        return self._head_rows
