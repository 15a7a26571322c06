"""The llama.cpp engine's model (a GGUF file and one llama context), its sequences and its
runner: the pieces the package's docstring describes."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...decoding.costs import SettlesNothing
from ...decoding.engine import Tokens, align_vocab, cropped_length, token_list
from ...errors import GenerationError, ModelLoadError
from ...machine import ProbeStore
from .library import default_threads, library
from .probe import FastPaths, Switch, choose_fast_paths

__all__ = ["LlamaCppModel", "LlamaCppRunner", "LlamaSequence", "check_vocabulary"]

ENGINE = "llama.cpp"


class LlamaSequence:
    """One call's KV in a ``LlamaCppModel``: a sequence id of its pool and how many positions
    it holds. It behaves as the decoding core expects of a cache: ``get_seq_length``, ``crop``
    (a negative argument drops that many positions, as transformers' caches do) and
    ``copy.deepcopy`` (a new sequence sharing these cells)."""

    __slots__ = ("__weakref__", "_model", "length", "seq_id")

    def __init__(self, model: LlamaCppModel, seq_id: int) -> None:
        self._model = model
        self.seq_id = seq_id
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        keep = cropped_length(self.length, max_length)
        if keep is not None:
            self._model._remove(self.seq_id, keep)
            self.length = keep

    def __deepcopy__(self, memo: dict[int, Any]) -> LlamaSequence:
        return self._model._copy(self)

    def __del__(self) -> None:
        model = getattr(self, "_model", None)
        if model is not None:
            model._released.append(self.seq_id)


class LlamaCppModel:
    """A GGUF model loaded by llama.cpp with one context for every call of a runtime.

    ``context_tokens`` sizes the shared KV pool (every live call and every kept prefix draws
    from it; kept prefixes share cells with the calls that made them); ``max_sequences``
    bounds how many calls, their drafts' KV and kept prefixes exist at once (llama.cpp allows
    256; the default leaves a runtime's 64 active calls room for their prefixes); ``threads``
    defaults to the CPUs this process may use; ``batch_tokens`` is the most tokens one
    ``llama_decode`` takes (longer forwards are split).

    ``repack`` (llama.cpp's weight repacking into its CPU-specific "extra buffer types", e.g.
    AMX tiles) and ``flash_attention`` are fast paths that kill the process on some machines:
    ``"auto"`` uses each only once a child process proved it on this machine with this file
    (``probe``; the verdict is kept in ``probe_store``, default the cache directory's),
    ``True`` uses it unproven, ``False`` never. ``fast_paths`` says what was chosen and why."""

    engine = ENGINE

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
    ) -> None:
        from ...catalog import cache_dir

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
        params = lib.llama_context_default_params()
        params.n_ctx = context_tokens
        params.n_batch = batch_tokens
        params.n_ubatch = batch_tokens
        params.n_seq_max = self.max_sequences
        # A verification reads every row it feeds; llama.cpp sizes outputs for >= n_seq_max.
        params.n_outputs_max = max(batch_tokens, self.max_sequences)
        params.n_outputs_max_per_seq = batch_tokens
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        params.kv_unified = True  # kept prefixes share cells with the calls that made them
        self.flash_attention = self.fast_paths.enabled("flash_attention")
        params.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if self.flash_attention
            else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.no_perf = True
        ctx = lib.llama_init_from_model(model, params)
        if not ctx:
            lib.llama_model_free(model)
            raise ModelLoadError(
                f"llama.cpp could not create a context of {context_tokens} tokens for "
                f"{self.path} (memory?)"
            )
        self._ctx = ctx
        self._memory = lib.llama_get_memory(ctx)
        self._vocab = lib.llama_model_get_vocab(model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))
        self.context_tokens = int(lib.llama_n_ctx(ctx))
        trained = int(lib.llama_model_n_ctx_train(model))
        self.context_window = min(trained, self.context_tokens) if trained > 0 else None
        """The longest call this model serves: what it was trained for, within the pool."""
        self.num_layers = int(lib.llama_model_n_layer(model))
        self.weight_bytes = int(lib.llama_model_size(model))
        self.n_parameters = int(lib.llama_model_n_params(model))
        buffer = ctypes.create_string_buffer(256)
        lib.llama_model_desc(model, buffer, len(buffer))
        self.description = buffer.value.decode("utf-8", "replace")
        """llama.cpp's own description of the weights (architecture, size, quantization)."""
        self._free = list(range(self.max_sequences - 1, -1, -1))
        self._released: collections.deque[int] = collections.deque()
        self._batch = lib.llama_batch_init(batch_tokens, 0, 1)
        self._evictors: list[weakref.WeakMethod[Callable[[], bool]]] = []
        self._lock = threading.RLock()
        """Held around every use of the context (batch, decode, memory): runtimes that share
        this model step on threads of their own. Never held while an evictor runs, so that
        evictors (other runtimes' prefix caches, with locks of their own) cannot deadlock."""
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

    def runner(self, vocab_size: int | None = None) -> LlamaCppRunner:
        return LlamaCppRunner(self, vocab_size)

    # ------------------------------------------------------------------ sequences

    def add_evictor(self, evict: Callable[[], bool]) -> None:
        """``evict`` (a bound method: held weakly) is called when the pool has no sequence id
        or no cell left; it drops one kept prefix and returns True, or False when it holds
        none. Every runtime over this model adds its prefix cache's."""
        self._evictors.append(weakref.WeakMethod(evict))

    def _evict(self) -> bool:
        """Free one kept prefix through an evictor; False when none holds any."""
        for ref in list(self._evictors):
            evict = ref()
            if evict is None:
                self._evictors.remove(ref)
            elif evict():
                self._reap()
                return True
        return False

    def sequence(self) -> LlamaSequence:
        """A new, empty sequence (frees a kept prefix through an evictor when none is left)."""
        while True:
            self._reap()
            with self._lock:
                if self._free:
                    return LlamaSequence(self, self._free.pop())
            if not self._evict():
                msg = (
                    f"llama.cpp engine: all {self.max_sequences} sequences are in use "
                    "(raise max_sequences or lower the runtime's max_active)"
                )
                raise GenerationError(msg)

    def _copy(self, source: LlamaSequence) -> LlamaSequence:
        copy = self.sequence()
        if source.length:
            with self._lock:
                self._lib.llama_memory_seq_cp(self._memory, source.seq_id, copy.seq_id, 0, -1)
            copy.length = source.length
        return copy

    def _remove(self, seq_id: int, start: int) -> None:
        with self._lock:
            removed = self._lib.llama_memory_seq_rm(self._memory, seq_id, start, -1)
        if not removed:
            raise GenerationError(f"llama.cpp could not remove positions {start}.. of a sequence")

    def _reap(self) -> None:
        """Free the ids of sequences dropped since the last call (a sequence's ``__del__``
        only queues its id: it may run on any thread, inside any llama.cpp call)."""
        with self._lock:
            while self._released:
                seq_id = self._released.popleft()
                self._lib.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
                self._free.append(seq_id)

    # ------------------------------------------------------------------ forwards

    def decode(self, items: Sequence[tuple[LlamaSequence, Sequence[int], int]]) -> list[np.ndarray]:
        """Feed each item's tokens after its sequence, in as few ``llama_decode`` calls as the
        batch size allows; returns the logits of each item's last ``keep`` rows ``[keep, V]``.
        All or nothing: on failure every sequence is cut back to where it was."""
        self._reap()
        lengths = [seq.length for seq, _, _ in items]
        try:
            return self._decode(items)
        except BaseException:
            for (seq, _, _), length in zip(items, lengths, strict=True):
                with contextlib.suppress(GenerationError):
                    self._remove(seq.seq_id, length)
                seq.length = length
            raise

    def _decode(
        self, items: Sequence[tuple[LlamaSequence, Sequence[int], int]]
    ) -> list[np.ndarray]:
        lib, batch, vocab = self._lib, self._batch, self.vocab_size
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
                    status = lib.llama_decode(self._ctx, batch)
                    if status == 0:
                        self.decodes += 1
                        if wanted_rows:
                            pointer = lib.llama_get_logits(self._ctx)
                            shape = (len(wanted_rows), vocab)
                            logits = np.ctypeslib.as_array(pointer, shape=shape)
                            for n, (item, row) in enumerate(wanted_rows):
                                outputs[item][row] = logits[n]
                        break
                if status == 1 and self._evict():
                    continue  # a kept prefix gave its cells back: try again
                if status == 1:
                    msg = (
                        f"llama.cpp engine: no room in its KV pool of {self.context_tokens} "
                        "tokens for this forward (raise context_tokens)"
                    )
                    raise GenerationError(msg)
                raise GenerationError(f"llama_decode failed with status {status}")
            for item, fed in collections.Counter(r[0] for r in chunk).items():
                items[item][0].length += fed  # positions fed so far
        return outputs

    def close(self) -> None:
        """Free the context and the weights (the model is unusable afterwards)."""
        lib, ctx, model = self._lib, getattr(self, "_ctx", None), getattr(self, "_model", None)
        if ctx:
            lib.llama_batch_free(self._batch)
            lib.llama_free(ctx)
            self._ctx = None
        if model:
            lib.llama_model_free(model)
            self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"LlamaCppModel({self.name!r}: {self.description}, {self.threads} threads)"


class LlamaCppRunner(SettlesNothing):
    """The decoding core's runner over a ``LlamaCppModel``: forwards over new tokens after a
    sequence, returning float32 logits (``[n_kept, V]``, V the target's vocabulary). llama.cpp
    chooses its own kernels: nothing here is tuned after load, ``tune`` only times."""

    head_rows = None
    takes_trees = False
    """Token trees need a custom attention mask, which llama.cpp's batch API does not take."""

    def __init__(self, model: LlamaCppModel, vocab_size: int | None = None) -> None:
        self.model = model
        self.vocab_size = vocab_size or model.vocab_size
        self.device = torch.device("cpu")

    def speed_key(self, *parts: object) -> str:
        """The GGUF's description, size and the context's settings (``LlamaCppModel.key``)."""
        from ...machine import config_key

        return config_key(self.model.key(), *parts)

    def new_cache(self) -> LlamaSequence:
        return self.model.sequence()

    def adopt(self, cache: LlamaSequence) -> LlamaSequence:
        return cache

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


def check_vocabulary(model: LlamaCppModel, tokenizer: Any) -> None:
    """Raise ``ModelLoadError`` unless the tokenizer's ids mean what the GGUF's do: specagent
    tokenizes with the transformers tokenizer (and its chat template) and llama.cpp only sees
    ids, so one id must be one token text in both."""
    size = len(tokenizer)
    if size > model.vocab_size:
        msg = (
            f"{model.path.name}: the tokenizer has {size} tokens but the GGUF's vocabulary "
            f"{model.vocab_size}; they are not the same model's"
        )
        raise ModelLoadError(msg)
    texts = tokenizer.convert_ids_to_tokens(list(range(size)))
    differing = [
        (i, text, model.token_text(i))
        for i, text in enumerate(texts)
        if text is not None and text != model.token_text(i)
    ]
    if differing:
        sample = ", ".join(f"{i}: {a!r} vs {b!r}" for i, a, b in differing[:3])
        msg = (
            f"{model.path.name}: the tokenizer and the GGUF's vocabulary differ on "
            f"{len(differing)} of {size} ids (e.g. {sample}); load the tokenizer of this GGUF"
        )
        raise ModelLoadError(msg)
