# -*- test-case-name: tests.test_emulator_login -*-
"""
The emulator's ChatGPT login endpoints (protocol.md 7.5): the
browser flow's authorize page and C{authorization_code} exchange, and the
device-code flow, with the shapes the Codex CLI's C{login} crate uses and
the faults an operator rehearses (denied, expired, slow poll, wrong
state). The tokens a login issues are the emulator's own
(L{relay.emulator.oauth}): a signed access token, an ID token with the
account claim, and a new single-use refresh token of the login's account.

B{Browser flow.} C{GET /oauth/authorize?...} (C{response_type=code}, the
Codex client id, a registered C{redirect_uri} --
C{http://localhost:1455/auth/callback} or C{:1457} --, an S256
C{code_challenge}, a C{state}) shows a sign-in page: one button per
emulated ChatGPT login ("Continue as <name>") and "Cancel". Either sends
the browser to the C{redirect_uri} with C{?code=...&state=...}, or
C{?error=access_denied&error_description=...&state=...}. The code lives
60 seconds, is single-use, and is bound to its challenge, redirect URI
and client: C{POST /oauth/token} with C{grant_type=authorization_code}
checks all three (C{invalid_grant} otherwise).

B{Device flow.} C{POST /api/accounts/deviceauth/usercode} (JSON
C{{"client_id"}}) answers C{{"device_auth_id", "user_code", "interval"}}
(the interval as a string, as Codex reads it; C{oauth.device_interval},
default 5). A person approves at C{GET /codex/device} (a form: the code,
the login to use, Approve / Deny) or a script does with C{POST
/_emulator/oauth/device/approve} (C{{"user_code", "account", "decision":
"allow" | "deny"}}). C{POST /api/accounts/deviceauth/token} answers 403
C{deviceauth_authorization_pending} until then, then 200
C{{"authorization_code", "code_challenge", "code_verifier"}} (the code's
C{redirect_uri} is C{<issuer>/deviceauth/callback}); a refusal is 400
C{access_denied}, an expired code (15 minutes, or the fault) 400
C{expired_token}. Polls sooner than the interval are counted
(C{early_polls}).

B{Faults} (C{PUT /_emulator/oauth/login} with C{{"fault": kind, "times":
n}}, or C{null} to clear; C{GET} shows the counters):

  - C{denied}: every sign-in or device approval is refused;
  - C{expired}: authorization codes and device codes are expired at once;
  - C{slow_poll}: device polls are answered 429 C{slow_down} (C{times} of
    them);
  - C{wrong_state}: the authorize redirect carries another C{state}.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import secrets
from typing import Any, Optional
from urllib.parse import parse_qs, urlencode

from attrs import define, field

__all__ = ["CODEX_CLIENT_ID", "LOGIN_FAULTS", "LoginFlows", "REDIRECT_URIS"]

CODEX_CLIENT_ID = "app_EMoamEEZ73f0CkXaXp7hrann"
"""The client id the emulator accepts (Codex's public one)."""

REDIRECT_URIS = ("http://localhost:1455/auth/callback", "http://localhost:1457/auth/callback")
"""The browser flow's registered redirect URIs (Codex's port and its fallback)."""

CODE_TTL_SECONDS = 60.0
DEVICE_TTL_SECONDS = 15 * 60.0

LOGIN_FAULTS = frozenset({"denied", "expired", "slow_poll", "wrong_state"})


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def s256(verifier: str) -> str:
    """
    @return: the S256 challenge of a PKCE verifier.
    """
    return _b64(hashlib.sha256(verifier.encode("ascii")).digest())


@define(eq=False)
class LoginFlows:
    """
    The emulator's login state (see the module docstring).

    @ivar authority: the L{relay.emulator.oauth.OAuthAuthority} whose
        accounts sign in and whose tokens are issued.
    @ivar interval: the device poll interval announced, seconds.
    """

    authority: Any
    interval: int = 5
    _codes: dict = field(factory=dict)
    _devices: dict = field(factory=dict)
    _byUserCode: dict = field(factory=dict)
    _fault: Optional[str] = None
    _faultTimes: Optional[int] = None
    stats: dict = field(factory=lambda: {
        "authorize": 0, "codes_issued": 0, "exchanges": 0, "exchange_failures": 0,
        "device_codes": 0, "polls": 0, "early_polls": 0, "slow_downs": 0,
    })

    @property
    def _clock(self):
        return self.authority.clock

    # -- faults ------------------------------------------------------------------------

    def setFault(self, spec: Any) -> None:
        """
        C{{"fault": kind, "times": n}} or L{None}.

        @raise ValueError: for an unknown kind.
        """
        if spec is None or (isinstance(spec, dict) and spec.get("fault") is None):
            self._fault, self._faultTimes = None, None
            return
        if not isinstance(spec, dict) or spec.get("fault") not in LOGIN_FAULTS:
            raise ValueError(f"login fault must be one of {sorted(LOGIN_FAULTS)}")
        times = spec.get("times")
        if times is not None and (not isinstance(times, int) or times < 1):
            raise ValueError("fault times must be a positive integer")
        self._fault, self._faultTimes = spec["fault"], times

    def _take(self, kind: str) -> bool:
        if self._fault != kind:
            return False
        if self._faultTimes is not None:
            self._faultTimes -= 1
            if self._faultTimes <= 0:
                self._fault, self._faultTimes = None, None
        return True

    def status(self) -> dict:
        """
        @return: the counters and the fault in force (no codes, no tokens).
        """
        return {"fault": self._fault, "times": self._faultTimes, **self.stats,
                "pending_devices": sum(1 for d in self._devices.values()
                                       if d["status"] == "pending")}

    def _names(self) -> list:
        return sorted(self.authority.accounts)

    # -- the browser flow ----------------------------------------------------------------

    def checkAuthorize(self, params: dict) -> Optional[str]:
        """
        @return: why an authorize request is malformed, or L{None}.
        """
        if params.get("response_type") != "code":
            return "response_type must be code"
        if params.get("client_id") != CODEX_CLIENT_ID:
            return "unknown client_id"
        if params.get("redirect_uri") not in REDIRECT_URIS:
            return "redirect_uri is not registered for this client"
        if params.get("code_challenge_method") != "S256" or not params.get("code_challenge"):
            return "an S256 code_challenge is required"
        if not params.get("state"):
            return "state is required"
        return None

    def authorizePage(self, params: dict) -> bytes:
        """
        The sign-in page of C{GET /oauth/authorize} (or its error page).
        """
        self.stats["authorize"] += 1
        problem = self.checkAuthorize(params)
        if problem is not None:
            return _page("Sign-in request refused", f"<p class=error>{html.escape(problem)}</p>")
        hidden = "".join(
            f'<input type=hidden name="{html.escape(k)}" value="{html.escape(v)}">'
            for k, v in sorted(params.items()))
        buttons = "".join(
            f'<button type=submit name=account value="{html.escape(n)}" class=signin>'
            f"Continue as {html.escape(n)}</button>" for n in self._names())
        body = (
            "<p>relay's bundled emulator: choose the emulated ChatGPT login to sign in"
            " with.</p>"
            f'<form method=post action="/oauth/authorize/decision">{hidden}{buttons}'
            '<button type=submit name=decision value=deny class=cancel>Cancel</button></form>'
        )
        return _page("Sign in to ChatGPT (emulator)", body)

    def decide(self, params: dict) -> tuple:
        """
        The sign-in page's answer (C{POST /oauth/authorize/decision}).

        @return: C{(302, location)} or C{(400, page bytes)}.
        """
        problem = self.checkAuthorize(params)
        if problem is not None:
            return 400, _page("Sign-in request refused", f"<p>{html.escape(problem)}</p>")
        state = params["state"]
        if self._take("wrong_state"):
            state = _b64(secrets.token_bytes(32))
        name = params.get("account")
        if params.get("decision") == "deny" or name not in self.authority.accounts or \
                self._take("denied"):
            query = {"error": "access_denied",
                     "error_description": "The user denied the sign-in request", "state": state}
            return 302, params["redirect_uri"] + "?" + urlencode(query)
        code = "ac_" + secrets.token_hex(16)
        expires = self._clock.seconds() + (0 if self._take("expired") else CODE_TTL_SECONDS)
        self._codes[code] = {"name": name, "challenge": params["code_challenge"],
                             "redirect_uri": params["redirect_uri"],
                             "client_id": params["client_id"], "expires_at": expires,
                             "used": False}
        self.stats["codes_issued"] += 1
        return 302, params["redirect_uri"] + "?" + urlencode({"code": code, "state": state})

    def accountForCode(self, params: dict) -> Optional[str]:
        """
        @return: the account name an authorization-code exchange is for.
        """
        entry = self._codes.get(params.get("code"))
        return entry["name"] if entry is not None else None

    def exchangeCode(self, params: dict) -> tuple:
        """
        C{POST /oauth/token} with C{grant_type=authorization_code}.

        @return: C{(status, body)}.
        """
        self.stats["exchanges"] += 1
        entry = self._codes.get(params.get("code"))

        def refused(description):
            self.stats["exchange_failures"] += 1
            return 400, {"error": "invalid_grant", "error_description": description}

        if entry is None:
            return refused("Invalid authorization code.")
        if entry["used"]:
            return refused("The authorization code has already been used.")
        entry["used"] = True
        if self._clock.seconds() >= entry["expires_at"]:
            return refused("The authorization code has expired.")
        if params.get("redirect_uri") != entry["redirect_uri"]:
            return refused("redirect_uri does not match the authorization request.")
        if params.get("client_id") != entry["client_id"]:
            return refused("client_id does not match the authorization request.")
        verifier = params.get("code_verifier")
        if not isinstance(verifier, str) or s256(verifier) != entry["challenge"]:
            return refused("code_verifier does not match the code_challenge.")
        return 200, self.authority.loginTokens(entry["name"])

    # -- the device flow ---------------------------------------------------------------

    def userCode(self, params: dict, issuer: str) -> tuple:
        """
        C{POST /api/accounts/deviceauth/usercode}.

        @param issuer: the emulator's base URL as the client reached it.
        @return: C{(status, body)}.
        """
        if params.get("client_id") != CODEX_CLIENT_ID:
            return 400, {"error": {"code": "invalid_client", "message": "Unknown client_id."}}
        deviceId = "deviceauth_" + secrets.token_hex(12)
        userCode = "-".join(secrets.token_hex(2).upper() for _ in range(2))
        expires = self._clock.seconds() + (0 if self._take("expired") else DEVICE_TTL_SECONDS)
        self._devices[deviceId] = {"user_code": userCode, "status": "pending", "name": None,
                                   "expires_at": expires, "last_poll": None,
                                   "issuer": issuer.rstrip("/")}
        self._byUserCode[userCode] = deviceId
        self.stats["device_codes"] += 1
        return 200, {"device_auth_id": deviceId, "user_code": userCode,
                     "interval": str(self.interval)}

    def approve(self, userCode: str, name: Optional[str], decision: str = "allow") -> tuple:
        """
        A person (the page) or a script approves or refuses a device code.

        @return: C{(ok, message)}.
        """
        deviceId = self._byUserCode.get((userCode or "").strip().upper())
        entry = self._devices.get(deviceId) if deviceId else None
        if entry is None or entry["status"] != "pending":
            return False, "That code is not pending (unknown, used, refused or expired)."
        if self._clock.seconds() >= entry["expires_at"]:
            entry["status"] = "expired"
            return False, "That code has expired."
        if decision == "deny" or self._take("denied"):
            entry["status"] = "denied"
            return True, "Sign-in refused."
        if name not in self.authority.accounts:
            return False, f"Unknown login {name!r}."
        entry.update(status="approved", name=name)
        return True, f"Device approved as {name}. You may close this page."

    def poll(self, params: dict) -> tuple:
        """
        C{POST /api/accounts/deviceauth/token}.

        @return: C{(status, body)}.
        """
        self.stats["polls"] += 1
        entry = self._devices.get(params.get("device_auth_id"))
        if entry is None or entry["user_code"] != params.get("user_code"):
            return 400, {"error": {"code": "invalid_request",
                                   "message": "Unknown device authorization."}}
        now = self._clock.seconds()
        if entry["last_poll"] is not None and now - entry["last_poll"] < self.interval - 0.05:
            self.stats["early_polls"] += 1
        entry["last_poll"] = now
        if self._take("slow_poll"):
            self.stats["slow_downs"] += 1
            return 429, {"error": {"code": "slow_down", "message": "Polling too fast."}}
        if entry["status"] == "pending" and now >= entry["expires_at"]:
            entry["status"] = "expired"
        if entry["status"] == "expired":
            return 400, {"error": {"code": "expired_token", "message": "The device code has"
                                   " expired. Please start again."}}
        if entry["status"] == "denied":
            return 400, {"error": {"code": "access_denied",
                                   "message": "The user denied the sign-in request."}}
        if entry["status"] == "used":
            return 400, {"error": {"code": "invalid_request",
                                   "message": "This device code was already used."}}
        if entry["status"] != "approved":
            return 403, {"error": {"code": "deviceauth_authorization_pending",
                                   "message": "Authorization pending."}}
        entry["status"] = "used"
        verifier = _b64(secrets.token_bytes(64))
        code = "ac_" + secrets.token_hex(16)
        self._codes[code] = {"name": entry["name"], "challenge": s256(verifier),
                             "redirect_uri": entry["issuer"] + "/deviceauth/callback",
                             "client_id": CODEX_CLIENT_ID,
                             "expires_at": now + CODE_TTL_SECONDS, "used": False}
        self.stats["codes_issued"] += 1
        return 200, {"authorization_code": code, "code_challenge": s256(verifier),
                     "code_verifier": verifier}

    def devicePage(self, message: str = "") -> bytes:
        """
        The verification page (C{GET /codex/device}).
        """
        options = "".join(f'<option value="{html.escape(n)}">{html.escape(n)}</option>'
                          for n in self._names())
        note = f"<p class=message>{html.escape(message)}</p>" if message else ""
        body = (
            f"{note}<form method=post action=/codex/device>"
            "<label>Code <input name=user_code autocomplete=off></label> "
            f"<label>Sign in as <select name=account>{options}</select></label> "
            "<button type=submit name=decision value=allow class=approve>Approve</button> "
            "<button type=submit name=decision value=deny class=deny>Deny</button></form>"
        )
        return _page("Connect a device (emulator)", body)


def parseForm(raw: bytes) -> dict:
    """
    @return: a form body's fields (first value each).
    """
    fields = parse_qs(raw.decode("utf-8", "replace"))
    return {k: v[0] for k, v in fields.items() if v}


def parseJSONObject(raw: bytes) -> dict:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _page(title: str, body: str) -> bytes:
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font:15px system-ui,sans-serif;max-width:560px;margin:40px auto}"
        "button{display:block;margin:8px 0;padding:8px 14px;font:inherit}"
        ".error{color:#b91c1c}</style></head>"
        f"<body><h1>{html.escape(title)}</h1>{body}</body></html>"
    ).encode("utf-8")
