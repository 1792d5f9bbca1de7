# -*- test-case-name: tests.test_anthropic -*-
"""
L{MessagesSink}: the turn sink of one attempt of a Messages turn
(behaviour.md R115).

Like L{relay.translate.sink.ChatCompletionsSink}: the engine's pump stages,
classifies and fails over on the upstream's Responses events exactly as for
C{/v1/responses} (R22, R23, R84), and this adapter, put in front of the
client's sink for one attempt, translates what the pump writes into the
Messages stream (L{relay.translate.anthropic.stream}) or, for a
non-streaming client, one message object. Nothing reaches the client before
the pump commits, so a failed attempt leaves no trace (R84).

A failed upstream turn becomes the error the chat route would give (R10,
L{relay.translate.sink.chatError}); the client's sink writes it in
Anthropic's shape (L{relay.translate.anthropic.errors}). No policy here.
"""

from __future__ import annotations

import json

from zope.interface import implementer

from relay.interfaces import ITurnSink
from relay.base.records import Turn
from relay.wire.sse import DONE, Event
from relay.translate.adapter import TranslatingSink
from relay.translate.anthropic.request import MessagesContext
from relay.translate.anthropic.stream import MessagesTranslator, foldMessage
from relay.translate.sink import chatError


def sseEvent(name: str, data: dict) -> Event:
    """
    @return: the L{Event} of one Messages stream event.
    """
    payload = json.dumps(data, separators=(",", ":")).encode("utf-8")
    raw = b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"
    return Event(name.encode(), payload, raw)


@implementer(ITurnSink)
class MessagesSink(TranslatingSink):
    """
    Writes Responses events to a Messages client (see the module docstring).

    @ivar committed: the engine committed this attempt's output.
    """

    def __init__(self, inner, turn: Turn):
        """
        @param inner: the client's L{ITurnSink} (SSE or JSON), built for
            C{endpoint="messages"}.
        @param turn: the Messages turn; C{turn.messages} is its
            L{MessagesContext}.
        """
        self._inner = inner
        self._stream = turn.stream
        context = turn.messages if isinstance(turn.messages, MessagesContext) else \
            MessagesContext(model=turn.model or "")
        self._translator = MessagesTranslator(context)
        self._events: list = []
        self._headers: dict = {}
        self._started = False
        self._done = False
        self.committed = False

    def writeEvent(self, event) -> None:
        if self._done or event.type == DONE:
            return
        parsed = event.json()
        out = self._translator.feed(parsed if isinstance(parsed, dict) else {})
        if self._translator.error is not None:
            self._fail(chatError(self._translator.error))
            return
        if self._stream:
            for name, data in out:
                self._send(name, data)
            if self._translator.finished:
                self._done = True
            return
        self._events.extend(out)
        if self._translator.finished:
            self._done = True
            body = json.dumps(foldMessage(self._events)).encode("utf-8")
            self._inner.writeBody(200, self._headers, body)

    def _send(self, name: str, data: dict) -> None:
        if not self._started:
            self._started = True
            self._inner.commit(self._headers)
        self._inner.writeEvent(sseEvent(name, data))

    def writeBody(self, status, headers, body) -> None:
        """
        A JSON upstream answer: a Responses object is translated like a
        terminal event; anything else goes through unchanged.
        """
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if status == 200 and isinstance(parsed, dict) and parsed.get("object") == "response":
            self._headers = dict(headers or {})
            kind = "response." + {"failed": "failed", "incomplete": "incomplete"}.get(
                parsed.get("status"), "completed")
            data = json.dumps({"type": kind, "response": parsed}).encode()
            self.writeEvent(Event(kind.encode(), data))
            return
        self._done = True
        self._inner.writeBody(status, headers, body)
