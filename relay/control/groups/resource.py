# -*- test-case-name: tests.test_control_keys -*-
"""
C{/admin/groups} and below, behind the admin key (R99):
C{GET /admin/groups}, C{GET}, C{PUT} and C{DELETE /admin/groups/{name}}
(the rules: L{relay.control.groups.service.GroupService}).
"""

from __future__ import annotations

from relay.control.web import ServiceLeaf, clientAddress, deliver, notFound, pathId, readJSONBody
from relay.console.fields import STRING, listOf

GROUP_BODY = {"accounts": listOf(STRING), "label": STRING}
"""The JSON types of a group's body (L{relay.console.fields})."""

__all__ = ["GroupsResource"]


class GroupsResource(ServiceLeaf):
    """
    See the module docstring.
    """

    def render_GET(self, request):
        path = request.postpath
        if path in ([], [b""]):
            return deliver(request, self.service.list, "reading the groups")
        if len(path) == 1:
            return deliver(request, lambda: (200, {"group": self.service.view(
                pathId(path[0]))}), "reading a group")
        return deliver(request, notFound, "reading a group")

    def render_PUT(self, request):
        path = request.postpath
        if len(path) != 1 or not path[0]:
            return deliver(request, notFound, "changing a group")
        note = self._note(request)
        address = clientAddress(request)
        return deliver(request, lambda: self.service.put(
            pathId(path[0]), readJSONBody(request, fields=GROUP_BODY,
                                          code="invalid_group"), address, note),
            "changing a group")

    def render_DELETE(self, request):
        path = request.postpath
        if len(path) != 1 or not path[0]:
            return deliver(request, notFound, "deleting a group")
        note = self._note(request)
        address = clientAddress(request)
        return deliver(request, lambda: self.service.delete(pathId(path[0]), address, note),
                       "deleting a group")
