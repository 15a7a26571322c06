"""specagent: speculative decoding on a local model, governed by per-task policies.

Public names only; everything else is private to its module.
"""

from ._version import __version__
from .backend import Backend
from .errors import (
    CallTimeoutError,
    ContextLengthError,
    EvaluationError,
    GenerationError,
    IncompatibleDraftError,
    IncompleteOutputError,
    InvalidRequestError,
    KeyConfigError,
    ModelLoadError,
    ModelNotFoundError,
    PolicyError,
    PolicyNotFoundError,
    RuntimeClosedError,
    RuntimeOverloadedError,
    SpecAgentError,
)
from .policy import (
    Policy,
    PolicySet,
    load_policies,
    load_policy,
    shipped_policies,
)
from .results import GenerationResult, Logprob, SpecStats, StreamChunk, Usage
from .runtime import RuntimeOptions, SpecRuntime
from .tenants import Tenant

__all__ = [
    "Backend",
    "CallTimeoutError",
    "ContextLengthError",
    "EvaluationError",
    "GenerationError",
    "GenerationResult",
    "IncompatibleDraftError",
    "IncompleteOutputError",
    "InvalidRequestError",
    "KeyConfigError",
    "Logprob",
    "ModelLoadError",
    "ModelNotFoundError",
    "Policy",
    "PolicyError",
    "PolicyNotFoundError",
    "PolicySet",
    "RuntimeClosedError",
    "RuntimeOptions",
    "RuntimeOverloadedError",
    "SpecAgentError",
    "SpecRuntime",
    "SpecStats",
    "StreamChunk",
    "Tenant",
    "Usage",
    "__version__",
    "load_policies",
    "load_policy",
    "shipped_policies",
]
