"""KV-cache bookkeeping for target and draft models.

A call keeps one transformers ``DynamicCache`` per model. After a verification step rejects draft
tokens, the cache is cropped back to the accepted length (``crop_to``), so no step recomputes the
prefix. The helpers here also hide the one API difference that matters across transformers
versions: the cache keyword (``cache=`` in new releases, ``past_key_values=`` in older ones).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ..errors import GenerationError
from .compiled import CompiledStep, as_dynamic, ensure_room, fill_static, is_static
from .engine import ForwardRequest, Runner, advance, crop_to
from .kernels import LinearPlan, PackedWeights
from .parts import Prefixes
from .quantized import Int8Linear
from .tree import row_depths, tree_mask
from .vocab import restricted_logits

__all__ = [
    "ForwardRequest",
    "ModelRunner",
    "PrefillTwin",
    "PrefixCache",
    "PrefixScope",
    "Prefixes",
    "advance",
    "common_prefix_length",
    "crop_to",
    "early_exit_view",
    "reuse_prefix",
]


ALONE_ROWS = 32
"""A forward over this many tokens (a first step that feeds a prompt) runs alone, not in a
batch: a batch pads every call's tokens to the widest, and a prompt's width would multiply the
work of the calls' few-token verifications."""


@functools.lru_cache(maxsize=64)
def _forward_params(model_type: Any) -> frozenset[str]:
    return frozenset(inspect.signature(model_type.forward).parameters)


def cache_keyword(model_type: Any) -> str:
    """The forward keyword that takes the KV cache: ``cache`` in new transformers releases,
    ``past_key_values`` in older ones."""
    return "cache" if "cache" in _forward_params(model_type) else "past_key_values"


@dataclass(frozen=True)
class PrefillTwin:
    """A copy of a runner's model in another dtype, for its forwards over ``from_rows`` tokens
    or more: on a CPU without native bf16, a bf16 draft decodes single tokens faster than in
    float32 but prefills a prompt several times slower; with AMX, a float32 draft's single
    tokens can cost what bf16's do while its long forwards cost twice as much (``precision``).
    Its KV is cast into the runner's own cache, so every later forward continues in the model's
    dtype. Only for a draft: a draft's numbers never touch losslessness, a target's define it."""

    model: PreTrainedModel
    from_rows: int


class ModelRunner:
    """Runs one causal LM forward over new tokens with its cache, returning float32 logits.

    ``forward`` runs one call's sequence, ``forward_batch`` several at once. ``logits_to_keep``
    avoids computing the vocabulary projection for prompt positions nobody reads.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        vocab_size: int | None = None,
        kernels: LinearPlan | None = None,
        prefill_twin: PrefillTwin | None = None,
    ) -> None:
        self.model = model
        self.prefill_twin = prefill_twin
        """Where long forwards run in another dtype (``PrefillTwin``; None: all in the model's)."""
        self._dtype = next(model.parameters()).dtype
        self.kernels = kernels or LinearPlan()
        """Which linear-layer kernels this runner's forwards use (``kernels.LinearPlan``; empty:
        torch's own), for the runner's own forwards only (``LinearPlan.active``)."""
        twin = [prefill_twin.model] if prefill_twin is not None else []
        self._linears = tuple(
            m for each in [model, *twin] for m in each.modules() if type(m) is nn.Linear
        )
        """The models' linear modules, which the kernel plan reroutes (``_planned``)."""
        self.packed: PackedWeights | None = None
        """The model's weights packed for oneDNN, where the plan's ``packed_rows`` read them
        (``kernels.PackedWeights``; set by the cost measurement, None: not packed)."""
        params = _forward_params(type(model))  # type: ignore[arg-type]
        self._cache_kw = cache_keyword(type(model))
        self._has_logits_to_keep = "logits_to_keep" in params
        head = model.get_output_embeddings()
        own_vocab = int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
        self.vocab_size = vocab_size or own_vocab
        """Size of the logits this runner returns (a draft's are aligned to the target's)."""
        self.device = next(model.parameters()).device
        self._body = _decoder_body(model)
        body = self._body
        self._base_cache_kw = cache_keyword(type(body)) if body is not None else "past_key_values"
        self._gather_checked: bool | None = None
        """Whether projecting gathered hidden states equals the model's own logits (checked
        once, on the first batch; None until then)."""
        self.compiled: CompiledStep | None = None
        """The compiled single-token step over static caches, where it measured faster
        (``compiled.choose_compiled_step``); None: eager steps over dynamic caches."""
        self.head_rows: int | None = None
        """A draft's logits cover only its head's first ``head_rows`` rows, the always-kept ids
        and each request's own ids (``vocab``), projected onto those alone; -inf elsewhere
        (``use_head_rows``, ``vocab.py``). None: the whole vocabulary."""
        self._head_always = torch.tensor([], dtype=torch.long)

    def use_head_rows(self, rows: int, always: Sequence[int] = ()) -> bool:
        """Project this runner's logits onto the head's first ``rows`` rows, the ``always``
        ids (end of sequence) and each request's own ids (``vocab``). Only for a draft: a
        target's logits define the output. Kept only where the head is a plain ``nn.Linear``
        or ``Int8Linear`` over the decoder body's last hidden state (checked on a short
        forward against the model's own logits) and ``rows`` is fewer than it has; returns
        whether it was kept."""
        head = self.model.get_output_embeddings()
        if self._body is None or not isinstance(head, nn.Linear | Int8Linear):
            return False
        vocab = int(head.weight.shape[0])
        if not 0 < rows < vocab:
            return False
        ids = torch.arange(1, 9, device=self.device)[None] % vocab
        with torch.inference_mode():
            full = self.model(input_ids=ids, use_cache=False).logits[0].float()
            hidden = self._body(input_ids=ids, use_cache=False).last_hidden_state[0]
            projected = head(hidden).float()
        if not torch.allclose(projected, full, atol=1e-3, rtol=1e-3):
            return False
        self.head_rows = rows
        self._head_always = torch.tensor(
            sorted({int(i) for i in always if rows <= int(i) < vocab}), dtype=torch.long
        )
        return True

    def _restricted(
        self, head: nn.Module, hidden: torch.Tensor, pieces: list[tuple[int, torch.Tensor | None]]
    ) -> torch.Tensor:
        assert self.head_rows is not None
        return restricted_logits(head, hidden, self.head_rows, self._head_always, pieces)

    def _masked(self, logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """Full logits cut to what ``_restricted`` would cover (paths that run the whole
        head: a compiled step, a model whose gathered projection differs)."""
        if self.head_rows is None:
            return logits
        kept = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        kept[: self.head_rows] = True
        kept[self._head_always.to(logits.device)] = True
        if vocab is not None:
            kept[vocab.to(logits.device)] = True
        return logits.masked_fill(~kept, float("-inf"))

    def _planned(self) -> contextlib.AbstractContextManager[None]:
        """The context this runner's forwards run in: its kernel plan over its models' linear
        modules (a compiled step keeps the plan's ``F.linear`` mode: its graph was traced
        through it)."""
        if self.compiled is not None:
            return self.kernels.active(self.packed)
        return self.kernels.active(self.packed, self._linears)

    @property
    def takes_trees(self) -> bool:
        """Whether ``forward`` can run a token tree: the model's attention takes a custom
        mask (eager or sdpa)."""
        implementation = getattr(self.model.config, "_attn_implementation", None) or "eager"
        return implementation in ("eager", "sdpa")

    def compiler(self) -> CompiledStep:
        """A compiled single-token step for this runner's model (compiled at its first use)."""
        return CompiledStep(self.model, self._cache_kw)

    def new_cache(self) -> DynamicCache:
        """An empty cache: a static one where this runner's steps run compiled, else an
        ordinary one."""
        if self.compiled is not None:
            static = self.compiled.new_cache()
            if static is not None:
                return static  # type: ignore[return-value]
        return self._dynamic_cache()

    def _dynamic_cache(self) -> DynamicCache:
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            return DynamicCache()

    def adopt(self, cache: DynamicCache) -> DynamicCache:
        """``cache`` (a kept prefix's private copy) as the kind of cache this runner's calls
        use: copied into a static one where steps run compiled."""
        if self.compiled is None:
            return cache
        own = self.new_cache()
        if not is_static(own):
            return cache
        fill_static(own, cache)  # type: ignore[arg-type]
        return own

    @torch.inference_mode()
    def forward(
        self,
        input_ids: list[int],
        cache: DynamicCache,
        keep: int | None = None,
        tree: list[int] | None = None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Feed ``input_ids`` after what ``cache`` holds; returns logits ``[n_kept, V]``.

        ``keep`` = how many trailing positions need logits (None: all of them). ``tree``: the
        rows form a token tree, each row's parent row given (-1: the root, which follows the
        cache); each row then sees the cache and its own ancestors, at its depth's position
        (``tree.py``; all rows' logits are returned). ``vocab``: the call's own ids beyond
        ``head_rows`` (``vocab.CallVocabulary``; ignored without ``head_rows``)."""
        with self._planned():
            if tree is not None:
                return self._masked(self._tree_forward(input_ids, cache, tree), vocab)
            return self._forward(input_ids, cache, keep, vocab)

    def _tree_forward(
        self, input_ids: list[int], cache: DynamicCache, parents: list[int]
    ) -> torch.Tensor:
        if len(parents) != len(input_ids):
            raise ValueError(f"a tree of {len(input_ids)} rows needs as many parents")
        length = int(cache.get_seq_length())
        width = length + len(input_ids)
        if is_static(cache):
            ensure_room(cache, len(input_ids))  # type: ignore[arg-type]
            first: Any = cache.layers[0]
            width = max(width, first.max_cache_len)  # the attention sees every slot
        implementation = getattr(self.model.config, "_attn_implementation", None) or "eager"
        dtype = self._dtype if implementation == "eager" else None  # eager adds; sdpa selects
        mask = tree_mask(parents, length, dtype, width)
        depths = row_depths(parents)
        kwargs: dict[str, Any] = {
            self._cache_kw: cache,
            "use_cache": True,
            "attention_mask": mask.to(self.device),
            "position_ids": torch.tensor([[length + d for d in depths]], device=self.device),
            "cache_position": torch.arange(length, length + len(input_ids), device=self.device),
        }
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        return self._finished(self.model(input_ids=ids, **kwargs).logits[0])

    def _forward(
        self,
        input_ids: list[int],
        cache: DynamicCache,
        keep: int | None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        twin = self.prefill_twin
        if twin is not None and len(input_ids) >= twin.from_rows:
            return self._twin_forward(twin.model, input_ids, cache, keep, vocab)
        if is_static(cache):
            ensure_room(cache, len(input_ids))  # type: ignore[arg-type]
            if (
                self.compiled is not None
                and len(input_ids) == 1
                and keep in (None, 1)
                and self.compiled.fits(cache)
            ):
                step = self.compiled.step(input_ids[0], cache, self.device)  # type: ignore[arg-type]
                return self._finished(self._masked(step, vocab))
        return self._run(self.model, input_ids, cache, keep, vocab)

    def _run(
        self,
        model: PreTrainedModel,
        input_ids: list[int],
        cache: DynamicCache,
        keep: int | None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward of ``model`` over ``input_ids`` after ``cache``: the kept logits."""
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        body = self._body if model is self.model else _decoder_body(model)
        if self.head_rows is not None and body is not None:
            kw = {self._base_cache_kw: cache, "use_cache": True}
            hidden = body(input_ids=ids, **kw).last_hidden_state[0]
            if keep is not None:
                hidden = hidden[-keep:] if keep > 0 else hidden[:0]
            head = model.get_output_embeddings()
            return self._finished(self._restricted(head, hidden, [(hidden.shape[0], vocab)]))
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if keep is not None and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        logits = model(input_ids=ids, **kwargs).logits[0]
        if keep is not None:
            logits = logits[-keep:] if keep > 0 else logits[:0]
        return self._finished(logits)

    def _finished(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits as every caller gets them: the target's vocabulary, float32."""
        if logits.shape[-1] != self.vocab_size:
            logits = _align_vocab(logits, self.vocab_size)
        return logits.float()

    def _twin_forward(
        self,
        twin: PreTrainedModel,
        input_ids: list[int],
        cache: DynamicCache,
        keep: int | None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``_forward`` through ``twin``: the cached KV cast to its dtype, the new KV cast back
        and appended to ``cache``."""
        length = int(cache.get_seq_length())
        dtype = next(twin.parameters()).dtype
        temp = DynamicCache()
        if length:
            for index, layer in enumerate(cache.layers):
                held: Any = layer
                temp.update(
                    held.keys[:, :, :length].to(dtype), held.values[:, :, :length].to(dtype), index
                )
        logits = self._run(twin, input_ids, temp, keep, vocab)
        if is_static(cache):
            ensure_room(cache, len(input_ids))  # type: ignore[arg-type]
        for index, layer in enumerate(temp.layers):
            new: Any = layer
            cache.update(
                new.keys[:, :, length:].to(self._dtype),
                new.values[:, :, length:].to(self._dtype),
                index,
            )
        return logits

    @torch.inference_mode()
    def forward_batch(
        self,
        requests: Sequence[tuple[list[int], DynamicCache]],
        keep: Sequence[int | None] | None = None,
        vocabs: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """``forward`` for several sequences at once: one model call over all of them, each
        feeding its own tokens after its own cache. Returns each request's logits (``[n_i, V]``,
        or its last ``keep[i]`` positions) and appends each one's new KV to its cache, exactly as
        ``forward`` would.

        Caches differ in length and requests in token count: caches are left-padded and tokens
        right-padded into one batch, with an attention mask that hides the padding and position
        ids that continue each sequence where it stands. The batch cache is a temporary copy;
        each call's own cache stays the source of truth, so calls join and leave between steps
        freely. Caches with other layer types (sliding windows, quantised) run one by one.

        The vocabulary projection is the largest matrix product of a small model; it runs only
        over the positions somebody reads (``_gathered_logits``), not over the padding or the
        positions ``keep`` drops. ``vocabs``: each request's own ids (``forward``'s ``vocab``)."""
        keeps: list[int | None] = list(keep) if keep is not None else [None] * len(requests)
        call_vocabs: list[torch.Tensor | None] = (
            list(vocabs) if vocabs is not None else [None] * len(requests)
        )
        lengths = [int(cache.get_seq_length()) for _, cache in requests]
        try:
            return self._forward_batch(requests, keeps, call_vocabs)
        except BaseException:
            # All or nothing: a forward that ran before the failing one (a prompt run alone)
            # leaves no KV behind, so the caller may retry every request (the worker does, one
            # by one, to find the culprit) without feeding any of them twice.
            for (_, cache), length in zip(requests, lengths, strict=True):
                crop_to(cache, length)
            raise

    def _forward_batch(
        self,
        requests: Sequence[tuple[list[int], DynamicCache]],
        keeps: list[int | None],
        call_vocabs: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        twin = self.prefill_twin
        if len(requests) > 1:
            alone = min(ALONE_ROWS, twin.from_rows) if twin is not None else ALONE_ROWS
            long = [i for i, (tokens, _) in enumerate(requests) if len(tokens) >= alone]
            if long:  # prefills run alone (through the twin, if any); the rest as one batch
                rest = [i for i in range(len(requests)) if i not in long]
                out: dict[int, torch.Tensor] = {
                    i: self._forward(*requests[i], keeps[i], call_vocabs[i]) for i in long
                }
                if rest:
                    batched = self._forward_batch(
                        [requests[i] for i in rest],
                        [keeps[i] for i in rest],
                        [call_vocabs[i] for i in rest],
                    )
                    out.update(zip(rest, batched, strict=True))
                return [out[i] for i in range(len(requests))]
        if len(requests) == 1 or not all(_plain_layers(cache) for _, cache in requests):
            return [
                self._forward(tokens, cache, k, v)
                for (tokens, cache), k, v in zip(requests, keeps, call_vocabs, strict=True)
            ]
        lengths = [int(cache.get_seq_length()) for _, cache in requests]
        for tokens, cache in requests:
            if is_static(cache):
                ensure_room(cache, len(tokens))  # type: ignore[arg-type]
        counts = [len(tokens) for tokens, _ in requests]
        longest, widest, size = max(lengths), max(counts), len(requests)
        batch_cache = self._dynamic_cache()  # a temporary copy: never a static one
        if longest > 0:
            template = next(c for (_, c), n in zip(requests, lengths, strict=True) if n)
            for layer in range(len(template.layers)):
                ref: Any = template.layers[layer]
                # Left-padded with zeros (masked out; garbage could be NaN and spread).
                heads, key_dim, value_dim = (
                    ref.keys.shape[1],
                    ref.keys.shape[3],
                    ref.values.shape[3],
                )
                keys = ref.keys.new_zeros((size, heads, longest, key_dim))
                values = ref.values.new_zeros((size, heads, longest, value_dim))
                for i, ((_, cache), length) in enumerate(zip(requests, lengths, strict=True)):
                    if length:
                        own: Any = cache.layers[layer]
                        # A static layer's buffers run past its length: take the length.
                        keys[i, :, longest - length :] = own.keys[0, :, :length]
                        values[i, :, longest - length :] = own.values[0, :, :length]
                batch_cache.update(keys, values, layer)
        ids = torch.zeros(size, widest, dtype=torch.long)
        mask = torch.zeros(size, longest + widest, dtype=torch.long)
        positions = torch.zeros(size, widest, dtype=torch.long)
        for i, ((tokens, _), length) in enumerate(zip(requests, lengths, strict=True)):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[i, longest - length : longest + len(tokens)] = 1
            positions[i] = torch.arange(length, length + widest)
        # Rows of the flattened [size * widest] positions whose logits are read.
        wanted = [
            (i, count - min(count, k if k is not None else count), count)
            for i, (count, k) in enumerate(zip(counts, keeps, strict=True))
        ]
        inputs = {
            "input_ids": ids.to(self.device),
            "attention_mask": mask.to(self.device),
            "position_ids": positions.to(self.device),
            "use_cache": True,
        }
        with self._planned():
            all_logits = self._gathered_logits(inputs, batch_cache, wanted, widest, call_vocabs)
        results = []
        for i, ((_, cache), count) in enumerate(zip(requests, counts, strict=True)):
            results.append(self._finished(all_logits[i]))
            batch_layers: list[Any] = list(batch_cache.layers)
            for layer, batch_layer in enumerate(batch_layers):
                new = slice(longest, longest + count)
                cache.update(
                    batch_layer.keys[i : i + 1, :, new],
                    batch_layer.values[i : i + 1, :, new],
                    layer,
                )
        return results

    def _gathered_logits(
        self,
        inputs: dict[str, Any],
        batch_cache: DynamicCache,
        wanted: list[tuple[int, int, int]],
        widest: int,
        vocabs: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """Logits of positions ``start:stop`` of each row ``(row, start, stop)`` in ``wanted``.

        Runs the decoder body, gathers the wanted hidden states and projects only those. Models
        whose head is more than the output embedding (logit soft-capping, scaling) would give
        other numbers, so the first batch also runs the full model and compares; on any
        difference this runner keeps using the full model's logits. With ``head_rows``, each
        row's logits cover what its ``vocabs`` entry adds to the kept rows (``_restricted``)."""
        base = self._body
        if base is None or self._gather_checked is False:
            out = self.model(**inputs, **{self._cache_kw: batch_cache})
            return [
                self._masked(out.logits[row, start:stop], vocab)
                for (row, start, stop), vocab in zip(wanted, vocabs, strict=True)
            ]
        check = self._gather_checked is None
        reference_cache = copy.deepcopy(batch_cache) if check else None
        hidden = base(**inputs, **{self._base_cache_kw: batch_cache}).last_hidden_state
        index = torch.tensor(
            [row * widest + j for row, start, stop in wanted for j in range(start, stop)],
            dtype=torch.long,
            device=hidden.device,
        )
        head = self.model.get_output_embeddings()
        gathered = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
        counts = [stop - start for _, start, stop in wanted]
        if self.head_rows is not None and not check:
            flat = self._restricted(head, gathered, list(zip(counts, vocabs, strict=True)))
            return list(torch.split(flat, counts))
        flat = head(gathered)
        pieces = list(torch.split(flat, counts))
        if check:
            full = self.model(**inputs, **{self._cache_kw: reference_cache}).logits
            self._gather_checked = all(
                torch.allclose(piece.float(), full[row, start:stop].float(), atol=1e-3, rtol=1e-3)
                for piece, (row, start, stop) in zip(pieces, wanted, strict=True)
            )
            if not self._gather_checked:
                pieces = [full[row, start:stop] for row, start, stop in wanted]
        return [self._masked(piece, vocab) for piece, vocab in zip(pieces, vocabs, strict=True)]


def _decoder_body(model: PreTrainedModel) -> nn.Module | None:
    """The model without its LM head (``model.model`` for Llama-style models), if any."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    head = model.get_output_embeddings()
    if not isinstance(base, nn.Module) or base is model or head is None:
        return None
    return base


def _plain_layers(cache: DynamicCache) -> bool:
    layers = getattr(cache, "layers", None)
    return layers is not None and (
        is_static(cache) or all(type(layer).__name__ == "DynamicLayer" for layer in layers)
    )


def reuse_prefix(
    runner: Runner, tokens: Sequence[int], prefixes: Prefixes | None
) -> tuple[Any, int]:
    """A cache for ``runner`` holding the longest kept prefix of ``tokens`` (empty when none is
    kept), and that prefix's length. Nothing is computed: the caller feeds the rest with its
    first forward (then ``Prefixes.store`` keeps the whole for later calls)."""
    cache, reused = prefixes.lookup(id(runner), tokens) if prefixes is not None else (None, 0)
    return (runner.new_cache() if cache is None else runner.adopt(cache)), reused


def _align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Make a draft's logits cover exactly the target's vocabulary: ids the target lacks are cut,
    ids only the target has (padding rows) get -inf so the draft never proposes them."""
    n = logits.shape[-1]
    if n > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - n), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def early_exit_view(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A model that runs only the first ``num_layers`` decoder layers of ``model``, then its final
    norm and LM head. It shares every parameter with ``model`` (no second copy in memory) and
    leaves ``model`` untouched: shallow copies of the wrappers, a truncated layer list and a
    config copy that says ``num_hidden_layers = num_layers``."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    layers = getattr(base, "layers", None)
    if base is None or not isinstance(layers, nn.ModuleList):
        msg = (
            f"early_exit needs a decoder with a `{prefix}.layers` list (Llama, Qwen, Mistral); "
            f"{type(model).__name__} has none"
        )
        raise ValueError(msg)
    total = len(layers)
    if not 1 <= num_layers < total:
        msg = (
            f"early_exit layers must be between 1 and {total - 1} for this model, got {num_layers}"
        )
        raise ValueError(msg)

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]

    view_base = copy.copy(base)
    view_base._modules = dict(base._modules)
    view_base.layers = nn.ModuleList(list(layers)[:num_layers])
    view_base.config = config
    view = copy.copy(model)
    view._modules = dict(model._modules)
    setattr(view, prefix, view_base)
    view.config = config
    return view


class PrefixCache:
    """KV of recent prompts and conversations, reused across calls (bounded, least recently used
    first out).

    Agents resend the same system prompt and tool schemas on every turn, and each turn resends
    the conversation so far: the previous turn's prompt and the reply the model wrote. A call
    leaves two entries: its prompt's KV after the prefill, and, when it finishes, the KV of its
    prompt and output (the cache it decoded with, handed over without a copy). A later call
    whose prompt shares a long enough prefix with a kept entry starts from a copy of that KV,
    cropped to the shared length, and prefills only the rest: the next turn of an agent pays
    for its new message only. An entry that is a prefix of a newer one (same owner) is dropped.
    Entries are per owner: a model runner (target, draft, early-exit view: their KV differ)
    within a scope (``scoped``: one tenant's calls never start from another tenant's KV).
    Over budget, the scope holding the most tokens loses its least recently used entry: one
    tenant alone may fill the cache, but its calls never flush a smaller tenant's prefixes.

    Copies are deep: the decoding loop appends to and crops its cache in place, and a kept entry
    must never change. Its own worker uses it; an engine shared by several runtimes may ask it
    to evict from another runtime's worker thread, so a lock guards it (``evict_oldest`` never
    waits for it: two workers each evicting from the other's cache must not deadlock).
    """

    def __init__(self, max_tokens: int = 65536, min_tokens: int = 32) -> None:
        if max_tokens < 0 or min_tokens < 1:
            raise ValueError("PrefixCache needs max_tokens >= 0 and min_tokens >= 1")
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], DynamicCache] = OrderedDict()
        self._size = 0
        self._scope_sizes: Counter[Hashable] = Counter()
        self.hits = 0
        self.reused_tokens = 0
        self._lock = threading.RLock()

    def scoped(self, scope: Hashable) -> PrefixScope:
        """The view of this cache that one scope (a tenant) reads and writes."""
        return PrefixScope(self, scope)

    def lookup(self, owner: Hashable, tokens: Sequence[int]) -> tuple[DynamicCache | None, int]:
        """A private copy of the KV of the longest kept prefix of ``tokens`` (for ``owner``), and
        its length; ``(None, 0)`` when no kept entry shares ``min_tokens`` or more."""
        with self._lock:
            return self._lookup(owner, tokens)

    def _lookup(self, owner: Hashable, tokens: Sequence[int]) -> tuple[DynamicCache | None, int]:
        best_key, best_len = self._longest(owner, tokens)
        if best_key is None:
            return None, 0
        self._entries.move_to_end(best_key)
        try:
            cache = copy.deepcopy(self._entries[best_key])
        except GenerationError:  # an engine with no sequence left for the copy: start cold
            return None, 0
        crop_to(cache, best_len)
        self.hits += 1
        self.reused_tokens += best_len
        return cache, best_len

    def matched(self, owner: Hashable, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` ``lookup`` would find kept: what a drafter weighs before it
        decides to catch up (no copy made, no hit counted)."""
        with self._lock:
            return self._longest(owner, tokens)[1]

    def _longest(
        self, owner: Hashable, tokens: Sequence[int]
    ) -> tuple[tuple[Hashable, tuple[int, ...]] | None, int]:
        best_key, best_len = None, 0
        for key in self._entries:
            if key[0] != owner:
                continue
            shared = common_prefix_length(key[1], tokens)
            if shared > best_len:
                best_key, best_len = key, shared
        if best_key is None or best_len < self.min_tokens:
            return None, 0
        return best_key, best_len

    def store(
        self, owner: Hashable, tokens: Sequence[int], cache: DynamicCache, *, copy: bool = True
    ) -> None:
        """Keep the KV of ``tokens``, which ``cache`` holds as its first positions: a copy cut to
        them (made only when the entry is kept), or (``copy=False``, for a cache its call no
        longer uses and that holds exactly them) the cache itself."""
        if len(tokens) < self.min_tokens or len(tokens) > self.max_tokens:
            return
        with self._lock:
            self._store(owner, tuple(tokens), cache, copy)

    def _store(
        self, owner: Hashable, tokens: tuple[int, ...], cache: DynamicCache, copy: bool
    ) -> None:
        key = (owner, tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        covered = [
            old
            for old in self._entries
            if old[0] == owner and len(old[1]) < len(key[1]) and key[1][: len(old[1])] == old[1]
        ]
        for old in covered:  # the new entry holds all of them
            self._drop(old)
        # A static cache is kept as an ordinary one cut to its length (a copy even when
        # ``copy`` is False: its slots would hold memory for positions it never fills).
        if copy or is_static(cache):
            try:
                kept = _copied(cache)
            except GenerationError:  # an engine with no sequence left for a copy: keep none
                return
            crop_to(kept, len(tokens))  # a first forward fed more after them (the drafts)
        else:
            kept = cache
        self._entries[key] = kept
        self._size += len(tokens)
        self._scope_sizes[_scope_of(owner)] += len(tokens)
        while self._size > self.max_tokens:
            self._evict_from_largest()

    def _evict_from_largest(self) -> None:
        """Drop the least recently used entry of the scope that holds the most tokens."""
        largest = max(self._scope_sizes, key=self._scope_sizes.__getitem__)
        self._drop(next(k for k in self._entries if _scope_of(k[0]) == largest))

    def _drop(self, key: tuple[Hashable, tuple[int, ...]]) -> None:
        del self._entries[key]
        self._size -= len(key[1])
        scope = _scope_of(key[0])
        self._scope_sizes[scope] -= len(key[1])
        if self._scope_sizes[scope] <= 0:
            del self._scope_sizes[scope]

    def evict_oldest(self) -> bool:
        """Drop the largest scope's least recently used entry (an engine short of sequences or
        memory asks); False when there is none, or when another thread holds this cache now."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if not self._entries:
                return False
            self._evict_from_largest()
            return True
        finally:
            self._lock.release()

    def clear(self) -> None:
        """Forget every entry (counters stay)."""
        with self._lock:
            self._entries.clear()
            self._size = 0
            self._scope_sizes.clear()

    @property
    def size(self) -> int:
        """Tokens held, over every entry."""
        return self._size

    def __len__(self) -> int:
        return len(self._entries)


def _copied(cache: DynamicCache) -> DynamicCache:
    return as_dynamic(cache)


class Scoped(NamedTuple):
    """An owner within a scope: what ``PrefixScope`` files its entries under."""

    scope: Hashable
    owner: Hashable


def _scope_of(owner: Hashable) -> Hashable:
    """The scope whose budget an entry draws on (unscoped owners share one)."""
    return owner.scope if isinstance(owner, Scoped) else None


class PrefixScope:
    """One scope's view of a ``PrefixCache``: lookups see only entries stored through the same
    scope. The runtime gives each call its tenant's scope."""

    def __init__(self, cache: PrefixCache, scope: Hashable) -> None:
        self.cache = cache
        self.scope = scope

    def lookup(self, owner: Hashable, tokens: Sequence[int]) -> tuple[DynamicCache | None, int]:
        return self.cache.lookup(Scoped(self.scope, owner), tokens)

    def matched(self, owner: Hashable, tokens: Sequence[int]) -> int:
        return self.cache.matched(Scoped(self.scope, owner), tokens)

    def store(
        self, owner: Hashable, tokens: Sequence[int], cache: DynamicCache, *, copy: bool = True
    ) -> None:
        self.cache.store(Scoped(self.scope, owner), tokens, cache, copy=copy)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
