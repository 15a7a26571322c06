"""Loading a runtime's models with transformers from local paths, hub ids or catalog names,
each in the dtype that runs fastest here (``precision``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...catalog import cache_dir, resolve_model
from ...errors import ModelLoadError
from ...machine import ProbeStore, config_key
from ...models import load_tokenizer
from ..base import Loaded, LoadRequest
from .checkpoint import load_config, load_model, resolve_dtype
from .model import TransformersModel, transformers_options
from .precision import INT8, DtypeChoice, Role, choose_dtype, load_as
from .quantized import int8_supported
from .runner import PrefillTwin

__all__ = ["load_pair"]


def load_pair(request: LoadRequest) -> Loaded:
    """Target (and draft) with the target's tokenizer, each in the dtype asked for or measured
    fastest here, and the probe store of this machine in the cache directory, where dtype
    choices, step costs and kernels are kept."""
    device, trust_remote_code = request.device, request.trust_remote_code
    dtype, draft_dtype, draft = request.dtype, request.draft_dtype, request.draft
    target = resolve_model(request.target)
    draft = resolve_model(draft) if draft is not None else None
    store = ProbeStore(cache_dir() / "probes")
    precision: dict[str, Any] = {}
    twins: dict[str, PrefillTwin] = {}

    def loaded(source: str, role: Role, wanted: str | torch.dtype) -> torch.nn.Module:
        def load(dt: torch.dtype) -> torch.nn.Module:
            return load_model(source, device=device, dtype=dt, trust_remote_code=trust_remote_code)

        if wanted == INT8:
            return _int8_draft(load, role, device, precision)
        if wanted != "auto":
            dt = resolve_dtype(wanted, device)
            precision[role] = DtypeChoice(dt, "asked for").to_json()
            return load(dt)
        shape = config_key(load_config(source, trust_remote_code=trust_remote_code))
        model, choice = choose_dtype(load, role, device, key=shape, store=store)
        precision[role] = choice.to_json()
        if choice.prefill_dtype is not None and choice.prefill_from is not None:
            twin = load(choice.prefill_dtype)
            twins[role] = PrefillTwin(twin, choice.prefill_from)  # type: ignore[arg-type]
        return model

    tokenizer = load_tokenizer(target, trust_remote_code=trust_remote_code)
    target_model = loaded(target, "target", dtype)
    draft_model = draft_tokenizer = None
    if draft is not None:
        draft_tokenizer = load_tokenizer(draft, trust_remote_code=trust_remote_code)
        draft_model = loaded(draft, "draft", draft_dtype)
    options = transformers_options(request.options, draft_prefill=twins.get("draft"))
    return Loaded(
        TransformersModel(target_model, options),
        TransformersModel(draft_model, options) if draft_model is not None else None,
        tokenizer,
        draft_tokenizer,
        device,
        store,
        Path(str(target)).name,
        precision,
        request.choice,
    )


def _int8_draft(
    load: Callable[[torch.dtype], torch.nn.Module],
    role: Role,
    device: torch.device,
    precision: dict[str, Any],
) -> torch.nn.Module:
    """A draft asked for with int8 weights (``draft_dtype="int8"``): bf16 activations, every
    forward in it (no full-precision twin: asking for int8 is asking to save the memory)."""
    if role != "draft":
        msg = (
            "dtype 'int8' is for a draft only (draft_dtype='int8'): the target defines what "
            "lossless decoding reproduces, and quantizing it would change its outputs"
        )
        raise ModelLoadError(msg)
    if not int8_supported(device):
        msg = (
            f"draft_dtype='int8' needs torch's weight-only int8 kernel "
            f"(torch._weight_int8pack_mm) on {device}, which torch {torch.__version__} lacks; "
            "use 'auto', 'bfloat16' or 'float32'"
        )
        raise ModelLoadError(msg)
    precision[role] = DtypeChoice(torch.bfloat16, "asked for", int8_weights=True).to_json()
    return load_as(load, INT8)
