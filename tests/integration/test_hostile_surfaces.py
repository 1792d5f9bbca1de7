"""
A hostile key on the newer client surfaces (behaviour.md R115 with R2,
R103, R106): bodies built to break the Messages translation or to stall
the process are the client's 400 in the surface's shape, and leave the
key's concurrency slot free for its next turn.
"""

from __future__ import annotations

import json

import pytest_twisted
import treq

from tests.integration.harness import startStack

KEY = "sk-relay-hostile-0123456789"
SONNET = "claude-sonnet-4-5"


async def start():
    keys = json.dumps([{"name": "hostile", "key": KEY, "concurrency": 1}])
    known = [{"name": "sk-a1", "credential": "sk-a1"}]
    return await startStack([{"id": "a1", "credential": "sk-a1"}],
                            emulatorConfig={"accounts": known}, keys=keys)


async def messages(relay, raw: bytes, path: str = "/v1/messages"):
    response = await treq.post(relay.url + path, raw, headers={
        "x-api-key": [KEY], "content-type": ["application/json"],
        "anthropic-version": ["2023-06-01"]})
    return response.code, json.loads(await response.content())


def body(**extra) -> bytes:
    return json.dumps(dict({"model": SONNET, "max_tokens": 20,
                            "messages": [{"role": "user", "content": "hi"}]}, **extra)).encode()


@pytest_twisted.ensureDeferred
async def test_deep_messages_bodies_are_the_clients_400():
    """
    A Messages body nested as deep as the JSON reader allows (900 levels
    inside a tool's schema, a tool_use input, a text block) is translated
    or answered 400 in Anthropic's shape, on C{/v1/messages} and
    C{count_tokens}: it was a RecursionError, an HTML 500. The key's one
    slot is free afterwards (its next turn is served).
    """
    relay = await start()
    try:
        nest = "[" * 900 + "]" * 900
        head = b'{"model":"%s","max_tokens":20,' % SONNET.encode()
        bodies = [
            head + ('"messages":[{"role":"user","content":"hi"}],"tools":[{"name":"f",'
                    '"input_schema":{"x":%s}}]}' % nest).encode(),
            head + ('"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t",'
                    '"name":"f","input":{"x":%s}}]},{"role":"user","content":"hi"}]}'
                    % nest).encode(),
            head + ('"messages":[{"role":"user","content":[{"type":"text","text":"hi",'
                    '"x":%s}]}]}' % nest).encode(),
        ]
        for raw in bodies:
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                code, answer = await messages(relay, raw, path)
                assert code in (200, 400), (path, code, answer)
                if code == 400:
                    assert answer["type"] == "error"
                    assert answer["error"]["type"] == "invalid_request_error"
        code, answer = await messages(relay, body())
        assert code == 200 and answer["type"] == "message", answer
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_stop_sequences_are_bounded():
    """
    200,000 stop sequences (each looked for in every text delta, on the
    one thread: 0.2 s a delta) are refused with a 400 naming
    C{stop_sequences}; nothing is dialled.
    """
    relay = await start()
    try:
        stops = ["Zq%07d" % i for i in range(200_000)]
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            code, answer = await messages(relay, body(stop_sequences=stops), path)
            assert code == 400, answer
            assert "stop_sequences" in answer["error"]["message"]
        assert relay.emulator.requestsFor("sk-a1") == []
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_integer_fields_written_as_long_digit_texts():
    """
    C{n} of an edit's form and C{output_compression} of a generation,
    written as 5,000 digits (or a superscript digit), are a 400 naming
    the field and nothing is dialled: they were a 500 at the entry (C{int()}
    of 5,000 digits raises), and on an OAuth account a 502 after the
    account was chosen (the translation to the image tool raised).
    """
    from relay.wire.multipart import Upload, encodeForm

    known = [{"name": "oauth-o1", "credential": "oauth-o1"}]
    keys = json.dumps([{"name": "hostile", "key": KEY, "concurrency": 1}])
    relay = await startStack([{"id": "o1", "type": "oauth", "credential": "oauth-o1"}],
                             emulatorConfig={"accounts": known}, keys=keys)
    try:
        auth = {"authorization": [f"Bearer {KEY}"]}
        for text in ("9" * 5000, "\u00b2"):
            raw, kind = encodeForm({"prompt": "a cat", "n": text},
                                   [Upload("image", "a.png", "image/png", b"\x89PNG")])
            response = await treq.post(relay.url + "/v1/images/edits", raw,
                                       headers=dict(auth, **{"content-type": [kind]}))
            answer = json.loads(await response.content())
            assert response.code == 400 and answer["error"]["param"] == "n", answer
            response = await treq.post(relay.url + "/v1/images/generations", json.dumps(
                {"model": "gpt-image-1", "prompt": "a cat", "output_compression": text}).encode(),
                headers=dict(auth, **{"content-type": ["application/json"]}))
            answer = json.loads(await response.content())
            assert response.code == 400, answer
            assert answer["error"]["param"] == "output_compression"
        assert relay.emulator.requestsFor("oauth-o1") == []
    finally:
        await relay.stop()
