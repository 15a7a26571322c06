"""Drafters: cheap proposers of the next k tokens, one module per kind.

One small interface (as transformers' ``CandidateGenerator``): ``propose(context, k, ...)``
returns up to k tokens and, where the drafter has one, the distribution q each was drawn from
(``base.Drafter``). A drafter object lives for one call and keeps that call's state (a draft KV
cache); ``observe`` tells it how many of its tokens were accepted. Each kind's module declares
its policy block (a ``base.DrafterBlock`` holding only the settings it reads) and ends with its
``KIND`` (``base.DrafterKind``: block, builder, cost model, what it needs), which
``decoding.registry.DRAFTERS`` lists under its name (``model_drafts``: the drafter the
model-drafting kinds share):

- ``draft_model``: a separate small model sharing the target's tokenizer;
- ``early_exit``: the target's own first layers (self-speculation);
- ``prompt_lookup``: what followed the last n-gram's latest earlier occurrence;
- ``suffix``: text already written, the call's and the history its policy may read;
- ``auto``: per step, the best of ``suffix``, ``draft_model`` and plain decoding;
- ``none``: plain decoding.
"""

from .auto import AutoDrafter
from .base import Drafter, DrafterKind, StepwiseDrafter
from .early_exit import EarlyExitDrafter
from .model_drafts import DraftModelDrafter
from .prompt_lookup import PromptLookupDrafter
from .suffix import SuffixDrafter

__all__ = [
    "AutoDrafter",
    "DraftModelDrafter",
    "Drafter",
    "DrafterKind",
    "EarlyExitDrafter",
    "PromptLookupDrafter",
    "StepwiseDrafter",
    "SuffixDrafter",
]
