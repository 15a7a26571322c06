"""What a torch module's measured speed is keyed by on this machine (``machine.ProbeStore``)."""

from __future__ import annotations

import torch

from ...machine import config_key
from .quantized import has_int8_weights

__all__ = ["model_key"]


def model_key(model: torch.nn.Module, *parts: object) -> str:
    """``machine.config_key`` of a loaded model, with its dtype and device (and whether its
    linears hold int8 weights: a draft's may, ``quantized``, at the same parameter dtype): its
    shape, not its weights."""
    config = getattr(model, "config", None) or {"type": type(model).__name__}
    param = next(model.parameters())
    if has_int8_weights(model):
        parts = ("int8-weights", *parts)
    return config_key(config, str(param.dtype), param.device.type, *parts)
