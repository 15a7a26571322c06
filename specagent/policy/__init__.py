"""Per-task decoding policies: schema, YAML loading, routing."""

from .loader import SHIPPED_POLICIES, load_policies, load_policy, parse_policy, shipped_policies
from .routing import DEFAULT_POLICY_NAME, PolicySet, default_policy
from .schema import Policy

__all__ = [
    "DEFAULT_POLICY_NAME",
    "SHIPPED_POLICIES",
    "Policy",
    "PolicySet",
    "default_policy",
    "load_policies",
    "load_policy",
    "parse_policy",
    "shipped_policies",
]
