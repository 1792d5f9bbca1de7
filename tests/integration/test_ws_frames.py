"""
Issue 19 item 2 on the WebSocket (behaviour.md R103, R85): client frames
are bounded like HTTP bodies -- a permessage-deflate message inflates to
at most C{gateway.limits.max_decompression_ratio} times its compressed
size, a message being assembled is held in the key's and the process's
bytes in flight, and a large frame waits for the key's slot before it is
parsed, with ping frames at the keepalive pace meanwhile. Frames are sent
by hand (L{tests.integration.rawws}) to a relay on real sockets.
"""

from __future__ import annotations

import json

import pytest_twisted
from twisted.internet import reactor

from tests.integration.harness import RELAY_KEY, startStack
from tests.integration.rawws import deflateMessage, rawWebSocket
from tests.integration.test_reload import waitFor
from tests.integration.test_ws_turns import connect, userTurn

CREATE = {"type": "response.create", "model": "gpt-5.5"}


async def _stack(limits="{}", concurrency=0, gateway=None):
    keys = json.dumps([{"name": "test", "key": RELAY_KEY, "concurrency": concurrency}])
    body = {"limits": "LIMITS"}
    body.update(gateway or {})
    return await startStack([{"id": "a1", "credential": "sk-a1"}],
                            gateway=json.dumps(body).replace('"LIMITS"', limits), keys=keys)


@pytest_twisted.ensureDeferred
async def test_deflate_bomb_is_refused_with_an_error_event_and_1009():
    """
    A 60 MiB message compressed to ~60 KB (1000:1) is refused once it
    inflates past 100x what arrived: a status-bearing C{error} event
    (C{decompression_ratio_exceeded}) and close 1009; relay inflated a few
    MiB at most, holds nothing afterwards, and serves the next client.
    (Today autobahn inflates all 60 MiB, under the 64 MiB frame limit, and
    the turn goes upstream.)
    """
    stack = await _stack()
    try:
        port = stack.port.getHost().port
        text = json.dumps(dict(CREATE, input="a" * (60 * 2**20))).encode()
        bomb = deflateMessage(text)
        assert len(text) / len(bomb) > 500
        client = await rawWebSocket(port, RELAY_KEY)
        assert client.compressing
        client.send(bomb, compressed=True)
        code, reason = await client.closed.addTimeout(10, reactor)
        [event] = client.messages
        assert event["type"] == "error" and event["status"] == 400, event
        assert event["error"]["code"] == "decompression_ratio_exceeded"
        assert "max_decompression_ratio" in event["error"]["message"]
        assert code == 1009, (code, reason)
        assert stack.emulator.requestsFor("sk-a1") == []
        assert stack.app.site.intake.budget.total == 0
        ok = await connect(stack)
        events = await ok.turn(userTurn("still there?"))
        assert events[-1]["type"] == "response.completed"
        ok.bye()
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_ordinary_compressed_frames_pass():
    """
    The ratio bound leaves real traffic alone: a compressed turn whose
    text repeats (well over 100:1 in its first kilobytes, under the 1 MiB
    floor) completes.
    """
    stack = await _stack()
    try:
        client = await rawWebSocket(stack.port.getHost().port, RELAY_KEY)
        client.send(deflateMessage(json.dumps(dict(CREATE, input="ab" * 200000)).encode()),
                    compressed=True)
        await waitFor(lambda: any(m.get("type") == "response.completed"
                                  for m in client.messages), timeout=10)
        client.transport.loseConnection()
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_messages_being_assembled_count_in_bytes_in_flight():
    """
    A message whose last frame has not come is held in the key's bytes in
    flight: with 2 MiB per key, one connection holding 1.5 MiB of an
    unfinished message leaves no room for another's 1 MiB: that one gets
    an C{error} event without status (busy, R81) and close 1013. Once the
    first connection goes, its bytes are given back.
    """
    stack = await _stack("{body_bytes_in_flight_per_key: 2097152}")
    budget = stack.app.site.intake.budget
    try:
        port = stack.port.getHost().port
        first = await rawWebSocket(port, RELAY_KEY, deflate=False)
        first.send(b'{"type":"response.create","input":"' + b"a" * (3 * 2**19), fin=False)
        await waitFor(lambda: budget.total == 3 * 2**19 + 35)
        second = await rawWebSocket(port, RELAY_KEY, deflate=False)
        second.send(b'{"type":"response.create","input":"' + b"a" * 2**20, fin=False)
        code, reason = await second.closed.addTimeout(10, reactor)
        [event] = second.messages
        assert event["type"] == "error" and "status" not in event, event
        assert event["error"]["code"] == "body_bytes_in_flight_exceeded"
        assert "body_bytes_in_flight_per_key" in event["error"]["message"]
        assert code == 1013, (code, reason)
        assert budget.total == 3 * 2**19 + 35
        first.transport.loseConnection()
        await first.closed
        await waitFor(lambda: budget.total == 0 and budget.perKey == {})
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_large_frame_waits_for_the_key_slot_with_pings():
    """
    R103 + R85: a key limited to one turn; while its first turn runs (a
    silent upstream), a frame over 256 KiB on a second connection is
    parsed only once the key's slot is free -- and that connection gets a
    ping every keepalive interval while it waits; then its turn completes.
    """
    stack = await _stack(concurrency=1, gateway={"stream_keepalive_interval": 0.5})
    try:
        stack.emulator.setFault("sk-a1", {"kind": "delay_first_output", "seconds": 5,
                                          "times": 1})
        busy = await connect(stack)
        busy.sendJSON(userTurn("slow"))
        await waitFor(lambda: stack.emulator.inflight("sk-a1") == 1)
        waiting = await rawWebSocket(stack.port.getHost().port, RELAY_KEY, deflate=False)
        waiting.sendJSON(dict(CREATE, input="b" * 300000))
        await waitFor(lambda: waiting.pings >= 3, timeout=4)
        assert stack.emulator.inflight("sk-a1") == 1
        assert len(stack.emulator.requestsFor("sk-a1", "frame")) == 1
        events = await busy.collect(10)
        assert events[-1]["type"] == "response.completed"
        await waitFor(lambda: any(m.get("type") == "response.completed"
                                  for m in waiting.messages), timeout=10)
        busy.bye()
        waiting.transport.loseConnection()
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_close_autobahn_refuses_is_logged_and_counted_as_sent():
    """
    A client close frame with a reserved code (999) or a reason that is
    not UTF-8 makes autobahn fail the connection (1002, 1007);
    C{relay.ws_closed} and the close-code metric say what relay sent, not
    the client's refused code (they said 1000). A client's ordinary close
    is still logged with its own code.
    """
    import struct

    from twisted.logger import globalLogPublisher

    seen = []

    def observer(event):
        if event.get("event") == "relay.ws_closed":
            seen.append(event)

    globalLogPublisher.addObserver(observer)
    stack = await _stack()
    try:
        port = stack.port.getHost().port
        for payload, code in ((struct.pack("!H", 999), 1002),
                              (struct.pack("!H", 1000) + b"\xff\xfe", 1007),
                              (struct.pack("!H", 4000) + b"bye", 4000)):
            client = await rawWebSocket(port, RELAY_KEY, deflate=False)
            client.send(payload, opcode=8)
            await client.closed.addTimeout(10, reactor)
            await waitFor(lambda: len(seen) == 1)
            assert seen.pop()["code"] == code, (payload, code)
        metrics = stack.app.runner.metrics
        for code in ("1002", "1007", "4000"):
            assert metrics.wsCloses.labels(code=code)._value.get() == 1, code
    finally:
        globalLogPublisher.removeObserver(observer)
        await stack.stop()
