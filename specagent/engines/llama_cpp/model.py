"""The llama.cpp engine's model (a GGUF file and one llama context), its sequences and its
runner: the pieces the package's docstring describes."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from ...decoding.costs import SettlesNothing
from ...decoding.engine import CopiedSequences, ForwardInputs, Tokens, align_vocab, token_list
from ...errors import GenerationError, ModelLoadError
from ...machine import ProbeStore
from ..base import Capabilities, EngineModel, RunnerNeeds
from . import compute_thread
from .library import default_threads, library
from .probe import FastPaths, Switch, choose_fast_paths
from .sequences import KeptState, LlamaSequence, _Context

__all__ = ["LlamaCppModel", "LlamaCppRunner"]

ENGINE = "llama.cpp"
T = TypeVar("T")


SPARE_CONTEXTS = 4
"""Private contexts kept, cleared, for the next reproducible calls once theirs ended."""


def _bytes(data: np.ndarray) -> Any:
    """``data``'s buffer as the ``uint8_t *`` llama.cpp's state functions take."""
    return data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


class LlamaCppModel(EngineModel):
    """A GGUF model loaded by llama.cpp with one shared context for the calls of a runtime.

    ``context_tokens`` sizes the shared KV pool (every live call draws from it; kept prefixes
    are saved to host memory, outside it: ``save_sequence``); ``max_sequences`` bounds how many
    calls and their drafts' KV exist at once (llama.cpp allows 256; the default leaves a
    runtime's 64 active calls room for copies); ``threads``
    defaults to the CPUs this process may use; ``batch_tokens`` is the most tokens one
    ``llama_decode`` takes (longer forwards are split); ``call_share`` is the most of the pool
    one call may hold (its prompt and output: the runtime refuses longer calls, and starts a
    call only when what it may hold fits beside the running calls', ``kv_budget``).

    A call whose forwards must not depend on what else the pool holds (a reproducible policy's)
    gets a context of its own (``private_sequence``): in the shared pool a call's cells land
    wherever others left room, and the order in which attention sums them, and so its rounding,
    changes with the load.

    ``repack`` (llama.cpp's weight repacking into its CPU-specific "extra buffer types", e.g.
    AMX tiles) and ``flash_attention`` are fast paths that kill the process on some machines:
    ``"auto"`` uses each only once a child process proved it on this machine with this file
    (``probe``; the verdict is kept in ``probe_store``, default the cache directory's),
    ``True`` uses it unproven, ``False`` never. ``fast_paths`` says what was chosen and why."""

    engine = ENGINE
    capabilities = Capabilities(shared_kv=True, devices=("cpu",))
    device = torch.device("cpu")

    def __init__(
        self,
        path: str | Path,
        *,
        context_tokens: int = 32768,
        max_sequences: int = 160,
        threads: int | None = None,
        batch_tokens: int = 512,
        repack: Switch = "auto",
        flash_attention: Switch = "auto",
        name: str | None = None,
        probe_store: ProbeStore | None = None,
        call_share: float = 0.5,
    ) -> None:
        from ...catalog import cache_dir

        if not 0 < call_share <= 1:
            raise ModelLoadError(f"call_share must be in (0, 1], got {call_share!r}")

        lib = library()
        self._lib = lib
        self.path = Path(path)
        self.name = name or self.path.stem
        if not self.path.is_file():
            raise ModelLoadError(f"no GGUF file at {self.path}")
        self.threads = threads or default_threads()
        self.batch_tokens = batch_tokens
        self.fast_paths: FastPaths = choose_fast_paths(
            self.path,
            {"repack": repack, "flash_attention": flash_attention},
            threads=self.threads,
            batch_tokens=batch_tokens,
            store=probe_store or ProbeStore(cache_dir() / "probes"),
        )
        """Which optional fast paths this model runs with, and why (``probe``)."""
        self.flash_attention = self.fast_paths.enabled("flash_attention")
        model_params = lib.llama_model_default_params()
        model_params.use_extra_bufts = self.fast_paths.enabled("repack")
        model = lib.llama_model_load_from_file(str(self.path).encode(), model_params)
        if not model:
            raise ModelLoadError(
                f"llama.cpp could not load {self.path} (its log line above says why)"
            )
        self._model = model
        limit = int(lib.llama_max_parallel_sequences())
        self.max_sequences = max(1, min(max_sequences, limit))
        try:
            # Unified: a call's copies share its cells, and calls take cells as they grow.
            self._shared = _Context(
                self, tokens=context_tokens, sequences=self.max_sequences, unified=True
            )
        except GenerationError as exc:
            lib.llama_model_free(model)
            raise ModelLoadError(str(exc)) from None
        self._vocab = lib.llama_model_get_vocab(model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))
        self.context_tokens = self._shared.tokens
        trained = int(lib.llama_model_n_ctx_train(model))
        share = max(1, int(self.context_tokens * call_share))
        self.context_window = min(trained, share) if trained > 0 else share
        """The longest call this model serves: what it was trained for, within its share of
        the pool (``call_share``: one call never takes the cells every other call needs)."""
        self.num_layers = int(lib.llama_model_n_layer(model))
        self.weight_bytes = int(lib.llama_model_size(model))
        self.n_parameters = int(lib.llama_model_n_params(model))
        buffer = ctypes.create_string_buffer(256)
        lib.llama_model_desc(model, buffer, len(buffer))
        self.description = buffer.value.decode("utf-8", "replace")
        """llama.cpp's own description of the weights (architecture, size, quantization)."""
        self._private: list[_Context] = []
        """Private contexts, in use or spare (closed with the model, never after it)."""
        self._lock = threading.RLock()
        """Held around every use of a context (batch, decode, memory): runtimes that share
        this model step on threads of their own."""
        self.decodes = 0
        """``llama_decode`` calls so far (tests count forwards with it)."""

    # ------------------------------------------------------------------ facts

    def eos_token_ids(self) -> list[int]:
        """Every end-of-generation token of the GGUF's vocabulary (EOS, EOT, ...)."""
        return [i for i in range(self.vocab_size) if self._lib.llama_vocab_is_eog(self._vocab, i)]

    def token_text(self, token: int) -> str:
        raw = self._lib.llama_vocab_get_text(self._vocab, token)
        return raw.decode("utf-8", "replace") if raw else ""

    def key(self) -> dict[str, Any]:
        """What this model's speed depends on, for keying measurements (not its weights)."""
        import llama_cpp

        return {
            "engine": ENGINE,
            "description": self.description,
            "parameters": self.n_parameters,
            "bytes": self.weight_bytes,
            "layers": self.num_layers,
            "threads": self.threads,
            "batch_tokens": self.batch_tokens,
            "flash_attention": self.flash_attention,
            "repack": self.fast_paths.enabled("repack"),
            "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
        }

    @property
    def model(self) -> LlamaCppModel:
        return self

    def runner(self, vocab_size: int | None = None) -> LlamaCppRunner:
        return LlamaCppRunner(self, vocab_size)

    def build_runner(self, needs: RunnerNeeds) -> tuple[LlamaCppRunner, None]:
        """Its runner (llama.cpp decides nothing about its steps that a runtime reports)."""
        return self.runner(needs.vocab_size), None

    def kv_budget(self) -> int:
        """The pool's cells: every call on this model draws from them."""
        return self.context_tokens

    # ------------------------------------------------------------------ sequences

    def compute(self, work: Callable[[], T]) -> T:
        """On the process's llama.cpp thread: one OpenMP team for every runtime's rounds
        (``compute_thread``)."""
        return compute_thread.run(work)

    def compute_wanted(self) -> bool:
        """Whether another job waits for the llama.cpp thread."""
        return compute_thread.wanted()

    def sequence(self) -> LlamaSequence:
        """A new, empty sequence in the shared pool."""
        shared = self._shared
        self._reap(shared)
        with self._lock:
            if shared.free:
                return LlamaSequence(self, shared, shared.free.pop())
        msg = (
            f"llama.cpp engine: all {self.max_sequences} sequences are in use "
            "(raise max_sequences or lower the runtime's max_active)"
        )
        raise GenerationError(msg)

    def private_sequence(self, tokens: int) -> LlamaSequence:
        """A new, empty sequence in a context of its own with room for ``tokens`` positions:
        its forwards depend on nothing any other call holds. A context whose call ended is
        cleared and kept (``SPARE_CONTEXTS`` at most) for the next such call, since creating
        one costs the stepping thread tens of milliseconds; sizes are powers of two so that
        calls of similar lengths reuse the same ones. A cleared context computes what a new
        one does (its cells are filled from the first again)."""
        size = max(256, 1 << max(0, tokens - 1).bit_length())
        with self._lock:
            idle = []
            for context in self._private:
                if context.released:  # its call's sequence was dropped: free for reuse
                    context.free.extend(context.released)
                    context.released.clear()
                if context.free:
                    idle.append(context)
            fits = [c for c in idle if c.tokens >= tokens]
            chosen = min(fits, key=lambda c: c.tokens) if fits else None
            spare = [c for c in idle if c is not chosen]
            # The spares beyond the bound are freed, the largest first.
            for context in sorted(spare, key=lambda c: c.tokens)[SPARE_CONTEXTS:]:
                self._private.remove(context)
                context.close()
            if chosen is not None:
                self._lib.llama_memory_clear(chosen.memory, True)
        if chosen is None:
            chosen = _Context(self, tokens=size, sequences=1, unified=True)
            with self._lock:
                self._private.append(chosen)
        return LlamaSequence(self, chosen, chosen.free.pop())

    def _copy(self, source: LlamaSequence) -> LlamaSequence:
        if source.private:
            raise GenerationError("a private llama.cpp sequence is not copied (nor kept)")
        copy = self.sequence()
        if source.length:
            with self._lock:
                self._lib.llama_memory_seq_cp(
                    self._shared.memory, source.seq_id, copy.seq_id, 0, -1
                )
            copy.length = source.length
        return copy

    def save_sequence(self, seq: LlamaSequence) -> KeptState:
        """``seq``'s KV saved to host memory (a ``KeptState``): what the prefix cache keeps,
        so that kept prefixes hold no cell of the pool (``KeptState`` says why). About 28 KB
        per position for a 1.5B model; a copy of memory, no forward."""
        if seq.private:
            raise GenerationError("a private llama.cpp sequence is not copied (nor kept)")
        lib, ctx = self._lib, self._shared.ctx
        with self._lock:
            size = int(lib.llama_state_seq_get_size_ext(ctx, seq.seq_id, 0))
            data = np.empty(size, dtype=np.uint8)
            written = lib.llama_state_seq_get_data_ext(ctx, _bytes(data), size, seq.seq_id, 0)
        if written != size:
            raise GenerationError(f"llama.cpp could not save a sequence of {seq.length} positions")
        return KeptState(self, data, seq.length)

    def restore_sequence(self, state: KeptState) -> LlamaSequence:
        """A new sequence of the pool holding ``state``'s first ``length`` positions (its cells
        go wherever the pool has room, as a forward's would)."""
        if state._model is not self:
            raise GenerationError("a kept llama.cpp prefix is restored only into its own model")
        seq = self.sequence()
        data = state.data
        with self._lock:
            read = self._lib.llama_state_seq_set_data_ext(
                self._shared.ctx, _bytes(data), data.size, seq.seq_id, 0
            )
        if read != data.size:
            msg = (
                f"llama.cpp engine: no room in its KV pool of {self.context_tokens} tokens for "
                f"a kept prefix of {state.saved} (raise context_tokens)"
            )
            raise GenerationError(msg)
        seq.length = state.saved
        seq.crop(state.length)
        return seq

    def _remove(self, seq: LlamaSequence, start: int) -> None:
        with self._lock:
            removed = self._lib.llama_memory_seq_rm(seq._context.memory, seq.seq_id, start, -1)
        if not removed:
            raise GenerationError(f"llama.cpp could not remove positions {start}.. of a sequence")

    def _reap(self, context: _Context) -> None:
        """Free the ids of ``context``'s sequences dropped since the last call (a sequence's
        ``__del__`` only queues its id: it may run on any thread, inside any llama.cpp call)."""
        with self._lock:
            while context.released:
                seq_id = context.released.popleft()
                self._lib.llama_memory_seq_rm(context.memory, seq_id, -1, -1)
                context.free.append(seq_id)

    # ------------------------------------------------------------------ forwards

    def decode(self, items: Sequence[tuple[LlamaSequence, Sequence[int], int]]) -> list[np.ndarray]:
        """Feed each item's tokens after its sequence, in as few ``llama_decode`` calls as the
        batch size allows (one context at a time); returns the logits of each item's last
        ``keep`` rows ``[keep, V]``. All or nothing: on failure every sequence is cut back to
        where it was. Runs on the process's llama.cpp thread (``compute_thread``), whichever
        thread asks."""
        return compute_thread.run(self._decode_items, items)

    def _decode_items(
        self, items: Sequence[tuple[LlamaSequence, Sequence[int], int]]
    ) -> list[np.ndarray]:
        lengths = [seq.length for seq, _, _ in items]
        try:
            outputs: list[np.ndarray | None] = [None] * len(items)
            contexts: dict[int, list[int]] = {}
            for index, (seq, _, _) in enumerate(items):
                contexts.setdefault(id(seq._context), []).append(index)
            for indices in contexts.values():
                context = items[indices[0]][0]._context
                self._reap(context)
                done = self._decode(context, [items[i] for i in indices])
                for index, logits in zip(indices, done, strict=True):
                    outputs[index] = logits
            return [logits for logits in outputs if logits is not None]
        except BaseException:
            for (seq, _, _), length in zip(items, lengths, strict=True):
                with contextlib.suppress(GenerationError):
                    self._remove(seq, length)
                seq.length = length
            raise

    def _decode(
        self, context: _Context, items: Sequence[tuple[LlamaSequence, Sequence[int], int]]
    ) -> list[np.ndarray]:
        lib, batch, vocab = self._lib, context.batch, self.vocab_size
        if context is not self._shared:
            for seq, tokens, _ in items:
                if seq.length + len(tokens) > context.tokens:
                    msg = (
                        f"llama.cpp engine: no room in the call's own KV of {context.tokens} "
                        f"tokens for {len(tokens)} more after {seq.length}"
                    )
                    raise GenerationError(msg)
        outputs = [np.empty((keep, vocab), dtype=np.float32) for _, _, keep in items]
        rows: list[tuple[int, int, int, int, bool, int]] = []  # item, token, seq, pos, out, row
        for index, (seq, tokens, keep) in enumerate(items):
            first_kept = len(tokens) - keep
            for j, token in enumerate(tokens):
                wanted = j >= first_kept
                rows.append((index, int(token), seq.seq_id, seq.length + j, wanted, j - first_kept))
        for start in range(0, len(rows), self.batch_tokens):
            chunk = rows[start : start + self.batch_tokens]
            wanted_rows = [(item, row) for item, _, _, _, wanted, row in chunk if wanted]
            while True:
                with self._lock:
                    for k, (_, token, seq_id, pos, wanted, _) in enumerate(chunk):
                        batch.token[k] = token
                        batch.pos[k] = pos
                        batch.n_seq_id[k] = 1
                        batch.seq_id[k][0] = seq_id
                        batch.logits[k] = wanted
                    batch.n_tokens = len(chunk)
                    status = lib.llama_decode(context.ctx, batch)
                    if status == 0:
                        self.decodes += 1
                        if wanted_rows:
                            pointer = lib.llama_get_logits(context.ctx)
                            shape = (len(wanted_rows), vocab)
                            logits = np.ctypeslib.as_array(pointer, shape=shape)
                            for n, (item, row) in enumerate(wanted_rows):
                                outputs[item][row] = logits[n]
                        break
                if status == 1:
                    where = (
                        f"its KV pool of {context.tokens} tokens (raise context_tokens)"
                        if context is self._shared
                        else f"the call's own KV of {context.tokens} tokens"
                    )
                    raise GenerationError(f"llama.cpp engine: no room in {where} for this forward")
                raise GenerationError(f"llama_decode failed with status {status}")
            for item, fed in collections.Counter(r[0] for r in chunk).items():
                items[item][0].length += fed  # positions fed so far
        return outputs

    def close(self) -> None:
        """Free the shared context and the weights (the model is unusable afterwards)."""
        for context in [*getattr(self, "_private", ()), getattr(self, "_shared", None)]:
            if context is not None:
                context.close()
        model = getattr(self, "_model", None)
        if model:
            self._lib.llama_model_free(model)
            self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"LlamaCppModel({self.name!r}: {self.description}, {self.threads} threads)"


class LlamaCppRunner(SettlesNothing, CopiedSequences):
    """The decoding core's runner over a ``LlamaCppModel``: forwards over new tokens after a
    sequence, returning float32 logits (``[n_kept, V]``, V the target's vocabulary). llama.cpp
    chooses its own kernels: nothing here is tuned after load, ``tune`` only times."""

    inputs = ForwardInputs()
    """No token trees (they need a custom attention mask, which llama.cpp's batch API does not
    take) and the whole vocabulary."""

    def __init__(
        self, model: LlamaCppModel, vocab_size: int | None = None, private_tokens: int = 0
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size or model.vocab_size
        self.device = torch.device("cpu")
        self.private_tokens = private_tokens
        """Where > 0: each call's KV is a context of its own of this many positions."""

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    def reproducible(self, tokens: int) -> LlamaCppRunner:
        """This runner for a call that must not depend on other calls (a reproducible
        policy's) and holds up to ``tokens`` positions: its KV is a context of its own
        (``LlamaCppModel.private_sequence``), not cells of the shared pool."""
        return LlamaCppRunner(self.model, self.vocab_size, private_tokens=tokens)

    def speed_key(self, *parts: object) -> str:
        """The GGUF's description, size and the context's settings (``LlamaCppModel.key``)."""
        from ...machine import config_key

        return config_key(self.model.key(), *parts)

    def new_cache(self) -> LlamaSequence:
        if self.private_tokens:
            return self.model.private_sequence(self.private_tokens)
        return self.model.sequence()

    def adopt(self, cache: LlamaSequence) -> LlamaSequence:
        return cache

    def kept(self, cache: LlamaSequence, copied: bool) -> KeptState:
        """``cache``'s KV saved outside the pool (``LlamaCppModel.save_sequence``); a sequence
        its call is done with (``copied=False``) gives its cells back at once."""
        state = self.model.save_sequence(cache)
        if not copied:
            cache.crop(0)
        return state

    def forward(
        self,
        input_ids: Tokens,
        cache: LlamaSequence,
        keep: int | None = None,
        tree: list[int] | None = None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if tree is not None:
            raise ValueError("the llama.cpp engine does not run token trees")
        return self.forward_batch([(input_ids, cache)], [keep])[0]

    def forward_batch(
        self,
        requests: Sequence[tuple[Tokens, LlamaSequence]],
        keep: Sequence[int | None] | None = None,
        vocabs: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        keeps = list(keep) if keep is not None else [None] * len(requests)
        items = []
        for (tokens, cache), k in zip(requests, keeps, strict=True):
            if not isinstance(cache, LlamaSequence) or cache._model is not self.model:
                raise TypeError("a llama.cpp forward needs a sequence of the same model")
            count = len(tokens) if k is None else max(0, min(k, len(tokens)))
            items.append((cache, token_list(tokens), count))
        logits = self.model.decode(items)
        return [self._finished(torch.from_numpy(rows)) for rows in logits]

    def _finished(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] == self.vocab_size:
            return logits
        return align_vocab(logits, self.vocab_size)
