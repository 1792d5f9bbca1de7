# -*- test-case-name: tests.test_emulator_oauth -*-
"""
The emulator's ChatGPT OAuth side (protocol.md 7.3, 7.4): the token
endpoint, short-lived JWT access tokens, single-use refresh tokens, token
endpoint faults, usage windows and C{wham/usage}.

B{Accounts.} An emulator account with C{type: oauth} has an initial
C{refresh_token}, a C{chatgpt_account_id} and a C{plan_type}. Its requests
are keyed (for scripts, faults, recordings and stats) by the canonical
credential C{oauth:<name>}, whatever access token they carry.

B{Access tokens} are HS256 JWTs signed with the emulator's secret, header
C{kid: relay-emulator}, claims C{sub}, C{iat}, C{exp} (C{iat} +
C{oauth.access_token_ttl}, default 10 days) and
C{https://api.openai.com/auth} = C{{chatgpt_account_id, chatgpt_plan_type}}.
A bearer that is such a JWT is checked: a bad signature or an unknown
account is 401 C{invalid_token}; an expired one is 401 C{token_expired}
(older tokens stay valid until their C{exp}, as upstream). Any other bearer
(an API key, a static test token) is treated as before.

B{C{POST /oauth/token}} takes JSON or form bodies
(C{grant_type=refresh_token}, C{refresh_token}, C{client_id}, C{scope}; or
C{grant_type=authorization_code} from a login, L{relay.emulator.login}).
A current refresh token is rotated: the answer is 200 C{{access_token,
refresh_token, id_token, token_type, expires_in, scope}} and the old one
is marked used. A used one is 401 C{refresh_token_reused} and counted
(C{reuse_attempts}); an unknown one is 400 C{invalid_grant}. A request that
is held or slowed rotates when it is answered, even if its client has gone
(the server processed it; the answer was lost).

B{Token faults} (C{PUT /_emulator/oauth/faults/<name or *>}, a fault, a
list or C{null}; each with optional C{times})::

    {"kind": "status", "code": 503, "body": {...}}       # answer, no rotation
    {"kind": "slow", "seconds": 2.5}                     # answer late
    {"kind": "hold"}                                     # until POST /_emulator/oauth/release
    {"kind": "reset"}                                    # drop the connection, no rotation
    {"kind": "invalid_grant"} | {"kind": "refresh_token_reused"}
    | {"kind": "refresh_token_expired"} | {"kind": "refresh_token_invalidated"}

B{Usage windows.} An account (any type) with C{usage: {primary_used_percent,
secondary_used_percent, primary_capacity_tokens, secondary_capacity_tokens,
primary_window_minutes, secondary_window_minutes}} reports used-percent
that grows with the tokens it served (base + served / capacity x 100,
capped at 100): in C{x-codex-*} headers on the OAuth-style HTTP route and
the WebSocket handshake, in a C{codex.rate_limits} event before each
WebSocket turn, and from C{GET /backend-api/wham/usage}.

B{Banked resets} (protocol.md 7.3a). C{usage: {reset_credits: N}} gives the
account N reset credits (ids C{rc-1} .. C{rc-N}). C{GET
/backend-api/wham/rate-limit-reset-credits} lists those available
(C{{"available_count", "credits": [{"id", "reset_type", "status",
"granted_at", "expires_at", "title", "description"}]}}); C{wham/usage}
carries C{rate_limit_reset_credits: {"available_count"}}. C{POST
.../rate-limit-reset-credits/consume} with C{{"redeem_request_id",
"credit_id"?}} answers C{{"code", "windows_reset"}}: C{reset} (one credit
spent; both windows start afresh at 0 %), C{nothing_to_reset} (no window
is used), C{no_credit}, or C{already_redeemed} (the same request id again;
nothing spent).

Control: C{GET /_emulator/oauth} (per account: C{token_requests},
C{refreshes}, C{reuse_attempts}, C{held}; never a token),
C{PUT|DELETE /_emulator/oauth/faults/<name>}, C{POST
/_emulator/oauth/release}.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Optional
from urllib.parse import parse_qs

import jwt
from attrs import define, field, frozen
from twisted.internet.interfaces import IReactorTime

AUTH_CLAIM = "https://api.openai.com/auth"
KID = "relay-emulator"
DEFAULT_ACCESS_TTL = 10 * 86400.0
"""An access token's lifetime by default, seconds (protocol.md 7.4: about 10 days)."""

TOKEN_FAULT_KINDS = frozenset({
    "status", "slow", "hold", "reset", "invalid_grant", "refresh_token_reused",
    "refresh_token_expired", "refresh_token_invalidated",
})

_PERMANENT_MESSAGES = {
    "refresh_token_reused": "Your refresh token has already been used to generate a new access"
    " token. Please try signing in again.",
    "refresh_token_expired": "Your refresh token has expired. Please try signing in again.",
    "refresh_token_invalidated": "Your refresh token was revoked. Please try signing in again.",
}


def canonicalKey(name: str) -> str:
    """
    @return: the credential key of an OAuth account, C{oauth:<name>}.
    """
    return "oauth:" + name


@frozen
class TokenFault:
    """
    One token endpoint fault (see the module docstring).
    """

    kind: str
    times: Optional[int] = None
    params: dict = field(factory=dict)


def parseTokenFaults(spec: Any) -> list:
    """
    Parse a token fault, a list of them, or L{None}.

    @raise ValueError: for a malformed fault.
    """
    if spec is None:
        return []
    items = spec if isinstance(spec, list) else [spec]
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError("a token fault must be a JSON object")
        params = dict(item)
        kind = params.pop("kind", None)
        if kind not in TOKEN_FAULT_KINDS:
            raise ValueError(f"unknown token fault kind {kind!r}")
        times = params.pop("times", None)
        if times is not None and (not isinstance(times, int) or times < 1):
            raise ValueError("fault times must be a positive integer")
        if kind == "status" and not isinstance(params.get("code"), int):
            raise ValueError("a status token fault needs an integer code")
        if kind == "slow" and not isinstance(params.get("seconds"), (int, float)):
            raise ValueError("a slow token fault needs seconds")
        out.append(TokenFault(kind=kind, times=times, params=params))
    return out


@define(eq=False)
class UsageModel:
    """
    One account's usage windows (see the module docstring).
    """

    primaryBase: float = 0.0
    secondaryBase: float = 0.0
    primaryCapacity: float = 0.0
    secondaryCapacity: float = 0.0
    primaryMinutes: int = 300
    secondaryMinutes: int = 10080
    served: int = 0
    start: float = 0.0
    credits: list = field(factory=list)
    """Ids of the available reset credits."""
    grantedAt: float = 0.0
    redeemed: dict = field(factory=dict)
    """redeem request id -> the consume answer it got."""

    @classmethod
    def parse(cls, spec: Any, now: float) -> "UsageModel":
        """
        @raise ValueError: for a malformed C{usage} object.
        """
        if not isinstance(spec, dict):
            raise ValueError("usage must be a mapping")
        known = {"primary_used_percent", "secondary_used_percent", "primary_capacity_tokens",
                 "secondary_capacity_tokens", "primary_window_minutes",
                 "secondary_window_minutes", "reset_credits"}
        unknown = set(spec) - known
        if unknown:
            raise ValueError(f"unknown usage keys {sorted(unknown)}")
        for key, value in spec.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"usage.{key} must be a non-negative number")
        return cls(
            primaryBase=float(spec.get("primary_used_percent", 0)),
            secondaryBase=float(spec.get("secondary_used_percent", 0)),
            primaryCapacity=float(spec.get("primary_capacity_tokens", 0)),
            secondaryCapacity=float(spec.get("secondary_capacity_tokens", 0)),
            primaryMinutes=int(spec.get("primary_window_minutes", 300)),
            secondaryMinutes=int(spec.get("secondary_window_minutes", 10080)),
            start=now,
            credits=[f"rc-{i}" for i in range(1, int(spec.get("reset_credits", 0)) + 1)],
            grantedAt=now,
        )

    def creditsBody(self) -> dict:
        """
        @return: the C{GET wham/rate-limit-reset-credits} body.
        """
        return {"available_count": len(self.credits), "credits": [
            {"id": credit, "reset_type": "rate_limit", "status": "available",
             "granted_at": int(self.grantedAt), "expires_at": int(self.grantedAt) + 30 * 86400,
             "title": "Rate limit reset", "description": "Resets your usage limits once."}
            for credit in self.credits]}

    def consume(self, requestId: str, creditId: Optional[str], now: float) -> dict:
        """
        Redeem one reset credit (see the module docstring).

        @return: the C{POST .../consume} body.
        """
        if requestId in self.redeemed:
            return {"code": "already_redeemed", "windows_reset": 0}
        if not self.credits or (creditId is not None and creditId not in self.credits):
            return {"code": "no_credit", "windows_reset": 0}
        used = [w for w in ("primary", "secondary") if self.percent(w) > 0]
        if not used:
            return {"code": "nothing_to_reset", "windows_reset": 0}
        self.credits.remove(creditId if creditId is not None else self.credits[0])
        self.primaryBase = self.secondaryBase = 0.0
        self.served = 0
        self.start = now
        answer = {"code": "reset", "windows_reset": len(used)}
        self.redeemed[requestId] = answer
        return answer

    def percent(self, window: str) -> float:
        """
        @param window: C{primary} or C{secondary}.
        @return: the used-percent, rounded to 0.1, at most 100.
        """
        base = self.primaryBase if window == "primary" else self.secondaryBase
        capacity = self.primaryCapacity if window == "primary" else self.secondaryCapacity
        grown = self.served * 100.0 / capacity if capacity > 0 else 0.0
        return round(min(100.0, base + grown), 1)

    def resetAt(self, window: str) -> int:
        minutes = self.primaryMinutes if window == "primary" else self.secondaryMinutes
        return int(self.start + minutes * 60)

    def headers(self, plan: str) -> dict:
        """
        @return: the C{x-codex-*} headers (protocol.md 7.3).
        """
        out = {"x-codex-plan-type": plan}
        for window in ("primary", "secondary"):
            minutes = self.primaryMinutes if window == "primary" else self.secondaryMinutes
            out[f"x-codex-{window}-used-percent"] = f"{self.percent(window):g}"
            out[f"x-codex-{window}-window-minutes"] = str(minutes)
            out[f"x-codex-{window}-reset-at"] = str(self.resetAt(window))
        return out

    def event(self, plan: str) -> dict:
        """
        @return: the C{codex.rate_limits} WebSocket event.
        """
        limits = {}
        for window in ("primary", "secondary"):
            limits[window] = {
                "used_percent": self.percent(window),
                "window_minutes": self.primaryMinutes if window == "primary"
                else self.secondaryMinutes,
                "reset_at": self.resetAt(window),
            }
        return {"type": "codex.rate_limits", "rate_limits": limits, "plan_type": plan,
                "credits": None}

    def wham(self, plan: str, now: float) -> dict:
        """
        @return: the C{GET /backend-api/wham/usage} body.
        """
        windows = {}
        for window in ("primary", "secondary"):
            minutes = self.primaryMinutes if window == "primary" else self.secondaryMinutes
            windows[window + "_window"] = {
                "used_percent": int(self.percent(window)),
                "limit_window_seconds": minutes * 60,
                "reset_after_seconds": max(0, int(self.resetAt(window) - now)),
                "reset_at": self.resetAt(window),
            }
        limited = any(self.percent(w) >= 100 for w in ("primary", "secondary"))
        return {"plan_type": plan, "rate_limit": dict(windows, allowed=not limited,
                                                      limit_reached=limited),
                "credits": None,
                "rate_limit_reset_credits": {"available_count": len(self.credits)}}


@define(eq=False)
class OAuthAccount:
    """
    One emulated ChatGPT login.

    @ivar refreshTokens: refresh token -> C{current} or C{used}.
    """

    name: str
    chatgptAccountId: str
    plan: str = "plus"
    refreshTokens: dict = field(factory=dict)
    tokenRequests: int = 0
    refreshes: int = 0
    reuseAttempts: int = 0

    @property
    def key(self) -> str:
        return canonicalKey(self.name)


@define(eq=False)
class OAuthAuthority:
    """
    The emulator's token issuer and usage meter.

    @ivar clock: the time source.
    @ivar accessTtl: access token lifetime, seconds.
    @ivar held: callables that answer held token requests.
    """

    clock: IReactorTime
    accessTtl: float = DEFAULT_ACCESS_TTL
    secret: bytes = field(factory=lambda: secrets.token_bytes(32), repr=False)
    accounts: dict = field(factory=dict)
    usage: dict = field(factory=dict)
    held: list = field(factory=list)
    login: Any = None
    """The browser and device login flows (L{relay.emulator.login.LoginFlows}),
    set by the emulator."""
    _byToken: dict = field(factory=dict)
    _faults: dict = field(factory=dict)

    # -- accounts and tokens ----------------------------------------------------------

    def addAccount(self, name: str, refreshToken: Optional[str], chatgptAccountId: str,
                   plan: str = "plus") -> OAuthAccount:
        """
        Configure an OAuth login; C{refreshToken} is its first refresh token.
        """
        account = OAuthAccount(name=name, chatgptAccountId=chatgptAccountId, plan=plan)
        self.accounts[name] = account
        if refreshToken:
            account.refreshTokens[refreshToken] = "current"
            self._byToken[refreshToken] = name
        return account

    def setUsage(self, key: str, spec: Any) -> None:
        """
        Configure (or with L{None} remove) the usage windows of a credential key.

        @raise ValueError: for a malformed spec.
        """
        if spec is None:
            self.usage.pop(key, None)
        else:
            self.usage[key] = UsageModel.parse(spec, self.clock.seconds())

    def mintAccessToken(self, name: str, ttl: Optional[float] = None) -> str:
        """
        A signed access token for C{name}, valid for C{ttl} seconds (default
        the configured lifetime; negative gives an expired token).
        """
        account = self.accounts[name]
        now = int(self.clock.seconds())
        claims = {
            "sub": name, "iat": now, "exp": now + int(self.accessTtl if ttl is None else ttl),
            "jti": secrets.token_hex(8),
            AUTH_CLAIM: {"chatgpt_account_id": account.chatgptAccountId,
                         "chatgpt_plan_type": account.plan},
            # As OpenAI's access tokens: the signed-in person's profile.
            "https://api.openai.com/profile": {"email": f"{account.name}@emulator.invalid",
                                               "email_verified": True},
        }
        return jwt.encode(claims, self.secret, algorithm="HS256", headers={"kid": KID})

    def _idToken(self, account: OAuthAccount) -> str:
        now = int(self.clock.seconds())
        claims = {"sub": account.name, "iat": now, "exp": now + 3600,
                  "email": f"{account.name}@emulator.invalid",
                  AUTH_CLAIM: {"chatgpt_account_id": account.chatgptAccountId,
                               "chatgpt_plan_type": account.plan}}
        return jwt.encode(claims, self.secret, algorithm="HS256", headers={"kid": KID})

    def newRefreshToken(self, name: str) -> str:
        """
        Issue another current refresh token for C{name} (a new login).
        """
        token = "rt_" + secrets.token_hex(16)
        self.accounts[name].refreshTokens[token] = "current"
        self._byToken[token] = name
        return token

    def authenticate(self, token: Optional[str]) -> tuple:
        """
        Check a bearer that may be one of our access tokens.

        @return: C{(key, None)} with the credential key to use (the
            canonical key for our tokens, else C{token} unchanged), or
            C{(key, body)} with a 401 body (C{key} is the account's key when
            the token names one of our accounts but is expired or badly
            signed, else L{None}).
        """
        if not token or token.count(".") != 2:
            return token, None
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            return token, None
        if header.get("kid") != KID:
            return token, None
        try:
            # Time claims are checked on the emulator's clock, not PyJWT's.
            claims = jwt.decode(token, self.secret, algorithms=["HS256"], options={
                "verify_aud": False, "verify_exp": False, "verify_iat": False,
                "verify_nbf": False})
            exp = claims.get("exp")
            if not isinstance(exp, (int, float)) or exp <= self.clock.seconds():
                raise jwt.ExpiredSignatureError("expired")
        except jwt.ExpiredSignatureError:
            name = claims.get("sub")
            key = canonicalKey(name) if name in self.accounts else None
            return key, _authError("Provided authentication token is expired. Please try"
                                   " signing in again.", "token_expired")
        except jwt.PyJWTError:
            try:
                name = jwt.decode(token, options={"verify_signature": False}).get("sub")
            except jwt.PyJWTError:
                name = None
            key = canonicalKey(name) if name in self.accounts else None
            return key, _authError("Could not validate your authentication token.",
                                   "invalid_token")
        name = claims.get("sub")
        if name not in self.accounts:
            return None, _authError("Unknown account.", "invalid_token")
        return canonicalKey(name), None

    # -- faults --------------------------------------------------------------------------

    def setFault(self, name: str, spec: Any) -> None:
        """
        Replace the token faults of an account name (or C{*}); L{None} clears.

        @raise ValueError: for a malformed fault.
        """
        faults = parseTokenFaults(spec)
        if faults:
            self._faults[name] = faults
        else:
            self._faults.pop(name, None)

    def takeFault(self, name: Optional[str]) -> Optional[TokenFault]:
        key = name if name in self._faults else "*"
        faults = self._faults.get(key)
        if not faults:
            return None
        fault = faults[0]
        if fault.times is not None:
            if fault.times <= 1:
                faults.pop(0)
                if not faults:
                    del self._faults[key]
            else:
                faults[0] = TokenFault(fault.kind, fault.times - 1, fault.params)
        return fault

    def release(self) -> int:
        """
        Answer every held token request (rotating as usual).

        @return: how many were released.
        """
        held, self.held = self.held, []
        for answer in held:
            answer()
        return len(held)

    # -- the token endpoint ---------------------------------------------------------------

    @staticmethod
    def parseRequest(raw: bytes, contentType: str) -> dict:
        """
        The token request's fields from a JSON or form body.
        """
        if "json" in (contentType or "").lower() or raw.lstrip().startswith(b"{"):
            try:
                value = json.loads(raw or b"{}")
            except ValueError:
                return {}
            return value if isinstance(value, dict) else {}
        fields = parse_qs(raw.decode("utf-8", "replace"))
        return {k: v[0] for k, v in fields.items() if v}

    def accountFor(self, params: dict) -> Optional[str]:
        """
        @return: the account name a token request's refresh token (or, for
            C{grant_type=authorization_code}, its code) belongs to.
        """
        if params.get("grant_type") == "authorization_code" and self.login is not None:
            return self.login.accountForCode(params)
        token = params.get("refresh_token")
        return self._byToken.get(token) if isinstance(token, str) else None

    def loginTokens(self, name: str) -> dict:
        """
        The tokens of a new login of C{name}: an access token,
        an ID token with the account claim, and a new current refresh token.
        """
        account = self.accounts[name]
        return {
            "access_token": self.mintAccessToken(name),
            "refresh_token": self.newRefreshToken(name),
            "id_token": self._idToken(account),
            "token_type": "Bearer",
            "expires_in": int(self.accessTtl),
            "scope": "openid profile email offline_access",
        }

    def exchange(self, params: dict) -> tuple:
        """
        Process a refresh (rotation happens here).

        @return: C{(status, body)}.
        """
        if params.get("grant_type") == "authorization_code" and self.login is not None:
            return self.login.exchangeCode(params)
        if params.get("grant_type") != "refresh_token":
            return 400, {"error": "unsupported_grant_type",
                         "error_description": "grant_type must be refresh_token or"
                         " authorization_code"}
        token = params.get("refresh_token")
        name = self._byToken.get(token) if isinstance(token, str) else None
        if name is None:
            return 400, {"error": "invalid_grant",
                         "error_description": "Invalid refresh token."}
        account = self.accounts[name]
        if account.refreshTokens.get(token) != "current":
            account.reuseAttempts += 1
            return 401, permanentError("refresh_token_reused")
        account.refreshTokens[token] = "used"
        fresh = self.newRefreshToken(name)
        account.refreshes += 1
        return 200, {
            "access_token": self.mintAccessToken(name),
            "refresh_token": fresh,
            "id_token": self._idToken(account),
            "token_type": "Bearer",
            "expires_in": int(self.accessTtl),
            "scope": "openid profile email offline_access",
        }

    def countRequest(self, name: Optional[str]) -> None:
        if name in self.accounts:
            self.accounts[name].tokenRequests += 1

    # -- usage ----------------------------------------------------------------------------

    def planOf(self, key: Optional[str]) -> str:
        if key and key.startswith("oauth:") and key[6:] in self.accounts:
            return self.accounts[key[6:]].plan
        return "plus"

    def usageHeaders(self, key: Optional[str]) -> dict:
        """
        @return: the C{x-codex-*} headers for a credential key, or C{{}}.
        """
        model = self.usage.get(key)
        return model.headers(self.planOf(key)) if model is not None else {}

    def usageEvent(self, key: Optional[str]) -> Optional[dict]:
        """
        @return: the C{codex.rate_limits} event for a key, or L{None}.
        """
        model = self.usage.get(key)
        return model.event(self.planOf(key)) if model is not None else None

    def served(self, key: Optional[str], tokens: int) -> None:
        """
        Count tokens a key's turn used.
        """
        model = self.usage.get(key)
        if model is not None:
            model.served += max(0, int(tokens))

    def wham(self, key: Optional[str]) -> dict:
        """
        @return: the C{wham/usage} body for a key.
        """
        model = self.usage.get(key) or UsageModel(start=self.clock.seconds())
        return model.wham(self.planOf(key), self.clock.seconds())

    def resetCredits(self, key: Optional[str]) -> dict:
        """
        @return: the C{wham/rate-limit-reset-credits} body for a key.
        """
        model = self.usage.get(key)
        return model.creditsBody() if model is not None else {"available_count": 0,
                                                              "credits": []}

    def consumeReset(self, key: Optional[str], body: Any) -> Optional[dict]:
        """
        @return: the C{.../consume} body for a key, or L{None} for a body
            without a C{redeem_request_id} (a 400).
        """
        body = body if isinstance(body, dict) else {}
        requestId, creditId = body.get("redeem_request_id"), body.get("credit_id")
        if not isinstance(requestId, str) or not requestId:
            return None
        model = self.usage.get(key)
        if model is None:
            return {"code": "no_credit", "windows_reset": 0}
        return model.consume(requestId, creditId if isinstance(creditId, str) else None,
                             self.clock.seconds())

    def stats(self) -> dict:
        """
        @return: per account name: C{token_requests}, C{refreshes},
            C{reuse_attempts}, and C{held} (overall); no token.
        """
        out = {
            name: {"token_requests": a.tokenRequests, "refreshes": a.refreshes,
                   "reuse_attempts": a.reuseAttempts}
            for name, a in self.accounts.items()
        }
        return {"accounts": out, "held": len(self.held)}


def permanentError(code: str) -> dict:
    """
    @return: the 401 body for a permanent refresh failure.
    """
    if code == "invalid_grant":
        return {"error": "invalid_grant", "error_description": "Invalid refresh token."}
    return {"error": {"message": _PERMANENT_MESSAGES.get(code, code),
                      "type": "invalid_request_error", "code": code, "param": None}}


def _authError(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code,
                      "param": None}}
