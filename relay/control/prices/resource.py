# -*- test-case-name: tests.test_control_keys -*-
"""
C{/admin/prices} and below, behind the admin key (R99):
C{GET /admin/prices}, C{PUT /admin/prices}, C{PUT} and C{DELETE
/admin/prices/{model}} (the rules: L{relay.control.prices.service.PriceService}).
"""

from __future__ import annotations

from relay.control.web import ServiceLeaf, clientAddress, deliver, notFound, pathId, readJSONBody
from relay.console.fields import NUMBER, mapOf, objectOf

__all__ = ["PRICES_BODY", "PRICE_BODY", "PricesResource"]

PRICE_BODY = {name: NUMBER for name in ("input", "cached_input", "output", "reasoning")}
"""The JSON types of one model's price (C{PUT /admin/prices/{model}})."""

PRICES_BODY = {"prices": mapOf(objectOf(PRICE_BODY))}
"""The JSON types of the whole table (C{PUT /admin/prices})."""


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
                readJSONBody(request, fields=PRICES_BODY,
                             code="invalid_price"), address, note), "setting the prices")
        if len(path) == 1:
            return deliver(request, lambda: self.service.setOne(
                pathId(path[0]), readJSONBody(request, fields=PRICE_BODY,
                                              code="invalid_price"), address, note),
                "setting a price")
        return deliver(request, notFound, "setting a price")

    def render_DELETE(self, request):
        path = request.postpath
        if len(path) != 1 or not path[0]:
            return deliver(request, notFound, "removing a price")
        note = self._note(request)
        address = clientAddress(request)
        return deliver(request, lambda: self.service.deleteOne(
            pathId(path[0]), address, note), "removing a price")
