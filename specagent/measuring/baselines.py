"""What a user of the runtime's engine would run instead, as methods a benchmark times beside
specagent's: the engine's own (``engines.tools.EngineTools.baselines``: transformers'
``generate``, plain, prompt lookup, assisted, on the runtime's own model objects; or
llama-cpp-python's ``Llama`` on the runtime's own GGUF file)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from ..chat import render_prompt
from ..engines.tools import Method, engine_tools
from ..runtime import SpecRuntime

__all__ = ["Method", "baseline_methods", "prepared_methods", "start_round", "warm_prompt"]


def baseline_methods(runtime: SpecRuntime, max_new_tokens: int) -> dict[str, Method]:
    """What a user of the runtime's engine would run instead, on the runtime's own model
    (``EngineTools.baselines``: transformers' ``generate``, llama-cpp-python's ``Llama``)."""
    return engine_tools(runtime.engine).baselines(runtime, max_new_tokens)


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
    names none, not those ``unless_named``: a workload a baseline cannot run). The runtime's
    step costs are measured first, with nothing else running (a baseline warming up beside
    the timings would skew the curve the runtime plans with), then each method is run once
    (kernels, allocator)."""
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
    if not runtime.wait_measured(timeout=3600):
        log("step costs still being measured after an hour; timing anyway")
    warm = warm_prompt(runtime)
    for name, method in runs.items():
        method(warm, 0)
        log(f"warmed up {name}")
    return runs


def warm_prompt(runtime: SpecRuntime) -> list[int]:
    """A short chat ("Hi") in the runtime's template: what every method runs once, untimed."""
    return render_prompt(
        [{"role": "user", "content": "Hi"}], runtime.tokenizer, vocab_size=runtime.vocab_size
    )


def start_round(
    runtime: SpecRuntime,
    own: Mapping[str, Method],
    new_round: Callable[[], None] | None = None,
) -> None:
    """Before each round of a benchmark, untimed: the other programs started afresh
    (``new_round``), and specagent's prefix cache left as a baseline's KV is then.

    A baseline keeps its last call's KV and reuses what the next prompt shares with it (the
    chat template's header and system prompt, never a whole earlier prompt: each prompt comes
    once a round). specagent's cache would keep every earlier round's prompts whole: it is
    cleared, then each of specagent's ``own`` methods (each calling as a tenant of its own)
    runs the warm-up chat once, so that its first prompt of the round finds the header kept,
    as a baseline's does."""
    if new_round is not None:
        new_round()
    if runtime.prefix_cache is None:
        return
    runtime.prefix_cache.clear()
    warm = warm_prompt(runtime)
    for method in own.values():
        method(warm, 0)
