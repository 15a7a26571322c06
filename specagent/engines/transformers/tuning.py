"""Making a transformers runner: everything it does beyond a plain forward, decided before it is
handed out.

``build_runner`` is the one place a ``ModelRunner`` is configured: a draft's head rows and its
prefill twin (from the dtype measurement at load, ``precision``), and whether few-token forwards
over the KV slots run compiled (``compiled.choose_compiled_step``: measured on CUDA, elsewhere
this machine's earlier decision). The runner itself picks its attention when it is made
(``attention``). The linear kernels are the runner's own first ``tune`` (or ``restore``). Once
built, nothing outside the runner changes how it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from .compiled import StepChoice, choose_compiled_step
from .runner import ModelRunner, PrefillTwin

__all__ = ["build_runner"]


def build_runner(
    model: nn.Module,
    vocab_size: int | None = None,
    *,
    prefill_twin: PrefillTwin | None = None,
    head_rows: int | None = None,
    always: Sequence[int] = (),
    compile_steps: bool | None = False,
    store: Any | None = None,
    slots: bool = True,
) -> tuple[ModelRunner, StepChoice | None]:
    """A runner over ``model`` and the compiled-step decision behind it (None: not asked).

    ``head_rows``: project a draft's logits onto its head's first rows (and ``always``, the
    end-of-sequence ids) where that holds for this model (``head``). ``compile_steps``: None
    measures on CUDA and elsewhere reuses what this machine measured before (compiling a 1.5B
    model takes minutes on a small CPU, for a gain measured there at none); True measures where
    nothing is recorded; False keeps eager steps. Compiled forwards run over the slots only.
    ``slots``: each call's KV in a slot of the runner's pool (``slots.SlotPool``: batched rounds
    copy no KV), where the model's layers are plain full attention; False: an ordinary cache
    per call."""
    runner = ModelRunner(
        model,  # type: ignore[arg-type]
        vocab_size,
        prefill_twin=prefill_twin,
        head_rows=head_rows,
        always=always,
        slots=slots,
    )
    if compile_steps is False:
        return runner, None
    measure = compile_steps is True or runner.device.type == "cuda"
    choice = choose_compiled_step(runner, key=runner.speed_key(), store=store, measure=measure)
    return runner, choice
