# -*- test-case-name: tests.test_operators -*-
"""
What a viewer (docs/security.md "Operators") sees of an admin answer: the
same JSON with every secret masked (L{masked}), applied where every admin
answer is encoded (L{relay.console.admin.respond}).

A value is masked (C{"***"}) when its field's name says it holds a secret
(L{SECRET_FIELDS}: API keys, tokens, key hints, passwords and their
hashes, client secrets, proxy credentials, ChatGPT account ids) or when
the value looks like one whatever its field (L{looksSecret}: C{sk-...}
keys, JWTs, Argon2 hashes), so a route added later leaks nothing either.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MASK", "SECRET_FIELDS", "looksSecret", "masked"]

MASK = "***"

SECRET_FIELDS = frozenset({
    "api_key", "key_value", "secret", "client_secret", "access_token", "refresh_token",
    "id_token", "token", "tokens", "password", "password_hash", "hint", "key_hint",
    "authorization", "cookie", "csrf_token", "proxy_url", "chatgpt_account_id",
    "auth_json", "code_verifier", "device_code", "user_code", "verification_uri_complete",
})
"""Field names whose values are secrets (compared lower-case)."""

_SECRETISH = re.compile(
    r"^(sk-[A-Za-z0-9_\-]{6,}|eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]+\.?.*|\$argon2.*)$")


def looksSecret(value: str) -> bool:
    """
    @return: whether a string looks like a key (C{sk-...}), a JWT or a
        password hash.
    """
    return bool(_SECRETISH.match(value))


def masked(value: Any, depth: int = 0) -> Any:
    """
    @return: a copy of the JSON value C{value} with every secret masked.
    """
    if depth > 32:
        return MASK
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if str(k).lower() in SECRET_FIELDS and v not in (None, "", False, "none", "set"):
                out[k] = MASK
            else:
                out[k] = masked(v, depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [masked(v, depth + 1) for v in value]
    if isinstance(value, str) and looksSecret(value):
        return MASK
    return value
