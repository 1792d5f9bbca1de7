# -*- test-case-name: tests.test_control_keys -*-
"""
C{/admin/keys} and below, behind the admin key (R99):

  - C{GET /admin/keys} - every key (file and admin) with its policy, state,
    usage and cost: C{{"keys": [view], "now"}};
  - C{POST /admin/keys} - issue a key: 201 C{{"key": view, "secret"}}, the
    secret shown this once;
  - C{GET /admin/keys/{name}} - one key: C{{"key": view}};
  - C{PATCH /admin/keys/{name}} - change an admin key's policy or label;
  - C{DELETE /admin/keys/{name}} - revoke an admin key;
  - C{POST /admin/keys/{name}/disable} (optional body C{{"reason"}}) and
    C{POST /admin/keys/{name}/enable} - any key.

The rules are L{relay.control.keys.service.KeyService}'s; each change
leaves its audit details on the request (C{request.notes.audit}) for
L{relay.control.audit} (never the secret).
"""

from __future__ import annotations

from relay.control.web import ServiceLeaf, clientAddress, deliver, notFound, pathId, readJSONBody
from relay.console.fields import BOOLEAN, INTEGER, NUMBER, REASON_BODY, STRING, listOf, oneOf

__all__ = ["KEY_BODY", "KeysResource"]

KEY_BODY = {
    **{name: STRING for name in ("name", "label", "group", "key", "key_env")},
    **{name: INTEGER for name in ("concurrency", "daily_tokens", "monthly_tokens", "rpm", "tpm")},
    **{name: listOf(STRING) for name in ("models", "deny_models", "accounts")},
    "daily_usd": NUMBER,
    "monthly_usd": NUMBER,
    "expires_at": oneOf(NUMBER, STRING),
    "disabled": BOOLEAN,
}
"""The JSON types of a key's body (C{POST}/C{PATCH /admin/keys}; the file's
C{keys[]} fields and C{label}), checked by L{relay.console.fields}."""


class KeysResource(ServiceLeaf):
    """
    See the module docstring.

    @ivar service: the L{relay.control.keys.service.KeyService}.
    """

    def render_GET(self, request):
        path = request.postpath
        if path in ([], [b""]):
            return deliver(request, self.service.list, "reading the keys")
        if len(path) == 1:
            return deliver(request, lambda: self.service.one(pathId(path[0])), "reading a key")
        return deliver(request, notFound, "reading a key")

    def render_POST(self, request):
        path = request.postpath
        address = clientAddress(request)
        if path in ([], [b""]):
            note = self._note(request)
            return deliver(request, lambda: self.service.create(
                readJSONBody(request, fields=KEY_BODY,
                             code="invalid_key"), address, note), "issuing a key")
        if len(path) == 2 and path[1] in (b"disable", b"enable"):
            note = self._note(request)
            disabled = path[1] == b"disable"
            return deliver(request, lambda: self.service.setDisabled(
                pathId(path[0]), disabled,
                readJSONBody(request, allowEmpty=True, fields=REASON_BODY,
                             code="invalid_key") if disabled else {},
                address, note),
                "disabling a key")
        return deliver(request, notFound, "changing a key")

    def render_PATCH(self, request):
        path = request.postpath
        if len(path) != 1 or not path[0]:
            return deliver(request, notFound, "changing a key")
        note = self._note(request)
        address = clientAddress(request)
        return deliver(request, lambda: self.service.update(
            pathId(path[0]), readJSONBody(request, fields=KEY_BODY,
                                          code="invalid_key"), address, note),
            "changing a key")

    def render_DELETE(self, request):
        path = request.postpath
        if len(path) != 1 or not path[0]:
            return deliver(request, notFound, "revoking a key")
        note = self._note(request)
        address = clientAddress(request)
        return deliver(request, lambda: self.service.delete(pathId(path[0]), address, note),
                       "revoking a key")
