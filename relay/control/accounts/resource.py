# -*- test-case-name: tests.test_control -*-
"""
C{/admin/accounts} and below: the control plane's routes, and
the operator surface's own ones (the accounts view, clear, token refresh,
new tokens: L{relay.console.admin}) handed on unchanged.

  - C{POST /admin/accounts} - add an account: 201 C{{"account": view}};
  - C{GET /admin/accounts/{id}} - one account's configuration view;
  - C{PATCH /admin/accounts/{id}} - change its editable fields;
  - C{DELETE /admin/accounts/{id}} - remove an admin account;
  - C{POST /admin/accounts/{id}/disable} (optional body C{{"reason"}}) and
    C{POST /admin/accounts/{id}/enable} - pause and resume any account;
  - C{POST /admin/accounts/{id}/redeem-reset} - redeem one of an OAuth
    account's banked rate-limit resets (L{relay.oauth.resets}; protocol.md
    7.3a): 200 C{{"account", "code", "windows_reset", "available"}};
  - C{POST /admin/accounts/{id}/test} - try the credential upstream (an
    API key lists the models, OAuth reads the usage probe) and answer what
    the upstream said (L{relay.control.accounts.check}); audited;
  - C{POST /admin/accounts/{id}/login} - start a new ChatGPT login of an
    OAuth account (body C{{"flow": "browser" | "device"}}; see
    L{relay.control.logins.resource});
  - everything else (C{GET /admin/accounts}, C{.../clear},
    C{.../refresh}, C{PUT .../tokens}) - the operator resource.

The rules are L{relay.control.accounts.service.AccountService}'s; each
answer that changed something leaves its audit details on the request
(C{request.notes.audit}) for L{relay.control.audit}.
"""

from __future__ import annotations

from relay.control.accounts.records import ACCOUNT_BODY
from relay.control.logins.resource import LOGIN_BODY
from relay.control.web import (
    ControlError, ServiceLeaf, clientAddress, deliver, pathId, readJSONBody,
)
from relay.console.fields import REASON_BODY

__all__ = ["AccountsResource"]


class AccountsResource(ServiceLeaf):
    """
    See the module docstring.

    @ivar service: the L{relay.control.accounts.service.AccountService}.
    @ivar logins: the L{relay.control.logins.service.LoginService}, or
        L{None}.
    @ivar fallback: the operator surface's accounts resource.
    @ivar resets: the L{relay.oauth.resets.BankedResets}, or L{None}.
    @ivar checks: the L{relay.control.accounts.check.CredentialCheck}, or
        L{None}.
    """

    def __init__(self, adminKey, service, fallback, logins=None, resets=None, checks=None):
        super().__init__(adminKey, service)
        self.fallback = fallback
        self.logins = logins
        self.resets = resets
        self.checks = checks

    def render_GET(self, request):
        """
        C{/admin/accounts/{id}}: C{{"account": view}}; the list is the
        operator view's.
        """
        path = request.postpath
        if len(path) == 1 and path[0]:
            return deliver(request, lambda: (200, {"account": self.service.view(
                pathId(path[0]))}), "reading an account")
        return self.fallback.render(request)

    def render_POST(self, request):
        """
        Add (no id), pause, resume or log in; the rest is the operator's.
        """
        path = request.postpath
        address = clientAddress(request)
        if path in ([], [b""]):
            note = self._note(request)
            return deliver(request, lambda: self.service.create(
                readJSONBody(request, fields=ACCOUNT_BODY,
                             code="invalid_account"), address, note), "adding an account")
        if len(path) == 2 and path[1] in (b"disable", b"enable"):
            note = self._note(request)
            paused = path[1] == b"disable"
            return deliver(request, lambda: self.service.setPaused(
                pathId(path[0]), paused,
                readJSONBody(request, allowEmpty=True, fields=REASON_BODY,
                             code="invalid_account") if paused
                else {}, address, note), "pausing an account")
        if len(path) == 2 and path[1] == b"login" and self.logins is not None:
            note = self._note(request)
            note["action"] = "login.start"
            return deliver(request, lambda: self.logins.begin(
                dict(readJSONBody(request, allowEmpty=True, fields=LOGIN_BODY,
                                  code="invalid_login"),
                     account_id=pathId(path[0])),
                address, note), "starting a login")
        if len(path) == 2 and path[1] == b"test" and self.checks is not None:
            note = self._note(request)
            return deliver(request, lambda: self.checks.test(pathId(path[0]), note),
                           "testing an account")
        if len(path) == 2 and path[1] == b"redeem-reset" and self.resets is not None:
            note = self._note(request)
            return deliver(request, lambda: self._redeem(pathId(path[0]), note),
                           "redeeming a banked reset")
        return self.fallback.render(request)

    async def _redeem(self, accountId: str, note: dict) -> tuple:
        """
        Redeem one banked reset of an account now (protocol.md 7.3a).

        @return: C{(200, {"account", "code", "windows_reset", "available"})}.
        @raise ControlError: 404, 400 (not OAuth), 409 (one in flight), 502.
        """
        from relay.oauth.resets import RedeemError

        note.update(account=accountId)
        try:
            answer = await self.resets.redeem(accountId)
        except RedeemError as e:
            raise ControlError(e.status, e.code, e.message) from None
        note.update(detail={"code": answer.get("code")})
        return 200, {"account": accountId, "code": answer.get("code"),
                     "windows_reset": answer.get("windows_reset", 0),
                     "available": self.resets.available.get(accountId)}

    def render_PATCH(self, request):
        """
        C{/admin/accounts/{id}}: change an admin account.
        """
        path = request.postpath
        if len(path) != 1 or not path[0]:
            return self.fallback.render(request)
        note = self._note(request)
        address = clientAddress(request)
        return deliver(request, lambda: self.service.update(
            pathId(path[0]), readJSONBody(request, fields=ACCOUNT_BODY,
                                          code="invalid_account"), address, note),
            "changing an account")

    def render_DELETE(self, request):
        """
        C{/admin/accounts/{id}}: remove an admin account.
        """
        path = request.postpath
        if len(path) != 1 or not path[0]:
            return self.fallback.render(request)
        note = self._note(request)
        address = clientAddress(request)
        return deliver(request, lambda: self.service.delete(pathId(path[0]), address, note),
                       "deleting an account")

    def render_PUT(self, request):
        """
        C{/admin/accounts/{id}/tokens}: the operator's.
        """
        return self.fallback.render(request)
