"""API keys from the environment and key files: parsed without ever echoing a key, one name
and one set of limits per key."""

from __future__ import annotations

import pytest

from specagent.server.keys import KeyConfigError, KeyStore, hash_key

BASE64_KEY = "c2VjcmV0LWtleS0xMjM0NTY="  # base64 with padding: contains "="


def test_a_bare_key_with_an_equals_sign_is_one_key() -> None:
    store = KeyStore.load(env=f"{BASE64_KEY},support-bot=0123456789abcdef0123")
    assert store.authenticate(BASE64_KEY) is not None
    assert store.authenticate(BASE64_KEY).name == "env-0"
    assert store.authenticate("0123456789abcdef0123").name == "support-bot"
    assert store.authenticate("c2VjcmV0LWtleS0xMjM0NTY") is None


def test_errors_never_print_any_part_of_a_key() -> None:
    secret = "s3cr3t=abc"  # too short, with an "=" that once split it into name and key
    with pytest.raises(KeyConfigError) as error:
        KeyStore.load(env=f"ok-key=0123456789abcdef,{secret}")
    message = str(error.value)
    assert "entry 2" in message
    for piece in ("s3cr3t", "abc", secret):
        assert piece not in message


def test_one_key_under_two_names_is_refused() -> None:
    key = "0123456789abcdef0123"
    with pytest.raises(KeyConfigError, match="listed as 'a' and 'b'") as error:
        KeyStore.load(env=f"a={key},b={key}")
    assert key not in str(error.value)
    assert KeyStore.load(env=f"a={key}").authenticate(key).sha256 == hash_key(key)
