# -*- test-case-name: tests.test_oauth -*-
"""
Tokens and their claims (protocol.md 7.4).

Access and ID tokens are JWTs; relay reads their claims without verifying
the signature (it is the upstream's business to verify them): C{exp} (the
expiry, Unix seconds), C{iat}, and the account claim under
C{https://api.openai.com/auth} (C{chatgpt_account_id},
C{chatgpt_plan_type}). Refresh tokens are opaque strings.

A L{TokenRecord} is what relay persists per account: the newest
L{TokenSet}, a version that increases with every write, the fingerprint of
the configured tokens that seeded this lineage (so an operator who puts a
new login into the configuration wins over the store, while the store wins
over a configuration that still holds an older, rotated token), and the
refresh state (C{ok}, C{in_doubt}, C{needs_login}), with the in-flight
marker written before a token request is sent.

A record also names (by fingerprint) the refresh tokens its lineage held
and replaced (C{retired}): a refresh token is single-use, so a
configuration, a peer process or a store that went back (a write lost at a
Redis failover) holding one of them holds a spent token, and relay never
presents it again (behaviour.md R96).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from attrs import evolve, field, frozen

AUTH_CLAIM = "https://api.openai.com/auth"
"""The JWT claim holding the ChatGPT account id and plan (protocol.md 7.2)."""

STATUS_OK = "ok"
STATUS_IN_DOUBT = "in_doubt"
STATUS_NEEDS_LOGIN = "needs_login"
STATUS_LOADING = "loading"
"""Shown by the operator view only: the record has not been read from the store yet."""

PERMANENT_CODES = (
    "refresh_token_expired",
    "refresh_token_reused",
    "refresh_token_invalidated",
    "invalid_grant",
)
"""Token endpoint error codes that need a new login (protocol.md 7.4)."""


def claims(token: Optional[str]) -> dict:
    """
    The claims of a JWT, read without verifying its signature.

    @param token: a JWT, or anything else.
    @return: the claims, or C{{}} when C{token} is not a readable JWT.
    """
    if not token or token.count(".") != 2:
        return {}
    import jwt  # late, for RSS: only with OAuth accounts (relay.process.app.checkImports)

    try:
        value = jwt.decode(
            token, options={"verify_signature": False, "verify_exp": False, "verify_aud": False}
        )
    except jwt.PyJWTError:
        return {}
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def expiresAt(token: Optional[str]) -> Optional[float]:
    """
    @return: the JWT's C{exp} (Unix seconds), or L{None}.
    """
    return _number(claims(token).get("exp"))


def issuedAt(token: Optional[str]) -> Optional[float]:
    """
    @return: the JWT's C{iat} (Unix seconds), or L{None}.
    """
    return _number(claims(token).get("iat"))


def authClaim(*tokens: Optional[str]) -> dict:
    """
    The C{https://api.openai.com/auth} claim of the first token that has
    one (access token first, then the ID token).

    @return: the claim dict, or C{{}}.
    """
    for token in tokens:
        value = claims(token).get(AUTH_CLAIM)
        if isinstance(value, dict):
            return value
    return {}


def accountIdOf(*tokens: Optional[str]) -> Optional[str]:
    """
    @return: C{chatgpt_account_id} from the tokens' account claim, or
        L{None}.
    """
    value = authClaim(*tokens).get("chatgpt_account_id")
    return str(value) if value else None


PROFILE_CLAIM = "https://api.openai.com/profile"
"""The access token's claim holding the signed-in person's C{email}."""


def emailOf(*tokens: Optional[str]) -> Optional[str]:
    """
    @return: the signed-in person's e-mail address from the first token
        that names one (an ID token's C{email}, an access token's profile
        claim), or L{None}.
    """
    for token in tokens:
        found = claims(token)
        profile = found.get(PROFILE_CLAIM)
        value = found.get("email") or (profile.get("email") if isinstance(profile, dict)
                                       else None)
        if isinstance(value, str) and value:
            return value
    return None


def planOf(*tokens: Optional[str]) -> Optional[str]:
    """
    @return: C{chatgpt_plan_type} from the tokens' account claim, or L{None}.
    """
    value = authClaim(*tokens).get("chatgpt_plan_type")
    return str(value) if value else None


def fingerprint(*secrets: Optional[str]) -> str:
    """
    A short, non-reversible fingerprint of token material, safe to store
    and show (never the secret itself).

    @return: 16 hex digits of the SHA-256 of the values.
    """
    digest = hashlib.sha256()
    for secret in secrets:
        digest.update((secret or "").encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@frozen
class TokenSet:
    """
    One account's tokens.

    @ivar access_token: the bearer for upstream requests (may be empty when
        only a refresh token is configured).
    @ivar refresh_token: the single-use refresh token, or L{None}.
    @ivar id_token: the ID token, or L{None}.
    @ivar expires_at: the access token's expiry, Unix seconds (its C{exp},
        else the token response's C{expires_in}), or L{None} when unknown.
    @ivar issued_at: when the access token was issued (C{iat}, else when
        relay received it), or L{None}.
    """

    access_token: str = field(default="", repr=False)
    refresh_token: Optional[str] = field(default=None, repr=False)
    id_token: Optional[str] = field(default=None, repr=False)
    expires_at: Optional[float] = None
    issued_at: Optional[float] = None

    @classmethod
    def fromTokens(
        cls,
        access: Optional[str],
        refresh: Optional[str],
        idToken: Optional[str] = None,
        now: Optional[float] = None,
        expiresIn: Optional[float] = None,
    ) -> "TokenSet":
        """
        Build a set, reading C{exp}/C{iat} from the access token.

        @param now: Unix seconds the tokens were received, for
            C{expiresIn} and a missing C{iat}.
        @param expiresIn: the token response's C{expires_in}, seconds.
        """
        access = access or ""
        exp = expiresAt(access)
        if exp is None and expiresIn is not None and now is not None:
            exp = now + float(expiresIn)
        iat = issuedAt(access)
        if iat is None and access:
            iat = now
        return cls(
            access_token=access, refresh_token=refresh or None, id_token=idToken or None,
            expires_at=exp, issued_at=iat,
        )

    def toJSON(self) -> dict:
        """
        @return: a JSON-able dict (with the secrets: for the store only).
        """
        return {
            "access_token": self.access_token, "refresh_token": self.refresh_token,
            "id_token": self.id_token, "expires_at": self.expires_at,
            "issued_at": self.issued_at,
        }

    @classmethod
    def fromJSON(cls, value: dict) -> "TokenSet":
        """
        The inverse of L{toJSON}.
        """
        return cls(
            access_token=str(value.get("access_token") or ""),
            refresh_token=value.get("refresh_token") or None,
            id_token=value.get("id_token") or None,
            expires_at=_number(value.get("expires_at")),
            issued_at=_number(value.get("issued_at")),
        )


RETIRED_KEEP = 32
"""How many retired refresh-token fingerprints a record keeps: the
lineage's first one and the newest others."""


def retiredAfter(retired: tuple, *refreshTokens: Optional[str]) -> tuple:
    """
    C{retired} with the fingerprints of C{refreshTokens} added (newest
    last, no duplicates), cut to L{RETIRED_KEEP} by dropping the oldest
    but the first.

    @param retired: fingerprints (L{fingerprint} of one refresh token).
    @param refreshTokens: refresh tokens that were just replaced; L{None}s
        and empty ones are skipped.
    @return: the new tuple.
    """
    out = list(retired)
    for refreshToken in refreshTokens:
        if not refreshToken:
            continue
        value = fingerprint(refreshToken)
        if value in out:
            out.remove(value)
        out.append(value)
    if len(out) > RETIRED_KEEP:
        out = out[:1] + out[len(out) - RETIRED_KEEP + 1:]
    return tuple(out)


@frozen
class TokenRecord:
    """
    What relay persists per OAuth account (see the module docstring).

    @ivar tokens: the newest L{TokenSet}.
    @ivar version: increases with every write (compare-and-set).
    @ivar seed: L{fingerprint} of the configured tokens this lineage
        descends from.
    @ivar status: C{ok}, C{in_doubt} (a refresh was in flight when its
        process died or timed out: the server may have rotated the refresh
        token, so relay never sends it again by itself) or C{needs_login}.
    @ivar reason: why the status is not C{ok} (an error code, no secrets).
    @ivar in_flight: set while a token request may be on the wire:
        C{{"owner": str, "since": seconds}}; L{None} otherwise.
    @ivar last_refresh: Unix seconds of the last successful refresh.
    @ivar failures: consecutive transient refresh failures.
    @ivar last_error: the last refresh error (short text, no secrets).
    @ivar updated_at: Unix seconds of this write.
    @ivar source: where this lineage's tokens came from when not from the
        configuration (C{admin}: C{PUT /admin/accounts/{id}/tokens}), or
        L{None} (the account's configured C{token_source}).
    @ivar retired: L{fingerprint}s of refresh tokens this record's lineage
        (and the lineages it replaced) held and replaced, oldest first
        (L{retiredAfter}); never presented again (behaviour.md R96).
    """

    tokens: TokenSet
    version: int = 0
    seed: str = ""
    status: str = STATUS_OK
    reason: Optional[str] = None
    in_flight: Optional[dict] = None
    last_refresh: Optional[float] = None
    failures: int = 0
    last_error: Optional[str] = None
    updated_at: float = 0.0
    source: Optional[str] = None
    retired: tuple = ()

    def retires(self, refreshToken: Optional[str]) -> bool:
        """
        @return: whether C{refreshToken} is one this record's lineage held
            and replaced (a spent token).
        """
        return bool(refreshToken) and fingerprint(refreshToken) in self.retired

    def knows(self, refreshToken: Optional[str]) -> bool:
        """
        @return: whether C{refreshToken} belongs to this record: its
            current refresh token or a retired one.
        """
        return bool(refreshToken) and (
            refreshToken == self.tokens.refresh_token or self.retires(refreshToken)
        )

    def next(self, now: float, **changes: Any) -> "TokenRecord":
        """
        The record's successor: C{version + 1}, C{updated_at = now}, plus
        C{changes}.
        """
        return evolve(self, version=self.version + 1, updated_at=now, **changes)

    def toJSON(self) -> str:
        """
        @return: the record as a JSON string (with secrets: for the store).
        """
        return json.dumps(
            {
                "tokens": self.tokens.toJSON(), "version": self.version, "seed": self.seed,
                "status": self.status, "reason": self.reason, "in_flight": self.in_flight,
                "last_refresh": self.last_refresh, "failures": self.failures,
                "last_error": self.last_error, "updated_at": self.updated_at,
                "source": self.source, "retired": list(self.retired),
            },
            sort_keys=True,
        )

    @classmethod
    def fromJSON(cls, raw: Any) -> Optional["TokenRecord"]:
        """
        Parse a stored record.

        @param raw: a JSON string or bytes.
        @return: the record, or L{None} when C{raw} is missing or unusable.
        """
        if raw is None:
            return None
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8")
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("tokens"), dict):
            return None
        status = value.get("status")
        if status not in (STATUS_OK, STATUS_IN_DOUBT, STATUS_NEEDS_LOGIN):
            status = STATUS_OK
        inFlight = value.get("in_flight")
        return cls(
            tokens=TokenSet.fromJSON(value["tokens"]),
            version=int(value.get("version") or 0),
            seed=str(value.get("seed") or ""),
            status=status,
            reason=value.get("reason"),
            in_flight=inFlight if isinstance(inFlight, dict) else None,
            last_refresh=_number(value.get("last_refresh")),
            failures=int(value.get("failures") or 0),
            last_error=value.get("last_error"),
            updated_at=float(value.get("updated_at") or 0.0),
            source=value.get("source") if isinstance(value.get("source"), str) else None,
            retired=tuple(
                str(v) for v in (value.get("retired") or ()) if isinstance(v, str)
            ) if isinstance(value.get("retired"), list) else (),
        )
