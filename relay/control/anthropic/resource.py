# -*- test-case-name: tests.test_anthropic -*-
"""
C{/admin/anthropic_models}, behind the admin key (R99): C{GET} and C{PUT}
(the rules: L{relay.control.anthropic.service.AnthropicModelsService}).
"""

from __future__ import annotations

from relay.control.web import ServiceLeaf, clientAddress, deliver, notFound, readJSONBody
from relay.console.fields import STRING, mapOf

__all__ = ["ANTHROPIC_MODELS_BODY", "AnthropicModelsResource"]

ANTHROPIC_MODELS_BODY = {"anthropic_models": mapOf(STRING)}
"""The JSON types of C{PUT /admin/anthropic_models}."""


class AnthropicModelsResource(ServiceLeaf):
    """
    See the module docstring.
    """

    def render_GET(self, request):
        if request.postpath not in ([], [b""]):
            return deliver(request, notFound, "reading the anthropic models")
        return deliver(request, self.service.view, "reading the anthropic models")

    def render_PUT(self, request):
        if request.postpath not in ([], [b""]):
            return deliver(request, notFound, "setting the anthropic models")
        note = self._note(request)
        address = clientAddress(request)
        return deliver(request, lambda: self.service.replace(
            readJSONBody(request, fields=ANTHROPIC_MODELS_BODY,
                         code="invalid_anthropic_models"), address, note),
            "setting the anthropic models")
