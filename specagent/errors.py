"""Every error specagent raises, in one tree.

::

    SpecAgentError
    ├── PolicyError                 a policy is invalid (names file, field, expectation)
    │   └── PolicyNotFoundError     a call named an unknown policy (lists the known names)
    ├── ModelLoadError              a model or tokenizer could not be loaded
    │   └── IncompatibleDraftError  the draft model cannot speculate for this target (vocabulary)
    ├── InvalidRequestError         a call's input is wrong (empty prompt, bad ids, bad lengths)
    │   ├── ModelNotFoundError      a call named a model this runtime or server does not serve
    │   └── ContextLengthError      the prompt does not fit the model's context window
    ├── RuntimeClosedError          the runtime was closed while the call waited or ran
    ├── RuntimeOverloadedError      the admission queue is full; retry later
    ├── CallTimeoutError            the call passed its deadline (``timeout``)
    ├── GenerationError             the worker failed while decoding this call (cause chained)
    │   └── IncompleteOutputError   the output ended before it parsed (a cut tool call, JSON)
    ├── EvaluationError             an eval/tune input is wrong (prompt set) or no setting fits
    └── KeyConfigError              the server's key file or ``SPECAGENT_API_KEYS`` is malformed

Errors about bad input also derive from :class:`ValueError` so that generic callers catching
``ValueError`` keep working; ``PolicyNotFoundError`` is also a :class:`LookupError`.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CallTimeoutError",
    "ContextLengthError",
    "EvaluationError",
    "GenerationError",
    "IncompatibleDraftError",
    "IncompleteOutputError",
    "InvalidRequestError",
    "KeyConfigError",
    "ModelLoadError",
    "ModelNotFoundError",
    "PolicyError",
    "PolicyNotFoundError",
    "RuntimeClosedError",
    "RuntimeOverloadedError",
    "SpecAgentError",
]


class SpecAgentError(Exception):
    """Base of every error raised by specagent."""


class PolicyError(SpecAgentError, ValueError):
    """A policy is invalid. The message names the file, the field and what was expected."""


class PolicyNotFoundError(PolicyError, LookupError):
    """A call named a policy that is not loaded."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = sorted(known)
        msg = f"no policy named {name!r}; known policies: {', '.join(self.known) or '(none)'}"
        super().__init__(msg)


class ModelLoadError(SpecAgentError):
    """A model or tokenizer could not be loaded or prepared."""


class IncompatibleDraftError(ModelLoadError, ValueError):
    """The draft model does not share the target's vocabulary, so its tokens mean other things."""


class InvalidRequestError(SpecAgentError, ValueError):
    """The call's input is wrong; nothing was run."""


class ModelNotFoundError(InvalidRequestError, LookupError):
    """A call named a model the backend does not serve (``<model>`` or ``<model>:<policy>``)."""

    def __init__(self, name: str, served: str) -> None:
        self.name = name
        self.served = served
        msg = (
            f"model {name!r} is not served here; this one is {served!r} "
            f"(or {served + ':<policy>'!r} to name a policy)"
        )
        super().__init__(msg)


class ContextLengthError(InvalidRequestError):
    """The prompt (plus what must be generated) does not fit the model's context window."""


class RuntimeClosedError(SpecAgentError, RuntimeError):
    """The runtime was closed before the call could finish."""


class RuntimeOverloadedError(SpecAgentError, RuntimeError):
    """Too many calls are waiting; the call was refused rather than queued without bound."""


class CallTimeoutError(SpecAgentError, TimeoutError):
    """The call passed its deadline (``timeout``), queueing included; it was cancelled."""


class GenerationError(SpecAgentError, RuntimeError):
    """Decoding failed for this call inside the worker; the cause is chained."""


class IncompleteOutputError(GenerationError):
    """A constrained output (a tool call, a JSON schema) ran out of tokens before the grammar
    was complete: it would not parse. ``output`` holds the text produced; raise the budget."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


class EvaluationError(SpecAgentError, ValueError):
    """``specagent eval`` / ``tune`` could not run: a prompt set is missing or malformed (the
    message names the file and line), or no setting stays within the budget."""


class KeyConfigError(SpecAgentError, ValueError):
    """The key file or ``SPECAGENT_API_KEYS`` is malformed; the message names where (never a
    key)."""
