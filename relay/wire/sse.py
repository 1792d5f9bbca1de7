# -*- test-case-name: tests.test_translate, tests.test_keepalive -*-
"""
Server-Sent Events framing for the relay's hot path (protocol.md 2.2).

The parser splits an upstream byte stream into events without decoding
JSON: it finds each event's C{type} from the C{event:} line, or by scanning
the C{data:} JSON for its C{"type"} key. JSON is parsed only where a rule
needs it (before the first output, and the terminal event).
"""

from __future__ import annotations

from typing import Callable, Optional

from relay.wire.jsoncodec import loads

TERMINAL_TYPES = frozenset(
    {
        b"response.completed",
        b"response.incomplete",
        b"response.failed",
        b"response.done",
        b"response.cancelled",
        b"response.canceled",
    }
)
"""Responses stream events that end a turn (protocol.md 2.5)."""

DONE = b"[DONE]"
"""The chat completions end marker, used as the type of a C{data: [DONE]} event."""

_TYPE_KEY = b'"type"'


def sniffType(data: bytes) -> bytes:
    """
    Find the value of the first C{"type"} key in a JSON object without
    parsing it.

    @param data: the JSON text of one event.
    @return: the type as bytes, C{b"[DONE]"} for the chat end marker, or
        C{b""} when none is found.
    """
    if data[:6] == DONE:
        return DONE
    i = data.find(_TYPE_KEY)
    if i < 0:
        return b""
    i = data.find(b'"', i + 6)
    if i < 0:
        return b""
    j = data.find(b'"', i + 1)
    if j < 0:
        return b""
    return data[i + 1 : j]


class Event:
    """
    One SSE event.

    @ivar type: the event type, bytes (C{b"response.completed"}).
    @ivar data: the JSON text of the event, bytes.
    @ivar raw: the event's wire bytes in relay's output framing
        (C{event:} + C{data:} + blank line), or L{None} until asked for.
    """

    __slots__ = ("type", "data", "_raw", "_parsed")

    def __init__(self, type: bytes, data: bytes, raw: Optional[bytes] = None):
        self.type = type
        self.data = data
        self._raw = raw
        self._parsed = None

    @property
    def raw(self) -> bytes:
        """
        The event framed as C{event: T\\ndata: D\\n\\n} (protocol.md 2.2:
        relay emits C{event:} + C{data:} pairs). Reuses the upstream bytes
        when they were already in that form.
        """
        if self._raw is None:
            if self.type and self.type != DONE:
                self._raw = b"event: " + self.type + b"\ndata: " + self.data + b"\n\n"
            else:
                self._raw = b"data: " + self.data + b"\n\n"
        return self._raw

    def json(self) -> dict:
        """
        @return: the parsed event (cached); C{{}} for non-JSON data.
        """
        if self._parsed is None:
            try:
                parsed = loads(self.data)
            except ValueError:
                parsed = {}
            self._parsed = parsed if isinstance(parsed, dict) else {}
        return self._parsed

    @property
    def terminal(self) -> bool:
        """
        Whether this event ends a Responses turn or a chat stream.
        """
        return self.type in TERMINAL_TYPES or self.type == DONE

    def __repr__(self) -> str:
        return f"<Event {self.type!r} {len(self.data)} bytes>"


def eventFromJSON(data: bytes) -> Event:
    """
    Make an L{Event} from one JSON message (a WebSocket frame).

    @param data: JSON text.
    """
    return Event(sniffType(data), data)


class SSEParser:
    """
    Incremental SSE splitter. Feed bytes; get complete events.

    Accepts C{event:}+C{data:} events and data-only events, C{\\r\\n} line
    ends, comments (lines starting with C{:}) and a trailing C{[DONE]}
    (protocol.md 2.2).

    @ivar maxLine: the largest pending event in bytes before L{feed} raises
        L{LineTooLong} (behaviour.md R22: 40 MiB line cap).
    """

    def __init__(self, maxLine: int = 40 * 2**20):
        self._buf = b""
        self.maxLine = maxLine

    def feed(self, chunk: bytes) -> list:
        """
        @param chunk: bytes from upstream.
        @return: a list of complete L{Event}s.
        @raise LineTooLong: a pending event grew past C{maxLine}.
        """
        if 13 in chunk:  # b"\r" by its int value: no TypeError raised and cleared
            chunk = chunk.replace(b"\r\n", b"\n")
        buf = self._buf + chunk if self._buf else chunk
        events = []
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            ev = _parseBlock(buf, start, end)
            if ev is not None:
                events.append(ev)
            start = end + 2
        self._buf = buf[start:]
        if len(self._buf) > self.maxLine:
            raise LineTooLong(len(self._buf))
        return events

    def feedWhile(self, chunk: bytes, handle: Callable, more: Callable[[], bool]) -> bytes:
        """
        Like L{feed}, but hand each complete event to C{handle} at once,
        and only while C{more()} is true (the stream pump parses
        events one by one only until the first output, and passes the rest
        of the read through).

        @param chunk: bytes from upstream.
        @param handle: called with each L{Event}.
        @param more: checked before each event.
        @return: the bytes after the last event handled when C{more()}
            turned false (the parser keeps none of them); else C{b""} (an
            incomplete tail stays in the parser, as with L{feed}).
        @raise LineTooLong: the pending event grew past C{maxLine}.
        """
        if 13 in chunk:  # b"\r" by its int value: no TypeError raised and cleared
            chunk = chunk.replace(b"\r\n", b"\n")
        buf = self._buf + chunk if self._buf else chunk
        self._buf = b""
        start = 0
        while more():
            end = buf.find(b"\n\n", start)
            if end < 0:
                self._buf = buf[start:]
                if len(self._buf) > self.maxLine:
                    raise LineTooLong(len(self._buf))
                return b""
            ev = _parseBlock(buf, start, end)
            start = end + 2
            if ev is not None:
                handle(ev)
        return buf[start:]

    @property
    def pending(self) -> int:
        """
        Bytes held that do not yet form a complete event.
        """
        return len(self._buf)


class LineTooLong(Exception):
    """
    An SSE event exceeded the line guard (behaviour.md R22).
    """


def _parseBlock(buf: bytes, start: int, end: int) -> Optional[Event]:
    """
    Parse C{buf[start:end]}, one SSE block without its blank line.
    """
    if buf.startswith(b"event: ", start):
        nl = buf.find(b"\n", start)
        if nl < 0 or nl > end:
            return None
        etype = buf[start + 7 : nl]
        if buf.startswith(b"data: ", nl + 1) and buf.find(b"\n", nl + 1, end) < 0:
            # The common case: exactly one event line and one data line.
            return Event(etype, buf[nl + 7 : end], buf[start : end + 2])
    block = buf[start:end]
    etype = b""
    data = []
    for line in block.split(b"\n"):
        if not line or line[:1] == b":":
            continue
        name, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if name == b"event":
            etype = value
        elif name == b"data":
            data.append(value)
    if not data:
        return None
    payload = b"\n".join(data)
    if etype and payload[:6] != DONE:
        return Event(etype, payload)
    etype = sniffType(payload)
    if etype.startswith(b"response."):
        return Event(etype, payload)  # framed with an event: line on output
    # Data-only events that are not Responses events (chat chunks, [DONE])
    # stay data-only (protocol.md 3): never synthesise an event: line.
    return Event(etype, payload, b"data: " + payload + b"\n\n")
