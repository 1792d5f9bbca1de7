# -*- test-case-name: tests.integration.test_operators_oidc -*-
"""
L{OIDCSignIn}: the console's optional OpenID Connect sign-in (config.md
C{oidc:}; docs/security.md "Signing in with OIDC"), the authorization
code flow with PKCE (RFC 7636) and a nonce:

  1. C{GET /auth/oidc/start}: reads the provider's discovery document
     (C{<issuer>/.well-known/openid-configuration}, kept
     L{DISCOVERY_SECONDS}), keeps the attempt (kind L{OIDC_LOGIN} of the
     control store, id = its C{state}, single use, L{ATTEMPT_SECONDS}) and
     redirects the browser to the C{authorization_endpoint};
  2. C{GET /auth/oidc/callback?code&state}: takes the attempt (unknown,
     used or stale: refused), redeems the code at the C{token_endpoint}
     (C{client_secret_post} when relay has a secret), and verifies the
     C{id_token} with PyJWT against the provider's C{jwks_uri} keys: its
     signature (RS256/ES256/PS256, never C{none} or an HMAC), C{iss},
     C{aud} (relay's client id), C{exp}/C{iat}, and the C{nonce};
  3. the configured C{claim} (default C{email}; an C{email} whose
     C{email_verified} is false is refused) is matched to an operator's
     C{email} (or, failing that, name): no match, no session.

Every request to the provider goes through the injected
L{relay.interfaces.IEgressClient} (bounded, timed out).
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from typing import TYPE_CHECKING, Any, Optional
from urllib.parse import urlencode

from attrs import define, field
from twisted.logger import Logger

from relay.control.store import VersionConflict

if TYPE_CHECKING:
    import jwt

__all__ = ["OIDC_LOGIN", "OIDCError", "OIDCSignIn"]

OIDC_LOGIN = "oidc_login"
"""The store kind of sign-in attempts under way."""

ATTEMPT_SECONDS = 600.0
"""How long a started sign-in may take, seconds."""

DISCOVERY_SECONDS = 3600.0
"""How long a discovery document and its keys are kept, seconds."""

TIMEOUT_SECONDS = 10.0
"""Each request to the provider, seconds."""

LEEWAY = 60.0
"""Clock skew allowed with the provider, seconds."""

ALGORITHMS = ["RS256", "RS384", "RS512", "ES256", "ES384", "PS256"]
"""The id_token signatures accepted (asymmetric only)."""


class OIDCError(Exception):
    """
    A sign-in the provider's answer does not allow; the message is one
    line for the operator (never a token).
    """


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


@define(eq=False)
class OIDCSignIn:
    """
    See the module docstring.

    @ivar settings: the L{relay.configuration.operators.OIDCSettings}.
    @ivar egress: the L{relay.interfaces.IEgressClient}.
    @ivar store: the L{relay.interfaces.IControlStore} (attempts).
    @ivar directory: the L{relay.interfaces.IOperatorDirectory}.
    @ivar clock: the injected clock.
    """

    settings: Any
    egress: Any
    store: Any
    directory: Any
    clock: Any
    _discovery: Optional[dict] = None
    _discoveredAt: float = 0.0
    _jwks: Optional[dict] = field(default=None, repr=False)
    _log = Logger()

    async def _get(self, url: str) -> dict:
        reply = await self.egress.request(None, "GET", url, {"Accept": "application/json"},
                                          None, TIMEOUT_SECONDS)
        if reply.status != 200:
            raise OIDCError(f"the OIDC provider answered {reply.status} for {url}")
        value = reply.json()
        if not value:
            raise OIDCError(f"the OIDC provider's {url} is not a JSON object")
        return value

    async def discover(self) -> dict:
        """
        @return: the provider's discovery document (cached).
        @raise OIDCError: unreachable, not JSON, or another issuer's.
        """
        now = self.clock.seconds()
        if self._discovery is None or now - self._discoveredAt > DISCOVERY_SECONDS:
            issuer = self.settings.issuer.rstrip("/")
            found = await self._get(issuer + "/.well-known/openid-configuration")
            if found.get("issuer", "").rstrip("/") != issuer:
                raise OIDCError("the OIDC discovery document names another issuer")
            for needed in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
                if not isinstance(found.get(needed), str):
                    raise OIDCError(f"the OIDC discovery document has no {needed}")
            self._discovery, self._discoveredAt, self._jwks = found, now, None
        return self._discovery

    def redirectURL(self, origin: str) -> str:
        """
        @param origin: the request's C{scheme://host[:port]}.
        @return: the callback URL relay registers (C{redirect_url}, else the
            origin's C{/auth/oidc/callback}).
        """
        return self.settings.redirect_url or origin.rstrip("/") + "/auth/oidc/callback"

    async def start(self, origin: str) -> str:
        """
        Begin a sign-in.

        @return: the provider's authorization URL to redirect the browser to.
        """
        found = await self.discover()
        state, nonce = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        verifier = secrets.token_urlsafe(48)
        redirect = self.redirectURL(origin)
        await self.store.put(OIDC_LOGIN, state, {
            "nonce": nonce, "verifier": verifier, "redirect": redirect,
            "started_at": self.clock.seconds()}, None)
        query = urlencode({
            "response_type": "code", "client_id": self.settings.client_id,
            "redirect_uri": redirect, "scope": " ".join(self.settings.scopes),
            "state": state, "nonce": nonce,
            "code_challenge": _b64(hashlib.sha256(verifier.encode("ascii")).digest()),
            "code_challenge_method": "S256"})
        endpoint = found["authorization_endpoint"]
        return endpoint + ("&" if "?" in endpoint else "?") + query

    async def _take(self, state: str) -> dict:
        if not state:
            raise OIDCError("the sign-in answer has no state")
        record = await self.store.get(OIDC_LOGIN, state)
        if record is None:
            raise OIDCError("unknown or already used sign-in (start again)")
        try:
            await self.store.delete(OIDC_LOGIN, state, record.version)
        except VersionConflict:
            raise OIDCError("this sign-in was already used (start again)") from None
        if self.clock.seconds() - record.data.get("started_at", 0) > ATTEMPT_SECONDS:
            raise OIDCError("the sign-in took too long (start again)")
        return record.data

    async def _keys(self, found: dict, refresh: bool = False) -> jwt.PyJWKSet:
        import jwt  # late, for RSS: only when someone signs in by OIDC

        if self._jwks is None or refresh:
            self._jwks = await self._get(found["jwks_uri"])
        return jwt.PyJWKSet.from_dict(self._jwks)

    async def finish(self, code: str, state: str) -> str:
        """
        Complete a sign-in.

        @return: the operator's name.
        @raise OIDCError: anything the flow refuses (see the module
            docstring).
        """
        attempt = await self._take(state)
        if not code:
            raise OIDCError("the sign-in answer has no code")
        found = await self.discover()
        form = {"grant_type": "authorization_code", "code": code,
                "redirect_uri": attempt["redirect"], "client_id": self.settings.client_id,
                "code_verifier": attempt["verifier"]}
        if self.settings.client_secret:
            form["client_secret"] = self.settings.client_secret
        reply = await self.egress.request(
            None, "POST", found["token_endpoint"],
            {"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"},
            urlencode(form).encode("ascii"), TIMEOUT_SECONDS)
        if reply.status != 200:
            raise OIDCError(f"the OIDC provider refused the code ({reply.status})")
        token = reply.json().get("id_token")
        if not isinstance(token, str):
            raise OIDCError("the OIDC provider gave no id_token")
        claims = await self._verify(token, found)
        if claims.get("nonce") != attempt["nonce"]:
            raise OIDCError("the id_token's nonce is not this sign-in's")
        claim = self.settings.claim
        value = claims.get(claim)
        if claim == "email" and claims.get("email_verified") is False:
            raise OIDCError("the provider says this e-mail address is not verified")
        name = self.directory.byEmail(value) if isinstance(value, str) else None
        if name is None:
            raise OIDCError(f"no operator matches this account's {claim}")
        return name

    async def _verify(self, token: str, found: dict) -> dict:
        import jwt  # late, for RSS: only when someone signs in by OIDC

        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise OIDCError("the id_token is not a JWT") from None
        if header.get("alg") not in ALGORITHMS:
            raise OIDCError(f"the id_token's algorithm {header.get('alg')!r} is not accepted")
        keys = await self._keys(found)
        kid = header.get("kid")
        key = _pick(keys, kid)
        if key is None:  # the provider may have rotated its keys
            key = _pick(await self._keys(found, refresh=True), kid)
        if key is None:
            raise OIDCError("the id_token's signing key is not among the provider's keys")
        try:
            claims = jwt.decode(
                token, key.key, algorithms=ALGORITHMS, audience=self.settings.client_id,
                issuer=found.get("issuer"),
                # Time is the injected clock's (checked below), not the library's.
                options={"require": ["exp", "iat", "iss", "aud", "sub"], "verify_exp": False,
                         "verify_iat": False, "verify_nbf": False})
        except jwt.PyJWTError as e:
            raise OIDCError(f"the id_token does not verify: {e}") from None
        now = self.clock.seconds()
        if not isinstance(claims.get("exp"), (int, float)) or claims["exp"] < now - LEEWAY:
            raise OIDCError("the id_token has expired")
        if isinstance(claims.get("iat"), (int, float)) and claims["iat"] > now + LEEWAY:
            raise OIDCError("the id_token was issued in the future")
        return claims


def _pick(keys, kid):
    for key in keys.keys:
        if kid is None or key.key_id == kid:
            return key
    return None
