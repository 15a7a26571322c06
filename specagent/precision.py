"""Which dtype a model runs in: chosen by measuring it on this machine.

``dtype="auto"`` used to mean float32 on every CPU. On a CPU with native bf16 (avx512_bf16, AMX)
a bf16 model decodes more than twice as fast; on a CPU without it, bf16 halves the bytes a
single-token forward reads, but every extra row of a verification is converted and multiplied in
float32 at full cost. Which matters more depends on the machine, so ``choose_dtype`` loads the
model in each candidate dtype, times it, and keeps the faster:

- the **target** is judged by what speculation pays per token: one forward over k + 1 tokens
  (with the best linear kernels, ``kernels.choose_kernels``) divided by the tokens it is expected
  to emit at a reference acceptance of 0.8, at the best k of 0, 3 and 7;
- the **draft** by one single-token forward: it drafts one token per forward, and its dtype never
  touches losslessness (the target's distribution is the reference), so it may run in a lower
  precision than the target.

float32 is kept unless bf16 is clearly (``MARGIN``) faster: its outputs are the reference most
users expect. "Lossless" always means exact with respect to the target *as run*: a bf16 target's
distribution is the bf16 model's, which is not the float32 model's.

On CUDA, bf16 is chosen without measuring (tensor cores run it natively); elsewhere
(Apple MPS) float32 as before. Decisions are kept per machine and model shape in a
``ProbeStore``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .decoding.cache import ModelRunner
from .decoding.costs import expected_tokens, forward_timer
from .decoding.kernels import choose_kernels
from .machine import ProbeStore

__all__ = ["DtypeChoice", "choose_dtype"]

CANDIDATES = (torch.float32, torch.bfloat16)
"""float16 is left out of ``auto``: some checkpoints overflow in it; name it to use it."""
MARGIN = 0.9
"""bf16 is chosen only where it costs less than this share of float32's time."""
REFERENCE_ACCEPTANCE = 0.8
TARGET_LENGTHS = (1, 4, 8)
"""Forward lengths timed for a target: plain decoding, and verifications of 3 and 7 drafts."""

Role = Literal["target", "draft"]


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model was loaded in, and why."""

    dtype: torch.dtype
    reason: str
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)
    """Measured forward time by dtype name and forward length (empty when not measured)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "reason": self.reason,
            "seconds": {d: {str(n): t for n, t in s.items()} for d, s in self.seconds.items()},
        }


def speculative_cost_per_token(seconds: dict[int, float]) -> float:
    """Seconds per emitted token of the cheapest of the timed verification lengths, at the
    reference acceptance (length n verifies n - 1 drafts)."""
    return min(t / expected_tokens(REFERENCE_ACCEPTANCE, n - 1) for n, t in seconds.items())


def choose_dtype(
    load: Callable[[torch.dtype], torch.nn.Module],
    role: Role,
    device: torch.device,
    *,
    key: str,
    store: ProbeStore | None = None,
) -> tuple[torch.nn.Module, DtypeChoice]:
    """Load the model with ``load(dtype)`` in the dtype that runs fastest here (see the module
    docstring); returns the loaded model and the choice with its measurements. ``key`` names
    the model's shape (``machine.config_key``) for the ``store``."""
    if device.type == "cuda":
        return load(torch.bfloat16), DtypeChoice(torch.bfloat16, "CUDA: bf16 runs natively")
    if device.type != "cpu":
        return load(torch.float32), DtypeChoice(torch.float32, f"{device.type}: float32")
    entry = f"dtype:{role}:{key}"
    stored = store.get(entry) if store is not None else None
    if isinstance(stored, dict) and stored.get("dtype") in ("float32", "bfloat16"):
        dtype = getattr(torch, stored["dtype"])
        seconds = {d: {int(n): t for n, t in s.items()} for d, s in stored["seconds"].items()}
        reason = f"{stored['reason']} (measured earlier on this machine)"
        return load(dtype), DtypeChoice(dtype, reason, seconds)
    lengths = TARGET_LENGTHS if role == "target" else (1,)
    full = load(torch.float32)
    seconds = {"float32": _time(full, lengths)}
    low = load(torch.bfloat16)
    seconds["bfloat16"] = _time(low, lengths)
    score = {
        name: speculative_cost_per_token(s) if role == "target" else s[1]
        for name, s in seconds.items()
    }
    measure = "s per token at acceptance 0.8" if role == "target" else "s per draft forward"
    figures = f"bf16 {score['bfloat16']:.3f} vs float32 {score['float32']:.3f} {measure}"
    if score["bfloat16"] < MARGIN * score["float32"]:
        choice = DtypeChoice(torch.bfloat16, f"bf16 is faster here: {figures}", seconds)
        chosen = low
    else:
        choice = DtypeChoice(torch.float32, f"bf16 is not clearly faster here: {figures}", seconds)
        chosen = full
    del full, low
    gc.collect()
    if store is not None:
        store.put(entry, choice.to_json())
    return chosen, choice


def _time(model: torch.nn.Module, lengths: tuple[int, ...]) -> dict[int, float]:
    runner = ModelRunner(model)  # type: ignore[arg-type]
    _, seconds = choose_kernels(forward_timer(runner), lengths)
    return {n: round(t, 5) for n, t in seconds.items()}
