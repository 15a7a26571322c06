"""Per-task decoding policies: schema, YAML loading, routing."""

from .loader import load_policies, load_policy, parse_policy
from .routing import DEFAULT_POLICY_NAME, PolicySet, default_policy
from .schema import Policy

__all__ = [
    "DEFAULT_POLICY_NAME",
    "Policy",
    "PolicySet",
    "default_policy",
    "load_policies",
    "load_policy",
    "parse_policy",
]
