"""What the parts of a ``runner.ModelRunner`` share (``RunnerState``): the attributes its
constructor sets and the members one part calls on another. The runner's forwards are split by
concern (``runner``: one call's forward; ``batched``: several calls'; ``trees``: token trees;
``tuned``: the kernel plan and head rows), each part a base class of the runner."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ...decoding.engine import Tokens

if TYPE_CHECKING:
    from .compiled import CompiledSlots
    from .kernels import LinearPlan, PackedWeights
    from .slots import SlotPool, SlotSequence
    from .views import PrefillTwin

__all__ = ["RunnerState"]


class RunnerState:
    model: PreTrainedModel
    vocab_size: int
    device: torch.device
    prefill_twin: PrefillTwin | None
    _dtype: torch.dtype
    _kernels: LinearPlan
    _settled: bool
    _packed: PackedWeights | None
    _linears: tuple[nn.Linear, ...]
    _cache_kw: str
    _base_cache_kw: str
    _has_logits_to_keep: bool
    _body: nn.Module | None
    _gather_checked: bool | None
    _compiled: CompiledSlots | None
    _head_rows: int | None
    _head_always: torch.Tensor
    _pool: SlotPool | None

    @property
    def compiled(self) -> CompiledSlots | None:
        raise NotImplementedError

    @property
    def head_rows(self) -> int | None:
        raise NotImplementedError

    def _forward(
        self,
        input_ids: Tokens,
        cache: DynamicCache,
        keep: int | None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def _slot_forward(
        self,
        requests: Sequence[tuple[Tokens, SlotSequence]],
        keeps: Sequence[int | None],
        vocabs: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        raise NotImplementedError

    def _finished(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _dynamic_cache(self) -> DynamicCache:
        raise NotImplementedError

    def _mask_dtype(self) -> torch.dtype | str | None:
        raise NotImplementedError

    def _planned(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    def _restricted(
        self, head: nn.Module, hidden: torch.Tensor, pieces: list[tuple[int, torch.Tensor | None]]
    ) -> torch.Tensor:
        raise NotImplementedError

    def _masked(self, logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError
