"""
Budgets under parallel load and prices of what was served (behaviour.md
R108, R109), end to end against the emulator: a key's money budget holds
when 40 turns run at once (HTTP and WebSocket); an account mapping the
client's model to an unpriced one is refused before dialling; the
response's service tier and hosted-tool calls are priced.
"""

from __future__ import annotations

import json

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults

from relay.tenants.prices import PriceTable
from relay.usage.tokens import fromUsage
from tests.integration.harness import sseEvents, startStack
from tests.integration.test_ws_turns import connect, drain

BUDGET = 0.0005
TABLE = PriceTable()


def keyEntry(name: str, **policy) -> dict:
    return dict({"name": name, "key": "sk-" + name, "concurrency": 0}, **policy)


async def stack(keys, accounts=None):
    return await startStack(
        accounts or [{"id": "api", "credential": "sk-api", "concurrency": 0}],
        keys=json.dumps(keys),
        emulatorConfig={"default_script": {"text": "word " * 40, "delay": 0.02}},
    )


def spent(s, key: str) -> int:
    """
    @return: nano-dollars C{key} spent today, as relay counts them.
    """
    return s.app.runner.usage.spent(key, reactor.seconds())[0]


def turnCost(response: dict) -> int:
    """
    @return: what one served response costs at the shipped gpt-5.5 price.
    """
    return TABLE.cost("gpt-5.5", fromUsage(response["usage"]))


BODY = {"model": "gpt-5.5", "input": "hi", "max_output_tokens": 4}
"""A turn of a few thousandths of a cent whose estimate ($0.00012 at most
4 output tokens) lets a few run at once on C{BUDGET}."""


async def httpTurn(s, secret: str):
    response, data = await s.postJSON("/v1/responses", dict(BODY, stream=True), key=secret)
    if response.code != 200:
        return response.code, json.loads(data)["error"]
    last = sseEvents(data)[-1]
    return 200, last[1]["response"]


async def wsTurn(s, secret: str):
    client = await connect(s, key=secret)
    try:
        events = await client.turn(dict(BODY, type="response.create"), timeout=10)
        last = events[-1]
        if last["type"] in ("response.completed", "response.incomplete"):
            return 200, last["response"], client
        return last.get("code") or last.get("status"), last, client
    except Exception:
        return None, None, client


@pytest_twisted.ensureDeferred
async def test_money_budget_holds_under_40_parallel_turns():
    """
    40 HTTP turns and then 40 WebSocket turns start at once, each on a
    key with C{daily_usd: 0.0005}: every key ends within its budget plus
    one turn's settled cost (charged after the fact they spent 5.5x), and
    the refused turns got 429 C{insufficient_quota} (WebSocket: the
    in-band 429 event, R113; it used to close 1013) without reaching the
    emulator.
    """
    s = await stack([keyEntry("http", daily_usd=BUDGET), keyEntry("ws", daily_usd=BUDGET)])
    clients = []
    try:
        results = await gatherResults(
            [Deferred.fromCoroutine(httpTurn(s, "sk-http")) for _ in range(40)])
        served = [r for code, r in results if code == 200]
        refused = [r for code, r in results if code != 200]
        assert served and refused, results
        assert {(r["code"]) for r in refused} == {"insufficient_quota"}, refused
        most = max(turnCost(r) for r in served)
        assert spent(s, "http") <= BUDGET * 1e9 + most, (spent(s, "http"), most)
        assert spent(s, "http") == sum(turnCost(r) for r in served)
        assert len(s.emulator.requestsFor("sk-api")) == len(served)

        results = await gatherResults(
            [Deferred.fromCoroutine(wsTurn(s, "sk-ws")) for _ in range(40)])
        clients = [c for _, _, c in results]
        served = [r for code, r, _ in results if code == 200]
        refusedCodes = {code for code, _, _ in results if code != 200}
        assert served and refusedCodes == {429}, [r[:2] for r in results]
        assert all(c.closeInfo is None for _, r, c in results if r and r.get("status") == 429)
        most = max(turnCost(r) for r in served)
        assert spent(s, "ws") <= BUDGET * 1e9 + most, (spent(s, "ws"), most)
    finally:
        await drain(s, clients)


@pytest_twisted.ensureDeferred
async def test_mapped_unpriced_model_refused_before_dialling():
    """
    The client's C{gpt-5.4-nano} has a price but the account serves it as
    an unpriced fine-tune: a key with a money budget is refused 403
    C{model_not_priced} naming the served model, and the emulator sees no
    request (over HTTP and the WebSocket, where it is an in-band event and
    the socket stays open, R113; it used to close 1008); a key without one
    is served.
    """
    accounts = [{"id": "ft", "credential": "sk-ft", "concurrency": 0,
                 "model_mapping": {"gpt-5.4-nano": "ft:gpt-4.1:org::1"}}]
    s = await stack([keyEntry("money", daily_usd=0.0001), keyEntry("free")], accounts)
    clients = []
    try:
        body = {"model": "gpt-5.4-nano", "input": "hi"}
        for _ in range(5):
            response, data = await s.postJSON("/v1/responses", body, key="sk-money")
            error = json.loads(data)["error"]
            assert (response.code, error["code"]) == (403, "model_not_priced"), data
            assert "ft:gpt-4.1:org::1" in error["message"]
        client = await connect(s, key="sk-money")
        clients.append(client)
        events = await client.turn(dict(body, type="response.create"), timeout=10)
        assert (events[-1]["type"], events[-1]["status"], events[-1]["error"]["code"]) == (
            "error", 403, "model_not_priced"), events
        assert client.closeInfo is None
        assert s.emulator.requestsFor("sk-ft") == []
        response, _ = await s.postJSON("/v1/responses", body, key="sk-free")
        assert response.code == 200
        assert len(s.emulator.requestsFor("sk-ft")) == 1
    finally:
        await drain(s, clients)


@pytest_twisted.ensureDeferred
async def test_tier_and_hosted_tools_priced_from_the_response():
    """
    A turn asking for the C{priority} tier and forcing C{web_search}: the
    emulator reports both; relay bills twice the token price plus $0.01
    for the call. A tool with no price (C{image_generation}) is refused
    for a key with a money budget.
    """
    s = await stack([keyEntry("money", daily_usd=5.0), keyEntry("chat", daily_usd=5.0)])
    try:
        body = {"model": "gpt-5.5", "input": "hi", "service_tier": "priority",
                "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}
        response, data = await s.postJSON("/v1/responses", body, key="sk-money")
        assert response.code == 200, data
        answer = json.loads(data)
        assert answer["service_tier"] == "priority"
        assert [i["type"] for i in answer["output"]][0] == "web_search_call"
        tokens = turnCost(answer)
        assert spent(s, "money") == 2 * tokens + 10_000_000, (spent(s, "money"), tokens)
        body = {"model": "gpt-5.5", "input": "hi", "tools": [{"type": "image_generation"}]}
        response, data = await s.postJSON("/v1/responses", body, key="sk-money")
        error = json.loads(data)["error"]
        assert (response.code, error["code"], error["param"]) == (
            403, "model_not_priced", "tools"), data
        assert len(s.emulator.requestsFor("sk-api")) == 1
        # Chat Completions, streamed: the tier is read from the usage chunk.
        body = {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}],
                "service_tier": "flex", "stream": True,
                "stream_options": {"include_usage": True}}
        response, data = await s.postJSON("/v1/chat/completions", body, key="sk-chat")
        assert response.code == 200, data
        usage = [e[1] for e in sseEvents(data) if isinstance(e[1], dict) and e[1].get("usage")]
        assert usage and usage[-1]["service_tier"] == "flex", data[-400:]
        tokens = turnCost(usage[-1])
        assert abs(spent(s, "chat") - tokens / 2) <= 1, (spent(s, "chat"), tokens)
    finally:
        await drain(s, [])
