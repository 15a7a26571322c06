"""``Call``: one call as every front door hands it to a backend (``Backend.run``) and the
runtime admits it (``runtime._admission``): built once, carried unchanged, validated once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from .chat import Prompt
    from .grammar import Constraint
    from .tenants import Tenant

__all__ = ["Call"]


@dataclass(frozen=True)
class Call:
    """What a caller asks for; None leaves a field to the call's policy. Nothing is checked
    here: admission validates the whole against the policy and the model, and names what was
    wrong (``InvalidRequestError``, ``ContextLengthError``, ``PolicyNotFoundError``)."""

    prompt: Prompt
    """Text, token ids, or chat messages (rendered by the tokenizer's chat template)."""
    policy: str | None = None
    """The policy's name (None: the one the ``tags`` route to, else the default)."""
    tags: Sequence[str] = ()
    """Routing tags (a lone string is one tag)."""
    default_policy: str | None = None
    """The policy when ``policy`` is None and the tags route to none (a front door's own
    default); None: the runtime's default. Chosen once, at admission (``PolicySet.resolve``)."""
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: Sequence[str] | None = None
    """Stop sequences (a lone string is one); None: the policy's."""
    seed: int | None = None
    logprobs: int | None = None
    """Each emitted token's log-probability under the target, with this many most likely
    alternatives (0: its own only; at most ``MAX_TOP_LOGPROBS``); None: none."""
    timeout: float | None = None
    """Seconds for the whole call, admission included."""
    tools: Sequence[Mapping[str, Any]] | None = None
    """OpenAI function tools, rendered by the chat template."""
    constraint: Constraint | None = None
    """What the output must match (``specagent.grammar``)."""
    prediction: str | Sequence[int] | None = None
    """The output's expected text (OpenAI's predicted outputs: the file being edited, the
    answer's last version), as text or token ids. It only drafts: a lossless call's output is
    the same with or without it; it is not part of the prompt."""
    tenant: str | Tenant | None = None
    """Who the call is for (a string: a principal; a ``Tenant``: a principal and a sub-tenant
    under it): a ``suffix``/``auto`` policy drafts only from that tenant's earlier calls, a
    call reuses only its tenant's kept KV, and memory is accounted per principal."""
    parent_context: Context | None = None
    """The OpenTelemetry context its span joins."""
    record: bool = True
    """Whether the runtime's audit store gets its row (a front door that records its calls
    itself passes False)."""

    def __post_init__(self) -> None:
        # A lone string is one tag or one stop sequence, never a sequence of characters.
        if isinstance(self.tags, str):
            object.__setattr__(self, "tags", (self.tags,))
        elif not isinstance(self.tags, tuple):
            object.__setattr__(self, "tags", tuple(self.tags))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None and not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
