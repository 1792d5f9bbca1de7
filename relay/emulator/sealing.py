# -*- test-case-name: tests.test_emulator_responsesapi -*-
"""
Account-bound opaque content: the C{encrypted_content} of C{compaction} items and of
encrypted C{reasoning} items (protocol.md 2.3, 2.8).

Upstream encrypts these with a key of the account (organisation) that produced them; another
account cannot open them and answers 400 C{invalid_encrypted_content} (behaviour.md R7, R89).
The emulator models that with a signed token naming the producing account::

    emu1.<base64url JSON {"a": account name, "k": kind, "n": nonce}>.<16 hex HMAC digits>

Content the emulator did not seal (hand-written fixtures, e.g. C{"gAAA..."}) is accepted as it
is: only content sealed for I{another} account, or whose seal is broken, is refused.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets

PREFIX = "emu1."
"""How sealed content starts."""

_SECRET = b"relay-emulator-sealing"
"""The HMAC key (the emulator is not a security boundary; it models one)."""


def seal(account: str, kind: str) -> str:
    """
    Opaque content bound to an account.

    @param account: the producing account's name.
    @param kind: C{compaction} or C{reasoning}.
    @return: the C{encrypted_content} string.
    """
    payload = json.dumps({"a": account, "k": kind, "n": secrets.token_hex(8)},
                         separators=(",", ":")).encode()
    body = base64.urlsafe_b64encode(payload).decode().rstrip("=")
    mac = hmac.new(_SECRET, body.encode(), hashlib.sha256).hexdigest()[:16]
    return f"{PREFIX}{body}.{mac}"


def sealedFor(content: object) -> str | None:
    """
    The account a sealed content belongs to.

    @param content: an C{encrypted_content} value.
    @return: the account name; C{""} for content in the sealed form whose seal is broken;
        L{None} for content the emulator did not seal.
    """
    if not isinstance(content, str) or not content.startswith(PREFIX):
        return None
    body, _, mac = content[len(PREFIX):].rpartition(".")
    good = hmac.new(_SECRET, body.encode(), hashlib.sha256).hexdigest()[:16]
    if not body or not hmac.compare_digest(mac, good):
        return ""
    try:
        payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except ValueError:
        return ""
    account = payload.get("a") if isinstance(payload, dict) else None
    return account if isinstance(account, str) else ""


SEALED_TYPES = ("compaction", "reasoning")
"""Input item types whose C{encrypted_content} is checked."""


def foreignItem(items: list, account: str) -> dict | None:
    """
    The first input item whose sealed content belongs to another account.

    @param items: the request's input items.
    @param account: the name of the account serving the request.
    @return: the item, or L{None} when every sealed item is the account's own.
    """
    for item in items:
        if not isinstance(item, dict) or item.get("type") not in SEALED_TYPES:
            continue
        owner = sealedFor(item.get("encrypted_content"))
        if owner is not None and owner != account:
            return item
    return None


def invalidContentError(item: dict) -> dict:
    """
    The 400 error object for an item another account sealed (what upstream answers).

    @param item: the offending input item.
    """
    name = item.get("id") or item.get("type")
    return {
        "message": f"The encrypted content for item {name} could not be verified.",
        "type": "invalid_request_error",
        "code": "invalid_encrypted_content",
        "param": "input",
    }
