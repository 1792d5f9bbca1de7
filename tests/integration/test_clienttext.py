"""
behaviour.md R106 through a real relay and the emulator on loopback: the
issue's exact inputs on HTTP SSE, HTTP JSON, chat and every WebSocket mode
(and the ChatGPT backend on OAuth accounts). The emulator's C{refuse} fault
echoes the request through OpenAI's error templates
(L{relay.emulator.refusals}); the class is proven by the property tests of
L{tests.test_clienttext}.

  - an unknown field named like R11's disable phrase is dropped and the turn
    retried once on the same account (R7, R112); no account is marked;
  - a project's model refusal (403 C{model_not_found}) blocks that model on
    each account it reached and nothing else: three in parallel disable
    nothing, and the accounts serve another model at once.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred, gatherResults

from tests.integration import parity as P
from tests.integration.harness import sseEvents
from tests.integration.test_ws_turns import userTurn

ACCOUNTS = [{"id": f"a{i}", "credential": f"sk-emu-a{i}", "priority": i} for i in (1, 2, 3)]
PHRASE = "identity verification is required"
ENTRYPOINTS = (*P.ENTRYPOINTS, P.SSE_OAUTH)


async def turn(stack, entrypoint: str, extra: dict, model: str = P.MODEL):
    """
    One turn carrying C{extra} top-level fields.

    @return: C{(Outcome, raw status or None)}.
    """
    sid, text = P.newSession()
    headers = {"session-id": [sid]}
    if entrypoint in P.WS_ENTRYPOINTS:
        client = await P.connectNew(stack)
        try:
            client.sendJSON({**userTurn(text, model=model), **extra})
            events = await P.collectTurn(client)
        finally:
            client.bye()
        return P.wsOutcome(events, "none")
    if entrypoint in P._CHAT:
        body = {"model": model, "messages": [{"role": "user", "content": text}],
                "stream": True, **extra}
        response, data = await stack.postJSON("/v1/chat/completions", body, headers=headers)
        if response.code != 200:
            return P.Outcome("terminal_error", response.code, None, data[:200].decode())
        return P.chatOutcome(data, "none")
    stream = entrypoint in P._SSE
    body = {"model": model, "input": text, "stream": stream, **extra}
    response, data = await stack.postJSON("/v1/responses", body, headers=headers)
    if response.code != 200:
        return P.Outcome("terminal_error", response.code, None, data[:200].decode())
    if stream:
        return P.responsesOutcome(sseEvents(data), "none")
    parsed = json.loads(data)
    return P._served(P._completedText(parsed), "none", parsed.get("id"))


def sent(stack, credential: str) -> list:
    """
    The turn bodies an account received (HTTP requests and WebSocket frames).
    """
    return [r.body for r in stack.emulator.requestsFor(credential)
            if r.kind in ("request", "frame") and isinstance(r.body, dict)]


async def assertUnmarked(stack, refusedModel=None):
    """
    No account is cooled, rate-limited, disabled or on a streak; the only
    model block allowed is C{refusedModel}'s.
    """
    ids = [a["id"] for a in ACCOUNTS]
    states = await stack.app.store.getAccountStates(ids)
    for id in ids:
        state = states[id]
        assert not state.disabled and not state.blockedUntil, (id, state)
        assert not state.rateLimitedUntil and not state.overloadedUntil, (id, state)
        assert not state.streaks, (id, state)
        assert set(state.modelBlocks) <= ({refusedModel} if refusedModel else set()), (id, state)
        assert stack.app.health.localBlock(id) is None, id


@pytest.mark.parametrize("field", (PHRASE, "model not found", "servers are overloaded"))
@pytest.mark.parametrize("entrypoint", ENTRYPOINTS)
@pytest_twisted.ensureDeferred
async def test_unknown_field_is_dropped_and_retried(entrypoint, field):
    """
    The issue's fields (C{"identity verification is required": 1}, which
    disabled every account it reached; C{"model not found"}, which blocked
    the model; C{"servers are overloaded"}, which cost 4 upstream calls),
    refused by every account as the API (or the ChatGPT backend on OAuth)
    does: relay drops the field, the same account serves the retry, nothing
    is marked.
    """
    stack = await P.startParityStack(entrypoint, ACCOUNTS)
    try:
        template = "unsupported_parameter" if entrypoint == P.SSE_OAUTH else "unknown_parameter"
        stack.emulator.setFault("*", {"kind": "refuse", "template": template})
        outcome = await turn(stack, entrypoint, {field: 1})
        # (the OAuth route's terminal event carries no output to name a1 by)
        assert outcome.kind == "served_by_other" and outcome.servedBy in ("a1", None), outcome
        bodies = sent(stack, "a1")
        assert len(bodies) == 2, bodies
        assert field in bodies[0] and field not in bodies[1], bodies
        assert sent(stack, "a2") == [] and sent(stack, "a3") == []
        await assertUnmarked(stack)
    finally:
        await P.drain(stack)


@pytest.mark.parametrize("entrypoint", ("http_sse", "ws_ctx_pool"))
@pytest_twisted.ensureDeferred
async def test_second_refusal_reaches_the_client(entrypoint):
    """
    A second unknown field: upstream's own refusal reaches the client after
    the one retry; "servers are overloaded" costs no backoff retries.
    """
    stack = await P.startParityStack(entrypoint, ACCOUNTS)
    try:
        stack.emulator.setFault("*", {"kind": "refuse", "template": "unknown_parameter"})
        outcome = await turn(stack, entrypoint,
                             {"servers are overloaded": 1, "model not found": 2})
        assert outcome.kind == "terminal_error", outcome
        assert outcome.code in (400, "error:400"), outcome
        assert "Unknown parameter" in outcome.detail, outcome
        assert len(sent(stack, "a1")) == 2 and sent(stack, "a2") == []
        await assertUnmarked(stack)
    finally:
        await P.drain(stack)


@pytest.mark.parametrize("entrypoint", ("http_sse", "http_json", "chat_stream", "ws_ctx_pool",
                                        P.SSE_OAUTH))
@pytest_twisted.ensureDeferred
async def test_project_model_refusal_blocks_the_model_only(entrypoint):
    """
    C{403 model_not_found} "Project `proj_…` does not have access to model
    `o1-pro`": three turns in parallel; no account is cooled or disabled,
    each holds a model block for o1-pro alone, and serves gpt-5.5 at once.
    """
    stack = await P.startParityStack(entrypoint, ACCOUNTS)
    try:
        stack.emulator.setFault("*", {"kind": "refuse", "template": "model_not_found",
                                      "code": 403})
        outcomes = await gatherResults(
            [Deferred.fromCoroutine(turn(stack, entrypoint, {}, model="o1-pro"))
             for _ in range(3)])
        for outcome in outcomes:
            assert outcome.kind in ("terminal_error", "retryable_close"), outcome
        await assertUnmarked(stack, refusedModel="o1-pro")
        states = await stack.app.store.getAccountStates(["a1"])
        assert "o1-pro" in states["a1"].modelBlocks
        stack.emulator.clearFaults()  # the project may use gpt-5.5
        outcome = await turn(stack, entrypoint, {}, model=P.MODEL)
        assert outcome.kind == "served_by_other" and outcome.servedBy in ("a1", None), outcome
        assert sent(stack, "a1")[-1]["model"] == P.MODEL
    finally:
        await P.drain(stack)


@pytest_twisted.ensureDeferred
async def test_ws_response_failed_wire():
    """
    The refusal as a WebSocket C{response.failed}: the same drop and retry.
    """
    stack = await P.startParityStack("ws_passthrough", ACCOUNTS)
    try:
        stack.emulator.setFault("*", {"kind": "refuse", "template": "unknown_parameter",
                                      "wire": "response.failed"})
        outcome = await turn(stack, "ws_passthrough", {PHRASE: 1})
        assert outcome.servedBy == "a1", outcome
        assert len(sent(stack, "a1")) == 2
        await assertUnmarked(stack)
    finally:
        await P.drain(stack)


@pytest.mark.parametrize("entrypoint", (P.SSE_OAUTH, P.CHAT_OAUTH))
@pytest_twisted.ensureDeferred
async def test_backend_model_refusal_blocks_the_model_only(entrypoint):
    """
    The ChatGPT backend's C{{"detail": "The 'o1-pro' model is not supported
    when using Codex with a ChatGPT account."}} (400, no code): R8 row 5's
    model block on each OAuth account, nothing account-wide.
    """
    stack = await P.startParityStack(entrypoint, ACCOUNTS)
    try:
        stack.emulator.setFault("*", {"kind": "refuse", "template": "model_not_supported"})
        outcome = await turn(stack, entrypoint, {}, model="o1-pro")
        assert outcome.kind == "terminal_error", outcome
        assert [len(sent(stack, a["id"])) for a in ACCOUNTS] == [1, 1, 1]
        await assertUnmarked(stack, refusedModel="o1-pro")
        states = await stack.app.store.getAccountStates([a["id"] for a in ACCOUNTS])
        assert all("o1-pro" in state.modelBlocks for state in states.values()), states
    finally:
        await P.drain(stack)
