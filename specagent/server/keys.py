"""API keys: who may call the server, with which policies, at what rate.

Keys are never kept in clear: a key file holds each key's SHA-256 (``specagent keys hash``
prints it), and keys from the environment are hashed as they are read. A request's key is hashed
and looked up in constant time per candidate (``hmac.compare_digest``). The server fails closed:
with no keys configured it refuses to start unless it was told, explicitly, to run without
authentication.

Key file (YAML)::

    keys:
      - name: support-bot              # also the tenant of its calls (history isolation)
        sha256: 9f86d081884c7d65...    # of the key itself
        policies: [customer-reply, default]   # may use only these ("*": any)
        requests_per_minute: 120       # optional
        max_concurrent: 8              # optional (default: the server's --max-concurrent)
        max_tokens: 1024               # optional (default: the server's --max-tokens)
        timeout_s: 60                  # optional (default: the server's --timeout)
        max_reproducible: 2            # optional: reproducible calls in flight (default 2)

``SPECAGENT_API_KEYS`` (comma-separated ``name=key`` pairs, or bare keys) adds keys that may use
every policy.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import KeyConfigError

__all__ = ["ApiKey", "KeyConfigError", "KeyStore", "hash_key"]

ENV_VAR = "SPECAGENT_API_KEYS"
MIN_KEY_CHARS = 16
_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")


def hash_key(key: str) -> str:
    """The SHA-256 hex digest a key file stores for ``key``."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ApiKey(BaseModel):
    """One key's identity and allowances."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@-]+$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    policies: tuple[str, ...] = ("*",)
    requests_per_minute: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    """The most new tokens one call may ask for (None: the server's ``--max-tokens``)."""
    timeout_s: float | None = Field(default=None, gt=0)
    """Each call's deadline in seconds (None: the server's ``--timeout``)."""
    max_reproducible: int | None = Field(default=None, ge=1)
    """Reproducible calls in flight (None: the server's ``max_reproducible``)."""

    @field_validator("policies", mode="before")
    @classmethod
    def _listed(cls, value: object) -> object:
        return (value,) if isinstance(value, str) else value

    def may_use(self, policy: str) -> bool:
        return "*" in self.policies or policy in self.policies


class _KeyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keys: list[ApiKey]


class KeyStore:
    """The keys a server accepts. ``open=True`` (``specagent serve --no-auth``) accepts any
    request as the anonymous tenant, for local development only."""

    ANONYMOUS = ApiKey(name="anonymous", sha256="0" * 64)

    def __init__(self, keys: Iterable[ApiKey] = (), open: bool = False) -> None:
        self.keys: tuple[ApiKey, ...] = tuple(keys)
        self.open = open
        if open and self.keys:
            raise KeyConfigError("an open key store (no authentication) holds no keys")
        names = [key.name for key in self.keys]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise KeyConfigError(f"API key names must be unique; repeated: {duplicated}")
        by_hash: dict[str, str] = {}
        for key in self.keys:
            if key.sha256 in by_hash:
                msg = (
                    f"the same API key is listed as {by_hash[key.sha256]!r} and {key.name!r}: "
                    "a key has one name (its tenant) and one set of limits"
                )
                raise KeyConfigError(msg)
            by_hash[key.sha256] = key.name
        if not self.keys and not open:
            msg = (
                "no API keys configured: pass --api-keys FILE or set SPECAGENT_API_KEYS "
                "(or --no-auth, for local development only)"
            )
            raise KeyConfigError(msg)

    @classmethod
    def load(
        cls, file: str | Path | None = None, env: str | None = None, open: bool = False
    ) -> KeyStore:
        """Keys from ``file`` (YAML, hashed) and the ``SPECAGENT_API_KEYS`` value ``env``
        (default: the environment's)."""
        keys: list[ApiKey] = []
        if file is not None:
            keys.extend(_read_file(Path(file)))
        raw = os.environ.get(ENV_VAR, "") if env is None else env
        keys.extend(_parse_env(raw))
        if open and keys:
            msg = (
                "--no-auth with API keys configured (a key file or SPECAGENT_API_KEYS): keys "
                "that let a wrong key in are no keys; drop --no-auth to check them, or the "
                "keys to run open (local development only)"
            )
            raise KeyConfigError(msg)
        return cls(keys, open=open)

    def authenticate(self, presented: str | None) -> ApiKey | None:
        """The key ``presented`` (a bearer token) is, or None."""
        if self.open:
            return self.ANONYMOUS
        if not presented:
            return None
        digest = hash_key(presented)
        found = None
        for key in self.keys:  # no early exit: the time taken does not depend on which matched
            if hmac.compare_digest(key.sha256, digest):
                found = key
        return found


def _read_file(path: Path) -> list[ApiKey]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KeyConfigError(f"{path}: cannot read the API key file: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise KeyConfigError(f"{path}: invalid YAML: {exc}") from exc
    try:
        return _KeyFile.model_validate(data).keys
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}" for error in exc.errors()
        )
        raise KeyConfigError(f"{path}: {problems}") from exc


def _parse_env(raw: str) -> Sequence[ApiKey]:
    """``name=key`` pairs or bare keys. An entry is a pair only when what precedes its first
    ``=`` is a valid key name and what follows is a whole key: a bare key may contain ``=``
    (base64 padding), and is then never split. Errors name the entry by position, never by
    any part of its text (which may be a key)."""
    keys = []
    for i, item in enumerate(part.strip() for part in raw.split(",")):
        if not item:
            continue
        name, sep, key = item.partition("=")
        if not (sep and _NAME.fullmatch(name) and len(key) >= MIN_KEY_CHARS):
            name, key = f"env-{i}", item
        if len(key) < MIN_KEY_CHARS:
            msg = f"{ENV_VAR}: entry {i + 1} holds a key shorter than {MIN_KEY_CHARS} characters"
            raise KeyConfigError(msg)
        keys.append(ApiKey(name=name, sha256=hash_key(key)))
    return keys
