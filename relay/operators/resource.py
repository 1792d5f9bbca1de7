# -*- test-case-name: tests.test_operators -*-
"""
C{/admin/operators}, behind the admin key or an owner's or admin's console
session (a viewer may read the list, never change it):

  - C{GET /admin/operators}: C{{"operators": [views], "me": {"name",
    "role", "via"}}} (a view never holds a hash; C{sessions}: how many
    are open);
  - C{POST /admin/operators} C{{"name", "role", "password"?, "email"?}}:
    add one (201);
  - C{PATCH /admin/operators/{name}} C{{"role"?, "password"?, "email"?}}:
    change its role, reset its password (its sessions end), change its
    e-mail;
  - C{DELETE /admin/operators/{name}}: remove it (its sessions end);
  - C{POST /admin/operators/{name}/signout}: end its sessions everywhere.

The rules are L{relay.operators.directory}'s and L{relay.operators.roles}'s
(only an owner manages owners). Every change is audited with its actor
(L{relay.control.audit}); the audit's detail names fields, never a
password.
"""

from __future__ import annotations

from relay.console.fields import STRING
from relay.control.web import (
    ControlError,
    ServiceLeaf,
    deliver,
    notFound,
    pathId,
    readJSONBody,
)
from relay.base.requestnotes import notesOf
from relay.operators.roles import ADMIN_KEY, mayManage

__all__ = ["OPERATOR_BODY", "OperatorsResource"]

OPERATOR_BODY = {"name": STRING, "role": STRING, "password": STRING, "email": STRING}
"""The JSON types of an operator's body (L{relay.console.fields})."""


def _actor(request):
    return notesOf(request).operator or ADMIN_KEY


class OperatorsResource(ServiceLeaf):
    """
    See the module docstring. C{service} is the
    L{relay.interfaces.IOperatorDirectory}; C{sessions} the
    L{relay.interfaces.IOperatorSessions}.
    """

    def __init__(self, adminKey, directory, sessions):
        super().__init__(adminKey, directory)
        self.sessions = sessions

    def render_GET(self, request):
        if request.postpath not in ([], [b""]):
            return deliver(request, notFound, "reading the operators")
        actor = _actor(request)
        return deliver(request, lambda: (200, {
            "operators": [dict(view, sessions=len(self.sessions.byOperator(view["name"])))
                          for view in self.service.list()],
            "me": {"name": actor.name, "role": actor.role, "via": actor.via}}),
            "reading the operators")

    def render_POST(self, request):
        path = request.postpath
        note = self._note(request)
        actor = _actor(request)
        if path in ([], [b""]):
            async def add():
                body = readJSONBody(request, fields=OPERATOR_BODY, code="invalid_operator")
                for field in body:
                    if field not in OPERATOR_BODY:
                        raise ControlError(400, "invalid_operator", f"unknown field {field}",
                                           field)
                note.update(target=body.get("name"),
                            detail={"fields": sorted(body), "role": body.get("role")})
                view = await self.service.add(body.get("name"), body.get("role"),
                                              body.get("password"), body.get("email"), actor)
                return 201, {"operator": view}

            return deliver(request, add, "adding an operator")
        if len(path) == 2 and path[1] == b"signout":
            async def signout():
                name = pathId(path[0])
                note.update(target=name)
                view = self.service.find(name)
                if view is None:
                    return notFound()
                refused = mayManage(actor, view["role"])
                if refused:
                    raise ControlError(403, "forbidden", refused)
                return 200, {"ended": await self.sessions.revokeOperator(name)}

            return deliver(request, signout, "signing an operator out")
        return deliver(request, notFound, "changing an operator")

    def render_PATCH(self, request):
        path = request.postpath
        if len(path) != 1 or not path[0]:
            return deliver(request, notFound, "changing an operator")
        note = self._note(request)
        actor = _actor(request)

        async def change():
            name = pathId(path[0])
            body = readJSONBody(request, fields=OPERATOR_BODY, code="invalid_operator")
            note.update(target=name, detail={"fields": sorted(body), "role": body.get("role")})
            view, revoke = await self.service.change(name, body, actor)
            ended = await self.sessions.revokeOperator(name) if revoke else 0
            return 200, {"operator": view, "sessions_ended": ended}

        return deliver(request, change, "changing an operator")

    def render_DELETE(self, request):
        path = request.postpath
        if len(path) != 1 or not path[0]:
            return deliver(request, notFound, "removing an operator")
        note = self._note(request)
        actor = _actor(request)

        async def remove():
            name = pathId(path[0])
            note.update(target=name)
            await self.service.remove(name, actor)
            ended = await self.sessions.revokeOperator(name)
            return 200, {"deleted": name, "sessions_ended": ended}

        return deliver(request, remove, "removing an operator")
