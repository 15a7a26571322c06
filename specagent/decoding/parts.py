"""What a drafter's builder is given besides its kind's settings (``drafters.base.DrafterBlock``):
the runtime's parts (its models' runners, prefix cache, costs and history). Its own module so
that drafters can name these types without importing the registry that imports them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .costs import CostModel
from .engine import Runner
from .history import SuffixIndex

__all__ = ["DraftingParts", "Prefixes"]


class Prefixes(Protocol):
    """Where a call finds and leaves KV for later calls (``PrefixCache`` or one scope of it).
    ``owner``: the runner whose KV it is (target, draft, early-exit view: their KV differ),
    itself, never its ``id`` (a runner made later could be given a freed one's)."""

    def lookup(self, owner: Runner, tokens: Sequence[int]) -> tuple[Any | None, int]:
        """A private copy of the KV of the longest kept prefix of ``tokens``, and its length."""
        ...

    def matched(self, owner: Runner, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` ``lookup`` would find kept (no copy made, nothing counted)."""
        ...

    def store(self, owner: Runner, tokens: Sequence[int], cache: Any, *, copy: bool = True) -> None:
        """Keep the KV of ``tokens``, which ``cache`` holds as its first positions (a copy cut
        to them; ``copy=False``: ``cache`` itself, which then holds exactly them)."""
        ...


@dataclass(frozen=True)
class DraftingParts:
    """What a runtime lends a builder: its models' runners and its costs."""

    target: Runner
    draft: Runner | None
    prefixes: Prefixes | None
    costs: Callable[[Runner | None], CostModel]
    """Step costs of drafting with a runner (None: a free drafter), measured or the prior."""
    shallow: Callable[[int], Runner]
    """A runner over the target's first n layers (early exit), made once per n."""
    num_layers: int
    history: Sequence[SuffixIndex] = ()
    """Earlier calls' text this call may draft from (its policy's history scope and tenant)."""
    call_end: int | None = None
    """The context length at which the call must end (prompt plus ``max_new_tokens``; None:
    unknown): a draft model weighs what catching up costs against what the call has left."""
    prediction: Sequence[int] = ()
    """The caller's predicted output (OpenAI's ``prediction``), tokenized: text-drafting kinds
    copy it where the output follows it; it never enters the prompt."""
