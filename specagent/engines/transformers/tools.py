"""The transformers engine's tools (``engines.tools.EngineTools``): its check in a child
process, transformers' own ``generate`` as the benchmarks' baselines, and a float32 copy of the
model as the reference that tells a rounding tie from a bug."""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import torch

from ...machine import _installed, describe_exit, python_child
from ..tools import Float32Reference, Method, OtherPrograms
from .views import cache_keyword

__all__ = ["baselines", "check", "float32_reference", "other_programs"]

CHECK = """
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
results = {}
for name in ("float32", "bfloat16"):
    print(json.dumps({"stage": f"{name} forwards"}), flush=True)
    model = LlamaForCausalLM(config).to(getattr(torch, name)).eval()
    with torch.no_grad():
        for n in (1, 2, 16):
            logits = model(torch.arange(n)[None] % 128).logits
            assert torch.isfinite(logits.float()).all(), f"{name}: logits not finite"
    results[name] = "ok"
print(json.dumps({"done": results}), flush=True)
"""
"""The check, run in a child: a seeded tiny Llama's forwards in each dtype."""

LOOKUP_TOKENS = 6
"""transformers' prompt lookup draft length in the baseline (as specagent's prompt lookup)."""


def check() -> dict[str, Any]:
    """Whether torch and transformers run a model's forwards here (in a child process)."""
    found = {"transformers": _installed("transformers"), "torch": _installed("torch")}
    if not all(found.values()):
        return {**found, "runs": False, "detail": "not installed"}
    started = time.perf_counter()
    try:
        done = subprocess.run(
            python_child(CHECK), capture_output=True, text=True, timeout=600, check=False
        )
        stdout, stderr, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired:
        stdout, stderr, code = "", "did not finish within 600 s", None
    seconds = round(time.perf_counter() - started, 1)
    stage, results = "starting", None
    for line in stdout.splitlines():
        try:
            said = json.loads(line)
        except ValueError:
            continue
        stage = said.get("stage", stage)
        results = said.get("done", results)
    if code == 0 and results:
        detail = (
            "a tiny model's forwards of 1, 2 and 16 tokens ran in float32 and bfloat16 "
            f"in a child process ({seconds} s)"
        )
        return {**found, "runs": True, "detail": detail}
    return {**found, "runs": False, "detail": describe_exit(stage, code, stderr)}


def baselines(runtime: Any, max_new_tokens: int) -> dict[str, Method]:
    """Greedy ``generate`` on the runtime's own model objects (so in its dtype): plain, prompt
    lookup and, with a draft model, assisted generation. Outputs stop at EOS, as specagent's
    do."""
    target, draft = runtime.target, runtime.draft
    eos = runtime.eos_token_ids

    def hf(ids: list[int], **kwargs: Any) -> list[int]:
        # Greedy: the round's seed (the second argument of every method) does not apply.
        inputs = torch.tensor([ids], device=runtime.device)
        generated = target.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
            **kwargs,
        )
        tokens = generated[0, len(ids) :].tolist()
        return [t for t in tokens if t not in eos]

    runs: dict[str, Method] = {
        "plain": lambda ids, seed: (hf(ids), None),
        "hf_prompt_lookup": lambda ids, seed: (
            hf(ids, prompt_lookup_num_tokens=LOOKUP_TOKENS),
            None,
        ),
    }
    if draft is not None:
        runs["hf_assisted"] = lambda ids, seed: (hf(ids, assistant_model=draft), None)
    return runs


@contextlib.contextmanager
def other_programs(
    runtime: Any, max_new_tokens: int, binary: str | None
) -> Iterator[OtherPrograms]:
    """None: what a transformers user runs instead is ``generate`` (``baselines``)."""
    yield OtherPrograms.none()


def float32_reference(runtime: Any) -> Float32Reference:
    """The model in float32 (a copy where it runs in another dtype) beside plain decoding's own
    path in the runtime's dtype; each prefix computed once."""
    target = runtime.target
    exact = target
    if next(target.parameters()).dtype != torch.float32:
        exact = copy.deepcopy(target).float()
    seen: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def reference(prompt: list[int], generated: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        key = (len(prompt), *prompt, *generated)
        if key not in seen:
            with torch.inference_mode():
                full = torch.tensor([[*prompt, *generated]], device=runtime.device)
                seen[key] = (
                    _plain_path_logits(target, prompt, generated, runtime.device),
                    exact(input_ids=full).logits[0, -1].float(),
                )
        return seen[key]

    return reference


def _plain_path_logits(
    model: Any, prompt: list[int], generated: list[int], device: torch.device
) -> torch.Tensor:
    """The last logits as plain greedy decoding computes them: the prompt in one forward, then
    each generated token in a forward of its own over the growing KV cache."""
    from transformers import DynamicCache

    kwargs = {cache_keyword(type(model)): DynamicCache(), "use_cache": True}
    logits = model(input_ids=torch.tensor([prompt], device=device), **kwargs).logits
    for token in generated:
        logits = model(input_ids=torch.tensor([[token]], device=device), **kwargs).logits
    return logits[0, -1].float()
