"""Why a lossless greedy output differs from plain greedy decoding: a tie within the dtype's
rounding, or something rounding cannot explain (a bug). Both benchmarks classify every
difference with ``explain_divergence`` and report the counts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..engines.tools import engine_tools

if TYPE_CHECKING:
    from ..runtime import SpecRuntime

__all__ = ["explain_divergence", "tally_differences"]


def tally_differences(
    outputs: Iterable[tuple[str, bool | None, dict[str, Any] | None]],
) -> dict[str, dict[str, int]]:
    """Per method, from ``(method, equal_to_plain, explain_divergence's report)``: outputs
    equal to plain greedy, outputs that differed at a tie within the dtype's rounding, and
    outputs that differed for another reason (a bug in a lossless method)."""
    counts: dict[str, dict[str, int]] = {}
    for method, equal, report in outputs:
        count = counts.setdefault(method, {"equal": 0, "near_tie": 0, "other": 0})
        if equal:
            count["equal"] += 1
        elif report is not None and report.get("near_tie"):
            count["near_tie"] += 1
        else:
            count["other"] += 1
    return counts


def explain_divergence(
    runtime: SpecRuntime, cases: list[tuple[list[int], list[int], list[int]]]
) -> list[dict[str, Any]]:
    """For each ``(prompt, reference, output)``, ``reference`` being plain greedy's: where
    ``output`` first differs, and whether that was a tie within rounding.

    Greedy decoding in bf16 is not one function: plain decoding feeds one token per forward, a
    verification feeds several, and the sums inside the model are added in another order, so
    where two tokens' logits are nearly equal either can come out on top. The first differing
    token is judged against the target computed in float32 (a float32 copy of its weights when
    it runs in another dtype: ``EngineTools.float32_reference``; an engine without one is judged
    by its own logits along two paths, ``_engine_report``). ``plain_margin`` is the margin of
    plain's token over the output's along plain's own path (the prompt's prefill, then one token
    per forward, in the runtime's dtype), ``float32_margin`` the same margin in float32
    (negative: float32 prefers the output's token), ``dtype_error`` the largest difference
    between plain's path and float32 over float32's ten likeliest tokens. Each path's margin is
    float32's give or take twice its per-logit error, so two paths can choose differently only
    where ``|float32_margin| <= 2 * dtype_error`` (``near_tie``; the other path's error is taken
    to be of the same size). Outside that, the difference is not rounding, and the report says
    so."""
    import torch

    reference_of = engine_tools(runtime.engine).float32_reference(runtime)
    if reference_of is None:
        return [_engine_report(runtime, *case) for case in cases]
    reports = []
    for prompt, reference, output in cases:
        at = _first_difference(reference, output)
        report: dict[str, Any] = {"at": at}
        if at >= min(len(reference), len(output)):
            report["near_tie"] = False  # one stopped where the other went on
            report["lengths"] = [len(reference), len(output)]
            reports.append(report)
            continue
        own, logits = reference_of(prompt, reference[:at])
        plain_token, token = reference[at], output[at]
        margin = float(logits[plain_token] - logits[token])
        top = torch.topk(logits, 10).indices
        error = float((own[top] - logits[top]).abs().max())
        report.update(
            plain_token=plain_token,
            token=token,
            plain_margin=round(float(own[plain_token] - own[token]), 4),
            float32_margin=round(margin, 4),
            float32_prefers="plain" if margin >= 0 else "output",
            dtype_error=round(error, 4),
            near_tie=abs(margin) <= 2 * error,
        )
        reports.append(report)
    return reports


def _first_difference(reference: list[int], output: list[int]) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(reference, output, strict=False)) if a != b),
        min(len(reference), len(output)),
    )


def _engine_report(
    runtime: SpecRuntime, prompt: list[int], reference: list[int], output: list[int]
) -> dict[str, Any]:
    """``explain_divergence`` on an engine without a float32 copy (llama.cpp runs its GGUF as
    shipped): the engine's own logits at the first difference, computed along plain's path
    (the prompt in one forward, then one token per forward) and along the path of a call that
    found the prompt's first half kept (that half in one forward, the rest and the output
    before the difference in another, as a verification adds them up). ``engine_error`` is
    the largest difference between the two over the ten likeliest tokens; the tokens were a tie
    within the engine's rounding where ``|margin| <= 2 * engine_error``. Splitting the prompt
    matters at the first token: fed whole on both paths, the two would be one computation and a tie
    there (a call that reused a kept prefix prefilled the rest apart) would read as no error.

    The reference is another program's output (llama-cpp-python's ``Llama``, which batches its
    prompt and reuses its last call's KV its own way). Where the engine fed plain's very tokens
    prefers the output's (``plain_margin < 0``), the reference's rounding differed from the
    engine's by at least that much (``reference_error``), and the tie is judged against the
    larger of the two errors. No drafting can cause that: plain's path is computed afresh here,
    one token per forward; a drafting bug leaves ``plain_margin`` positive."""
    at = _first_difference(reference, output)
    report: dict[str, Any] = {"at": at}
    if at >= min(len(reference), len(output)):
        report.update(near_tie=False, lengths=[len(reference), len(output)])
        return report
    runner = runtime._decoder.target_runner
    path = runner.new_cache()
    own = runner.forward(prompt, path, keep=1)[-1]
    for token in reference[:at]:
        own = runner.forward([token], path, keep=1)[-1]
    kept, half = runner.new_cache(), len(prompt) // 2
    if half:
        runner.forward(prompt[:half], kept, keep=1)
    split = runner.forward([*prompt[half:], *reference[:at]], kept, keep=1)[-1]
    plain_token, token = reference[at], output[at]
    margin = float(split[plain_token] - split[token])
    top = split.topk(10).indices
    error = float((own[top] - split[top]).abs().max())
    plain_margin = float(own[plain_token] - own[token])
    reference_error = max(0.0, -plain_margin)
    report.update(
        plain_token=plain_token,
        token=token,
        plain_margin=round(plain_margin, 4),
        margin=round(margin, 4),
        engine_error=round(error, 4),
        reference_error=round(reference_error, 4),
        near_tie=abs(margin) <= 2 * max(error, reference_error),
    )
    return report
