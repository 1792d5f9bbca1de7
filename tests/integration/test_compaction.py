"""
Compaction kept intact (issue 20; behaviour.md R89; protocol.md 2.8) through
a real relay to the emulator on loopback: a compaction turn passes on every
entrypoint and WebSocket mode and gets its one C{compaction} item; the
http_bridge transcript never replays a used trigger and restarts from the
compaction item; a turn carrying a compaction item goes to the account that
produced it; relay never drops a compaction item to fit another account.
"""

import json
import uuid

import pytest
import pytest_twisted

from relay.emulator.sealing import sealedFor
from tests.integration.harness import sseEvents, startStack
from tests.integration.test_ws_turns import connect, drain, gateway

MODEL = "gpt-5.5"
TRIGGER = {"type": "compaction_trigger"}


def user(text):
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def frame(items, previous=None):
    out = {"type": "response.create", "model": MODEL, "store": False, "stream": True,
           "input": items}
    if previous:
        out["previous_response_id"] = previous
    return out


def compactionOf(response: dict):
    items = [i for i in response.get("output") or [] if i.get("type") == "compaction"]
    assert len(items) == 1, response
    return items[0]


def named(*pairs):
    """
    An emulator config naming each credential (sealed content names its account).
    """
    return {"accounts": [{"name": n, "credential": c} for n, c in pairs]}


def bodies(stack, credential):
    return [r.body for r in stack.emulator.requestsFor(credential)
            if r.kind in ("request", "frame")]


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough", "http_bridge"])
@pytest_twisted.ensureDeferred
async def test_websocket_compaction_turn_and_the_turn_after(mode):
    """
    R89 in every WebSocket mode: the compaction turn gets one compaction
    item (rebuilt from output_item.done where the terminal event's output
    is empty); the chained turn after it completes, and the bridge sends
    the compaction item in place of the history -- never the used trigger.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}], gateway=gateway(mode))
    client = await connect(stack, headers={"session-id": uuid.uuid4().hex})
    try:
        first = await client.turn(frame([user("long history"), TRIGGER]))
        assert first[-1]["type"] == "response.completed", first
        done = [e["item"] for e in first if e["type"] == "response.output_item.done"]
        assert [i["type"] for i in done] == ["compaction"]
        rid = first[-1]["response"]["id"]
        second = await client.turn(frame([user("next question")], previous=rid))
        assert second[-1]["type"] == "response.completed", second
        sent = bodies(stack, "sk-a1")
        if mode == "http_bridge":
            assert [i["type"] for i in sent[-1]["input"]] == ["compaction", "message"]
        assert all(i.get("type") != "compaction_trigger" for i in sent[-1]["input"])
    finally:
        await drain(stack, [client])


@pytest.mark.parametrize("stream", [True, False])
@pytest_twisted.ensureDeferred
async def test_http_compaction_turn(stream):
    """
    R89 over HTTP (SSE and JSON) on both account types: the trigger passes
    as the last item and the answer carries the one compaction item.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1", "priority": 1},
                              {"id": "o1", "type": "oauth", "credential": "oauth-1",
                               "priority": 2}],
                             emulatorConfig=named(("a1", "sk-a1"), ("o1", "oauth-1")))
    try:
        for account in ("a1", "o1"):
            if account == "o1":
                await stack.app.store.markAccount("a1", "temp_unschedulable",
                                                  stack.app.reactor.seconds() + 60, "test")
            body = {"model": MODEL, "stream": stream,
                    "input": [user(f"history {account}"), TRIGGER]}
            response, data = await stack.postJSON("/v1/responses", body)
            assert response.code == 200, data
            if stream:
                events = sseEvents(data)
                items = [d["item"] for t, d in events if t == "response.output_item.done"]
            else:
                items = json.loads(data)["output"]
            assert [i["type"] for i in items] == ["compaction"], (account, data[:300])
            assert sealedFor(items[0]["encrypted_content"]) == account
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_compaction_item_routes_to_the_account_that_produced_it():
    """
    R89: after a failover the compaction item was produced by C{good}; the
    next turn carrying it goes to C{good} although C{bad} is preferred and
    healthy again (a new session, so no session binding decides it).
    Without that, C{bad} would refuse the item (invalid_encrypted_content).
    """
    stack = await startStack([{"id": "bad", "credential": "sk-bad", "priority": 1},
                              {"id": "good", "credential": "sk-good", "priority": 50}],
                             emulatorConfig=named(("bad", "sk-bad"), ("good", "sk-good")))
    try:
        stack.emulator.setFault("sk-bad", {"kind": "status", "code": 503, "times": 1})
        body = {"model": MODEL, "input": [user("a long history"), TRIGGER]}
        response, data = await stack.postJSON("/v1/responses", body,
                                              headers={"session-id": [uuid.uuid4().hex]})
        assert response.code == 200, data
        item = compactionOf(json.loads(data))
        assert sealedFor(item["encrypted_content"]) == "good"
        stack.emulator.clearRequests()
        later = {"model": MODEL, "input": [user("context again"), item, user("go on")]}
        response, data = await stack.postJSON("/v1/responses", later,
                                              headers={"session-id": [uuid.uuid4().hex]})
        assert response.code == 200, data
        assert stack.emulator.requestsFor("sk-bad") == []
        assert len(stack.emulator.requestsFor("sk-good")) == 1
        # A turn without compaction items still prefers bad (priority 1).
        response, _ = await stack.postJSON("/v1/responses", {"model": MODEL, "input": "plain"},
                                           headers={"session-id": [uuid.uuid4().hex]})
        assert len(stack.emulator.requestsFor("sk-bad")) == 1
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_compaction_item_is_never_dropped_to_fit_another_account():
    """
    R89, R7: when the turn lands on an account that cannot open the
    compaction item, relay's one-shot rewrite drops encrypted reasoning
    only; the compaction item stays, and the client gets the upstream's
    own error.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"},
                              {"id": "a2", "credential": "sk-a2"}])
    try:
        from relay.emulator.sealing import seal

        item = {"type": "compaction", "id": "cmp_1", "encrypted_content": seal("elsewhere",
                                                                               "compaction")}
        reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                     "encrypted_content": seal("elsewhere", "reasoning")}
        body = {"model": MODEL, "input": [reasoning, item, user("go on")]}
        response, data = await stack.postJSON("/v1/responses", body)
        assert response.code == 400, data
        assert json.loads(data)["error"]["code"] == "invalid_encrypted_content"
        sent = [r.body for r in stack.emulator.requests if r.kind == "request"]
        assert [[i["type"] for i in b["input"]] for b in sent] == [
            ["reasoning", "compaction", "message"], ["compaction", "message"]]
    finally:
        await stack.stop()


@pytest.mark.parametrize("entrypoint", ["http", "ctx_pool", "http_bridge"])
@pytest_twisted.ensureDeferred
async def test_a_replayed_trigger_never_goes_upstream(entrypoint):
    """
    R89: a client that replays a used trigger (not the last item) gets its
    turn served; the trigger does not go upstream (where it would be
    refused).
    """
    mode = "ctx_pool" if entrypoint == "http" else entrypoint
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}], gateway=gateway(mode))
    clients = []
    try:
        items = [user("before"), TRIGGER, user("after")]
        if entrypoint == "http":
            response, data = await stack.postJSON("/v1/responses", {"model": MODEL,
                                                                    "input": items})
            assert response.code == 200, data
        else:
            client = await connect(stack)
            clients.append(client)
            events = await client.turn(frame(items))
            assert events[-1]["type"] == "response.completed", events
        (sent,) = bodies(stack, "sk-a1")
        assert [i["type"] for i in sent["input"]] == ["message", "message"]
    finally:
        await drain(stack, clients)
