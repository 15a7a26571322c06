"""The llama.cpp engine: GGUF models as shipped (quantized weights untouched), run by llama.cpp
through llama-cpp-python's low-level API.

On a CPU llama.cpp is the fastest thing there is for a GGUF model; specagent keeps its own
decoding (drafters, acceptance, grammar, history) and hands llama.cpp only forwards:

- one ``LlamaCppModel`` owns a llama context whose KV memory is one unified pool of cells
  shared by up to ``max_sequences`` sequences (``kv_unified``);
- a call's KV is a ``LlamaSequence``: a sequence id in that pool and its length. Rolling back
  rejected drafts removes the sequence's positions past a length (``llama_memory_seq_rm``); a
  copy of a sequence (``llama_memory_seq_cp``) shares its cells;
- a kept prefix is a sequence's KV saved to host memory (``KeptState``) and restored into a
  new sequence when a call reuses it: held in the pool it would tax every forward, which
  reads the mask over every cell up to the highest one in use;
- ``LlamaCppRunner.forward_batch`` is one ``llama_decode`` over every call's new tokens (each
  at its own positions, in its own sequence), asking logits only for the rows somebody reads:
  llama.cpp then runs the vocabulary projection over those rows alone.

Before the model loads, the fast paths llama.cpp would turn on by itself (weight repacking,
flash attention) are proven in a child process on this machine (``probe``): one that crashes
or computes other logits there stays off, and ``LlamaCppModel.fast_paths`` says why.

Every forward of the process runs on one thread (``on_compute_thread``): OpenMP keeps a
thread team per calling thread, and a second team makes every step pay for waking threads.
Memory operations (removing, copying sequences) run on the runtime's worker under the model's
lock. A sequence that is dropped elsewhere (the garbage collector runs anywhere) is only
queued, and its id is freed by the next call on the worker.
"""

from .compute_thread import run as on_compute_thread
from .library import available, build_info, default_threads
from .loading import check_vocabulary
from .model import LlamaCppModel, LlamaCppRunner
from .probe import FAST_PATHS, FastPaths, PathChoice
from .sequences import KeptState, LlamaSequence

__all__ = [
    "FAST_PATHS",
    "FastPaths",
    "KeptState",
    "LlamaCppModel",
    "LlamaCppRunner",
    "LlamaSequence",
    "PathChoice",
    "available",
    "build_info",
    "check_vocabulary",
    "default_threads",
    "on_compute_thread",
]
