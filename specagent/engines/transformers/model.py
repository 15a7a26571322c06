"""A transformers model behind the engine seam (``engines.base.EngineModel``), with the knobs
of this engine (``TransformersOptions``) that the runtime passes through untouched."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from ..base import Capabilities, EngineModel, RunnerNeeds
from .checkpoint import context_window, model_vocab_size, num_layers
from .head import head_rows_for
from .runner import ModelRunner, PrefillTwin, early_exit_view
from .tuning import build_runner

__all__ = ["ENGINE", "TransformersModel", "TransformersOptions", "transformers_options"]

ENGINE = "transformers"


@dataclass(frozen=True)
class TransformersOptions:
    """How the transformers engine runs a runtime's models (``engine_options`` of
    ``SpecRuntime`` and ``from_pretrained``)."""

    compile_steps: bool | None = None
    """Few-token forwards compiled over the KV slots: None measures on CUDA and reuses what
    this machine measured before elsewhere; True measures; False keeps eager steps."""
    kv_slots: bool = True
    """Each call's KV in a slot of one preallocated pool (``slots``)."""
    draft_prefill: PrefillTwin | None = None
    """A copy of the draft in another dtype for its long forwards (``precision``)."""
    draft_head_rows: int | Literal["auto"] | None = "auto"
    """The draft head's leading rows its logits are projected onto (``head``): ``"auto"`` keeps
    32768 where the tokenizer orders its vocabulary by frequency and the vocabulary is at least
    twice that; an int that many; None the whole head."""

    def __post_init__(self) -> None:
        rows = self.draft_head_rows
        if rows in ("auto", None):
            return
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            msg = f"draft_head_rows must be 'auto', None or a positive int, got {rows!r}"
            raise ValueError(msg)


def transformers_options(options: Mapping[str, Any] | None, **decided: Any) -> TransformersOptions:
    """``engine_options`` as the transformers engine takes them, with what it ``decided`` at
    load; an option it does not take is an error that names the ones it does."""
    given = dict(options or {})
    known = {f.name for f in dataclasses.fields(TransformersOptions)} - set(decided)
    unknown = sorted(set(given) - known)
    if unknown:
        msg = f"engine_options: the transformers engine takes {sorted(known)}, not {unknown}"
        raise ValueError(msg)
    return TransformersOptions(**given, **decided)


class TransformersModel(EngineModel):
    """A Hugging Face causal LM (a torch module) as the runtime sees it."""

    engine: ClassVar[str] = ENGINE
    capabilities: ClassVar[Capabilities] = Capabilities(early_exit=True)

    def __init__(self, module: torch.nn.Module, options: TransformersOptions | None = None) -> None:
        self.module = module
        self.options = options or TransformersOptions()
        self.vocab_size = model_vocab_size(module)  # type: ignore[arg-type]
        self.context_window = context_window(module)  # type: ignore[arg-type]
        self.num_layers = num_layers(module)
        first = next(module.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.dtype = str(first.dtype).removeprefix("torch.") if first is not None else None
        config = getattr(module, "config", None)
        path = getattr(config, "_name_or_path", "") or getattr(config, "model_type", "")
        self.name = Path(str(path)).name or type(module).__name__

    @property
    def model(self) -> torch.nn.Module:
        return self.module

    def placed(self, device: torch.device) -> TransformersModel:
        """On ``device`` in eval mode (``Module.to`` moves it in place: the caller's model)."""
        return TransformersModel(self.module.to(device).eval(), self.options)

    def eos_token_ids(self) -> list[int]:
        """The generation config's end tokens (chat models often have several)."""
        found = getattr(getattr(self.module, "generation_config", None), "eos_token_id", None)
        if isinstance(found, int):
            return [found]
        return [int(x) for x in found] if isinstance(found, (list, tuple)) else []

    def build_runner(self, needs: RunnerNeeds) -> tuple[ModelRunner, Any | None]:
        options = self.options
        extra: dict[str, Any] = {}
        if needs.role == "draft":
            rows = options.draft_head_rows
            if rows == "auto":
                rows = head_rows_for(needs.tokenizer, self.vocab_size)
            extra = {
                "prefill_twin": options.draft_prefill,
                "head_rows": rows,
                "always": list(needs.eos_token_ids),
            }
        return build_runner(
            self.module,
            needs.vocab_size,
            compile_steps=options.compile_steps,
            store=needs.store,
            slots=options.kv_slots,
            **extra,
        )

    def shallow_runner(self, layers: int, vocab_size: int) -> ModelRunner:
        view = early_exit_view(self.module, layers)  # type: ignore[arg-type]
        return ModelRunner(view, vocab_size=vocab_size)
