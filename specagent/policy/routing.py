"""``PolicySet``: the loaded policies, lookup by name, and routing of a call by its tags."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from ..errors import PolicyError, PolicyNotFoundError
from .schema import DraftModelConfig, Policy, PromptLookupConfig

__all__ = ["DEFAULT_POLICY_NAME", "PolicySet", "default_policy"]

DEFAULT_POLICY_NAME = "default"


def default_policy(has_draft_model: bool = False) -> Policy:
    """The built-in policy for calls that name none and match none: always lossless. It drafts
    with the draft model when the runtime has one, else with prompt lookup (free)."""
    return Policy(
        name=DEFAULT_POLICY_NAME,
        description="Built-in default: lossless, so an unrouted call is never degraded.",
        mode="lossless",
        drafter=DraftModelConfig() if has_draft_model else PromptLookupConfig(),
    )


class PolicySet:
    """An immutable set of policies with unique names, plus a lossless default.

    ``policies["legal"]`` and ``policies.get("legal")`` raise ``PolicyNotFoundError`` (listing the
    known names) for an unknown name: a misspelt policy never silently becomes another one.
    """

    def __init__(self, policies: Iterable[Policy] = (), default: Policy | None = None) -> None:
        by_name: dict[str, Policy] = {}
        for policy in policies:
            if not isinstance(policy, Policy):
                msg = f"PolicySet takes Policy objects, got {type(policy).__name__}"
                raise PolicyError(msg)
            if policy.name in by_name:
                msg = f"two policies are named {policy.name!r}; names must be unique"
                raise PolicyError(msg)
            by_name[policy.name] = policy
        self._user_policies = list(by_name.values())
        self._builtin_default = default is None and DEFAULT_POLICY_NAME not in by_name
        if default is None:
            default = by_name.get(DEFAULT_POLICY_NAME) or default_policy()
        if default.mode != "lossless":
            msg = f"the default policy must be lossless; {default.name!r} is {default.mode}"
            raise PolicyError(msg)
        by_name.setdefault(default.name, default)
        self._policies = by_name
        self.default = default

    def names(self) -> list[str]:
        """Sorted names of every policy, the default included."""
        return sorted(self._policies)

    def defined(self) -> list[Policy]:
        """The policies given to this set, without a built-in default it added."""
        return list(self._user_policies)

    def get(self, name: str) -> Policy:
        try:
            return self._policies[name]
        except KeyError:
            raise PolicyNotFoundError(name, self._policies) from None

    __getitem__ = get

    def __contains__(self, name: object) -> bool:
        return name in self._policies

    def __iter__(self) -> Iterator[Policy]:
        return iter(self._policies[name] for name in self.names())

    def __len__(self) -> int:
        return len(self._policies)

    def __repr__(self) -> str:
        return f"PolicySet({self.names()!r})"

    def route(self, tags: Sequence[str]) -> Policy:
        """The policy whose ``match.tags`` overlap ``tags`` most; ties go to a lossless policy,
        then to the first name. No overlap: the default (lossless)."""
        matched = self._matched(tags)
        return matched if matched is not None else self.default

    def _matched(self, tags: Sequence[str]) -> Policy | None:
        wanted = set(tags)
        best: tuple[int, int, str] | None = None
        chosen = None
        for policy in self._policies.values():
            overlap = len(wanted.intersection(policy.match.tags))
            if overlap == 0:
                continue
            key = (-overlap, 0 if policy.mode == "lossless" else 1, policy.name)
            if best is None or key < best:
                best, chosen = key, policy
        return chosen

    def resolve(
        self, name: str | None = None, tags: Sequence[str] = (), default: str | None = None
    ) -> Policy:
        """The one rule every front door and the runtime choose a call's policy by: an explicit
        ``name`` wins (and must exist); else the policy the ``tags`` route to; else ``default``
        (a front door's own default, which must exist), else this set's default."""
        if name is not None:
            return self.get(name)
        matched = self._matched(tags)
        if matched is not None:
            return matched
        return self.get(default) if default is not None else self.default

    def with_default(self, default: Policy) -> PolicySet:
        """A copy with ``default`` as its default, unless this set was given one of its own."""
        if not self._builtin_default:
            return self
        return PolicySet(self._user_policies, default=default)
