"""Weight-only int8 linears for a draft model.

A draft's single-token forward reads every weight once and does little arithmetic with it, so
on a CPU it costs what streaming its weights from memory costs. Stored as int8 (one scale per
output channel) they are half of bf16's bytes and a quarter of float32's; the product runs in
``torch._weight_int8pack_mm`` with bf16 activations. On a 2-core Xeon with AMX the Qwen2.5 0.5B
draft's single-token forward took 0.08 s this way against 0.17 s in bf16 and 0.19 s in float32
(its 16-token forward 0.28 s against bf16's 0.17 s: the kernel's cost grows with every row, so
long forwards keep a full-precision copy, ``runner.PrefillTwin``). On a 2-core AMD EPYC the same
forward measured level with bf16, so nothing is assumed: ``precision`` times the draft
this way beside bf16 and float32 and keeps it only where it is clearly cheaper per draft token.

Only ever a draft: its numbers never touch losslessness (the verifier's distribution is the
target's, and the acceptance rule is exact for any draft distribution), while a quantized target
would change what "the target's output" means.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "INT8_K_MULTIPLE",
    "Int8Linear",
    "has_int8_weights",
    "int8_supported",
    "quantize_linears",
]

INT8_K_MULTIPLE = 16
"""Input sizes the int8 kernel takes safely (multi-row products over 24 columns crashed)."""


class Int8Linear(nn.Module):
    """``nn.Linear`` with its weight stored as int8 rows and a per-row scale: ``y = (x @ q.T) *
    scale + bias``, with ``q = round(w / scale)`` and ``scale = max|w_row| / 127``.

    ``weight`` keeps the int8 matrix under the name and shape transformers' helpers read
    (``get_output_embeddings().weight.shape``); it cannot be fed to ``F.linear``."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        full = linear.weight.detach().float()
        scale = full.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        quantized = torch.round(full / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("weight", quantized.contiguous())
        self.register_buffer("scales", scale.to(dtype))
        self.bias = (
            None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scales.dtype).contiguous()
        out = torch._weight_int8pack_mm(flat, self.weight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def quantize_linears(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (its LM head included, even where it is tied to
    the input embedding, which stays as it is) with an ``Int8Linear`` in the model's dtype, in
    place; returns the model. Meant for a bf16 model: the int8 kernel is fast with bf16
    activations and, on the CPUs measured, slow with float32 ones. Linears whose input size
    is not a multiple of ``INT8_K_MULTIPLE`` stay as they are: torch 2.13's CPU kernel crashes
    the process (a segmentation fault) on them with more than one row."""
    dtype = next(model.parameters()).dtype
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % INT8_K_MULTIPLE == 0:
                setattr(module, name, Int8Linear(child, dtype))
    return model


def int8_supported(device: torch.device) -> bool:
    """Whether this torch has the weight-only int8 kernel for ``device`` (tried on a tiny
    product, so a build without it is told apart from one with it)."""
    if not hasattr(torch, "_weight_int8pack_mm"):
        return False
    try:
        x = torch.ones(2, 32, dtype=torch.bfloat16, device=device)
        w = torch.ones(8, 32, dtype=torch.int8, device=device)
        s = torch.ones(8, dtype=torch.bfloat16, device=device)
        out = torch._weight_int8pack_mm(x, w, s)
    except (RuntimeError, NotImplementedError):
        return False
    return bool(out.shape == (2, 8) and float(out[0, 0]) == 32.0)


def has_int8_weights(model: nn.Module) -> bool:
    """Whether ``quantize_linears`` changed this model (its measurements are kept apart)."""
    return any(isinstance(module, Int8Linear) for module in model.modules())
