"""
The hostile tenant (behaviour.md R106-R112 together): a relay process with
three accounts on the emulator (two API-key accounts, one OAuth; a
WebSocket mode each), one client key running every trick a key holder has
against the pool at once while a second key's ordinary turns run.

The hostile key (C{evil}; its budget trick on a third key, C{miser}, since a
money budget would refuse its other tricks):

  - sends field names and values carrying R8/R11's phrases, echoed back by
    the emulator's refusal templates (C{unknown_parameter}, C{invalid_value},
    as a WebSocket C{response.failed} too) on HTTP SSE, JSON, chat and the
    WebSocket (R106, R7);
  - asks for models the project may not use (403 C{model_not_found}) and for
    models named like R11's phrases (400/403/404 C{model_not_found}) (R106,
    R8 row 5);
  - hangs up after C{response.output_text.done}, the first delta or the
    C{finish_reason} chunk, on HTTP SSE, chat and the WebSocket, and at the
    first delta of turns whose upstream then stalls past the drain bound
    (R107);
  - fires 20 turns at once on a tiny money budget, on the OAuth account
    where its C{max_output_tokens} does not bound the turn (R108), and
    creates a background response it never polls (R107);
  - spells a denied model as a snapshot, in capitals, with a trailing space
    (R110);
  - sends the other key's C{X-Request-Id}s (R111), its session id and its
    C{prompt_cache_key}, with prewarms (R112, R113);
  - guesses the admin key (backed off per address; the operator, on
    another address, is not).

Afterwards: the innocent key (C{innocent}) saw no failure; no account is
cooled, rate-limited, disabled, on a streak or blocked account-wide, and
the only model blocks are the refused models' (never the innocent key's
model), and a refused model reached each account once; every token the
emulator generated (C{GET /_emulator/generations}) is in C{/admin/usage}
within 1 %, and the two stalled turns are estimated, marked in the
request log and counted in C{estimated_requests}; the budget key spent at
most its budget plus one turn; the shared client ids find each key's own
rows under relay's own ids; the two keys' upstream prompt cache keys
differ. The OAuth account refuses in the ChatGPT backend's words.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import deferLater
from twisted.web.client import Agent, HTTPConnectionPool

from relay.emulator import Emulator
from relay.tenants.prices import PriceTable
from relay.usage.tokens import fromUsage
from tests.integration.hangup import hangUpAt
from tests.integration.harness import sseEvents
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.relayproc import RelayProcess
from tests.integration.test_ws_turns import PREWARM, connect, userTurn

ADMIN = "hostile-admin-5c0f1e9a7b3d42c8a6e0f4b1d9c7a253"
EVIL, INNOCENT, MISER = "sk-evil-tenant", "sk-innocent-tenant", "sk-miser-tenant"
MODEL = "gpt-5.5"
PHRASES = ("identity verification is required", "model not found", "servers are overloaded",
           "Your organization has been disabled")
PHRASE_MODELS = {PHRASES[0]: 403, PHRASES[2]: 400, PHRASES[3]: 404}
"""Model names the emulator refuses, with the status of the refusal."""
REFUSED_MODELS = ("o1-pro", *PHRASE_MODELS)
DENIED = ("gpt-5.4-2026-03-05", "GPT-5.4", "gpt-5.4 ")
BUDGET = 0.002
TURN_CAP = 20
"""The budget key's C{max_turn_output_tokens}: a few turns fit at once."""
CACHE_KEY = "innocent-cache-key"
SESSION = "5f0e3c1a-0000-4000-8000-00000000beef"
"""The innocent key's session id, which the hostile key sends too."""
STALLED = "gpt-5.4-mini"
"""A model the emulator stalls after its second delta, beyond relay's drain
bound: a turn whose client left is then estimated (R107)."""
DRAIN_SECONDS = 5
ACCOUNTS = [("a1", "sk-emu-hostile-a1", "ctx_pool"), ("a2", "sk-emu-hostile-a2", "passthrough"),
            ("o3", "emu-hostile-oauth-o3", "http_bridge")]
"""Two API-key accounts and an OAuth (ChatGPT backend) one, each with its
own WebSocket mode."""
OAUTH = "o3"
STALL = {"kind": "stall_after_events", "events": 6, "seconds": 30, "model": STALLED}
FAULTS = [
    {"kind": "refuse", "template": "model_not_found", "code": 403, "model": "o1-pro"},
    *({"kind": "refuse", "template": "model_not_found", "code": code, "model": name}
      for name, code in PHRASE_MODELS.items()),
    STALL,
    {"kind": "refuse", "template": "unknown_parameter", "transport": "ws",
     "wire": "response.failed"},
    {"kind": "refuse", "template": "unknown_parameter"},
    {"kind": "refuse", "template": "invalid_value", "param": "tool_choice"},
]
"""The emulator's refusals, together as upstream's validations (the
innocent key's bodies fit none of them)."""
BACKEND_FAULTS = [
    *({"kind": "refuse", "template": "model_not_supported", "model": name}
      for name in ("o1-pro", *PHRASE_MODELS)),
    STALL,
    {"kind": "refuse", "template": "unsupported_parameter"},
]
"""The ChatGPT backend's refusals for the OAuth account (its own wording:
C{{"detail": ...}})."""
ENTRIES = ("sse", "json", "chat", "ws")
DEADLINE = 40.0
"""Seconds the whole exchange may take (the test's own bound)."""


class _Port:
    def __init__(self, port: int):
        self.port = port

    def getHost(self):
        return self


class _Target:
    """
    The relay process as L{tests.integration.test_ws_turns.connect} wants a
    stack (C{stack.port.getHost().port}).
    """

    def __init__(self, port: int):
        self.port = _Port(port)


def target(relay) -> _Target:
    return _Target(relay.port)


def headersFor(key: str, extra: dict | None = None) -> dict:
    headers = {"Authorization": [f"Bearer {key}"], "Content-Type": ["application/json"]}
    headers.update(extra or {})
    return headers


async def post(relay, path: str, body: dict, key: str, headers: dict | None = None):
    """
    @return: C{(status, raw body, response headers)}.
    """
    response = await treq.post(relay.url + path, json.dumps(body).encode(),
                               headers=headersFor(key, headers), persistent=False)
    return response.code, await response.content(), response.headers


OPERATOR_ADDRESS = "127.0.0.2"
"""The operator's own address (the hostile key guesses the admin key from
127.0.0.1: its back-off is per address)."""


class _FromAddress:
    """
    An endpoint factory whose connections leave from C{host}.
    """

    def __init__(self, host: str):
        self.host = host

    def endpointForURI(self, uri):
        return TCP4ClientEndpoint(reactor, uri.host.decode("ascii"), uri.port,
                                  bindAddress=(self.host, 0))


def operator() -> treq.client.HTTPClient:
    """
    An HTTP client on the operator's address (no persistent connections).
    """
    pool = HTTPConnectionPool(reactor, persistent=False)
    return treq.client.HTTPClient(
        Agent.usingEndpointFactory(reactor, _FromAddress(OPERATOR_ADDRESS), pool=pool))


async def admin(relay, path: str) -> dict:
    """
    C{GET} an admin route with the admin key, from the operator's address.
    """
    response = await operator().get(relay.url + path,
                                    headers={"Authorization": [f"Bearer {ADMIN}"]})
    body = json.loads(await response.content())
    assert response.code == 200, (path, body)
    return body


async def sleep(seconds: float) -> None:
    await deferLater(reactor, seconds, lambda: None)


def textOf(entry: str, data: bytes) -> tuple:
    """
    The outcome of an HTTP turn's 200 answer: C{("ok", response)} when it
    ended with a completed (or incomplete) response, else C{("bad", tail)}.
    """
    if entry == "json":
        parsed = json.loads(data)
        if parsed.get("status") in ("completed", "incomplete"):
            return "ok", parsed
        return "bad", data[-300:]
    events = sseEvents(data)
    if entry == "chat":
        done = any(e[1] == "[DONE]" for e in events)
        return ("ok", None) if done else ("bad", data[-300:])
    last = events[-1] if events else (None, None)
    if last[0] in ("response.completed", "response.incomplete"):
        return "ok", last[1]["response"]
    return "bad", data[-300:]


async def httpTurn(relay, entry: str, key: str, text: str, extra: dict | None = None,
                   model: str = MODEL, headers: dict | None = None):
    """
    One HTTP turn (C{sse}, C{json} or C{chat} stream).

    @return: C{(status, outcome, detail, response headers)}.
    """
    extra = extra or {}
    if entry == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": text}],
                "stream": True, **extra}
        path = "/v1/chat/completions"
    else:
        body = {"model": model, "input": text, "stream": entry == "sse", **extra}
        path = "/v1/responses"
    code, data, hdrs = await post(relay, path, body, key, headers)
    if code != 200:
        return code, "refused", data[:300], hdrs
    outcome, detail = textOf(entry, data)
    return code, outcome, detail, hdrs


async def wsTurn(relay, key: str, frame: dict, client=None):
    """
    One WebSocket turn, on C{client} or a new connection (closed after).

    @return: C{(last event, client)}.
    """
    own = client is None
    if own:
        client = await connect(target(relay), key=key)
    try:
        events = await client.turn(frame, timeout=15)
        return events[-1], client
    finally:
        if own:
            client.bye()


async def hangUpHTTP(relay, path: str, body: dict, marker: bytes) -> bytes:
    return await hangUpAt(relay.port, EVIL, path, body, marker, timeout=15)


async def hangUpWS(relay, text: str, after: str, model: str = MODEL) -> list:
    client = await connect(target(relay), key=EVIL)
    client.sendJSON(userTurn(text, model=model))
    seen = []
    while True:
        event = await client.next(15)
        seen.append(event["type"])
        if event["type"] == after or event["type"] in (
                "response.completed", "error", "response.failed", "__closed__"):
            break
    client.transport.abortConnection()
    return seen


# -- the hostile key's tricks ---------------------------------------------------------------


async def echoedFields(relay, log: list) -> None:
    """
    R106: fields named like R11's phrases (dropped, retried once, served)
    and values carrying them (the client's own 400).
    """
    for phrase in PHRASES:
        for entry in ENTRIES:
            for extra, kind in (({phrase: 1}, "field"), ({"tool_choice": phrase}, "value")):
                text = f"evil echo {kind}"
                if entry == "ws":
                    last, _ = await wsTurn(relay, EVIL, {**userTurn(text), **extra})
                    log.append(("echo", kind, entry, last.get("type"),
                                last.get("status") or (last.get("error") or {}).get("code")))
                else:
                    code, outcome, detail, _ = await httpTurn(relay, entry, EVIL, text, extra)
                    log.append(("echo", kind, entry, code, outcome))


async def refusedModels(relay, log: list) -> None:
    """
    R106 / R8 row 5: a project's model refusal and models named like R11's
    phrases, echoed in every C{model_not_found} wording.
    """
    for model in REFUSED_MODELS:
        for entry in ENTRIES:
            if entry == "ws":
                last, _ = await wsTurn(relay, EVIL, userTurn("evil model", model=model))
                log.append(("model", model, entry, last.get("type"), last.get("status")))
            else:
                code, outcome, _, _ = await httpTurn(relay, entry, EVIL, "evil model",
                                                     model=model)
                log.append(("model", model, entry, code, outcome))


async def hangUps(relay, log: list) -> None:
    """
    R107: hang up after C{response.output_text.done} or the first delta
    (HTTP SSE and the WebSocket), after the first delta or the
    C{finish_reason} chunk (chat stream).
    """
    body = {"model": MODEL, "input": "evil hang up", "stream": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "evil hang up"}],
            "stream": True}
    for _ in range(2):
        for marker in (b"response.output_text.done", b"response.output_text.delta"):
            got = await hangUpHTTP(relay, "/v1/responses", body, marker)
            log.append(("hangup", "sse", marker, b"response.completed" in got))
        for marker in (b'"finish_reason":"stop"', b'"content":"w'):
            got = await hangUpHTTP(relay, "/v1/chat/completions", chat, marker)
            log.append(("hangup", "chat", marker, b"[DONE]" in got))
        for after in ("response.output_text.done", "response.output_text.delta"):
            seen = await hangUpWS(relay, "evil ws hang up", after)
            log.append(("hangup", "ws", after, seen[-1]))


async def estimated(relay, log: list) -> None:
    """
    R107: hang up at the first delta of a turn whose upstream then stalls
    past C{usage_drain_seconds} (HTTP SSE and the WebSocket): relay cannot
    learn the real usage and records its estimate, marked.
    """
    body = {"model": STALLED, "input": "evil stalled", "stream": True}
    got = await hangUpHTTP(relay, "/v1/responses", body, b"response.output_text.delta")
    log.append(("stalled", "sse", b"response.completed" in got))
    seen = await hangUpWS(relay, "evil ws stalled", "response.output_text.delta", STALLED)
    log.append(("stalled", "ws", seen[-1]))


async def background(relay, log: list) -> None:
    """
    R107, R88: a background response nobody ever polls is counted once,
    when it finishes.
    """
    code, data, _ = await post(relay, "/v1/responses",
                               {"model": MODEL, "input": "evil background", "background": True},
                               EVIL)
    log.append(("background", code, json.loads(data).get("status")))


async def budgetBurst(relay, log: list) -> list:
    """
    R108: 20 turns at once on C{daily_usd: 0.002}, half on HTTP SSE, half
    on the WebSocket, each asking for 4 output tokens from the OAuth
    account, which takes no C{max_output_tokens} (relay drops it) and
    answers in full. (Reserving the body's 4 tokens let 11 run: 2.9x the
    budget.)

    @return: the served responses.
    """
    body = {"model": MODEL, "input": "miser", "max_output_tokens": 4, "stream": True}

    async def http():
        code, data, _ = await post(relay, "/v1/responses", body, MISER)
        if code != 200:
            return code, None
        events = sseEvents(data)
        return code, events[-1][1].get("response") if events else None

    async def ws():
        try:
            last, _ = await wsTurn(relay, MISER, dict(body, type="response.create"))
        except Exception as e:
            return repr(e), None
        if last["type"] in ("response.completed", "response.incomplete"):
            return 200, last["response"]
        return last.get("status") or last.get("code"), None

    results = await gatherResults([Deferred.fromCoroutine((http, ws)[n % 2]())
                                   for n in range(20)])
    log.append(("budget", sorted(str(code) for code, _ in results)))
    return [r for code, r in results if code == 200 and r is not None]


async def deniedSpellings(relay, log: list) -> None:
    """
    R110: the key's denied C{gpt-5.4} as a snapshot, in capitals, with a
    space: refused on every entrypoint, before any account.
    """
    for model in DENIED:
        for entry in ENTRIES:
            if entry == "ws":
                last, _ = await wsTurn(relay, EVIL, userTurn("evil denied", model=model))
                log.append(("denied", model, entry, last.get("type"),
                            last.get("status") or last.get("code")))
            else:
                code, _, _, _ = await httpTurn(relay, entry, EVIL, "evil denied", model=model)
                log.append(("denied", model, entry, code))


async def adminGuesses(relay, log: list) -> None:
    """
    R99 (issue 35 item 7): the hostile key guesses the admin key, with its
    own client key too: wrong keys back its address off; its own key is a
    wrong door, not a guess.
    """
    for n in range(8):
        for secret in (f"admin-guess-{n:04d}", EVIL):
            response = await treq.get(relay.url + "/admin/accounts",
                                      headers={"Authorization": [f"Bearer {secret}"]},
                                      persistent=False)
            await response.content()
            log.append(("guess", secret == EVIL, response.code))


async def collisions(relay, log: list, rounds: int, prewarmed: list) -> None:
    """
    R111 and R112: the innocent key's request ids and prompt cache key,
    with prewarms on the WebSocket.

    @param prewarmed: gets the tokens of each prewarm's reported usage (the
        emulator reports a prewarm's input, though it is no generation;
        relay counts what the upstream reports).
    """
    client = await connect(target(relay), key=EVIL)
    try:
        for n in range(rounds):
            code, _, _, _ = await httpTurn(
                relay, ("sse", "json")[n % 2], EVIL, f"evil collide {n}",
                {"prompt_cache_key": CACHE_KEY},
                headers={"X-Request-Id": [f"shared-{n}"], "session_id": [SESSION]})
            log.append(("collide", n, code))
            warm = dict(PREWARM, prompt_cache_key=CACHE_KEY)
            last, _ = await wsTurn(relay, EVIL, warm, client)
            log.append(("prewarm", n, last.get("type")))
            usage = (last.get("response") or {}).get("usage") or {}
            prewarmed.append(usage.get("input_tokens", 0) + usage.get("output_tokens", 0))
            last, _ = await wsTurn(relay, EVIL, dict(userTurn(f"evil warm {n}"),
                                                      prompt_cache_key=CACHE_KEY), client)
            log.append(("warm turn", n, last.get("type")))
    finally:
        client.bye()


# -- the innocent key -----------------------------------------------------------------------


async def innocentLane(relay, entry: str, done: list, failures: list, ids: list,
                       least: int, most: int) -> int:
    """
    Ordinary turns, one after another, until the hostile key is done (at
    least C{least}, at most C{most}).

    @return: how many turns ran.
    """
    client = await connect(target(relay), key=INNOCENT) if entry == "ws" else None
    n = 0
    try:
        while n < most and (n < least or not done):
            text = f"innocent {entry} {n}"
            if entry == "ws":
                last, _ = await wsTurn(relay, INNOCENT, dict(userTurn(text),
                                                             prompt_cache_key=CACHE_KEY), client)
                if last.get("type") != "response.completed":
                    failures.append((entry, n, last))
            else:
                shared = f"shared-{n}"
                code, outcome, detail, hdrs = await httpTurn(
                    relay, entry, INNOCENT, text, {"prompt_cache_key": CACHE_KEY},
                    headers={"X-Request-Id": [shared], "session_id": [SESSION]})
                if (code, outcome) != (200, "ok"):
                    failures.append((entry, n, code, outcome, detail))
                else:
                    ids.append((shared, hdrs.getRawHeaders("x-request-id")[0]))
            n += 1
    finally:
        if client is not None:
            client.bye()
    return n


# -- checks ---------------------------------------------------------------------------------


async def waitFor(predicate, timeout: float, what: str, seen: list = ()):
    """
    Poll the async C{predicate} every 50 ms until it returns a true value.
    """
    deadline = reactor.seconds() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if reactor.seconds() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {seen}")
        await sleep(0.05)


async def requestRows(relay, query: str) -> list:
    """
    Every row of C{/admin/requests?<query>}, following C{next}.
    """
    rows, cursor = [], None
    while True:
        page = await admin(relay, f"/admin/requests?limit=500{query}"
                                  + (f"&cursor={cursor}" if cursor else ""))
        rows.extend(page["requests"])
        cursor = page.get("next")
        if not cursor:
            return rows


def upstreamBodies(emulator) -> list:
    return [r.body for _, credential, _ in ACCOUNTS for r in emulator.requestsFor(credential)
            if r.kind in ("request", "frame") and isinstance(r.body, dict)]


def generated(emulator) -> int:
    return sum(g["input_tokens"] + g["output_tokens"] for g in emulator.ledger.usage)


@pytest.mark.parametrize("state", ["memory", "redis"])
@pytest_twisted.ensureDeferred
async def test_hostile_tenant_cannot_break_or_cheat_the_pool(state, request):
    """
    See the module docstring; on memory state and on Redis (account state,
    budget holds and usage shared through it).
    """
    stateConfig = ""
    if state == "redis":
        server = request.getfixturevalue("redisServer")
        server.command("FLUSHALL")
        stateConfig = f"state: {{backend: redis, redis_url: '{server.url}'}}\n"
    emulator = Emulator(reactor=reactor, config={
        "default_script": {"text": "word " * 12, "deltas": 4, "delay": 0.02}})
    await emulator.listen(reactor)
    emulator.setFault("*", FAULTS)
    emulator.setFault(dict((n, c) for n, c, _ in ACCOUNTS)[OAUTH], BACKEND_FAULTS)
    tmp = tempfile.mkdtemp(prefix="relay-hostile-")
    config = os.path.join(tmp, "relay.yaml")
    relay = RelayProcess(config=config, log=os.path.join(tmp, "relay.log"))
    keys = [
        {"name": "evil", "key": EVIL, "concurrency": 0, "deny_models": ["gpt-5.4"]},
        {"name": "innocent", "key": INNOCENT, "concurrency": 0},
        # on the OAuth account, which takes no max_output_tokens (R108's estimate)
        {"name": "miser", "key": MISER, "concurrency": 0, "daily_usd": BUDGET,
         "max_turn_output_tokens": TURN_CAP, "accounts": [OAUTH]},
    ]
    accounts = [{"id": name, "type": "apikey", "base_url": emulator.baseURL("apikey"),
                 "api_key": secret, "concurrency": 0, "ws_mode": mode}
                if name != OAUTH else
                {"id": name, "type": "oauth", "base_url": emulator.baseURL("oauth"),
                 "access_token": secret, "chatgpt_account_id": "acct-hostile",
                 "concurrency": 0, "ws_mode": mode}
                for name, secret, mode in ACCOUNTS]
    with open(config, "w") as f:
        f.write(f'listen: "tcp:{relay.port}:interface=127.0.0.1"\n'
                f"admin_key: {ADMIN}\n"
                f"database: {json.dumps(os.path.join(tmp, 'relay.sqlite'))}\n"
                f"keys: {json.dumps(keys)}\n"
                f"accounts: {json.dumps(accounts)}\n"
                f"gateway: {{usage_drain_seconds: {DRAIN_SECONDS}}}\n"
                f"{stateConfig}")
    relay.start()
    try:
        await relay.waitHealthy()
        started = reactor.seconds()
        log, failures, ids, done, prewarmed = [], [], [], [], []

        async def hostile():
            burst = Deferred.fromCoroutine(budgetBurst(relay, log))
            await gatherResults([
                burst,
                Deferred.fromCoroutine(echoedFields(relay, log)),
                Deferred.fromCoroutine(refusedModels(relay, log)),
                Deferred.fromCoroutine(hangUps(relay, log)),
                Deferred.fromCoroutine(estimated(relay, log)),
                Deferred.fromCoroutine(background(relay, log)),
                Deferred.fromCoroutine(adminGuesses(relay, log)),
                Deferred.fromCoroutine(deniedSpellings(relay, log)),
                Deferred.fromCoroutine(collisions(relay, log, 4, prewarmed)),
            ], consumeErrors=True)
            done.append(True)
            return burst.result

        lanes = [Deferred.fromCoroutine(innocentLane(relay, entry, done, failures, ids, 4, 60))
                 for entry in ("sse", "json", "chat", "ws")]
        served, *counts = await gatherResults(
            [Deferred.fromCoroutine(hostile()), *lanes], consumeErrors=True
        ).addTimeout(DEADLINE, reactor)

        # The innocent key saw no failure, all the while.
        assert failures == [], (failures, relay.tail())
        assert all(count >= 4 for count in counts), counts

        # The hostile key's tricks did what they were meant to.
        for entry in log:
            if entry[:2] == ("echo", "field"):
                assert entry[3] in (200, "response.completed"), entry
            elif entry[0] == "denied":
                # (the WebSocket: an error event, or the socket closed 1008)
                assert entry[3] in (403, "error", "__closed__"), entry
                assert entry[3] == 403 or entry[4] in (403, 1008), entry
            elif entry[0] == "guess":
                assert entry[2] in (401, 429), entry
            elif entry[0] == "background":
                assert entry[1:] == (200, "queued"), entry
            elif entry[0] == "model":
                assert entry[3] not in (200, "response.completed"), entry
        guesses = [code for kind, _, code in (e for e in log if e[0] == "guess")]
        assert guesses[:9] == [401] * 9 and 429 in guesses, guesses  # 5 wrong keys, then waits
        models = [str(b.get("model", "")) for b in upstreamBodies(emulator)]
        assert not any(m.strip().lower().startswith("gpt-5.4") and m != STALLED
                       for m in models), models
        for phrase in PHRASES:
            # an echoed field reached at most one account once (its retry went
            # without it; a chat turn translated for the backend never sends it)
            fields = sum(1 for b in upstreamBodies(emulator) if phrase in b)
            values = sum(1 for b in upstreamBodies(emulator) if b.get("tool_choice") == phrase)
            assert 1 <= fields <= len(ENTRIES) and values == len(ENTRIES), (phrase, fields,
                                                                             values)
        for model in REFUSED_MODELS:
            # each account refused it once; no same-account retry, no backoff (R8, R106)
            assert models.count(model) <= len(ACCOUNTS), (model, models.count(model))

        # Every generated token is counted (R107), within 1 %, once every
        # upstream turn is over; the usage route flushes first.
        last = []

        async def settled():
            if any(emulator.inflight(credential) for _, credential, _ in ACCOUNTS):
                return None
            usage = await admin(relay, "/admin/usage?group_by=key")
            total = usage["total"]
            counted = total.get("input_tokens", 0) + total.get("output_tokens", 0)
            estimates = [r for r in await requestRows(relay, "") if r.get("usage_estimated")]
            want = (generated(emulator) + sum(prewarmed)
                    + sum(r["input_tokens"] + r["output_tokens"] for r in estimates))
            last[:] = [counted, want, usage["rows"]]
            return usage if want and abs(counted - want) <= want / 100 else None

        usage = await waitFor(settled, 15, "usage to match the generations", last)
        total = usage["total"]
        counted = total["input_tokens"] + total["output_tokens"]
        rows = await requestRows(relay, "")
        estimates = [r for r in rows if r.get("usage_estimated")]
        gone = [r for r in rows if r["outcome"] == "client_gone"]
        # a hang-up after output is a client_gone row with its tokens (one
        # whose terminal event was already on its way may end completed)
        assert 2 <= len(gone) <= 14 and all(r["key"] == "evil" for r in gone), gone
        assert all(r["input_tokens"] and r["output_tokens"] for r in gone), gone
        guessed = sum(r["input_tokens"] + r["output_tokens"] for r in estimates)
        want = generated(emulator) + sum(prewarmed)
        assert abs(counted - guessed - want) <= want / 100, (counted, guessed, want)
        # the two stalled turns, and nothing else, are estimated and marked
        assert len(estimates) == total["estimated_requests"] == 2, (total, estimates)
        assert {(r["key"], r["outcome"]) for r in estimates} == {("evil", "client_gone")}
        assert all(r["output_tokens"] >= 1 for r in estimates), estimates

        # No account is cooled, rate-limited, disabled, on a streak or
        # blocked account-wide; the only model blocks are the refused models'.
        view = await admin(relay, "/admin/accounts")
        allowed = {m.strip().lower() for m in REFUSED_MODELS}
        for account in view["accounts"]:
            assert account["schedulable"] or all(
                b["scope"] == "model" for b in account["blocks"]), account
            assert not account["disabled"], account
            assert not account["rate_limited_until"], account
            assert not account["streaks"], account
            assert [b for b in account["blocks"] if b["scope"] != "model"] == [], account
            blocked = {m.strip().lower() for m in account["blocked_models"]}
            assert blocked <= allowed, account
            assert MODEL not in blocked, account
            breaker = account["breaker"]
            assert breaker is None or not breaker["opens"], account

        # The budget held (R108): at most one turn's settled cost above it.
        assert served, log
        budget = {row["key"]: row for row in usage["budgets"]}["miser"]
        most = max(PriceTable().cost(MODEL, fromUsage(r["usage"])) for r in served)
        assert budget["daily_spent_usd"] * 1e9 <= BUDGET * 1e9 + most + 1, (budget, most)
        codes = [entry[1] for entry in log if entry[0] == "budget"][0]
        # refused: HTTP 429, the WebSocket an in-band 429 or a close 1013
        assert set(codes) <= {"200", "429", "1013"} and len(served) < 20, codes

        # Request ids (R111): the innocent key's are relay's own, and the
        # shared client id finds each key's rows under its own key.
        relayIds = [rid for _, rid in ids]
        assert len(set(relayIds)) == len(relayIds)
        assert all(rid.startswith("req_") for rid in relayIds), relayIds
        for shared in ("shared-0", "shared-1"):
            rows = await requestRows(relay, f"&client_request_id={shared}")
            keysOf = {(r["key"], r["request_id"]) for r in rows}
            mine = {("innocent", rid) for s, rid in ids if s == shared}
            assert mine and mine <= keysOf, (rows, mine)
            assert {r["key"] for r in rows} == {"evil", "innocent"}, rows
            assert all(r["client_request_id"] == shared for r in rows), rows

        # Prompt caches (R112): the two keys never share one upstream.
        caches = {"evil": set(), "innocent": set()}
        for body in upstreamBodies(emulator):
            text = json.dumps(body)
            who = "innocent" if "innocent" in text else "evil" if "evil" in text else None
            if who and body.get("prompt_cache_key"):
                caches[who].add(body["prompt_cache_key"])
        assert caches["innocent"] and caches["evil"], caches
        assert not caches["innocent"] & caches["evil"], caches
        assert CACHE_KEY not in caches["innocent"] | caches["evil"], caches
        # ... nor one session or client request id on the OAuth account
        oauth = dict((n, c) for n, c, _ in ACCOUNTS)[OAUTH]
        sessions = {"evil": set(), "innocent": set()}
        for r in emulator.requestsFor(oauth, "request"):
            text = json.dumps(r.body)
            who = "innocent" if "innocent" in text else "evil" if "evil" in text else None
            if who and r.headers.get("session_id"):
                sessions[who].add(r.headers["session_id"])
            assert not str(r.headers.get("x-client-request-id", "")).startswith("shared-"), r
        assert not sessions["innocent"] & sessions["evil"], sessions
        assert SESSION not in sessions["innocent"] | sessions["evil"], sessions

        assert reactor.seconds() - started < DEADLINE
    finally:
        await relay.shutdown()
        await emulator.stop()
