# -*- test-case-name: tests.test_control_logins -*-
"""
C{/admin/logins} (protocol.md 7.5): ChatGPT logins over HTTP,
behind the admin key. The rules are
L{relay.control.logins.service.LoginService}'s.

  - C{POST /admin/logins} - start one: C{{"flow": "browser" | "device",
    "account": {"id", ...}}} (a new OAuth account) or C{{"flow",
    "account_id"}} (log an account in again; also C{POST
    /admin/accounts/{id}/login}); 201 C{{"login": view}};
  - C{GET /admin/logins} - the last hour's logins; C{GET
    /admin/logins/{id}} - one (the page polls a device login with it);
  - C{POST /admin/logins/{id}/complete} - the browser flow's paste-back:
    C{{"redirect_url": "http://localhost:1455/auth/callback?code=...&state=..."}}
    or C{{"code": "..."}}; 200 C{{"login", "account", "warnings"}}
    (C{duplicate_identity} when the ChatGPT identity is already in the
    pool); a paste without a code is a 400 C{no_code} that leaves the login
    pending (its C{login} view beside the error): paste again or cancel;
  - C{DELETE /admin/logins/{id}} or C{POST /admin/logins/{id}/cancel} -
    cancel a pending login.
"""

from __future__ import annotations

from relay.control.accounts.records import ACCOUNT_BODY
from relay.base.requestnotes import notesOf
from relay.control.web import ServiceLeaf, clientAddress, deliver, notFound, pathId, readJSONBody
from relay.console.fields import STRING, objectOf

__all__ = ["COMPLETE_BODY", "LOGIN_BODY", "LoginsResource"]

LOGIN_BODY = {"flow": STRING, "account_id": STRING, "account": objectOf(ACCOUNT_BODY)}
"""The JSON types of a login's start (L{relay.console.fields})."""

COMPLETE_BODY = {"redirect_url": STRING, "code": STRING}
"""The JSON types of a browser login's paste-back."""


class LoginsResource(ServiceLeaf):
    """
    See the module docstring.

    @ivar service: the L{relay.control.logins.service.LoginService}.
    """

    def render_GET(self, request):
        """
        The list, or one login.
        """
        path = request.postpath
        if path in ([], [b""]):
            return deliver(request, self.service.recent, "reading logins")
        if len(path) == 1:
            return deliver(request, lambda: self.service.get(pathId(path[0])), "reading a login")
        return deliver(request, notFound, "reading a login")

    def render_POST(self, request):
        """
        Start a login, or complete a browser login.
        """
        path = request.postpath
        address = clientAddress(request)
        note = self._note(request)
        if path in ([], [b""]):
            # Who began it: the audit names them when the login ends later.
            note["actor"] = getattr(notesOf(request).operator, "actor", None) or "admin-key"
            return deliver(request, lambda: self.service.begin(
                readJSONBody(request, fields=LOGIN_BODY,
                             code="invalid_login"), address, note), "starting a login")
        if len(path) == 2 and path[1] == b"cancel":
            return deliver(request, lambda: self.service.cancel(pathId(path[0]), address, note),
                           "cancelling a login")
        if len(path) == 2 and path[1] == b"complete":
            return deliver(request, lambda: self.service.complete(
                pathId(path[0]), readJSONBody(request, fields=COMPLETE_BODY,
                                              code="invalid_login"), address, note),
                "completing a login")
        return deliver(request, notFound, "starting a login")

    def render_DELETE(self, request):
        """
        Cancel a pending login.
        """
        path = request.postpath
        if len(path) != 1:
            return deliver(request, notFound, "cancelling a login")
        note = self._note(request)
        address = clientAddress(request)
        return deliver(request, lambda: self.service.cancel(pathId(path[0]), address, note),
                       "cancelling a login")
