"""The llama.cpp engine's tools (``engines.tools.EngineTools``): its probe on a sample GGUF in
child processes, llama-cpp-python's ``Llama`` (what ``ChatLlamaCpp`` runs) as the benchmarks'
baselines, and llama.cpp's own server beside them (``server``). It runs its GGUF as shipped:
no float32 reference."""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError
from ..tools import Method, OtherPrograms
from .compute_thread import run as on_compute_thread
from .library import available, build_info, default_threads

__all__ = ["baselines", "check", "float32_reference", "other_programs"]

LOOKUP_TOKENS = 10
"""llama-cpp-python's prompt-lookup drafter's own default draft length."""


def check() -> dict[str, Any]:
    """Whether llama.cpp runs a quantized model here, and which of its fast paths do: the
    engine's own probe on a sample GGUF, in child processes, with nothing kept."""
    if not available():
        return {"runs": False, "detail": 'not installed (pip install "specagent[gguf]")'}
    from .probe import choose_fast_paths
    from .sample import write_sample_gguf

    described: dict[str, Any] = {**build_info()}
    try:
        with tempfile.TemporaryDirectory(prefix="specagent-doctor-") as folder:
            sample = write_sample_gguf(Path(folder) / "sample-q8_0.gguf", "Q8_0")
            paths = choose_fast_paths(
                sample, {}, threads=default_threads(), batch_tokens=512, store=None
            )
    except ModelLoadError as exc:
        return {**described, "runs": False, "detail": str(exc)}
    described["fast_paths"] = {n: c.to_json() for n, c in paths.choices.items()}
    described["runs"] = True
    described["detail"] = (
        f"a quantized (Q8_0) sample model ran every forward shape of the engine in child "
        f"processes ({paths.probe_s:.1f} s)"
    )
    return described


def baselines(runtime: Any, max_new_tokens: int) -> dict[str, Method]:
    """llama-cpp-python's ``Llama`` on the runtime's own GGUF file, with the same threads:
    ``plain`` greedy decoding, and ``llama_prompt_lookup`` with its prompt-lookup drafter
    (``LlamaPromptLookupDecoding``, the speculative mode it exposes; llama-server's draft-model
    and n-gram modes are not reachable from Python: ``other_programs``). Each keeps its own KV
    between calls and reuses the longest common prefix, as an agent's process would."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

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
def other_programs(
    runtime: Any, max_new_tokens: int, binary: str | None
) -> Iterator[OtherPrograms]:
    """llama.cpp's own server in each of its modes (``server.MODES``) on the same GGUF; none,
    said on stderr, where no binary is found."""
    from .server import llama_server_methods

    with llama_server_methods(runtime, max_new_tokens, binary) as servers:
        if not servers.methods:
            print(
                "no llama-server binary found: its baselines are left out "
                "(--llama-server PATH, or `python benchmarks/llama_server.py build`)",
                file=sys.stderr,
            )
        yield servers


def float32_reference(runtime: Any) -> None:
    """None: the GGUF runs as shipped (a difference is judged along two paths of its own)."""
    return None


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
