"""What a user of the runtime's engine would run instead, as methods a benchmark times beside
specagent's: transformers' ``generate`` (plain, prompt lookup, assisted) on the runtime's own
model objects, or llama-cpp-python's ``Llama`` on the runtime's own GGUF file."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..chat import render_prompt
from ..runtime import SpecRuntime

__all__ = [
    "LOOKUP_TOKENS",
    "Method",
    "baseline_methods",
    "llama_cpp_baselines",
    "prepared_methods",
]


Method = Callable[[list[int], int], tuple[list[int], Any]]
"""A decoding method under test: prompt ids and a round's seed -> output ids and stats."""


def baseline_methods(runtime: SpecRuntime, max_new_tokens: int) -> dict[str, Method]:
    """What a user of the runtime's engine would run instead: on transformers, greedy
    ``generate`` on the runtime's own model objects (so in its dtype): plain, prompt lookup (6
    tokens, as specagent's prompt lookup here) and, with a draft model, assisted generation; on
    llama.cpp, llama-cpp-python on the same GGUF (``llama_cpp_baselines``). Outputs stop at
    EOS, as specagent's do."""
    if runtime.engine == "llama.cpp":
        return llama_cpp_baselines(runtime, max_new_tokens)
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
        "hf_prompt_lookup": lambda ids, seed: (hf(ids, prompt_lookup_num_tokens=6), None),
    }
    if draft is not None:
        runs["hf_assisted"] = lambda ids, seed: (hf(ids, assistant_model=draft), None)
    return runs


LOOKUP_TOKENS = 10
"""llama-cpp-python's prompt-lookup drafter's own default draft length."""


def llama_cpp_baselines(runtime: SpecRuntime, max_new_tokens: int) -> dict[str, Method]:
    """llama-cpp-python's ``Llama`` (what ChatLlamaCpp runs) on the runtime's own GGUF file,
    with the same threads: ``plain`` greedy decoding, and ``llama_prompt_lookup`` with its
    prompt-lookup drafter (``LlamaPromptLookupDecoding``, the speculative mode it exposes;
    llama-server's draft-model and n-gram modes are not reachable from Python). Each keeps its
    own KV between calls and reuses the longest common prefix, as an agent's process would."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from ..engines.llama_cpp import on_compute_thread

    model = runtime.target
    eos = set(runtime.eos_token_ids)

    def load(**options: Any) -> Any:
        with _extra_buffer_types(model.fast_paths.enabled("repack")):
            return on_compute_thread(
                lambda: Llama(
                    model_path=str(model.path),
                    n_ctx=min(model.context_tokens, 16384),
                    n_threads=model.threads,
                    n_threads_batch=model.threads,
                    n_batch=model.batch_tokens,
                    flash_attn=model.flash_attention,
                    verbose=False,
                    **options,
                )
            )

    def greedy(llm: Any) -> Method:
        def run(ids: list[int], seed: int) -> tuple[list[int], Any]:
            # On the thread that runs the engine's forwards: one OpenMP team for both.
            return on_compute_thread(decode, ids)

        def decode(ids: list[int]) -> tuple[list[int], Any]:
            out: list[int] = []
            for token in llm.generate(
                ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
            ):
                if token in eos:
                    break
                out.append(int(token))
                if len(out) >= max_new_tokens:
                    break
            return out, None

        return run

    lookup = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
    return {
        "plain": greedy(load()),
        "llama_prompt_lookup": greedy(load(draft_model=lookup)),
    }


@contextlib.contextmanager
def _extra_buffer_types(enabled: bool) -> Iterator[None]:
    """llama-cpp-python's ``Llama`` with weight repacking as the engine proved it here:
    ``Llama`` takes no option for it and loads in its constructor, so the default model
    parameters it starts from are set for the duration (on a machine where repacking crashes,
    a ``Llama`` as shipped dies at its first forward of two tokens)."""
    import llama_cpp.llama_cpp as low_level

    default = low_level.llama_model_default_params

    def params() -> Any:
        made = default()
        made.use_extra_bufts = enabled
        return made

    low_level.llama_model_default_params = params
    try:
        yield
    finally:
        low_level.llama_model_default_params = default


def prepared_methods(
    runtime: SpecRuntime,
    own: Mapping[str, Method],
    max_new_tokens: int,
    methods: Iterable[str] | None = None,
    baselines: Mapping[str, Method] | None = None,
    log: Callable[[str], None] = print,
    unless_named: Iterable[str] = (),
) -> dict[str, Method]:
    """The methods a benchmark times: plain (the reference, first and always) and the other
    baselines of the runtime's engine, ``baselines`` (other programs on the same model files),
    then specagent's ``own``; only those ``methods`` names where it names any (and, where it
    names none, not those ``unless_named``: a workload a baseline cannot run). Each is run once
    (kernels, allocator), and the runtime's step costs are measured before any is timed (timed
    runs must not share the worker with the measurement)."""
    runs = {**baseline_methods(runtime, max_new_tokens), **(baselines or {}), **own}
    if methods is None:
        runs = {name: run for name, run in runs.items() if name not in set(unless_named)}
    else:
        only = set(methods)
        unknown = only - set(runs)
        if unknown:
            raise ValueError(f"unknown bench methods {sorted(unknown)}; known: {sorted(runs)}")
        runs = {name: run for name, run in runs.items() if name == "plain" or name in only}
    if runtime.tokenizer is None:
        raise ValueError("the benchmark renders chat prompts: the runtime needs a tokenizer")
    warm = render_prompt(
        [{"role": "user", "content": "Hi"}], runtime.tokenizer, vocab_size=runtime.vocab_size
    )
    for name, method in runs.items():
        method(warm, 0)
        log(f"warmed up {name}")
    if not runtime.wait_measured(timeout=3600):
        log("step costs still being measured after an hour; timing anyway")
    return runs
