# -*- test-case-name: tests.test_control_logins -*-
"""
The ChatGPT login wire formats (protocol.md 7.5), as the Codex CLI's own
C{login} crate speaks them. Checked against openai/codex
C{codex-rs/login/src/} (C{pkce.rs}, C{server.rs}, C{device_code_auth.rs};
read, not copied):

  - B{PKCE}: the verifier is 64 random bytes, base64url without padding
    (86 characters); the challenge is base64url (no padding) of the
    verifier's SHA-256, method C{S256}; the C{state} is 32 random bytes,
    base64url without padding.
  - B{Authorize URL}: C{{issuer}/oauth/authorize?response_type=code
    &client_id=...&redirect_uri=http://localhost:1455/auth/callback
    &scope=...&code_challenge=...&code_challenge_method=S256
    &id_token_add_organizations=true&codex_cli_simplified_flow=true
    &state=...}, each value percent-encoded. Codex listens on 1455 (and
    falls back to 1457 when it is busy); relay cannot listen on the
    operator's machine, so the operator pastes the address the browser
    ended on. Codex's current source also asks for the scopes
    C{api.connectors.read api.connectors.invoke} and adds
    C{originator=<its originator>}; relay keeps protocol.md's scope
    C{openid profile email offline_access} (it uses no connectors) and
    sends C{originator=codex_cli_rs}, the value its other upstream calls
    send.
  - B{Callback}: Codex checks C{state} first (a mismatch is refused before
    anything else), then an C{error} (with C{error_description}; e.g.
    C{access_denied}) is a failed sign-in, then a missing C{code}.
  - B{Code exchange}: C{POST {issuer}/oauth/token}, form-encoded:
    C{grant_type=authorization_code&code=...&redirect_uri=...
    &client_id=...&code_verifier=...}; the answer's C{id_token},
    C{access_token} and C{refresh_token} are all required; an error body's
    message is C{error_description}, else C{error.message}, else the
    C{error} code. The ChatGPT account id is the id token's
    C{https://api.openai.com/auth} claim C{chatgpt_account_id}; Codex reads
    the plan (C{chatgpt_plan_type}) from the access token's claim.
  - B{Device code}: C{POST {issuer}/api/accounts/deviceauth/usercode} with
    JSON C{{"client_id"}} -> C{{"device_auth_id", "user_code" (also
    "usercode"), "interval"}}; Codex parses C{interval} from a string
    (relay takes a string or a number); a 404 means device login is not
    enabled. The person opens C{{issuer}/codex/device}. Polls: C{POST
    {issuer}/api/accounts/deviceauth/token} with JSON
    C{{"device_auth_id", "user_code"}} every C{interval} seconds; 403 and
    404 mean "not yet", 200 brings C{{"authorization_code",
    "code_challenge", "code_verifier"}}, any other status ends the login.
    The code is exchanged as above with C{redirect_uri={issuer}/deviceauth/callback}
    and the verifier the poll returned. Codex stops after 15 minutes;
    relay's pending logins last 10.

Everything here is pure (no I/O); the requests go through the account's
proxy in L{relay.control.logins.service}.
"""

from __future__ import annotations

import base64
import hashlib
import os
from typing import Optional
from urllib.parse import parse_qs, quote, urlencode, urlsplit

from attrs import frozen

__all__ = [
    "BROWSER_REDIRECT_URI", "CallbackParams", "SCOPE", "authorizeURL", "challengeOf",
    "deviceRedirectURI", "deviceTokenURL", "deviceUserCodeURL", "exchangeBody",
    "newState", "newVerifier", "parseCallback", "tokenErrorOf", "tokenURL",
    "verificationURL",
]

BROWSER_REDIRECT_URI = "http://localhost:1455/auth/callback"
"""Codex's registered redirect URI (protocol.md 7.5)."""

SCOPE = "openid profile email offline_access"
"""The scopes relay asks for (protocol.md 7.5)."""

ORIGINATOR = "codex_cli_rs"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def newVerifier() -> str:
    """
    @return: a PKCE code verifier: 64 random bytes, base64url (86 chars).
    """
    return _b64(os.urandom(64))


def challengeOf(verifier: str) -> str:
    """
    @return: the S256 code challenge of C{verifier}.
    """
    return _b64(hashlib.sha256(verifier.encode("ascii")).digest())


def newState() -> str:
    """
    @return: a C{state}: 32 random bytes, base64url (43 chars).
    """
    return _b64(os.urandom(32))


def authorizeURL(issuer: str, clientId: str, challenge: str, state: str,
                 redirectUri: str = BROWSER_REDIRECT_URI) -> str:
    """
    The browser flow's authorize URL (see the module docstring).

    @param issuer: the auth base URL, e.g. C{https://auth.openai.com}.
    """
    query = [
        ("response_type", "code"), ("client_id", clientId), ("redirect_uri", redirectUri),
        ("scope", SCOPE), ("code_challenge", challenge), ("code_challenge_method", "S256"),
        ("id_token_add_organizations", "true"), ("codex_cli_simplified_flow", "true"),
        ("state", state), ("originator", ORIGINATOR),
    ]
    return issuer.rstrip("/") + "/oauth/authorize?" + urlencode(query, quote_via=quote)


def tokenURL(issuer: str) -> str:
    """
    @return: C{{issuer}/oauth/token}.
    """
    return issuer.rstrip("/") + "/oauth/token"


def deviceUserCodeURL(issuer: str) -> str:
    """
    @return: C{{issuer}/api/accounts/deviceauth/usercode}.
    """
    return issuer.rstrip("/") + "/api/accounts/deviceauth/usercode"


def deviceTokenURL(issuer: str) -> str:
    """
    @return: C{{issuer}/api/accounts/deviceauth/token}.
    """
    return issuer.rstrip("/") + "/api/accounts/deviceauth/token"


def verificationURL(issuer: str) -> str:
    """
    @return: where the person enters the user code, C{{issuer}/codex/device}.
    """
    return issuer.rstrip("/") + "/codex/device"


def deviceRedirectURI(issuer: str) -> str:
    """
    @return: the device flow's exchange C{redirect_uri},
        C{{issuer}/deviceauth/callback}.
    """
    return issuer.rstrip("/") + "/deviceauth/callback"


def exchangeBody(code: str, verifier: str, redirectUri: str, clientId: str) -> bytes:
    """
    @return: the form-encoded authorization-code exchange body.
    """
    return urlencode([
        ("grant_type", "authorization_code"), ("code", code), ("redirect_uri", redirectUri),
        ("client_id", clientId), ("code_verifier", verifier),
    ], quote_via=quote).encode("ascii")


@frozen
class CallbackParams:
    """
    What an operator pasted back: the browser's address after the login,
    its query, or just the code.

    @ivar code: the authorization code, or L{None}.
    @ivar state: the C{state} it carried, or L{None} (only a code pasted).
    @ivar error: the C{error} it carried (e.g. C{access_denied}), or L{None}.
    @ivar description: the C{error_description}, or L{None}.
    """

    code: Optional[str] = None
    state: Optional[str] = None
    error: Optional[str] = None
    description: Optional[str] = None


def parseCallback(text: str) -> CallbackParams:
    """
    Read what the operator pasted: a URL (C{http://localhost:1455/auth/
    callback?code=...&state=...}), a query string (C{code=...&state=...}
    or C{?code=...}), or a bare code.

    @param text: the pasted text.
    @rtype: L{CallbackParams}
    """
    text = (text or "").strip()
    if not text:
        return CallbackParams()
    query = None
    if "://" in text:
        parts = urlsplit(text)
        query = parts.query or parts.fragment
    elif "=" in text:
        query = text.lstrip("?#")
    if query is None:
        return CallbackParams(code=text)
    fields = parse_qs(query, keep_blank_values=False)

    def one(name):
        values = fields.get(name)
        return values[0] if values and values[0] else None

    return CallbackParams(code=one("code"), state=one("state"), error=one("error"),
                          description=one("error_description"))


def tokenErrorOf(body: dict) -> tuple:
    """
    The code and message of a token endpoint's error answer, as Codex
    reads them.

    @return: C{(code or None, message or None)}.
    """
    error = body.get("error")
    code = error if isinstance(error, str) and error.strip() else None
    message = None
    if isinstance(error, dict):
        if isinstance(error.get("code"), str):
            code = error["code"]
        if isinstance(error.get("message"), str) and error["message"].strip():
            message = error["message"]
    description = body.get("error_description")
    if isinstance(description, str) and description.strip():
        message = description
    return code, message
