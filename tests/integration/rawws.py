"""
A WebSocket client driven frame by frame over a raw TCP connection (issue
19): it sends exactly the bytes a test builds -- a permessage-deflate
frame compressed ahead of time (a deflate bomb), a message whose last
frame never comes -- which a real client library would not. It reads
relay's frames (inflating compressed ones) and its close.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import zlib

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory, Protocol

DEFLATE_OFFER = "permessage-deflate; client_no_context_takeover; server_no_context_takeover"
"""No context takeover either way: every message inflates on its own."""

_TAIL = b"\x00\x00\xff\xff"


def deflateMessage(payload: bytes) -> bytes:
    """
    C{payload} compressed for one permessage-deflate message (RFC 7692:
    raw deflate, the final empty block's C{00 00 ff ff} removed).
    """
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    data = c.compress(payload) + c.flush(zlib.Z_SYNC_FLUSH)
    return data[:-4] if data.endswith(_TAIL) else data


def frame(payload: bytes, opcode: int = 1, fin: bool = True, compressed: bool = False) -> bytes:
    """
    One masked client frame.
    """
    first = (0x80 if fin else 0) | (0x40 if compressed else 0) | opcode
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", first, 0x80 | n)
    elif n < 2**16:
        head = struct.pack("!BBH", first, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", first, 0x80 | 127, n)
    mask = os.urandom(4)
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload)) if n < 4096 else _mask(
        payload, mask)
    return head + mask + body


def _mask(payload: bytes, mask: bytes) -> bytes:
    """
    XOR a long payload with the mask, at C speed.
    """
    n = len(payload)
    key = int.from_bytes((mask * (n // 4 + 1))[:n], "big")
    return (int.from_bytes(payload, "big") ^ key).to_bytes(n, "big")


class RawWebSocket(Protocol):
    """
    The client side: the handshake, then frames.

    @ivar opened: fires with the 101's header block, or fails.
    @ivar closed: fires with C{(code, reason)} of relay's close frame, or
        C{(None, "")} when the connection ended without one.
    @ivar messages: the text messages relay sent, parsed as JSON.
    """

    def __init__(self, path: str, headers: dict, deflate: bool):
        self.path, self.headers, self.deflate = path, headers, deflate
        self.opened = Deferred()
        self.closed = Deferred()
        self.messages = []
        self.pings = 0
        self._buffer = b""
        self._head = None
        self._closeInfo = None

    def connectionMade(self):
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [f"GET {self.path} HTTP/1.1", "Host: 127.0.0.1", "Upgrade: websocket",
                 "Connection: Upgrade", f"Sec-WebSocket-Key: {key}",
                 "Sec-WebSocket-Version: 13"]
        if self.deflate:
            lines.append(f"Sec-WebSocket-Extensions: {DEFLATE_OFFER}")
        lines += [f"{k}: {v}" for k, v in self.headers.items()]
        self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode())

    def dataReceived(self, data):
        self._buffer += data
        if self._head is None:
            head, sep, rest = self._buffer.partition(b"\r\n\r\n")
            if not sep:
                return
            self._head, self._buffer = head, rest
            if not head.startswith(b"HTTP/1.1 101"):
                self.opened.errback(Exception(head.decode("latin-1")))
                return
            self.compressing = b"permessage-deflate" in head.lower()
            self.opened.callback(head)
        self._frames()

    def _frames(self):
        while len(self._buffer) >= 2:
            b0, b1 = self._buffer[0], self._buffer[1]
            n, at = b1 & 0x7F, 2
            if n == 126:
                if len(self._buffer) < 4:
                    return
                n, at = struct.unpack("!H", self._buffer[2:4])[0], 4
            elif n == 127:
                if len(self._buffer) < 10:
                    return
                n, at = struct.unpack("!Q", self._buffer[2:10])[0], 10
            if len(self._buffer) < at + n:
                return
            payload, self._buffer = self._buffer[at:at + n], self._buffer[at + n:]
            opcode = b0 & 0x0F
            if b0 & 0x40:
                payload = zlib.decompressobj(-15).decompress(payload + _TAIL)
            if opcode == 1:
                self.messages.append(json.loads(payload))
            elif opcode == 8:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
                self._closeInfo = (code, payload[2:].decode("utf-8", "replace"))
                self.transport.write(frame(payload[:2], opcode=8))
                self.transport.loseConnection()
            elif opcode == 9:
                self.pings += 1
                self.transport.write(frame(payload, opcode=10))

    def send(self, payload: bytes, opcode: int = 1, fin: bool = True, compressed=False):
        self.transport.write(frame(payload, opcode, fin, compressed))

    def sendJSON(self, value) -> None:
        self.send(json.dumps(value).encode())

    def connectionLost(self, reason):
        if not self.opened.called:
            self.opened.errback(Exception("connection lost before the handshake"))
        if not self.closed.called:
            self.closed.callback(self._closeInfo or (None, ""))


async def rawWebSocket(port: int, key: str, path="/v1/responses", deflate=True,
                       headers=None) -> RawWebSocket:
    """
    Open a L{RawWebSocket} to relay on C{port} with C{key}.
    """
    hdrs = {"Authorization": f"Bearer {key}", **(headers or {})}
    proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5).connect(
        Factory.forProtocol(lambda: RawWebSocket(path, hdrs, deflate)))
    await proto.opened.addTimeout(5, reactor)
    return proto
