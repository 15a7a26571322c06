"""What a drafter hands the loop (``Proposal``: tokens, their distributions and masks, and
other drafts merged into a ``DraftTree``), and the grammar state it drafts under
(``TokenConstraint``). A leaf: it imports nothing of the decoding core, which all of it does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from .sampling import SamplingParams

__all__ = ["EMPTY", "DraftRequest", "DraftTree", "Proposal", "TokenConstraint", "row_depths"]


class DraftRequest(NamedTuple):
    """What a drafter is asked at each step (``Drafter.propose``), as one object."""

    context: list[int]
    """The call's tokens so far (prompt, output, and any tokens the grammar forces next)."""
    k: int
    """The most tokens to propose."""
    params: SamplingParams
    """How the distributions are shaped (a sampling drafter draws from them)."""
    generator: torch.Generator
    """The call's own random stream."""
    constraint: TokenConstraint | None = None
    """Under a grammar: only allowed tokens, each consumed into it (the loop rolls them
    back)."""


@dataclass(frozen=True)
class Proposal:
    """Draft tokens and, if the drafter samples, the distribution q of each ``[n, V]``.
    ``probs is None`` means the tokens were proposed deterministically (q is one-hot).
    Under a constraint, ``masks`` holds the allowed-token mask of each drafted position."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    masks: list[torch.Tensor] | None = None
    source: str = "model"
    """Where the tokens came from: ``model`` (a draft model or early exit), ``history`` (text
    already written: this call's or earlier calls'), ``grammar`` (forced by a constraint)."""
    tree: DraftTree | None = None
    """Other drafts beside these tokens, all merged into one token tree (``tree.py``; its first
    draft is this one) for the target to verify in one forward. The loop verifies ``tokens``
    alone where a tree cannot be used (a constraint, grammar-forced tokens, a relaxed rule)."""


class TokenConstraint(Protocol):
    """A grammar's state over the output so far (see ``specagent.grammar.GrammarState``)."""

    def allowed(self) -> torch.Tensor:
        """Boolean mask ``[V]`` of the tokens allowed next."""
        ...

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (may be empty), not consumed."""
        ...

    def consume(self, tokens: Sequence[int]) -> None: ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_stopped(self) -> bool: ...


EMPTY = Proposal(tokens=[])


@dataclass
class DraftTree:
    """Drafts of one step merged into a trie rooted at the step's first input (the context's
    last token, row 0 of the forward). Node ``i`` is row ``i + 1``."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    """Each node's parent node (-1: the root); always an earlier node."""
    tries: dict[int, list[tuple[int, torch.Tensor | None, str]]] = field(default_factory=dict)
    """Per node (-1: the root), its children in the order they are tried, each with the q row
    its token was drawn from (None: proposed deterministically) and its draft's source."""
    chains: list[list[int]] = field(default_factory=list)
    """Each draft as the nodes of its path, in the order the drafts were added."""
    sources: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, proposals: list[Proposal]) -> DraftTree:
        tree = cls()
        for proposal in proposals:
            tree.add(proposal)
        return tree

    def add(self, proposal: Proposal) -> int:
        """Merge ``proposal`` (a draft from the root) into the trie; returns the nodes it added."""
        before, node, path = len(self.tokens), -1, []
        for depth, token in enumerate(proposal.tokens):
            child = self._child(node, token)
            if child is None:
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
            q = proposal.probs[depth] if proposal.probs is not None else None
            self.tries.setdefault(node, []).append((child, q, proposal.source))
            path.append(child)
            node = child
        self.chains.append(path)
        self.sources.append(proposal.source)
        return len(self.tokens) - before

    def _child(self, node: int, token: int) -> int | None:
        for child, _, _ in self.tries.get(node, ()):
            if self.tokens[child] == token:
                return child
        return None

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Each row's depth below the root (the root's is 0)."""
        return row_depths(self.row_parents())

    def row_parents(self) -> list[int]:
        """Each forward row's parent row (-1 for the root row)."""
        return [-1, *(parent + 1 for parent in self.parents)]

    def accepted_of(self, chain: int, path: list[int]) -> int:
        """How many of draft ``chain``'s tokens the accepted ``path`` (nodes) took."""
        n = 0
        for mine, taken in zip(self.chains[chain], path, strict=False):
            if mine != taken:
                break
            n += 1
        return n


def row_depths(row_parents: list[int]) -> list[int]:
    """Each row's depth below the root row (its position past the cache)."""
    depths: list[int] = []
    for parent in row_parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
    return depths
