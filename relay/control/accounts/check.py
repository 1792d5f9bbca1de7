# -*- test-case-name: tests.test_control_check -*-
"""
L{CredentialCheck}: C{POST /admin/accounts/{id}/test} -- try an
account's credential upstream before traffic relies on it, and say what
the upstream answered.

  - an API-key account: C{GET <base_url>/models} (the models list,
    protocol.md 4) with its key;
  - an OAuth account: the usage probe, C{GET .../backend-api/wham/usage}
    (protocol.md 7.4) with its current access token and ChatGPT account
    id; an account that needs a login is answered at once, not sent.

Either goes through the account's egress proxy (behaviour.md R97), once,
never retried. Nothing in the account's state changes (no cooldown, no
token refresh, no usage snapshot): the check only reports. The answer
never holds the credential (R99): an upstream message that quotes it has
it replaced by C{***}. One check per account runs at a time.
"""

from __future__ import annotations

from typing import Any, Optional

from attrs import define, field

from relay.control.web import ControlError

__all__ = ["CHECK_TIMEOUT_SECONDS", "CredentialCheck"]

CHECK_TIMEOUT_SECONDS = 15.0
"""The whole exchange of one check, seconds."""


def _scrub(text: str, secrets) -> str:
    for secret in secrets:
        if secret and len(secret) >= 6:
            text = text.replace(secret, "***")
    return text[:300]


@define(eq=False)
class CredentialCheck:
    """
    See the module docstring.

    @ivar accounts: the live accounts (C{byId}).
    @ivar egress: the L{relay.interfaces.IEgressClient}.
    @ivar credentials: the L{relay.interfaces.ICredentialSource}, or L{None}.
    @ivar clock: the L{IReactorTime}.
    """

    accounts: Any
    egress: Any
    credentials: Any
    clock: Any
    _running: set = field(factory=set, init=False)

    async def test(self, accountId: str, note: dict) -> tuple:
        """
        Check one account now.

        @return: C{(200, {"account", "type", "check", "ok", "status",
            "latency_ms", "at", "models", "usage", "error"})}.
        @raise ControlError: 404 unknown account; 409 a check of it is
            running.
        """
        note.update(account=accountId, action="account.test")
        account = self.accounts.byId(accountId)
        if account is None:
            raise ControlError(404, "account_not_found", f"No account {accountId!r}", "id")
        if accountId in self._running:
            raise ControlError(409, "test_in_progress",
                               f"a test of {accountId} is running; wait for its answer")
        self._running.add(accountId)
        try:
            answer = await self._check(account)
        finally:
            self._running.discard(accountId)
        note.update(detail={"check": answer["check"], "ok": answer["ok"],
                            "status": answer["status"]})
        return 200, answer

    async def _check(self, account) -> dict:
        from relay.oauth.usageprobe import usageURL

        now = self.clock.seconds()
        oauth = account.type == "oauth"
        answer = {"account": account.id, "type": account.type,
                  "check": "usage" if oauth else "models", "ok": False, "status": None,
                  "latency_ms": None, "at": now, "models": None, "usage": None, "error": None}
        dial = self.credentials.current(account) if self.credentials is not None else account
        if oauth and self.credentials is not None:
            blocked = self.credentials.blockReason(account, now)
            if blocked is not None:
                answer["error"] = {"code": "needs_login" if "login" in blocked[0]
                                   else "token_unusable", "message": blocked[0]}
                return answer
        headers = {"authorization": "Bearer " + (dial.credential or ""), "accept":
                   "application/json"}
        if oauth:
            url = usageURL(account.base_url)
            headers["originator"] = "codex_cli_rs"
            if dial.chatgpt_account_id:
                headers["chatgpt-account-id"] = dial.chatgpt_account_id
        else:
            url = account.base_url.rstrip("/") + "/models"
        secrets = (dial.credential, account.credential)
        try:
            reply = await self.egress.request(account.proxy, "GET", url, headers, None,
                                              CHECK_TIMEOUT_SECONDS)
        except Exception as e:  # noqa: BLE001 - the answer says what happened
            answer["latency_ms"] = round((self.clock.seconds() - now) * 1000)
            answer["error"] = {"code": "unreachable", "message":
                               _scrub(f"{type(e).__name__}: {e}", secrets)}
            return answer
        answer["latency_ms"] = round((self.clock.seconds() - now) * 1000)
        answer["status"] = reply.status
        body = reply.json()
        if reply.status != 200:
            answer["error"] = self._errorOf(reply.status, body, secrets)
            return answer
        answer["ok"] = True
        if oauth:
            answer["usage"] = self._usageOf(body, now)
        else:
            answer["models"] = sorted(str(m.get("id")) for m in body.get("data") or ()
                                      if isinstance(m, dict) and m.get("id"))
        return answer

    @staticmethod
    def _errorOf(status: int, body: dict, secrets) -> dict:
        error = body.get("error") if isinstance(body.get("error"), dict) else {}
        code = error.get("code") or error.get("type") or f"status_{status}"
        message = error.get("message") or body.get("detail") or f"upstream answered {status}"
        return {"code": str(code), "message": _scrub(str(message), secrets)}

    @staticmethod
    def _usageOf(body: dict, now: float) -> Optional[dict]:
        from relay.oauth.windows import windowsFromWham

        snapshot = windowsFromWham(body, now)
        view = snapshot.toJSON(now) if snapshot is not None else {}
        view["plan"] = view.get("plan") or body.get("plan_type")
        return view
