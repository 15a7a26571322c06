"""Which dtype a model runs in: chosen by measuring it on this machine.

``dtype="auto"`` used to mean float32 on every CPU. On a CPU with native bf16 (avx512_bf16, AMX)
a bf16 model decodes more than twice as fast; on a CPU without it, bf16 halves the bytes a
single-token forward reads, but every extra row of a verification is converted and multiplied in
float32 at full cost. Which matters more depends on the machine, so ``choose_dtype`` loads the
model in each candidate dtype, times it, and keeps the faster:

- the **target** is judged by what speculation pays per token: one forward over k + 1 tokens
  (with the best linear kernels, ``ModelRunner.tune``) divided by the tokens it is expected
  to emit at a reference acceptance of 0.8, at the best k of 0, 3 and 7;
- the **draft** by one single-token forward: it drafts one token per forward, and its dtype never
  touches losslessness (the target's distribution is the reference), so it may run in a lower
  precision than the target. Its long forwards (the prompt's prefill, catching up on what it
  did not draft) are timed too. Where single tokens cost about the same, they decide: on a
  2-core Xeon with AMX the Qwen 0.5B draft takes the same for one token in either dtype and
  half as long over 64 in bf16, so it runs in bf16. Where one dtype wins the single token and
  the other is clearly faster from some length on, the choice says so (``prefill_dtype``,
  ``prefill_from``) and the loader keeps a copy of the draft in that dtype for those forwards
  (``runner.PrefillTwin``): without native bf16, a bf16 forward costs per row what a
  float32 one costs per forward (the same draft over 400 tokens: 17.8 s in bf16, 4.0 s in
  float32, while one token takes 0.115 s against 0.261 s). Where the CPU has the kernel, the
  draft is also timed with int8 weights and bf16 activations (``quantized``): a
  single-token forward streams every weight from memory, and int8 halves bf16's bytes (on the
  AMX Xeon 0.08 s against 0.17 s). It is kept only where clearly cheaper than both.

float32 is kept unless bf16 is clearly (``MARGIN``) faster: its outputs are the reference most
users expect. "Lossless" always means exact with respect to the target *as run*: a bf16 target's
distribution is the bf16 model's, which is not the float32 model's.

On CUDA, bf16 is chosen without measuring (tensor cores run it natively); elsewhere
(Apple MPS) float32 as before. Decisions are kept per machine and model shape in a
``ProbeStore``.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ...decoding.costs import expected_tokens
from ...machine import ProbeStore
from .quantized import int8_supported, quantize_linears
from .runner import ModelRunner

log = logging.getLogger("specagent.precision")

__all__ = ["DtypeChoice", "choose_dtype", "load_as"]

CANDIDATES = (torch.float32, torch.bfloat16)
"""float16 is left out of ``auto``: some checkpoints overflow in it; name it to use it."""
MARGIN = 0.9
"""bf16 is chosen only where it costs less than this share of float32's time."""
INT8 = "int8"
"""A draft's third candidate where the CPU has the kernel: int8 weights, bf16 activations
(``quantized``)."""
REFERENCE_ACCEPTANCE = 0.8
TARGET_LENGTHS = (1, 4, 8)
"""Forward lengths timed for a target: plain decoding, and verifications of 3 and 7 drafts."""
DRAFT_LENGTHS = (1, 16, 64)
"""Forward lengths timed for a draft: a draft step, and two prefill lengths."""

Role = Literal["target", "draft"]


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model was loaded in, and why."""

    dtype: torch.dtype
    reason: str
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)
    """Measured forward time by dtype name and forward length (empty when not measured)."""
    prefill_dtype: torch.dtype | None = None
    """A draft's: the dtype its forwards over ``prefill_from`` tokens or more run in, where it
    measured clearly faster on them than ``dtype`` (None: every forward in ``dtype``)."""
    prefill_from: int | None = None
    int8_weights: bool = False
    """A draft's: its linears hold int8 weights (``quantized``), with activations in
    ``dtype`` (bf16)."""

    @property
    def variant(self) -> str:
        """How ``seconds`` names what was chosen: ``float32``, ``bfloat16`` or ``int8``."""
        return INT8 if self.int8_weights else _dtype_name(self.dtype)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dtype": _dtype_name(self.dtype),
            "reason": self.reason,
            "seconds": {d: {str(n): t for n, t in s.items()} for d, s in self.seconds.items()},
        }
        if self.int8_weights:
            out["weights"] = INT8
        if self.prefill_dtype is not None:
            out["prefill_dtype"] = _dtype_name(self.prefill_dtype)
            out["prefill_from"] = self.prefill_from
        return out

    @classmethod
    def from_json(cls, stored: dict[str, Any], reason: str) -> DtypeChoice:
        prefill = stored.get("prefill_dtype")
        return cls(
            getattr(torch, stored["dtype"]),
            reason,
            {d: {int(n): t for n, t in s.items()} for d, s in stored["seconds"].items()},
            getattr(torch, prefill) if prefill in ("float32", "bfloat16") else None,
            stored.get("prefill_from") if prefill else None,
            stored.get("weights") == INT8,
        )


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
    # Drafts' v2: the decision also covers the prefill dtype. v3 (both roles): the transposed
    # kernels feed a single row as two, which changes what a single-token forward costs.
    # v4 (drafts): the long forwards decide where single tokens cost about the same, and the
    # twin for long forwards may be of either dtype. v5 (drafts): int8 weights are a candidate.
    # v4 (targets) and v6 (drafts): packed weights are a kernel of either dtype.
    entry = f"dtype-v4:{role}:{key}" if role == "target" else f"dtype-v6:{role}:{key}"
    stored = store.get(entry) if store is not None else None
    if isinstance(stored, dict) and stored.get("dtype") in ("float32", "bfloat16"):
        kept = DtypeChoice.from_json(
            stored, f"{stored['reason']} (measured earlier on this machine)"
        )
        # int8 kept by a torch build with the kernel, read by one without: measure again.
        if not kept.int8_weights or int8_supported(device):
            return load_as(load, kept.variant), kept
    lengths = TARGET_LENGTHS if role == "target" else DRAFT_LENGTHS
    variants = [_dtype_name(dtype) for dtype in CANDIDATES]
    if role == "draft" and int8_supported(device):
        variants.append(INT8)
    log.info(
        "timing the %s in %s to load it in the fastest here (once per machine and model; "
        "about a minute for a 1.5B model on 2 cores)",
        role,
        ", ".join(variants),
    )
    started = time.perf_counter()
    models: dict[str, torch.nn.Module] = {}
    seconds: dict[str, dict[int, float]] = {}
    for name in variants:
        models[name] = load_as(load, name)
        seconds[name] = _time(models[name], lengths)
    choice = _target_choice(seconds) if role == "target" else _draft_choice(seconds)
    chosen = models.pop(choice.variant)
    models.clear()
    gc.collect()
    if store is not None:
        store.put(entry, choice.to_json())
    log.info(
        "%s: %s, in %.0f s (kept for this machine)",
        role,
        choice.reason,
        time.perf_counter() - started,
    )
    return chosen, choice


def load_as(load: Callable[[torch.dtype], torch.nn.Module], variant: str) -> torch.nn.Module:
    """The model from ``load(dtype)`` as ``variant`` names it (as ``seconds`` and
    ``DtypeChoice.variant`` do): ``float32``, ``bfloat16``, or ``int8`` (bf16 with int8
    linears)."""
    if variant == INT8:
        return quantize_linears(load(torch.bfloat16))
    return load(getattr(torch, variant))


def _target_choice(seconds: dict[str, dict[int, float]]) -> DtypeChoice:
    """bf16 where it is clearly cheaper per token of speculation, else float32."""
    score = {name: speculative_cost_per_token(s) for name, s in seconds.items()}
    figures = f"bf16 {score['bfloat16']:.3f} vs float32 {score['float32']:.3f}"
    figures += " s per token at acceptance 0.8"
    if score["bfloat16"] < MARGIN * score["float32"]:
        return DtypeChoice(torch.bfloat16, f"bf16 is faster here: {figures}", seconds)
    return DtypeChoice(torch.float32, f"bf16 is not clearly faster here: {figures}", seconds)


def _draft_choice(seconds: dict[str, dict[int, float]]) -> DtypeChoice:
    """int8 weights where they are clearly cheaper per draft token (one single-token forward)
    than both full-precision dtypes; else the full-precision dtype clearly cheaper per draft
    token; where those two cost about the same, bf16 if it is clearly cheaper on long forwards
    (the prompt's prefill, catching up on text drafted from history: on a 2-core Xeon with AMX,
    the Qwen 0.5B draft's single token took 0.161 s in bf16 and 0.150 s in float32, 64 tokens
    0.317 s and 0.653 s), else float32. Long forwards run in a full-precision dtype from the
    shortest timed length on where it is clearly faster there (``PrefillTwin``)."""
    choice = _full_precision_draft_choice(seconds)
    int8 = seconds.get(INT8)
    best_full = min(seconds["bfloat16"][1], seconds["float32"][1])
    if int8 is not None and int8[1] < MARGIN * best_full:
        reason = (
            f"int8 weights are faster here: {int8[1]:.3f} s per draft forward against "
            f"bf16 {seconds['bfloat16'][1]:.3f} and float32 {seconds['float32'][1]:.3f} s"
        )
        choice = DtypeChoice(torch.bfloat16, reason, seconds, int8_weights=True)
    return _with_prefill_dtype(choice)


def _full_precision_draft_choice(seconds: dict[str, dict[int, float]]) -> DtypeChoice:
    low, full = seconds["bfloat16"], seconds["float32"]
    figures = f"bf16 {low[1]:.3f} vs float32 {full[1]:.3f} s per draft forward"
    if low[1] < MARGIN * full[1]:
        return DtypeChoice(torch.bfloat16, f"bf16 is faster here: {figures}", seconds)
    if full[1] < MARGIN * low[1]:
        return DtypeChoice(torch.float32, f"float32 is faster here: {figures}", seconds)
    longest = max(n for n in low if n in full)
    long_figures = f"bf16 {low[longest]:.3f} vs float32 {full[longest]:.3f} s"
    if low[longest] < MARGIN * full[longest]:
        reason = (
            f"single tokens cost about the same ({figures}); bf16 is faster over "
            f"{longest} tokens ({long_figures})"
        )
        return DtypeChoice(torch.bfloat16, reason, seconds)
    reason = f"bf16 is not clearly faster here: {figures}; over {longest} tokens "
    return DtypeChoice(torch.float32, reason + long_figures, seconds)


def _with_prefill_dtype(choice: DtypeChoice) -> DtypeChoice:
    """A draft whose long forwards measured clearly faster in a full-precision dtype other
    than its own: from the shortest such timed length on, they run in the fastest of those
    there. (int8 weights are never the twin: their kernel's cost grows with every row.)"""
    mine = choice.seconds[choice.variant]
    others = {
        name: choice.seconds[name]
        for name in map(_dtype_name, CANDIDATES)
        if name != choice.variant and name in choice.seconds
    }
    for n in sorted(length for length in mine if length > 1):
        faster = {name: s[n] for name, s in others.items() if n in s and s[n] < MARGIN * mine[n]}
        if faster:
            name = min(faster, key=faster.__getitem__)
            reason = (
                f"{choice.reason}; forwards over {n}+ tokens run in {name} "
                f"({faster[name]:.3f} s vs {mine[n]:.3f} s over {n} tokens)"
            )
            twin = getattr(torch, name)
            return dataclasses.replace(choice, reason=reason, prefill_dtype=twin, prefill_from=n)
    return choice


def _dtype_name(dtype: torch.dtype) -> str:
    """``float32`` / ``bfloat16``: how choices name a dtype (in ``seconds`` and in JSON)."""
    return str(dtype).removeprefix("torch.")


def _time(model: torch.nn.Module, lengths: tuple[int, ...]) -> dict[int, float]:
    """Each length's forward time with its best linear kernels (a runner of its own, tuned at
    these lengths only, dropped afterwards with its packed weights)."""
    runner = ModelRunner(model)  # type: ignore[arg-type]
    tuning = runner.tune(lengths, prefill_lengths=())
    while True:
        try:
            next(tuning)
        except StopIteration as done:
            seconds: dict[int, float] = done.value
            return {n: round(t, 5) for n, t in seconds.items()}
