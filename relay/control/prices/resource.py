# -*- test-case-name: tests.test_control_keys -*-
"""
C{/admin/prices} and below (issue 22), behind the admin key (R99):
C{GET /admin/prices}, C{PUT /admin/prices}, C{PUT} and C{DELETE
/admin/prices/{model}} (the rules: L{relay.control.prices.service.PriceService}).
"""

from __future__ import annotations

from relay.control.web import ServiceLeaf, clientAddress, deliver, notFound, pathId, readJSONBody

__all__ = ["PricesResource"]


class PricesResource(ServiceLeaf):
    """
    See the module docstring.
    """

    def render_GET(self, request):
        if request.postpath not in ([], [b""]):
            return deliver(request, notFound, "reading the prices")
        return deliver(request, self.service.view, "reading the prices")

    def render_PUT(self, request):
        path = request.postpath
        note = self._note(request)
        address = clientAddress(request)
        if path in ([], [b""]):
            return deliver(request, lambda: self.service.replace(
                readJSONBody(request), address, note), "setting the prices")
        if len(path) == 1:
            return deliver(request, lambda: self.service.setOne(
                pathId(path[0]), readJSONBody(request), address, note), "setting a price")
        return deliver(request, notFound, "setting a price")

    def render_DELETE(self, request):
        path = request.postpath
        if len(path) != 1 or not path[0]:
            return deliver(request, notFound, "removing a price")
        note = self._note(request)
        address = clientAddress(request)
        return deliver(request, lambda: self.service.deleteOne(
            pathId(path[0]), address, note), "removing a price")
