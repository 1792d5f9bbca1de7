"""
Issue 13 items 2 and 3 over real sockets: compressed request bodies
(C{Content-Encoding} gzip, deflate, zstd and chains) are decoded before
routing and forwarded as plain JSON; corrupt ones get 400, unknown
encodings 415; C{gateway.max_request_body_bytes} answers 413 at once, from
the C{Content-Length} alone or as soon as a chunked or compressed body
crosses it, without storing the rest; and a 1 MB -> 1 GB bomb leaves a real
relay process's memory flat.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib

import pytest
import pytest_twisted
import treq
import zstandard
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater

from relay.entry import body as bodymodule
from tests.integration.harness import RELAY_KEY, startStack
from tests.integration.test_twistd import (
    CLIENT_KEY,
    goodConfig,
    removeConfig,
    startRelay,
    stopRelay,
    writeConfig,
)

MiB = 2**20
BODY = {"model": "gpt-5.5", "input": "compressed hello " * 50, "stream": False}
AUTH = {"Authorization": [f"Bearer {RELAY_KEY}"], "Content-Type": ["application/json"]}


def zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


ENCODERS = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
    "zstd": zstd,
    "gzip, zstd": lambda d: zstd(gzip.compress(d)),
}


async def post(stack, path, data, encoding=None, key=RELAY_KEY):
    headers = {"Authorization": [f"Bearer {key}"], "Content-Type": ["application/json"]}
    if encoding:
        headers["Content-Encoding"] = [encoding]
    response = await treq.post(stack.url + path, data, headers=headers)
    return response, await response.content()


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
@pytest_twisted.ensureDeferred
async def test_compressed_body_is_forwarded_as_plain_json(encoding):
    """
    A compressed body is decoded; the upstream gets plain JSON with its own
    length and no C{Content-Encoding}.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:
        raw = json.dumps(BODY).encode()
        response, data = await post(stack, "/v1/responses", ENCODERS[encoding](raw), encoding)
        assert response.code == 200, data
        assert json.loads(data)["status"] == "completed"
        [seen] = stack.emulator.requestsFor("sk-emu-a1")
        assert seen.body["input"] == BODY["input"]
        assert "content-encoding" not in seen.headers
        sent = json.dumps(seen.body, separators=(",", ":")).encode()
        assert int(seen.headers["content-length"]) == len(sent)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_compressed_chat_and_chained_turn_route_on_the_json():
    """
    Decoding happens before routing: a zstd chat request is served, and a
    zstd request with C{previous_response_id} goes to the account that
    owns the response (the emulator answers 400 on any other).
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1", "priority": 1},
                              {"id": "a2", "credential": "sk-emu-a2", "priority": 1}])
    try:
        chat = {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}]}
        response, data = await post(stack, "/v1/chat/completions",
                                    zstd(json.dumps(chat).encode()), "zstd")
        assert response.code == 200, data
        for _ in range(3):
            stack.emulator.clearRequests()
            response, data = await post(stack, "/v1/responses", json.dumps(BODY).encode())
            first = json.loads(data)
            [owner] = [a for a in ("sk-emu-a1", "sk-emu-a2") if stack.emulator.requestsFor(a)]
            chained = dict(BODY, input="next", previous_response_id=first["id"])
            response, data = await post(stack, "/v1/responses",
                                        zstd(json.dumps(chained).encode()), "zstd")
            assert response.code == 200, data
            [_, second] = stack.emulator.requestsFor(owner)
            assert second.body["previous_response_id"] == first["id"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_corrupt_and_unknown_encodings():
    """
    Corrupt data is 400 and an unknown encoding 415, in OpenAI's envelope;
    nothing reaches upstream.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:
        raw = json.dumps(BODY).encode()
        for data, encoding, status, code in [
            (b"this is not gzip", "gzip", 400, "invalid_content_encoding"),
            (gzip.compress(raw)[:-30], "gzip", 400, "invalid_content_encoding"),
            (raw, "br", 415, "unsupported_content_encoding"),
        ]:
            response, body = await post(stack, "/v1/responses", data, encoding)
            assert response.code == status, body
            assert json.loads(body)["error"]["code"] == code
        assert stack.emulator.requestsFor("sk-emu-a1") == []
    finally:
        await stack.stop()


class RawClient(Protocol):
    """
    A raw HTTP/1.1 client: records what it receives and when the server
    closes.
    """

    def __init__(self):
        self.received = b""
        self.closed = Deferred()
        self.answered = Deferred()

    def dataReceived(self, data):
        self.received += data
        if not self.answered.called and b"\r\n\r\n" in self.received:
            self.answered.callback(None)

    def connectionLost(self, reason):
        if not self.answered.called:
            self.answered.callback(None)
        self.closed.callback(None)


async def rawConnect(stack) -> RawClient:
    endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", stack.port.getHost().port)
    return await endpoint.connect(Factory.forProtocol(RawClient))


def head(path, extra):
    return (f"POST {path} HTTP/1.1\r\nHost: relay\r\nAuthorization: Bearer {RELAY_KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


@pytest_twisted.ensureDeferred
async def test_declared_100mb_body_is_413_before_it_is_sent():
    """
    Item 3: a 100 MB C{Content-Length} is answered 413 (OpenAI envelope,
    C{Connection: close}) from the headers alone, and the connection is
    closed; not one body byte was sent and nothing was stored. Like every
    answer it carries relay's id as C{X-Request-Id} (issue 15; R111: relay's
    own, never the client's).
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    files = []
    original = bodymodule._contentFile
    bodymodule._contentFile = lambda length: files.append(original(length)) or files[-1]
    try:
        client = await rawConnect(stack)
        client.transport.write(head(
            "/v1/responses", "X-Request-Id: myid\r\nContent-Length: 104857600\r\n"
        ))
        await client.closed.addTimeout(10, reactor)
        status, _, rest = client.received.partition(b"\r\n")
        assert status == b"HTTP/1.1 413 Payload Too Large"
        assert b"connection: close" in rest.lower()
        assert b"myid" not in rest
        envelope = json.loads(rest.partition(b"\r\n\r\n")[2])
        assert envelope["error"]["type"] == "invalid_request_error"
        own = envelope["error"]["request_id"]
        assert own.startswith("req_")
        assert b"x-request-id: " + own.encode() + b"\r\n" in rest.lower()
        assert files == []
        assert stack.emulator.requestsFor("sk-emu-a1") == []
    finally:
        bodymodule._contentFile = original
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chunked_body_crossing_the_limit_is_413_and_closed():
    """
    Item 3: a chunked body is answered 413 as soon as it crosses
    C{gateway.max_request_body_bytes} (1 MiB here) and the connection
    closes; the file it was stored in never grew past the limit and is
    closed.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}],
                             gateway="{max_request_body_bytes: 1048576}")
    files = []
    original = bodymodule._contentFile
    bodymodule._contentFile = lambda length: files.append(original(length)) or files[-1]
    try:
        client = await rawConnect(stack)
        client.transport.write(head("/v1/responses", "Transfer-Encoding: chunked\r\n"))
        chunk = b"%x\r\n" % (64 * 1024) + b"x" * (64 * 1024) + b"\r\n"
        sent = 0
        while not client.answered.called and sent < 8 * MiB:
            client.transport.write(chunk)
            sent += 64 * 1024
            await deferLater(reactor, 0.002, lambda: None)
        await client.closed.addTimeout(10, reactor)
        assert client.received.startswith(b"HTTP/1.1 413 "), client.received[:200]
        assert sent < 4 * MiB
        [stored] = files
        assert stored.closed
        assert stack.emulator.requestsFor("sk-emu-a1") == []
    finally:
        bodymodule._contentFile = original
        await stack.stop()


def memoryKiB(pid: int) -> dict:
    """
    C{VmRSS} and C{VmHWM} (peak RSS) of a process, in KiB.
    """
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}


def bombs() -> dict:
    """
    1 GiB of zeros as zstd (~32 KiB) and as gzip (~1 MiB).
    """
    zeros = b"\0" * (64 * MiB)
    z = zstandard.ZstdCompressor(level=3).compressobj()
    zbomb = b"".join(z.compress(zeros) for _ in range(16)) + z.flush()
    g = zlib.compressobj(9, zlib.DEFLATED, 31)
    gbomb = b"".join(g.compress(zeros) for _ in range(16)) + g.flush()
    return {"zstd": zbomb, "gzip": gbomb}


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
@pytest_twisted.ensureDeferred
async def test_bombs_leave_a_real_relay_flat(capsys):
    """
    Item 2: against a real relay process (default 64 MiB limit), a 1 GiB
    zstd bomb and a 1 GiB gzip bomb are answered 413 and the process's
    peak RSS grows by far less than the limit (it would grow by the
    inflated size if relay inflated past it). The figures are printed.
    """
    payloads = bombs()
    path = writeConfig(goodConfig())
    try:
        collector, process, url = await startRelay("twist", path)
        try:
            before = memoryKiB(process.pid)
            for encoding, data in payloads.items():
                response = await treq.post(
                    url + "/v1/responses", data, persistent=False,
                    headers={"Authorization": [f"Bearer {CLIENT_KEY}"],
                             "Content-Type": ["application/json"],
                             "Content-Encoding": [encoding]},
                )
                body = await response.content()
                assert response.code == 413, body
                assert json.loads(body)["error"]["type"] == "invalid_request_error"
            after = memoryKiB(process.pid)
        finally:
            await stopRelay(collector, process)
    finally:
        removeConfig(path)
    grew = after["VmHWM"] - before["VmHWM"]
    with capsys.disabled():
        print(f"\n[bomb RSS] sizes: zstd {len(payloads['zstd'])} B, gzip "
              f"{len(payloads['gzip'])} B -> 1 GiB each; relay VmHWM before "
              f"{before['VmHWM']} KiB, after {after['VmHWM']} KiB (+{grew} KiB), "
              f"VmRSS after {after['VmRSS']} KiB")
    assert grew < 32 * 1024, (before, after)
