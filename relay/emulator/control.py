# -*- test-case-name: tests.test_emulator -*-
"""
The emulator's control API, C{/_emulator/*} (see L{relay.emulator}): the
recorded requests, stats, faults, scripts, OAuth and login faults, chaos,
the turn ledger and the peaks.
"""

from __future__ import annotations

from typing import Any

from relay.emulator.httpwire import Route


class ControlAPI(Route):
    """
    C{/_emulator/*} of L{relay.emulator.http.EmulatorResource}.

    @ivar emulator: the owning emulator.
    """

    def render(self, request: Any, path: str) -> bytes:
        """
        Serve the C{/_emulator/} control API (see L{relay.emulator}).

        @param request: the request.
        @param path: the normalised path.
        @type path: L{str}
        @rtype: L{bytes}
        """
        parts = path.split("/")[2:]
        method = request.method
        emulator = self.emulator
        try:
            if parts == ["requests"] and method == b"GET":
                return self._resource._json(request, 200, [r.toJSON() for r in emulator.requests])
            if parts == ["requests"] and method == b"DELETE":
                emulator.clearRequests()
                return self._resource._json(request, 200, {"ok": True})
            if parts == ["stats"] and method == b"GET":
                return self._resource._json(request, 200, emulator.state.stats())
            if parts == ["faults"] and method == b"GET":
                return self._resource._json(request, 200, emulator.state.faults())
            if parts == ["faults"] and method == b"DELETE":
                emulator.clearFaults()
                return self._resource._json(request, 200, {"ok": True})
            if len(parts) == 2 and parts[0] in ("faults", "scripts") and method in (
                    b"PUT", b"DELETE"):
                ok, body = self._resource._parseBody(request)
                if not ok:
                    return self._resource._json(request, 400, {"error": "invalid JSON"})
                if method == b"DELETE":
                    body = None
                if parts[0] == "faults":
                    emulator.setFault(parts[1], body)
                else:
                    emulator.setScript(parts[1], body)
                return self._resource._json(request, 200, {"ok": True})
            if parts == ["oauth"] and method == b"GET":
                return self._resource._json(request, 200, emulator.oauth.stats())
            if parts == ["oauth", "release"] and method == b"POST":
                return self._resource._json(request, 200, {"released": emulator.oauth.release()})
            if parts == ["oauth", "login"] and method == b"GET":
                return self._resource._json(request, 200, emulator.oauth.login.status())
            if parts == ["oauth", "login"] and method in (b"PUT", b"DELETE"):
                ok, body = self._resource._parseBody(request)
                if not ok:
                    return self._resource._json(request, 400, {"error": "invalid JSON"})
                emulator.oauth.login.setFault(None if method == b"DELETE" else body)
                return self._resource._json(request, 200, {"ok": True})
            if parts == ["oauth", "device", "approve"] and method == b"POST":
                ok, body = self._resource._parseBody(request)
                if not ok or not isinstance(body, dict):
                    return self._resource._json(request, 400, {"error": "expected a JSON object"})
                done, message = emulator.oauth.login.approve(
                    str(body.get("user_code", "")), body.get("account"),
                    body.get("decision", "allow"))
                return self._resource._json(request, 200 if done else 400,
                                            {"ok": done, "message": message})
            if len(parts) == 3 and parts[:2] == ["oauth", "faults"] and method in (
                    b"PUT", b"DELETE"):
                ok, body = self._resource._parseBody(request)
                if not ok:
                    return self._resource._json(request, 400, {"error": "invalid JSON"})
                emulator.oauth.setFault(parts[2], None if method == b"DELETE" else body)
                return self._resource._json(request, 200, {"ok": True})
            if parts == ["chaos"] and method == b"GET":
                chaos = emulator.chaos
                return self._resource._json(
                    request, 200, chaos.toJSON() if chaos is not None else None
                )
            if parts == ["chaos"] and method in (b"PUT", b"DELETE"):
                ok, body = self._resource._parseBody(request)
                if not ok:
                    return self._resource._json(request, 400, {"error": "invalid JSON"})
                emulator.setChaos(None if method == b"DELETE" else body)
                return self._resource._json(request, 200, {"ok": True})
            if parts == ["turns"] and method == b"GET":
                return self._resource._json(request, 200, emulator.ledger.toJSON())
            if parts == ["generations"] and method == b"GET":
                return self._resource._json(request, 200, {
                    "total": emulator.ledger.total,
                    "by_account": dict(emulator.ledger.byAccount),
                    "generations": list(emulator.ledger.usage)})
            if parts == ["turns"] and method == b"DELETE":
                emulator.ledger.clear()
                return self._resource._json(request, 200, {"ok": True})
            if parts == ["peaks"] and method == b"DELETE":
                emulator.state.resetPeaks()
                return self._resource._json(request, 200, {"ok": True})
        except ValueError as e:
            return self._resource._json(request, 400, {"error": str(e)})
        return self._resource._json(request, 404, {"error": "unknown control endpoint"})
