# -*- test-case-name: tests.test_control -*-
"""
The audit trail over HTTP:

  - L{AuditResource}: C{GET /admin/audit?limit=N&account=ID} - the newest
    records first (C{{"audit": [...], "now": seconds}}), behind the admin
    key;
  - L{ControlAdmin}: the C{/admin} tree relay mounts: the operator
    surface's routes (L{relay.console.admin}) with the control plane's
    added or put in front (C{accounts}, C{logins}, C{audit}), and every
    admin change that was answered 2xx recorded in the trail once its
    answer is sent (L{relay.control.audit.service}).
"""

from __future__ import annotations

from twisted.web.resource import Resource

from relay.control.audit.service import actionOf
from relay.control.web import AdminLeaf, ControlError, clientAddress, deliver, notFound
from relay.base.requestid import requestIdOf
from relay.base.requestnotes import notesOf

__all__ = ["AuditResource", "ControlAdmin"]

_CHANGES = (b"POST", b"PUT", b"PATCH", b"DELETE")


class AuditResource(AdminLeaf):
    """
    C{GET /admin/audit}.
    """

    def __init__(self, adminKey, trail, clock):
        super().__init__(adminKey)
        self.trail = trail
        self.clock = clock

    def render_GET(self, request):
        """
        C{{"audit": [records, newest first], "now": seconds}}; C{limit}
        (1..1000, default 100) and C{account} narrow it; a bad C{limit} is a
        400 naming it.
        """
        if request.postpath not in ([], [b""]):
            return deliver(request, notFound, "reading the audit")

        def arg(name):
            values = request.args.get(name.encode("ascii"))
            return values[0].decode("utf-8", "replace") if values else None

        async def read():
            raw = arg("limit")
            try:
                limit = int(raw) if raw is not None else 100
            except ValueError:
                limit = 0
            if not 1 <= limit <= 1000:
                raise ControlError(400, "invalid_value", "limit: expected 1 to 1000", "limit")
            entries = await self.trail.recent(limit, arg("account"))
            return 200, {"audit": entries, "now": self.clock.seconds()}

        return deliver(request, read, "reading the audit")


class ControlAdmin(Resource):
    """
    The C{/admin} resource: L{routes} first, then the operator's admin
    root; changes are audited (see the module docstring).

    @ivar inner: the operator surface's C{/admin} resource.
    @ivar routes: path segment -> resource, in front of C{inner}'s.
    @ivar trail: the L{relay.control.audit.service.AuditTrail}.
    """

    def __init__(self, inner, trail, routes: dict):
        super().__init__()
        self.inner = inner
        self.trail = trail
        self.routes = dict(routes)

    def getChildWithDefault(self, path, request):
        """
        Route one segment; a change (POST, PUT, PATCH, DELETE) is recorded
        in the trail once answered with a 2xx.
        """
        if request.method in _CHANGES:
            segments = [path] + list(request.postpath)
            request.notifyFinish().addBoth(lambda _: self._audit(request, segments))
        child = self.routes.get(path)
        if child is not None and self.inner.adminKey is not None:
            return child
        return self.inner.getChildWithDefault(path, request)

    def render(self, request):
        """
        C{/admin} itself: the operator root's answer (a redirect to
        C{/admin/}).
        """
        return self.inner.render(request)

    def _audit(self, request, segments) -> None:
        try:
            self._record(request, segments)
        except Exception:  # noqa: BLE001 - logged; the answer is already sent
            from twisted.logger import Logger

            Logger().failure("recording an admin change failed", event="relay.admin_audit_failed")

    def _record(self, request, segments) -> None:
        status = getattr(request, "code", None) or getattr(request, "responseCode", None) or 200
        if not 200 <= status < 300:
            return
        note = notesOf(request).audit or {}
        names = [s.decode("utf-8", "replace") for s in segments]
        action, target = actionOf(request.method.decode("ascii", "replace"), names)
        account = note.get("account")
        if account is None and names and names[0] == "accounts":
            account = target
        principal = notesOf(request).operator
        self.trail.record(
            note.get("action") or action, account=account, address=clientAddress(request),
            status=status, requestId=requestIdOf(request), detail=note.get("detail"),
            target=note.get("target") or target,
            actor=getattr(principal, "actor", None) or "admin-key",
        )
