# -*- test-case-name: tests.test_control_keys -*-
"""
The secret of a client key and its digest.

A key issued through the admin API is C{sk-relay-} followed by 32 random
bytes (C{os.urandom}, base64url: 43 characters, 256 bits). relay shows it
once, in the answer that issued it, and keeps only its SHA-256 digest: a
stolen store holds no usable key, because finding a secret with a given
digest is a preimage search over 2**256 values. A slow password hash would
add nothing for a random 256-bit secret and cost every request; a keyed
hash would need a second secret kept apart from the store on every process.

Authentication hashes the presented secret once and looks the digest up
in an index (L{relay.entry.http.KeyRing}): one lookup per request. The
lookup is by digest, so what its timing could tell is about the digest of
the presented value, never about a stored secret; the match is then
confirmed with L{hmac.compare_digest}.
"""

from __future__ import annotations

import base64
import hashlib
import os

__all__ = ["KEY_PREFIX", "keyDigest", "keyHint", "newKeySecret"]

KEY_PREFIX = "sk-relay-"
"""How every key relay issues begins (clients and scanners can tell a relay
key from an OpenAI one)."""

SECRET_BYTES = 32
"""Random bytes in an issued key."""


def newKeySecret() -> str:
    """
    @return: a new key secret, C{sk-relay-} and 43 base64url characters.
    """
    raw = base64.urlsafe_b64encode(os.urandom(SECRET_BYTES)).rstrip(b"=").decode("ascii")
    return KEY_PREFIX + raw


def keyDigest(secret) -> bytes:
    """
    @param secret: a presented or issued secret (C{str} or C{bytes}).
    @return: its SHA-256 digest (32 bytes).
    """
    if isinstance(secret, str):
        secret = secret.encode("utf-8", "surrogatepass")
    return hashlib.sha256(secret).digest()


def keyHint(secret: str) -> str:
    """
    What an admin view shows of an issued key so a person can tell two
    keys apart: its prefix and its last four characters (16 bits of the
    secret's 256), e.g. C{sk-relay-…x3Qa}.
    """
    return KEY_PREFIX + "\u2026" + secret[-4:]
