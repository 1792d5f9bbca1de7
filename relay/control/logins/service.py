# -*- test-case-name: tests.test_control_logins -*-
"""
L{LoginService}: ChatGPT logins started from the admin API or page, for a
new OAuth account or to log an existing one in again
(protocol.md 7.5, behaviour.md R96, R97).

B{Browser flow (PKCE).} L{begin} makes a verifier, its S256 challenge and
a C{state}, and answers the authorize URL. The operator opens it
anywhere, signs in, and pastes the address the browser was sent to (or
just the code) into L{complete}: relay checks the C{state} (a pasted
address of another login is refused, and that login ends), reads an
C{error} (a refused sign-in), then exchanges the code at the account's
C{auth_base_url} through the account's egress proxy.

B{Device-code flow.} L{begin} asks the auth server for a user code
(through the proxy) and answers the verification address and the code;
the process that began it polls at the announced interval (5 s more after
a C{slow_down}) until the person approves (then exchanges the code the
poll returns), refuses, or the login expires.

B{Either way} the new tokens are stored like every OAuth account's: a new
account is added with them (L{relay.control.accounts.service}; its id
token gives the ChatGPT account id and plan) and serves the next turn; a
re-login puts them into the account's token lineage
(L{relay.oauth.credentials.OAuthCredentials.setTokens}, the same as
C{PUT /admin/accounts/{id}/tokens}), clearing C{needs_login} and the
account's learnt blocks. A re-login whose tokens belong to another
ChatGPT account is refused.

B{Pending logins} are records of kind C{login} in the control store (so
any relay process can complete or show one): single-use (completing one
claims it with a compare-and-set; a second attempt is a 409), and they
expire 10 minutes after they began (L{LOGIN_TTL_SECONDS}). Their secrets
(verifier, state, device code) live only in the record, are registered
for log redaction at once, and are removed when the login ends; a code,
a verifier or a token is never logged or answered. Finished logins are
kept (without secrets) for an hour for the page, then swept.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from attrs import define, field
from twisted.logger import Logger

from relay.control.accounts.records import (
    ADMIN_ONLY_FIELDS,
    FILE_ONLY_FIELDS,
    accountFromSpec,
    describeConfigError,
    specSecrets,
)
from relay.control.logins import wire
from relay.control.service import PlaneService
from relay.control.store import ANY, VersionConflict
from relay.control.web import ControlError
from relay.base.logs import registerSecrets
from relay.base.records import ConfigError
from relay.oauth.tokens import accountIdOf, emailOf, planOf

__all__ = ["LOGIN", "LOGIN_TTL_SECONDS", "LoginService"]

LOGIN = "login"
"""The store kind of logins."""

LOGIN_TTL_SECONDS = 600.0
"""A pending login expires this long after it began (10 minutes)."""

FINISHED_KEEP_SECONDS = 3600.0
"""How long an ended login stays readable (without secrets)."""

DEFAULT_INTERVAL = 5
"""The device poll interval when the server announces none, seconds."""

SLOW_DOWN_STEP = 5
"""Seconds added to the interval after a C{slow_down} (RFC 8628 3.5)."""

PENDING, EXCHANGING, COMPLETED, FAILED, EXPIRED, CANCELLED = (
    "pending", "exchanging", "completed", "failed", "expired", "cancelled")

NEW_ACCOUNT_FIELDS = (
    "id", "label", "priority", "concurrency", "models", "model_mapping", "ws_mode", "proxy",
    "proxy_id", "base_url", "auth_base_url",
)
"""What a new account started by a login may set (its tokens come from the login)."""


def _fail(status: int, code: str, message: str, param: Optional[str] = None,
          extra: Optional[dict] = None) -> ControlError:
    return ControlError(status, code, message, param, extra)


def _newId() -> str:
    return "login_" + os.urandom(12).hex()


@define(eq=False)
class LoginService(PlaneService):
    """
    See the module docstring (plane, clock and store: L{PlaneService};
    the plane's live set is read here).

    @ivar accounts: the L{relay.control.accounts.service.AccountService}.
    @ivar tokens: an object with C{setTokens(accountId, body)} (the
        operator view's: new tokens, blocks cleared).
    @ivar egress: the L{relay.interfaces.IEgressClient}.
    @ivar settings: the L{relay.state.settings.RuntimeSettings}
        (C{gateway.oauth}).
    @ivar audit: the L{relay.control.audit.service.AuditTrail}, or L{None}.
    @ivar credentials: the L{relay.oauth.credentials.OAuthCredentials}, to
        adopt a re-login another process completed, or L{None}.
    """

    accounts: Any
    tokens: Any
    egress: Any
    settings: Any
    audit: Any = None
    credentials: Any = None
    _polls: dict = field(factory=dict, init=False)
    _log = Logger()

    def watch(self) -> None:
        """
        Adopt re-logins other processes complete (their tokens are in the
        shared token store): subscribe to the store's C{login} changes.
        """
        self.store.subscribe(self._onChange)

    def _onChange(self, change) -> None:
        if change.kind == LOGIN and change.version is not None and self.credentials is not None:
            d = self.store.get(LOGIN, change.id)

            def _cbRecord(record):
                if record is not None and record.data.get("status") == COMPLETED and \
                        record.data.get("mode") == "relogin":
                    return self.credentials.sync()

            d.addCallback(_cbRecord)
            d.addErrback(lambda f: self._log.warn(
                "reading login {login_id} failed: {error}", login_id=change.id,
                error=str(f.value), event="relay.login_read_failed"))

    # -- views -----------------------------------------------------------------------------

    def publicView(self, record) -> dict:
        """
        A login as the API answers it: never its verifier, state, device
        code or tokens (its authorize URL and user code are for the
        operator to use).
        """
        data = record.data
        view = {
            "id": record.id, "flow": data.get("flow"), "status": data.get("status"),
            "mode": data.get("mode"), "account_id": data.get("account_id"),
            "created_at": data.get("created_at"), "expires_at": data.get("expires_at"),
            "error": data.get("error"),
        }
        if data.get("status") in (PENDING, EXCHANGING):
            view.update(data.get("public") or {})
        if data.get("plan"):
            view["plan"] = data["plan"]
        for name in ("identity", "warnings", "last_paste_error", "paste_attempts"):
            if name in data:
                view[name] = data[name]
        return view

    async def get(self, loginId: str) -> tuple:
        """
        C{GET /admin/logins/{id}}: the login's view (expired logins say so).

        @return: C{(200, {"login": view})}.
        @raise ControlError: 404.
        """
        record = await self._record(loginId)
        record = await self._expireIfDue(record)
        return 200, {"login": self.publicView(record)}

    async def recent(self) -> tuple:
        """
        C{GET /admin/logins}: the logins of the last hour, newest first.
        """
        now = self._clock.seconds()
        out = []
        for record in await self.store.list(LOGIN):
            if record.data.get("status") in (PENDING, EXCHANGING) and \
                    now >= record.data.get("expires_at", 0):
                record = await self._expireIfDue(record)
            out.append(self.publicView(record))
        out.sort(key=lambda v: v.get("created_at") or 0, reverse=True)
        return 200, {"logins": out, "now": now}

    async def _record(self, loginId: str):
        record = await self.store.get(LOGIN, loginId)
        if record is None:
            raise _fail(404, "login_not_found", f"No login {loginId!r}", "id")
        return record

    # -- begin -----------------------------------------------------------------------------

    def _issuer(self, account) -> str:
        return (account.auth_base_url if account is not None and account.auth_base_url
                else self.settings.current.oauth.auth_base_url)

    def _target(self, body: dict) -> tuple:
        """
        What a login is for.

        @return: C{(mode, spec or None, account)}: C{relogin} with the
            account in force, or C{new} with the new account's spec (no
            tokens) and a trial account built from it (for its proxy and
            auth base URL).
        @raise ControlError: 400/404/409.
        """
        accountId = body.get("account_id")
        if accountId is not None:
            if not isinstance(accountId, str):
                raise _fail(400, "invalid_login", "account_id: expected a string", "account_id")
            account = self.plane.live.accounts.byId(accountId)
            if account is None:
                raise _fail(404, "account_not_found", f"No account {accountId!r}", "account_id")
            if account.type != "oauth":
                raise _fail(400, "invalid_login",
                            f"account {accountId!r} is an API-key account; only an OAuth account"
                            " logs in", "account_id")
            return "relogin", None, account
        spec = body.get("account")
        if not isinstance(spec, dict):
            raise _fail(400, "invalid_login",
                        "give account_id (log an account in again) or account (the new"
                        " account's id and settings)", "account")
        for name in spec:
            if name in FILE_ONLY_FIELDS or name not in NEW_ACCOUNT_FIELDS:
                raise _fail(400, "invalid_account",
                            f"account.{name}: not a field of a new login's account (allowed: "
                            + ", ".join(NEW_ACCOUNT_FIELDS) + ")", name)
        registerSecrets(specSecrets(spec))
        spec = dict(spec, type="oauth")
        accountId = spec.get("id")
        from relay.control.accounts.service import ACCOUNT_ID

        if not isinstance(accountId, str) or not ACCOUNT_ID.fullmatch(accountId):
            raise _fail(400, "invalid_account", "account.id: required, 1 to 64 letters, digits"
                        " and . _ @ : - (starting with a letter or digit)", "id")
        if self.plane.sourceOf(accountId) is not None or accountId in self.plane.admin:
            raise _fail(409, "account_exists",
                        f"account {accountId!r} already exists; to log it in again, start a"
                        " login with account_id", "id")
        trialSpec = {k: v for k, v in spec.items() if k not in ADMIN_ONLY_FIELDS}
        trialSpec.update(access_token="login-pending", chatgpt_account_id="login-pending")
        try:
            trial = accountFromSpec(trialSpec, tuple(self.plane.live.config.proxies))
        except ConfigError as e:
            message, param = describeConfigError(e)
            raise _fail(400, "invalid_account", "account." + message, param)
        return "new", spec, trial

    async def begin(self, body: dict, address: Optional[str], note: dict) -> tuple:
        """
        Start a login (C{POST /admin/logins}, C{POST
        /admin/accounts/{id}/login}).

        @param body: C{{"flow": "browser" | "device", "account_id": id}} for a
            re-login, or C{{"flow", "account": {"id", "label", "priority",
            "concurrency", "models", "model_mapping", "ws_mode", "proxy" |
            "proxy_id", "base_url", "auth_base_url"}}} for a new account.
        @return: C{(201, {"login": view})}: a browser login's view has
            C{authorize_url} and C{redirect_uri}; a device login's
            C{verification_url}, C{user_code} and C{interval}.
        @raise ControlError: 400 (flow, fields), 404 (account), 409 (the
            new id exists), 502 (the auth server refused or was
            unreachable: device flow).
        """
        flow = body.get("flow")
        if flow not in ("browser", "device"):
            raise _fail(400, "invalid_login", "flow: expected browser or device", "flow")
        for name in body:
            if name not in ("flow", "account", "account_id"):
                raise _fail(400, "invalid_login", f"unknown field {name}", name)
        mode, spec, account = self._target(body)
        accountId = account.id
        note.update(account=accountId, detail={"flow": flow, "mode": mode})
        issuer = self._issuer(account)
        now = self._clock.seconds()
        loginId = _newId()
        note["target"] = loginId
        data = {
            "flow": flow, "mode": mode, "status": PENDING, "account_id": accountId,
            "spec": spec, "issuer": issuer, "created_at": now,
            "expires_at": now + LOGIN_TTL_SECONDS, "created_from": address, "error": None,
            "created_by": note.pop("actor", None),
        }
        if flow == "browser":
            verifier, state = wire.newVerifier(), wire.newState()
            registerSecrets([verifier, state])
            data["secret"] = {"verifier": verifier, "state": state}
            data["public"] = {
                "authorize_url": wire.authorizeURL(
                    issuer, self.settings.current.oauth.client_id, wire.challengeOf(verifier),
                    state),
                "redirect_uri": wire.BROWSER_REDIRECT_URI,
            }
        else:
            deviceAuthId, userCode, interval = await self._userCode(account, issuer)
            data["secret"] = {"device_auth_id": deviceAuthId, "user_code": userCode}
            data["public"] = {"verification_url": wire.verificationURL(issuer),
                              "user_code": userCode, "interval": interval}
        record = await self.store.put(LOGIN, loginId, data, None)
        self._log.info(
            "{flow} login {login_id} started for {mode} account {account_id}",
            event="relay.login_started", flow=flow, login_id=loginId, mode=mode,
            account_id=accountId,
        )
        if flow == "device":
            self._schedulePoll(loginId, data["public"]["interval"])
        return 201, {"login": self.publicView(record)}

    def _proxyOf(self, account):
        return account.proxy

    async def _userCode(self, account, issuer: str) -> tuple:
        """
        Step 1 of the device flow, through the account's proxy.

        @return: C{(device_auth_id, user_code, interval seconds)}.
        @raise ControlError: 502 when the server refused or was unreachable.
        """
        body = json.dumps({"client_id": self.settings.current.oauth.client_id}).encode()
        try:
            reply = await self.egress.request(
                self._proxyOf(account), "POST", wire.deviceUserCodeURL(issuer),
                {"content-type": "application/json"}, body, self._timeout())
        except Exception as e:
            raise _fail(502, "login_unreachable",
                        f"the auth server could not be reached through the account's egress"
                        f" ({type(e).__name__}); nothing was started")
        if reply.status == 404:
            raise _fail(502, "device_login_unavailable",
                        "device code login is not enabled on this auth server (404); use the"
                        " browser flow")
        answer = reply.json()
        deviceAuthId = answer.get("device_auth_id")
        userCode = answer.get("user_code") or answer.get("usercode")
        if reply.status != 200 or not isinstance(deviceAuthId, str) or not isinstance(
                userCode, str):
            code, message = wire.tokenErrorOf(answer)
            raise _fail(502, "login_refused",
                        f"the auth server refused the device code request ({reply.status}"
                        f" {message or code or 'error'})")
        registerSecrets([deviceAuthId, userCode])
        try:
            interval = int(str(answer.get("interval", DEFAULT_INTERVAL)).strip())
        except ValueError:
            interval = DEFAULT_INTERVAL
        return deviceAuthId, userCode, max(1, min(60, interval))

    def _timeout(self) -> float:
        return float(self.settings.current.oauth.refresh_timeout_seconds)

    # -- the browser flow's paste-back --------------------------------------------------

    async def complete(self, loginId: str, body: dict, address: Optional[str],
                       note: dict) -> tuple:
        """
        Finish a browser login with what the operator pasted (C{POST
        /admin/logins/{id}/complete}, body C{{"redirect_url": "..."}} or
        C{{"code": "..."}}).

        @return: C{(200, {"login": view, "account": account view})}.
        @raise ControlError: 404; 409 (not pending: used, failed, expired
            -- a login is single-use); 400 C{no_code} (no code in what was
            pasted: the login stays pending, to paste again or cancel; the
            answer holds its C{login} view); 400 (a refused sign-in, a
            C{state} of another login, a code the server refused: the login
            then ends, no account is created); 502 (the auth server was
            unreachable).
        """
        for name in body:
            if name not in ("redirect_url", "code"):
                raise _fail(400, "invalid_login", f"unknown field {name}", name)
        pasted = body.get("redirect_url") or body.get("code")
        if not isinstance(pasted, str) or not pasted.strip():
            raise _fail(400, "invalid_login",
                        "paste the address your browser was sent to (redirect_url) or the code",
                        "redirect_url")
        record = await self._expireIfDue(await self._record(loginId))
        data = record.data
        note.update(account=data.get("account_id"), target=loginId,
                    detail={"flow": data.get("flow"), "mode": data.get("mode")})
        if data.get("flow") != "browser":
            raise _fail(400, "invalid_login",
                        "this is a device-code login: it completes by itself once approved")
        if data.get("status") != PENDING:
            raise self._notPending(record)
        params = wire.parseCallback(pasted)
        registerSecrets([v for v in (params.code, params.state) if v])
        secret = data.get("secret") or {}
        if params.state is not None and params.state != secret.get("state"):
            await self._end(record, FAILED, "state_mismatch",
                            "the pasted address belongs to another login (its state does not"
                            " match)")
            raise _fail(400, "state_mismatch",
                        "the pasted address belongs to another login (its state does not match):"
                        " this login has ended, start a new one", "redirect_url")
        if params.error is not None:
            message = "sign-in was refused: " + (params.description or params.error)
            await self._end(record, FAILED, params.error, message)
            raise _fail(400, "login_denied", message + "; no account was created",
                        "redirect_url")
        if not params.code:
            raise await self._pasteRefused(record, "no code in what was pasted")
        claimed = await self._claim(record)
        result = await self._exchange(claimed, params.code, secret.get("verifier"),
                                      wire.BROWSER_REDIRECT_URI)
        return 200, result

    async def _pasteRefused(self, record, message: str) -> ControlError:
        """
        A paste without a code: the login stays pending (paste again, or
        cancel it); the attempt is kept on it (C{last_paste_error},
        C{paste_attempts}) and the error carries the login's view.

        @return: the 400 C{no_code} to raise.
        """
        data = dict(record.data, last_paste_error=message,
                    paste_attempts=int(record.data.get("paste_attempts") or 0) + 1)
        try:
            record = await self.store.put(LOGIN, record.id, data, record.version)
        except VersionConflict:
            record = await self._record(record.id)  # someone else moved it on
        return _fail(400, "no_code",
                     message + ": paste the whole address the browser was sent to (it holds"
                     " code=...); the login is still pending, paste again or cancel it",
                     "redirect_url", extra={"login": self.publicView(record)})

    def _notPending(self, record) -> ControlError:
        status = record.data.get("status")
        if status == EXPIRED:
            return _fail(409, "login_expired",
                         "this login expired (10 minutes after it began); start a new one")
        if status == EXCHANGING:
            return _fail(409, "login_in_progress", "this login is being completed already")
        return _fail(409, "login_used",
                     f"this login has ended ({status}); a login is single-use, start a new one")

    async def _claim(self, record):
        """
        Take a pending login for its code exchange (single-use, across
        processes: compare-and-set on its version).
        """
        data = dict(record.data, status=EXCHANGING)
        try:
            return await self.store.put(LOGIN, record.id, data, record.version)
        except VersionConflict:
            raise _fail(409, "login_in_progress", "this login is being completed already")

    async def _exchange(self, record, code: str, verifier: Optional[str],
                        redirectUri: str) -> dict:
        """
        Exchange the code through the account's proxy, then store the
        tokens (L{_finish}). The login ends either way.

        @return: C{{"login": view, "account": account view}}.
        @raise ControlError: 400 (refused), 502 (unreachable); the login has
            then ended as failed.
        """
        data = record.data
        account = self._accountFor(record)
        body = wire.exchangeBody(code, verifier or "", redirectUri,
                                 self.settings.current.oauth.client_id)
        try:
            reply = await self.egress.request(
                account.proxy if account is not None else None, "POST",
                wire.tokenURL(data["issuer"]),
                {"content-type": "application/x-www-form-urlencoded"}, body, self._timeout())
        except Exception as e:
            message = (f"the auth server could not be reached through the account's egress"
                       f" ({type(e).__name__})")
            await self._end(record, FAILED, "login_unreachable", message)
            raise _fail(502, "login_unreachable", message + "; no account was created")
        answer = reply.json()
        tokens = {k: answer.get(k) for k in ("access_token", "refresh_token", "id_token")}
        registerSecrets([v for v in tokens.values() if isinstance(v, str)])
        if reply.status != 200 or not all(isinstance(v, str) and v for v in tokens.values()):
            code, message = wire.tokenErrorOf(answer)
            text = (f"the auth server refused the code ({reply.status}"
                    f" {message or code or 'no tokens in its answer'})")
            await self._end(record, FAILED, code or "exchange_failed", text)
            raise _fail(400, "login_refused", text + "; no account was created")
        return await self._finish(record, tokens)

    def _accountFor(self, record):
        """
        The account whose egress a login's traffic uses: the one in force
        (re-login), or the new account's trial build.
        """
        data = record.data
        if data.get("mode") == "relogin":
            return self.plane.live.accounts.byId(data["account_id"])
        spec = dict(data.get("spec") or {})
        spec = {k: v for k, v in spec.items() if k not in ADMIN_ONLY_FIELDS}
        spec.update(access_token="login-pending", chatgpt_account_id="login-pending")
        try:
            return accountFromSpec(spec, tuple(self.plane.live.config.proxies))
        except ConfigError:
            return None

    async def _finish(self, record, tokens: dict) -> dict:
        """
        Store a login's tokens: a new account, or the account's new tokens.

        @raise ControlError: the account's ChatGPT id differs (re-login),
            or the new id was taken meanwhile; the login has ended as
            failed.
        """
        data = record.data
        accountId = data["account_id"]
        chatgptId = accountIdOf(tokens["id_token"], tokens["access_token"])
        plan = planOf(tokens["access_token"], tokens["id_token"])
        login = {"flow": data["flow"], "at": self._clock.seconds(), "plan": plan}
        identity = {"chatgpt_account_id": chatgptId,
                    "email": emailOf(tokens["id_token"], tokens["access_token"])}
        warnings: list = []
        try:
            if data.get("mode") == "relogin":
                account = self.plane.live.accounts.byId(accountId)
                if account is None:
                    raise _fail(404, "account_not_found",
                                f"account {accountId!r} is gone; nothing was stored")
                if chatgptId and account.chatgpt_account_id and \
                        chatgptId != account.chatgpt_account_id:
                    raise _fail(400, "wrong_account",
                                f"this login is for ChatGPT account {chatgptId}, not"
                                f" {account.chatgpt_account_id} (the account's); nothing was"
                                " stored")
                await self.tokens.setTokens(accountId, dict(tokens))
                await self._noteLogin(accountId, login)
                view = self.accounts.view(accountId)
            else:
                spec = dict(data.get("spec") or {}, **tokens)
                if chatgptId:
                    spec["chatgpt_account_id"] = chatgptId
                _, answer = await self.accounts.create(spec, data.get("created_from"), {},
                                                       login=login)
                view = answer["account"]
                warnings = answer.get("warnings") or []
        except ControlError as e:
            await self._end(record, FAILED, e.code, e.message)
            raise
        finished = await self._end(record, COMPLETED, None, None, plan=plan,
                                   extra={"identity": identity, "warnings": warnings})
        self._log.info(
            "{flow} login {login_id} completed: {mode} account {account_id} (plan {plan})",
            event="relay.login_completed", flow=data["flow"], login_id=record.id,
            mode=data.get("mode"), account_id=accountId, plan=plan,
        )
        return {"login": self.publicView(finished) if finished is not None else None,
                "account": view, "warnings": warnings}

    async def _noteLogin(self, accountId: str, login: dict) -> None:
        """
        An admin account's record remembers its last login (shown in its
        view); a file account has no record to keep it in.
        """
        from relay.control.accounts.records import ACCOUNT

        record = await self.store.get(ACCOUNT, accountId)
        if record is None:
            return
        try:
            await self.store.put(ACCOUNT, accountId, dict(record.data, login=login),
                                 record.version)
        except VersionConflict:
            pass  # edited meanwhile: the login is stored anyway (in the token store)

    async def _end(self, record, status: str, code: Optional[str], message: Optional[str],
                   plan: Optional[str] = None, extra: Optional[dict] = None):
        """
        End a login: its secrets removed, its outcome kept. A failure or an
        expiry is audited and logged (never with a secret).

        @param extra: more fields to keep (a completed login's C{identity}
            and C{warnings}).
        @return: the ended record, or L{None} when the store refused.
        """
        self._cancelPoll(record.id)
        data = {k: v for k, v in record.data.items() if k not in ("secret", "public", "spec")}
        data.update(status=status, ended_at=self._clock.seconds(),
                    error={"code": code, "message": message} if code or message else None)
        if plan:
            data["plan"] = plan
        data.update(extra or {})
        try:
            ended = await self.store.put(LOGIN, record.id, data, ANY)
        except Exception as e:  # noqa: BLE001 - logged; the login expires anyway
            self._log.warn("ending login {login_id} failed: {error}", login_id=record.id,
                           error=str(e), event="relay.login_store_failed")
            return None
        if status in (FAILED, EXPIRED):
            self._log.warn(
                "{flow} login {login_id} for {account_id} {status}: {message}",
                event="relay.login_failed", flow=data.get("flow"), login_id=record.id,
                account_id=data.get("account_id"), status=status, code=code,
                message=message or status,
            )
            if self.audit is not None:
                # Not an answered change (the HTTP audit records those): what
                # became of a login, on behalf of the admin who began it.
                self.audit.record(
                    "login.expired" if status == EXPIRED else "login.failed",
                    account=data.get("account_id"), address=data.get("created_from"),
                    target=record.id, detail={"flow": data.get("flow"), "reason": code},
                    actor=data.get("created_by"),
                )
        return ended

    async def _expireIfDue(self, record):
        if record.data.get("status") in (PENDING, EXCHANGING) and \
                self._clock.seconds() >= record.data.get("expires_at", 0):
            ended = await self._end(record, EXPIRED, "expired",
                                    "the login was not completed within 10 minutes")
            return ended or record
        return record

    # -- cancel ------------------------------------------------------------------------------

    async def cancel(self, loginId: str, address: Optional[str], note: dict) -> tuple:
        """
        C{DELETE /admin/logins/{id}}: end a pending login.

        @return: C{(200, {"login": view})}.
        @raise ControlError: 404; 409 when it has ended already.
        """
        record = await self._expireIfDue(await self._record(loginId))
        note.update(account=record.data.get("account_id"), target=loginId)
        if record.data.get("status") != PENDING:
            raise self._notPending(record)
        ended = await self._end(record, CANCELLED, None, None)
        return 200, {"login": self.publicView(ended or record)}

    # -- the device flow's polls -----------------------------------------------------------

    def _schedulePoll(self, loginId: str, interval: float) -> None:
        self._cancelPoll(loginId)
        self._polls[loginId] = self._clock.callLater(interval, self._poll, loginId)

    def _cancelPoll(self, loginId: str) -> None:
        call = self._polls.pop(loginId, None)
        if call is not None and call.active():
            call.cancel()

    def stop(self) -> None:
        """
        Stop polling (service stop); pending device logins then expire.
        """
        for loginId in list(self._polls):
            self._cancelPoll(loginId)

    def _poll(self, loginId: str) -> None:
        self._polls.pop(loginId, None)
        from twisted.internet.defer import Deferred

        d = Deferred.fromCoroutine(self._pollOnce(loginId))
        d.addErrback(lambda f: self._log.failure("device login poll {login_id} failed", f,
                                                 login_id=loginId))

    async def _pollOnce(self, loginId: str) -> None:
        """
        One device poll (step 2), through the account's proxy; pending
        answers (403, 404) poll again at the interval, C{slow_down} (or a
        429) 5 s later, a transport error again at the interval; a 200 is
        exchanged; anything else ends the login.
        """
        try:
            record = await self.store.get(LOGIN, loginId)
        except Exception as e:  # noqa: BLE001 - logged; polled again
            self._log.warn("reading login {login_id} failed: {error}", login_id=loginId,
                           error=str(e), event="relay.login_store_failed")
            self._schedulePoll(loginId, DEFAULT_INTERVAL)
            return
        if record is None or record.data.get("status") != PENDING:
            return
        record = await self._expireIfDue(record)
        if record.data.get("status") != PENDING:
            return
        data = record.data
        public, secret = data.get("public") or {}, data.get("secret") or {}
        interval = int(public.get("interval") or DEFAULT_INTERVAL)
        account = self._accountFor(record)
        body = json.dumps({"device_auth_id": secret.get("device_auth_id"),
                           "user_code": secret.get("user_code")}).encode()
        try:
            reply = await self.egress.request(
                account.proxy if account is not None else None, "POST",
                wire.deviceTokenURL(data["issuer"]), {"content-type": "application/json"},
                body, self._timeout())
        except Exception as e:  # noqa: BLE001 - transient: polled again
            self._log.info("device login poll {login_id}: {error}; polling again",
                           login_id=loginId, error=type(e).__name__,
                           event="relay.login_poll_failed")
            self._schedulePoll(loginId, interval)
            return
        answer = reply.json()
        code, message = wire.tokenErrorOf(answer)
        if reply.status in (403, 404):
            self._schedulePoll(loginId, interval)
            return
        if reply.status == 429 or code == "slow_down":
            interval += SLOW_DOWN_STEP
            try:
                await self.store.put(LOGIN, loginId, dict(
                    data, public=dict(public, interval=interval)), record.version)
            except VersionConflict:
                return  # ended or claimed meanwhile
            self._schedulePoll(loginId, interval)
            return
        authCode, verifier = answer.get("authorization_code"), answer.get("code_verifier")
        address = data.get("created_from")
        if reply.status != 200 or not isinstance(authCode, str) or not isinstance(verifier,
                                                                                  str):
            if code == "access_denied" or reply.status == 401:
                text = "sign-in was refused: " + (message or code or str(reply.status))
            elif code in ("expired_token", "token_expired"):
                text = "the device code expired: " + (message or code)
            else:
                text = f"the auth server ended the login ({reply.status} {message or code})"
            await self._end(record, FAILED, code or "device_failed", text)
            return
        registerSecrets([authCode, verifier])
        try:
            claimed = await self._claim(record)
        except ControlError:
            return
        try:
            await self._exchange(claimed, authCode, verifier,
                                 wire.deviceRedirectURI(data["issuer"]))
        except ControlError:
            return  # ended (and audited) as failed
        if self.audit is not None:
            self.audit.record("login.complete", account=data.get("account_id"), address=address,
                              target=loginId, detail={"flow": "device", "mode": data.get("mode")},
                              actor=data.get("created_by"))

    # -- the sweep -------------------------------------------------------------------------

    async def sweep(self) -> None:
        """
        A periodic job: pending logins past their expiry end as expired;
        ended ones older than L{FINISHED_KEEP_SECONDS} are deleted. Never
        raises (logged).
        """
        try:
            now = self._clock.seconds()
            for record in await self.store.list(LOGIN):
                status = record.data.get("status")
                if status in (PENDING, EXCHANGING):
                    await self._expireIfDue(record)
                elif now - (record.data.get("ended_at") or record.updated_at) > \
                        FINISHED_KEEP_SECONDS:
                    await self.store.delete(LOGIN, record.id, record.version)
        except Exception as e:  # noqa: BLE001 - a periodic job logs its own errors (T26)
            self._log.warn("sweeping logins failed: {error}", error=str(e),
                           event="relay.login_sweep_failed")
