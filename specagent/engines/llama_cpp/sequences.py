"""A llama.cpp model's contexts and sequences: one call's KV is a sequence id of a context and
how many positions it holds (``LlamaCppModel`` creates, copies and frees them); a kept prefix
is a sequence's KV saved to host memory (``KeptState``), outside the pool."""

from __future__ import annotations

import collections
import contextlib
from typing import TYPE_CHECKING, Any

import numpy as np

from ...decoding.engine import cropped_length
from ...errors import GenerationError

if TYPE_CHECKING:
    from .model import LlamaCppModel

__all__ = ["KeptState", "LlamaSequence"]


class _Context:
    """One llama context over the model's weights: its KV memory, its batch and the ids of
    its sequences. The model's shared context holds every ordinary call in one unified pool; a
    private one holds a single call (``LlamaCppModel.private_sequence``)."""

    def __init__(
        self,
        model: LlamaCppModel,
        *,
        tokens: int,
        sequences: int,
        unified: bool,
    ) -> None:
        lib = model._lib
        params = lib.llama_context_default_params()
        params.n_ctx = tokens
        params.n_batch = model.batch_tokens
        params.n_ubatch = model.batch_tokens
        params.n_seq_max = sequences
        # A verification reads every row it feeds; llama.cpp sizes outputs for >= n_seq_max.
        params.n_outputs_max = max(model.batch_tokens, sequences)
        params.n_outputs_max_per_seq = model.batch_tokens
        params.n_threads = model.threads
        params.n_threads_batch = model.threads
        params.kv_unified = unified
        params.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if model.flash_attention
            else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.no_perf = True
        ctx = lib.llama_init_from_model(model._model, params)
        if not ctx:
            raise GenerationError(
                f"llama.cpp could not create a context of {tokens} tokens for "
                f"{model.path.name} (memory?)"
            )
        self._lib = lib
        self.ctx = ctx
        self.memory = lib.llama_get_memory(ctx)
        self.tokens = int(lib.llama_n_ctx(ctx))
        self.batch = lib.llama_batch_init(model.batch_tokens, 0, 1)
        self.free = list(range(sequences - 1, -1, -1))
        self.released: collections.deque[int] = collections.deque()

    def close(self) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx:
            self._lib.llama_batch_free(self.batch)
            self._lib.llama_free(ctx)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class LlamaSequence:
    """One call's KV in a ``LlamaCppModel``: a sequence id of one of its contexts and how many
    positions it holds. It behaves as the decoding core expects of a cache: ``get_seq_length``,
    ``crop`` (a negative argument drops that many positions, as transformers' caches do) and
    ``copy.deepcopy`` (a new sequence sharing these cells)."""

    __slots__ = ("__weakref__", "_context", "_model", "length", "seq_id")

    def __init__(self, model: LlamaCppModel, context: _Context, seq_id: int) -> None:
        self._model = model
        self._context = context
        self.seq_id = seq_id
        self.length = 0

    @property
    def private(self) -> bool:
        """Whether this sequence has a context of its own (``private_sequence``)."""
        return self._context is not self._model._shared

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        keep = cropped_length(self.length, max_length)
        if keep is not None:
            self._model._remove(self, keep)
            self.length = keep

    def __deepcopy__(self, memo: dict[int, Any]) -> LlamaSequence:
        return self._model._copy(self)

    def __del__(self) -> None:
        context = getattr(self, "_context", None)
        if context is not None:
            context.released.append(self.seq_id)


class KeptState:
    """A kept prefix: the KV of a sequence's first ``length`` positions, saved to host memory
    (``LlamaCppModel.save_sequence``). It holds no cell of the pool: every forward reads the
    mask over the cells up to the highest one in use, so a prefix kept in the pool (above all
    one kept at its top) slowed every step of every call by about a third on a 2-core CPU,
    where restoring one costs milliseconds per thousand tokens.

    It behaves as a ``KVSequence`` for the prefix cache: ``get_seq_length``, ``crop`` (only the
    recorded length: positions past it are dropped once restored) and ``copy.deepcopy``, which
    restores it into a new sequence of the pool (``LlamaCppModel.restore_sequence``)."""

    __slots__ = ("_model", "data", "length", "saved")

    def __init__(self, model: LlamaCppModel, data: np.ndarray, length: int) -> None:
        self._model = model
        self.data = data
        """The saved state (llama.cpp's format, this model's layout)."""
        self.saved = length
        """Positions the saved state holds."""
        self.length = length
        """Positions a restored copy keeps (at most ``saved``)."""

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        keep = cropped_length(self.length, max_length)
        if keep is not None:
            self.length = keep

    def __deepcopy__(self, memo: dict[int, Any]) -> LlamaSequence:
        return self._model.restore_sequence(self)
