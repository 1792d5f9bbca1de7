# -*- test-case-name: tests.test_emulator -*-
"""
The emulator's Chat Completions endpoint (C{POST /v1/chat/completions}):
the scripted reply as one completion or as SSE chunks, with the HTTP
faults of L{relay.emulator.http.EmulatorResource}.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.web.server import NOT_DONE_YET

from relay.emulator.httpwire import (
    Route,
    breakAfter,
    dropConnection,
    lowerHeaders,
    streamErrorBody,
)
from relay.emulator.refusals import refusalOf
from relay.emulator.state import HTTP, chatChunks, chooseReply
from relay.emulator.stream import EventPump, TurnTracker, stallOf


class ChatCompletions(Route):
    """
    C{POST /v1/chat/completions} of L{relay.emulator.http.EmulatorResource}.

    @ivar emulator: the owning emulator.
    """

    def post(self, request: Any) -> Any:
        """
        Answer a Chat Completions POST.

        @param request: the request.
        @return: the body or C{NOT_DONE_YET}.
        """
        ok, body = self._resource._parseBody(request)
        credential, denied = self._resource._credential(request)
        self._resource._record(request, HTTP, "request", credential, body)
        if denied is not None:
            return self._resource._json(request, 401, denied)
        if not ok or not isinstance(body, dict):
            return self._resource._json(request, 400, {"error": {
                "message": "We could not parse the JSON body of your request.",
                "type": "invalid_request_error", "code": None, "param": None}})
        draw = self.emulator.arrive(credential, HTTP, body, lowerHeaders(request))
        stream = body.get("stream") is True
        answer, fault = self._resource._admit(request, credential, draw, body, "chat")
        if answer is not None:
            return answer
        if fault is not None and fault.kind == "refuse":
            # Chat Completions refuses before it streams: always the HTTP status.
            refusal = refusalOf(fault, body, "chat", credential)
            if refusal is not None:
                return self._resource._json(request, refusal.status, refusal.body)
            fault = None
        if fault is not None and fault.kind == "hang_after_headers":
            return self._resource._hangAfterHeaders(request, credential, stream)
        script = self._state.scriptFor(credential)
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        reply = chooseReply(script, messages, self._state.nameOf(credential),
                            body.get("model") or "")
        options = body.get("stream_options") or {}
        includeUsage = bool(options.get("include_usage")) if isinstance(options, dict) else False
        chunks, completion = chatChunks(body, reply, self.emulator.clock.seconds(),
                                        includeUsage, script.argumentDeltas, script.usage)
        kind = fault.kind if fault is not None else None
        tracker = TurnTracker(self._state, credential)
        firstDelay = float(fault.get("seconds", 0)) if kind == "delay_first_output" else 0.0
        cutAfter, cleanEnd = breakAfter(fault)

        def complete() -> None:
            self.emulator.generated(draw, credential, completion)

        if not stream:
            if kind == "empty_completed":
                completion["choices"][0]["message"]["content"] = ""
                completion.pop("usage")
            if kind == "stream_error":
                tracker.end()
                return self._resource._json(request, 500, streamErrorBody(fault))
            generation = script.delay * max(0, len(chunks) - 1)
            return self._resource._nonStream(request, tracker, completion, firstDelay + generation,
                                             cutAfter, cleanEnd, complete)
        frames = [b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n"
                  for c in chunks]
        if kind == "stream_error":
            frames = frames[:1] + [
                b"data: " + json.dumps(streamErrorBody(fault)).encode() + b"\n\n"]
        elif kind == "empty_completed":
            frames = frames[:1] + frames[-1:] if not includeUsage else frames[:1] + frames[-2:-1]
            frames.append(b"data: [DONE]\n\n")
        else:
            frames.append(b"data: [DONE]\n\n")
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        request.write(b"")

        finish = self._resource._finisher(request, tracker)

        def cut() -> None:
            tracker.end()
            dropConnection(request)

        pump = EventPump(
            clock=self.emulator.clock, events=frames, send=request.write,
            finish=self._resource._finisher(request, tracker,
                                            None if kind == "stream_error" else complete),
            cut=finish if cleanEnd else cut, beforeTerminal=tracker.end,
            delay=script.delay, firstOutput=1, firstDelay=firstDelay, cutAfter=cutAfter,
            **stallOf(fault),
        )
        self._resource._watch(request, tracker, pump)
        pump.start()
        return NOT_DONE_YET
