"""Token trees: several drafts of one step verified in one target forward.

Where two drafters disagree (the draft model proposes one continuation, the history another),
a chain can carry only one of them. A tree carries both: its nodes are the union of the drafts
(a trie: a shared prefix is one node), fed to the target in one forward with an attention mask
that lets every node see the cached context and its own ancestors only, at the position its
depth gives. On a CPU whose verify curve is flat for a few rows, the second branch costs next to
nothing and wins whenever the first one is rejected early.

The lossless rule for trees is recursive rejection sampling (SpecInfer, Miao et al. 2024;
SpecTr, Sun et al. 2023): at a node whose target distribution is p, the children are *tried* in
the order their drafts were given, each try a proposal ``x ~ q`` drawn independently of the
others (a deterministic draft has q one-hot on x). A try is accepted with probability
``min(1, r(x)/q(x))`` against the current residual r (at first p); a rejection replaces r by
``norm(max(0, r - q))``, the residual of that try. The first accepted try moves the walk to its
child; when every try is rejected, the emitted token is sampled from the last residual, and at a
leaf from p. Every try is an exact speculative-sampling step for the distribution r it faces,
so the token emitted at each node is distributed exactly as p. Two drafts that propose the same
token are two tries of the same child (the second one, after the first was rejected, faces a
residual that may still hold that token).

Greedy verification walks the argmax: from the root, to the child whose token is the target's
choice, while there is one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import residual_distribution
from .proposal import DraftTree
from .sampling import sample

__all__ = ["TreeVerdict", "tree_mask", "verify_tree"]


@dataclass(frozen=True)
class TreeVerdict:
    """The outcome of verifying a tree: the accepted path, then one more token."""

    path: list[int]
    """Accepted nodes, root to leaf."""
    next_token: int
    sources: list[str]
    """The source of the try that accepted each node of ``path``."""

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def tree_mask(
    row_parents: list[int], cached: int, dtype: torch.dtype | None, width: int | None = None
) -> torch.Tensor:
    """The ``[1, 1, rows, width]`` attention mask of a tree forward (``width``: at least
    ``cached + rows``, the key length the attention sees): every row
    sees the ``cached`` positions and its own ancestors (itself included), nothing after them.
    ``dtype=None`` gives a boolean mask (True: attend), a float dtype an additive one (0 or the
    dtype's minimum)."""
    rows = len(row_parents)
    width = cached + rows if width is None else width
    if width < cached + rows:
        raise ValueError(f"a mask of width {width} cannot hold {cached} + {rows} positions")
    allowed = torch.zeros(rows, width, dtype=torch.bool)
    allowed[:, :cached] = True
    for row, parent in enumerate(row_parents):
        if parent >= row:
            raise ValueError(f"row {row}'s parent {parent} is not an earlier row")
        if parent >= 0:
            allowed[row] = allowed[parent]
        allowed[row, cached + row] = True
    allowed = allowed[None, None]
    if dtype is None:
        return allowed
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype))


def verify_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    greedy: bool,
    probs: torch.Tensor | None,
    generator: torch.Generator,
) -> TreeVerdict:
    """Walk ``tree`` with the target's rows (``logits [1 + n, V]``; ``probs``, the target's
    distributions of the same rows, when sampling) by the greedy or the lossless rule."""
    path: list[int] = []
    sources: list[str] = []
    node = -1
    if greedy:
        choice = logits.argmax(dim=-1).tolist()
        while True:
            wanted = choice[node + 1]
            step = next((t for t in tree.tries.get(node, ()) if tree.tokens[t[0]] == wanted), None)
            if step is None:
                return TreeVerdict(path, wanted, sources)
            node = step[0]
            path.append(node)
            sources.append(step[2])
    assert probs is not None
    while True:
        residual = probs[node + 1]
        chosen = None
        for child, q, source in tree.tries.get(node, ()):
            token = tree.tokens[child]
            q_x = float(q[token]) if q is not None else 1.0
            u = float(torch.rand((), generator=generator, device=generator.device))
            if u * q_x < float(residual[token]):
                chosen = (child, source)
                break
            if q is None:
                q = torch.zeros_like(residual)
                q[token] = 1.0
            residual = residual_distribution(residual, torch.minimum(q, residual))
        if chosen is None:
            return TreeVerdict(path, int(sample(residual, generator)), sources)
        node = chosen[0]
        path.append(node)
        sources.append(chosen[1])
