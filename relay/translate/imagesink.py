# -*- test-case-name: tests.test_media -*-
"""
L{ImagesSink}: the turn sink of an images turn on an OAuth account
(behaviour.md R115).

The engine runs the turn as a Responses turn (L{relay.translate.media.imagesToResponses})
and its pump stages, classifies and fails over on the upstream's events as
on any turn; this adapter, put in front of the client's JSON sink for that
one attempt, collects the C{image_generation_call} items and, at the
terminal event, writes the images API's answer (L{relay.translate.media.imagesAnswer}).
Nothing reaches the client before the terminal event, so a failed attempt
leaves no trace. A failed upstream turn becomes OpenAI's error envelope
(L{relay.translate.sink.chatError}); a turn that ends without an image is a
502 C{api_error}. It counts the images it saw into the turn's
C{hostedCalls} (C{image_generation}), read when the usage is recorded (R109).
Transport adapter only; no policy.
"""

from __future__ import annotations

import json

from zope.interface import implementer

from relay.base.records import ClientError, Turn
from relay.interfaces import ITurnSink
from relay.translate.adapter import TranslatingSink
from relay.translate.assemble import ResponseAssembler
from relay.translate.media import imagesAnswer
from relay.translate.sink import chatError

NO_IMAGE_MESSAGE = "The upstream finished without making an image."

_ITEM_DONE = b"response.output_item.done"


@implementer(ITurnSink)
class ImagesSink(TranslatingSink):
    """
    Writes a Responses turn to an images client (see the module docstring).

    @ivar committed: the engine committed this attempt's output.
    """

    holdsOutput = True

    def __init__(self, inner, turn: Turn, now: float):
        """
        @param inner: the client's JSON L{ITurnSink}.
        @param turn: the images turn (its C{hostedCalls} is set here).
        @param now: clock seconds, for C{created}.
        """
        self._inner = inner
        self._turn = turn
        self._created = int(now)
        self._assembler = ResponseAssembler()
        self._items: list = []
        self._headers: dict = {}
        self._done = False
        self.committed = False
        if turn.hostedCalls is None:
            turn.hostedCalls = {}
        turn.hostedCalls.pop("image_generation", None)  # this attempt's only

    def writeEvent(self, event) -> None:
        if self._done:
            return
        if event.type == _ITEM_DONE:
            parsed = event.json()
            item = parsed.get("item") if isinstance(parsed, dict) else None
            if isinstance(item, dict) and item.get("type") == "image_generation_call":
                self._items.append(item)
                calls = self._turn.hostedCalls
                calls["image_generation"] = calls.get("image_generation", 0) + 1
            return
        if event.type == b"error":
            parsed = event.json()
            parsed = parsed if isinstance(parsed, dict) else {}
            error = parsed.get("error") if isinstance(parsed.get("error"), dict) else parsed
            self._fail(chatError(error))
            return
        if not event.terminal or event.type == b"[DONE]":
            return
        parsed = event.json()
        parsed = parsed if isinstance(parsed, dict) else {}
        response = parsed.get("response") if isinstance(parsed.get("response"), dict) else {}
        if event.type == b"response.failed":
            error = response.get("error") if isinstance(response.get("error"), dict) else {}
            self._fail(chatError(error))
            return
        self._answer(response)

    def _answer(self, response: dict) -> None:
        items = self._items or [i for i in response.get("output") or [] if isinstance(i, dict)]
        answer = imagesAnswer(items, response, self._created)
        if answer is None:
            self._fail(ClientError(502, "api_error", NO_IMAGE_MESSAGE, code="no_image"))
            return
        self._done = True
        self._inner.writeBody(200, self._headers, json.dumps(answer).encode("utf-8"))

    def writeBody(self, status, headers, body) -> None:
        """
        A non-streaming upstream answer (not expected: OAuth accounts
        stream): a Responses object is answered like a terminal event.
        """
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if status == 200 and isinstance(parsed, dict) and parsed.get("object") == "response":
            self._headers = dict(headers or {})
            self._answer(parsed)
            return
        self._done = True
        self._inner.writeBody(status, headers, body)
