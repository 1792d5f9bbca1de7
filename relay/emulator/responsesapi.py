# -*- test-case-name: tests.test_emulator_responsesapi -*-
"""
The emulator's Responses routes beyond the turn itself (protocol.md 1, 2.8; behaviour.md
R87-R92): remote compaction, stored and background responses (retrieve, stream resume,
delete, input items, cancel), input token counts, and the Codex models manifest with its
ETag.

What each account type serves, as the real upstreams do:

  - API-key route (C{/v1/responses/...}): C{POST compact} (the compacted window: the user
    messages, then one account-bound C{compaction} item), C{POST input_tokens},
    C{GET}/C{DELETE {id}}, C{GET {id}/input_items}, C{POST {id}/cancel};
  - OAuth route (C{/backend-api/codex/responses/...}): none of them. The ChatGPT backend
    retired C{/responses/compact} (404) and stores nothing (C{store: false} is forced), so a
    response id is unknown there. It serves the Codex models manifest
    (C{GET /backend-api/codex/models?client_version=...}) with an C{ETag}, and answers
    C{If-None-Match} with 304.

None of these is a generation; the emulator's counters show it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from twisted.web.server import NOT_DONE_YET

from relay.emulator.httpwire import lowerHeaders
from relay.emulator.sealing import seal
from relay.emulator.state import (
    HTTP,
    estimateTokens,
    inputError,
    newId,
    normaliseInput,
    sseFrame,
    usageFor,
)
from relay.emulator.stored import (
    ACTIVE,
    StoredResponse,
    backgroundEvents,
    inputItemsWithIds,
    listPage,
    resolveItems,
)
from relay.emulator.stream import EventPump

COMPACT = "compact"
INPUT_TOKENS = "input_tokens"

REASONING_LEVELS = ("low", "medium", "high")


def notFound(responseId: str) -> dict:
    """
    The 404 body for a response id the account does not have.
    """
    return {"error": {"message": f"Response with id '{responseId}' not found.",
                      "type": "invalid_request_error", "param": None, "code": None}}


def queryOf(request: Any) -> dict:
    """
    The query parameters of a request, first value of each, as strings.
    """
    return {k.decode("latin-1"): v[0].decode("latin-1")
            for k, v in (request.args or {}).items() if v}


def modelsManifest(models: tuple) -> dict:
    """
    The Codex models manifest (C{{"models": [...]}}, protocol.md 7.2) for a list of slugs.
    """
    return {"models": [
        {
            "slug": slug,
            "display_name": slug,
            "description": f"{slug} (relay emulator)",
            "default_reasoning_level": "medium",
            "supported_reasoning_levels": [
                {"effort": level, "description": f"{level} reasoning"}
                for level in REASONING_LEVELS
            ],
            "shell_type": "shell_command",
            "visibility": "list",
            "supported_in_api": True,
            "priority": index,
            "context_window": 272000,
        }
        for index, slug in enumerate(models)
    ]}


def manifestETag(manifest: dict) -> str:
    """
    The strong ETag of a manifest: a digest of its JSON.
    """
    raw = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return '"' + hashlib.sha256(raw).hexdigest()[:32] + '"'


def compactedWindow(body: dict, account: str, now: float, pinned: dict | None) -> dict:
    """
    The answer of C{POST /v1/responses/compact} (protocol.md 1): the user messages of the
    input, then one C{compaction} item bound to the account.

    @param body: the compact request (C{model}, C{input}, C{instructions}, ...).
    @param account: the serving account's name.
    @param pinned: the script's pinned usage, or L{None}.
    """
    items = normaliseInput(body.get("input"))
    users = [dict(item, id=item.get("id") or newId("msg"), status="completed")
             for item in inputItemsWithIds(items)
             if item.get("type") == "message" and item.get("role") == "user"]
    compaction = {"type": "compaction", "id": newId("cmp"),
                  "encrypted_content": seal(account, "compaction")}
    inputTokens = estimateTokens(items) + estimateTokens(body.get("instructions"))
    return {
        "id": newId("resp"),
        "object": "response.compaction",
        "created_at": int(now),
        "output": [*users, compaction],
        "usage": usageFor(inputTokens, max(1, inputTokens // 10), pinned),
    }


class ResponsesAPIMixin:
    """
    The sub-route handlers of L{relay.emulator.http.EmulatorResource} (mixed in; it provides
    C{emulator}, C{_state}, C{_json}, C{_parseBody}, C{_credential}, C{_record}, C{_admit},
    C{_hold}).
    """

    # -- dispatch -------------------------------------------------------------------

    def _subRoute(self, request: Any, route: str, rest: list) -> Any:
        """
        Answer C{/…/responses/<rest>}.

        @param route: C{apikey} or C{oauth}.
        @param rest: the path segments after C{responses}.
        """
        method = request.method
        if rest == [COMPACT] or rest == [INPUT_TOKENS]:
            if method != b"POST":
                return self._json(request, 405, {"error": {
                    "type": "invalid_request_error", "message": "Method not allowed"}})
            if route == "oauth":
                return self._unknownPath(request)
            if rest == [COMPACT]:
                return self._compact(request)
            return self._inputTokens(request)
        if len(rest) == 1 and method in (b"GET", b"DELETE"):
            return self._stored(request, route, rest[0], method)
        if len(rest) == 2 and rest[1] == "input_items" and method == b"GET":
            return self._stored(request, route, rest[0], b"ITEMS")
        if len(rest) == 2 and rest[1] == "cancel" and method == b"POST":
            return self._stored(request, route, rest[0], b"CANCEL")
        return self._unknownPath(request)

    def _unknownPath(self, request: Any) -> bytes:
        path = request.path.decode("latin-1")
        return self._json(request, 404, {"error": {
            "message": f"Invalid URL ({request.method.decode()} {path})",
            "type": "invalid_request_error", "code": None, "param": None}})

    def _authorised(self, request: Any, body: Any = None) -> tuple:
        """
        Authenticate and record a sub-route request.

        @return: C{(credential, answer)}; C{answer} is not L{None} when refused.
        """
        credential, denied = self._credential(request)
        self._record(request, HTTP, "request", credential, body)
        if denied is not None:
            return credential, self._json(request, 401, denied)
        return credential, None

    def _faulted(self, request: Any, credential: str | None, body: Any) -> Any:
        """
        Apply the faults that act before an answer (scripted first, then chaos), as for a
        turn; a sub-route is never a generation.

        @return: the answer when a fault (or an unknown key) answered, else L{None}.
        """
        draw = self.emulator.arrive(credential, HTTP, body, lowerHeaders(request))
        answer, fault = self._admit(request, credential, draw)
        if answer is not None:
            return answer
        if fault is not None and fault.kind in ("hang_after_headers",):
            return self._hangAfterHeaders(request, credential, False)
        return None

    # -- compact, input_tokens --------------------------------------------------------

    def _compact(self, request: Any) -> Any:
        """
        C{POST /v1/responses/compact}: the compacted window (not a generation; its usage is
        reported).
        """
        ok, raw = self._parseBody(request)
        credential, refused = self._authorised(request, raw)
        if refused is not None:
            return refused
        body, bad = self._jsonBody(request, ok, raw)
        if bad is not None:
            return bad
        answer = self._faulted(request, credential, body)
        if answer is not None:
            return answer
        if not isinstance(body.get("model"), str) or not body["model"]:
            return self._json(request, 400, {"error": {
                "message": "Missing required parameter: 'model'.",
                "type": "invalid_request_error", "code": "missing_required_parameter",
                "param": "model"}})
        name = self._state.nameOf(credential)
        items = normaliseInput(body.get("input"))
        resolved, missing = resolveItems(self.emulator.responses, "apikey", credential, items)
        if missing is not None:
            return self._json(request, 404, {"error": missing})
        if resolved is not items:
            body, items = dict(body, input=resolved), resolved
        error = inputError(items, name)
        if error is not None:
            return self._json(request, 400, {"error": error})
        script = self._state.scriptFor(credential)
        window = compactedWindow(body, name, self.emulator.clock.seconds(), script.usage)
        self.emulator.oauth.served(credential, window["usage"]["total_tokens"])
        return self._json(request, 200, window)

    def _jsonBody(self, request: Any, ok: bool, body: Any) -> tuple:
        """
        @return: C{(body, None)} for a JSON object body, else C{(None, 400 answer)}.
        """
        if not ok or not isinstance(body, dict):
            return None, self._json(request, 400, {"error": {
                "message": "We could not parse the JSON body of your request.",
                "type": "invalid_request_error", "code": None, "param": None}})
        return body, None

    def _inputTokens(self, request: Any) -> Any:
        """
        C{POST /v1/responses/input_tokens}: C{{"object": "response.input_tokens",
        "input_tokens": N}}, N as a turn with this body would report it.
        """
        ok, raw = self._parseBody(request)
        credential, refused = self._authorised(request, raw)
        if refused is not None:
            return refused
        body, bad = self._jsonBody(request, ok, raw)
        if bad is not None:
            return bad
        answer = self._faulted(request, credential, body)
        if answer is not None:
            return answer
        items = normaliseInput(body.get("input"))
        items, missing = resolveItems(self.emulator.responses, "apikey", credential, items)
        if missing is not None:
            return self._json(request, 404, {"error": missing})
        count = estimateTokens(items) + estimateTokens(body.get("instructions"))
        return self._json(request, 200, {"object": "response.input_tokens", "input_tokens": count})

    # -- stored responses -------------------------------------------------------------

    def _stored(self, request: Any, route: str, responseId: str, action: bytes) -> Any:
        """
        Retrieve (C{GET}, with C{?stream=true&starting_after=N} a stream), delete, list the
        input items of, or cancel a stored response of the caller's account.
        """
        body = None
        if action == b"CANCEL":
            ok, body = self._parseBody(request)
        credential, refused = self._authorised(request, body)
        if refused is not None:
            return refused
        answer = self._faulted(request, credential, body)
        if answer is not None:
            return answer
        stored = None if route == "oauth" else self.emulator.responses.get(credential, responseId)
        if stored is None:
            return self._json(request, 404, notFound(responseId))
        if action == b"DELETE":
            self.emulator.responses.delete(credential, responseId)
            return self._json(request, 200, {"id": responseId, "object": "response",
                                             "deleted": True})
        if action == b"ITEMS":
            try:
                page = listPage(stored.inputItems, queryOf(request))
            except ValueError as e:
                return self._json(request, 400, {"error": {
                    "message": str(e), "type": "invalid_request_error", "code": None,
                    "param": None}})
            return self._json(request, 200, page)
        if action == b"CANCEL":
            if not stored.background:
                return self._json(request, 400, {"error": {
                    "message": "Only responses created with background=true can be cancelled.",
                    "type": "invalid_request_error", "code": None, "param": None}})
            if stored.status in ACTIVE:
                stored.cancel(self.emulator.clock.seconds())
            elif stored.status != "cancelled":
                return self._json(request, 400, {"error": {
                    "message": f"Cannot cancel a response with status '{stored.status}'.",
                    "type": "invalid_request_error", "code": None, "param": None}})
            return self._json(request, 200, stored.snapshot())
        query = queryOf(request)
        if query.get("stream") == "true":
            try:
                after = int(query.get("starting_after", -1))
            except ValueError:
                return self._json(request, 400, {"error": {
                    "message": "starting_after must be an integer",
                    "type": "invalid_request_error", "code": None, "param": "starting_after"}})
            return self._resume(request, stored, after)
        return self._json(request, 200, stored.snapshot())

    def _resume(self, request: Any, stored: StoredResponse, after: int) -> Any:
        """
        Stream a stored response's events after sequence number C{after}, then follow a
        running background response live to its end.
        """
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        request.write(b"")
        happened = [e for e in stored.happened() if e.get("sequence_number", -1) > after]
        if not happened and stored.status not in ACTIVE and stored.events:
            # A finished response answers at least its terminal event.
            happened = stored.events[-1:]
        for event in happened:
            request.write(sseFrame(event))
        if stored.status not in ACTIVE:
            request.finish()
            return NOT_DONE_YET

        def finish() -> None:
            if not request.finished and not getattr(request, "_emulatorGone", False):
                request.finish()

        forget = stored.listen(lambda event: request.write(sseFrame(event)), finish)

        def gone(_: Any) -> None:
            request._emulatorGone = True
            forget()

        request.notifyFinish().addErrback(gone)
        return NOT_DONE_YET

    def _keep(self, credential: str | None, turn: Any, body: dict,
              background: bool = False) -> StoredResponse:
        """
        Store a response the API-key route answered (C{store} not false) or runs in the
        background.
        """
        events = turn.events
        final = turn.final
        if background:
            events = backgroundEvents(events, turn.responseId, body,
                                      self.emulator.clock.seconds())
            final = dict(final, background=True)
        stored = StoredResponse(
            responseId=turn.responseId, credential=credential, body=body,
            inputItems=inputItemsWithIds(normaliseInput(body.get("input"))), events=events,
            final=final, background=background,
            status="queued" if background else final.get("status", "completed"),
            emitted=0 if background else len(events),
            createdAt=self.emulator.clock.seconds(),
        )
        self.emulator.responses.add(stored)
        return stored

    # -- background -------------------------------------------------------------------

    def _background(self, request: Any, credential: str | None, body: dict, turn: Any,
                    script: Any, stream: bool, complete: Any) -> Any:
        """
        C{background: true} (behaviour.md R88): answer C{queued} at once (or, streaming,
        follow the run live from its C{response.created}); the run goes on on the clock whatever
        the client does, and its whole delivery is the generation.
        """
        stored = self._keep(credential, turn, body, background=True)
        clock = self.emulator.clock

        def done() -> None:
            stored.stopRun = None
            if stored.status in ("completed", "incomplete") and complete is not None:
                complete()

        pump = EventPump(clock=clock, events=stored.events, send=stored.emit, finish=done,
                         delay=script.delay, firstOutput=3)
        call = clock.callLater(0, pump.start)

        def stop() -> None:
            if call.active():
                call.cancel()
            pump.stop()

        stored.stopRun = stop
        if not stream:
            return self._json(request, 200, stored.snapshot())
        return self._resume(request, stored, -1)

