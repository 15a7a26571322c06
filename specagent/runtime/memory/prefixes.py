"""The prefix cache: KV of earlier prompts and conversations, kept per tenant and runner, so that
the next turn of a conversation prefills only its new message. Engine-agnostic: an entry is a
copy of whatever a runner's ``new_cache`` made (``KVSequence``), taken as its engine declares
(``Runner.kept``). The decoding loop reaches it through ``decoding.parts.Prefixes``."""

from __future__ import annotations

import copy
import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from ...decoding.engine import Runner, crop_to
from ...decoding.prefix import common_prefix_length
from ...errors import GenerationError
from ...tenants import Tenant

__all__ = ["PrefixCache", "PrefixScope", "Scoped"]


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
    Memory is accounted by principal (``tenants.Tenant``): over budget, the principal holding
    the most tokens loses its least recently used entry, so one principal alone may fill the
    cache but its calls never flush a smaller principal's prefixes, however many sub-tenants
    it spreads them over (it keeps at most ``max_subtenants``; its least recently used one
    loses its entries first).

    ``min_tokens`` is the shortest prefix worth a copy. A chat template's header with a short
    system prompt (Qwen2.5's default: 24 tokens) is what unrelated calls share, and what a
    llama.cpp process reuses from its last call: on a CPU its prefill is a tenth of a short
    call's time, where a kept copy costs a sequence copy (llama.cpp) or one memory copy of
    the entry (transformers). 16 is below such headers and above the few tokens of a role
    marker that every prompt starts with (a copy taken on every call for next to nothing).

    Copies are deep: the decoding loop appends to and crops its cache in place, and a kept entry
    must never change. An engine keeps what suits it (``Runner.kept``): transformers a copy of
    the cache, llama.cpp the sequence's KV saved to host memory, outside its pool. A lock
    guards it: its worker stores and looks up while other threads may clear it.
    """

    def __init__(
        self, max_tokens: int = 65536, min_tokens: int = 16, *, max_subtenants: int = 64
    ) -> None:
        if max_tokens < 0 or min_tokens < 1:
            raise ValueError("PrefixCache needs max_tokens >= 0 and min_tokens >= 1")
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.max_subtenants = max_subtenants
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], Any] = OrderedDict()
        self._size = 0
        self._scope_sizes: Counter[Hashable] = Counter()
        """Tokens held per principal."""
        self._subtenants: dict[Hashable, OrderedDict[Hashable, None]] = {}
        self.hits = 0
        self.reused_tokens = 0
        self._lock = threading.RLock()

    def scoped(self, scope: Hashable) -> PrefixScope:
        """The view of this cache that one scope (a tenant) reads and writes."""
        return PrefixScope(self, scope)

    def lookup(self, owner: object, tokens: Sequence[int]) -> tuple[Any | None, int]:
        """A private copy of the KV of the longest kept prefix of ``tokens`` (for ``owner``), and
        its length; ``(None, 0)`` when no kept entry shares ``min_tokens`` or more."""
        with self._lock:
            return self._lookup(owner, tokens)

    def _lookup(self, owner: object, tokens: Sequence[int]) -> tuple[Any | None, int]:
        best_key, best_len = self._longest(owner, tokens)
        if best_key is None:
            return None, 0
        self._entries.move_to_end(best_key)
        try:
            cache = copy.deepcopy(self._entries[best_key])
        except GenerationError:  # no sequence or no room left in the engine for it: start cold
            return None, 0
        crop_to(cache, best_len)
        self.hits += 1
        self.reused_tokens += best_len
        return cache, best_len

    def matched(self, owner: object, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` ``lookup`` would find kept: what a drafter weighs before it
        decides to catch up (no copy made, no hit counted)."""
        with self._lock:
            return self._longest(owner, tokens)[1]

    def _longest(
        self, owner: object, tokens: Sequence[int]
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

    def store(self, owner: object, tokens: Sequence[int], cache: Any, *, copy: bool = True) -> None:
        """Keep the KV of ``tokens``, which ``cache`` holds as its first positions: a copy cut to
        them (made only when the entry is kept), or (``copy=False``, for a cache its call no
        longer uses and that holds exactly them) the cache itself."""
        if len(tokens) < self.min_tokens or len(tokens) > self.max_tokens:
            return
        with self._lock:
            self._store(owner, tuple(tokens), cache, copy)

    def _store(self, owner: object, tokens: tuple[int, ...], cache: Any, copy: bool) -> None:
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
        try:
            kept = _runner_of(owner).kept(cache, copy)
        except GenerationError:  # the engine could not copy or save it: keep none
            return
        crop_to(kept, len(tokens))  # a first forward fed more after them (the drafts)
        self._entries[key] = kept
        self._size += len(tokens)
        principal = _principal_of(owner)
        self._scope_sizes[principal] += len(tokens)
        self._seen(principal, _tenant_of(owner))
        while self._size > self.max_tokens:
            self._evict_from_largest(principal)

    def _seen(self, principal: Hashable, tenant: Hashable) -> None:
        """``tenant`` is ``principal``'s most recent sub-tenant; past ``max_subtenants`` its
        least recently used one loses its entries."""
        recent = self._subtenants.setdefault(principal, OrderedDict())
        recent[tenant] = None
        recent.move_to_end(tenant)
        while len(recent) > self.max_subtenants:
            stale = next(iter(recent))
            del recent[stale]
            for key in [k for k in self._entries if _tenant_of(k[0]) == stale]:
                self._drop(key)

    def _evict_from_largest(self, storing: Hashable = None) -> None:
        """Drop the least recently used entry of the principal that holds the most tokens (on
        a tie, the one storing now)."""
        sizes = self._scope_sizes
        largest = max(sizes, key=lambda p: (sizes[p], p == storing))
        self._drop(next(k for k in self._entries if _principal_of(k[0]) == largest))

    def _drop(self, key: tuple[Hashable, tuple[int, ...]]) -> None:
        del self._entries[key]
        self._size -= len(key[1])
        principal = _principal_of(key[0])
        self._scope_sizes[principal] -= len(key[1])
        if self._scope_sizes[principal] <= 0:
            del self._scope_sizes[principal]
            self._subtenants.pop(principal, None)

    def held(self, principal: Hashable) -> int:
        """Tokens ``principal`` holds (its sub-tenants' together)."""
        with self._lock:
            return self._scope_sizes.get(principal, 0)

    def clear(self) -> None:
        """Forget every entry (counters stay)."""
        with self._lock:
            self._entries.clear()
            self._size = 0
            self._scope_sizes.clear()
            self._subtenants.clear()

    @property
    def size(self) -> int:
        """Tokens held, over every entry."""
        return self._size

    def __len__(self) -> int:
        return len(self._entries)


class Scoped(NamedTuple):
    """An owner within a scope: what ``PrefixScope`` files its entries under."""

    scope: Hashable
    owner: object


def _runner_of(owner: object) -> Runner:
    """The runner an entry's KV is of (an owner as stored, or within a scope)."""
    runner = owner.owner if isinstance(owner, Scoped) else owner
    return runner  # type: ignore[return-value]  # the loop and the drafters store runners


def _tenant_of(owner: object) -> Hashable:
    """The scope (a tenant) an entry was stored through (unscoped owners share one)."""
    return owner.scope if isinstance(owner, Scoped) else None


def _principal_of(owner: object) -> Hashable:
    """Whose budget an entry draws on: its tenant's principal."""
    tenant = _tenant_of(owner)
    return tenant.principal if isinstance(tenant, Tenant) else tenant


class PrefixScope:
    """One scope's view of a ``PrefixCache``: lookups see only entries stored through the same
    scope. The runtime gives each call its tenant's scope."""

    def __init__(self, cache: PrefixCache, scope: Hashable) -> None:
        self.cache = cache
        self.scope = scope

    def lookup(self, owner: object, tokens: Sequence[int]) -> tuple[Any | None, int]:
        return self.cache.lookup(Scoped(self.scope, owner), tokens)

    def matched(self, owner: object, tokens: Sequence[int]) -> int:
        return self.cache.matched(Scoped(self.scope, owner), tokens)

    def store(self, owner: object, tokens: Sequence[int], cache: Any, *, copy: bool = True) -> None:
        self.cache.store(Scoped(self.scope, owner), tokens, cache, copy=copy)
