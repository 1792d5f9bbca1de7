"""
Drivers for the issue 11 tests (the attempt-end reproductions and the parity
matrix): one client turn through any entrypoint, a client that leaves mid-turn
or while waiting, and the three things every cell records: the client's
outcome class, the account state as C{/admin/accounts} reports it, and the
relay's decision counters from its Prometheus registry.

Everything runs over loopback against the bundled emulator
(L{tests.integration.harness.startStack}); waits are on events (turn
counters, slot loads, received bytes), never on fixed sleeps.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import Counter

import treq
from attrs import evolve, frozen
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater

from tests.integration.harness import RELAY_KEY, closedPort, sseEvents, startStack
from tests.integration.test_ws_turns import connect, drain, userTurn

__all__ = [
    "ADMIN",
    "BAD",
    "CHAT_OAUTH",
    "MESSAGES_ENTRYPOINTS",
    "MESSAGES_OAUTH",
    "OAUTH_ENTRYPOINTS",
    "SSE_OAUTH",
    "ENTRYPOINTS",
    "GOOD",
    "HTTP_ENTRYPOINTS",
    "MEDIA_ENTRYPOINTS",
    "MODEL",
    "WS_ENTRYPOINTS",
    "Outcome",
    "RawHTTP",
    "accountState",
    "adminAccounts",
    "closedPort",
    "connectNew",
    "decisionCounters",
    "departures",
    "drain",
    "leaveMidTurn",
    "metricSamples",
    "modelFor",
    "newSession",
    "oneTurn",
    "reasonClass",
    "settle",
    "startParityStack",
    "upstreamTransport",
    "waitUntil",
]

ADMIN = "parity-admin-key"
BAD = "cred-bad"
GOOD = "cred-good"
MODEL = "gpt-5.5"

HTTP_ENTRYPOINTS = ("http_sse", "http_json", "chat_stream")
WS_ENTRYPOINTS = ("ws_ctx_pool", "ws_passthrough", "ws_http_bridge")
ENTRYPOINTS = HTTP_ENTRYPOINTS + WS_ENTRYPOINTS

CHAT_OAUTH = "chat_stream_oauth"
"""A chat stream on OAuth accounts: relay translates it to the backend's
Responses route (issue 13), so the upstream faults are Responses-shaped."""

SSE_OAUTH = "http_sse_oauth"
"""A Responses SSE stream on OAuth accounts: the reference column the chat
translation is compared with (R11 marks OAuth accounts differently from
API-key ones, so the API-key rows' prescriptions do not apply)."""

MESSAGES_ENTRYPOINTS = ("messages_sse", "messages_json")
"""The Anthropic Messages API (R115), streaming and not, on API-key
accounts: a Responses turn upstream, so the faults are Responses-shaped."""

MEDIA_ENTRYPOINTS = ("embeddings", "images")
"""C{POST /v1/embeddings} and C{POST /v1/images/generations} (R115): JSON
answers on API-key accounts; who served is told by the emulator's
generation count (their answers name no account)."""

_MEDIA_REQUESTS = {
    "embeddings": ("/v1/embeddings", {"model": "text-embedding-3-small"}, "input"),
    "images": ("/v1/images/generations", {"model": "gpt-image-1"}, "prompt"),
}

MESSAGES_OAUTH = "messages_sse_oauth"
"""A streaming Messages turn on OAuth accounts (compared with L{SSE_OAUTH})."""

OAUTH_ENTRYPOINTS = (SSE_OAUTH, CHAT_OAUTH, MESSAGES_OAUTH)

ACCOUNT_TYPE = {CHAT_OAUTH: "oauth", SSE_OAUTH: "oauth", MESSAGES_OAUTH: "oauth"}
"""Account type per entrypoint; everything else uses API-key accounts."""

_SSE = ("http_sse", SSE_OAUTH)
_MESSAGES = (*MESSAGES_ENTRYPOINTS, MESSAGES_OAUTH)
_MESSAGES_SSE = ("messages_sse", MESSAGES_OAUTH)
_HTTP = (*HTTP_ENTRYPOINTS, *OAUTH_ENTRYPOINTS, *MESSAGES_ENTRYPOINTS)
_CHAT = ("chat_stream", CHAT_OAUTH)

WS_MODE = {"ws_ctx_pool": "ctx_pool", "ws_passthrough": "passthrough",
           "ws_http_bridge": "http_bridge"}

#: seconds; every single wait in these drivers is bounded by this
WAIT = 8.0


def upstreamTransport(entrypoint: str) -> str:
    """
    The transport relay uses upstream for an entrypoint: C{"ws"} for
    ctx_pool and passthrough (an upstream WebSocket), else C{"http"}
    (http_bridge turns are upstream HTTP POSTs, R52).
    """
    return "ws" if entrypoint in ("ws_ctx_pool", "ws_passthrough") else "http"


def _names(accounts) -> dict:
    """
    An emulator config naming every account after its relay id, so the
    emulator's default reply text says which account served a turn.
    """
    return {"accounts": [{"name": a["id"], "credential": a["credential"]} for a in accounts]}


async def startParityStack(entrypoint: str, accounts, firstOutputTimeout: float = 0.0,
                           keys=None, extra: str = ""):
    """
    Start an emulator + relay for one entrypoint with an admin key; the
    WebSocket entrypoints set C{gateway.websocket.mode_default}.

    @param accounts: account dicts as L{tests.integration.harness.accountsYAML}
        takes them (each needs C{id} and C{credential}).
    @param firstOutputTimeout: seconds; when set, written straight onto the
        runtime settings (the config file only allows 30..600, R20).
    @param keys: the C{keys:} section as JSON text (default: the harness key).
    @param extra: more configuration text (e.g. C{groups:}, issue 22).
    """
    mode = WS_MODE.get(entrypoint)
    gateway = "{" + (f"websocket: {{mode_default: {mode}}}" if mode else "") + "}"
    kind = ACCOUNT_TYPE.get(entrypoint)
    if kind is not None:
        accounts = [{"type": kind, **a} for a in accounts]
    stack = await startStack(accounts, gateway=gateway, emulatorConfig=_names(accounts),
                             keys=keys, extra=f"admin_key: {ADMIN}\n{extra}")
    if firstOutputTimeout:
        s = stack.app.settings.current
        stack.app.settings.current = evolve(s, first_output_timeout_seconds=firstOutputTimeout)
    return stack


# -- outcomes -------------------------------------------------------------------


@frozen
class Outcome:
    """
    What one client saw.

    @ivar kind: C{served_by_other} (the turn completed on an account other
        than the faulty one), C{served_same} (completed on the faulty
        account), C{terminal_error} (an HTTP error status, an in-stream
        failure, or a status-bearing WebSocket C{error} event),
        C{retryable_close} (a WebSocket close code), C{none} (the client
        left), or one of the spec violations C{mixed_stream} (two attempts'
        events reached the client, R22/R84), C{no_terminal} (the turn ended
        without a terminal event, protocol.md 2.5), C{broken} (unparsable).
    @ivar code: the HTTP status, C{"in-stream"}, the close code, a
        C{"error:<status>"} for a WebSocket error event, or L{None} for a
        served turn.
    @ivar servedBy: the account whose reply the client got, if any.
    @ivar detail: a short human-readable note (messages, close reasons).
    @ivar responseId: the served response's id, for a later turn.
    """

    kind: str
    code: object = None
    servedBy: object = None
    detail: str = ""
    responseId: object = None

    def key(self) -> tuple:
        """
        @return: C{(kind, code)}, the part the matrix compares.
        """
        return (self.kind, self.code)


_ACCOUNT = re.compile(r"\(account ([A-Za-z0-9_.-]+)\)")


def _served(text: str, faulty: str, responseId=None, detail="") -> Outcome:
    match = _ACCOUNT.search(text or "")
    who = match.group(1) if match else None
    kind = "served_same" if who == faulty else "served_by_other"
    return Outcome(kind, None, who, detail or (text or "")[:60], responseId)


def _completedText(response: dict) -> str:
    parts = []
    for item in response.get("output") or []:
        for content in item.get("content") or []:
            if isinstance(content, dict) and content.get("text"):
                parts.append(content["text"])
    return "".join(parts)


def responsesOutcome(events: list, faulty: str) -> Outcome:
    """
    Classify a Responses event sequence (SSE or WebSocket frames).

    @param events: C{(type, data)} pairs in arrival order.
    @param faulty: the faulty account's id (a reply from it is
        C{served_same}).
    """
    types = [t for t, _ in events]
    if types.count("response.created") > 1:
        return Outcome("mixed_stream", "in-stream", None, " ".join(types)[:120])
    last, data = events[-1] if events else (None, None)
    if last == "response.completed":
        response = data.get("response") or {}
        return _served(_completedText(response), faulty, response.get("id"))
    for t, d in events:
        if t in ("response.failed", "error"):
            error = (d.get("response") or {}).get("error") or d.get("error") or d
            return Outcome("terminal_error", "in-stream", None, json.dumps(error)[:120])
    return Outcome("no_terminal", "in-stream", None, " ".join(types)[-120:])


def _messagesRequest(entrypoint: str, text: str) -> tuple:
    return "/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 200,
                            "stream": entrypoint in _MESSAGES_SSE,
                            "messages": [{"role": "user", "content": text}]}


def messagesOutcome(data: bytes, stream: bool, faulty: str) -> Outcome:
    """
    Classify a Messages answer (protocol.md 10): a stream with one
    C{message_start} and a C{message_stop}, or a message object, is a served
    turn; an C{error} event is a terminal error; two C{message_start}s
    mean two attempts reached the client (R84).
    """
    if not stream:
        try:
            message = json.loads(data)
        except ValueError:
            return Outcome("broken", 200, None, data[:80].decode("utf-8", "replace"))
        if message.get("type") != "message":
            return Outcome("terminal_error", "in-body", None, json.dumps(message)[:120])
        text = "".join(b.get("text", "") for b in message.get("content") or [])
        return _served(text, faulty, detail=message.get("stop_reason") or "")
    events = sseEvents(data)
    types = [t for t, _ in events]
    if types.count("message_start") > 1:
        return Outcome("mixed_stream", "in-stream", None, " ".join(types)[:120])
    for t, d in events:
        if t == "error":
            return Outcome("terminal_error", "in-stream", None, json.dumps(d)[:120])
    if types and types[-1] == "message_stop":
        text = "".join((d.get("delta") or {}).get("text", "") for t, d in events
                       if t == "content_block_delta")
        return _served(text, faulty)
    return Outcome("no_terminal", "in-stream", None, " ".join(types)[-120:])


def _errorMessage(data: bytes) -> str:
    try:
        return json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return data[:120].decode("utf-8", "replace")


def newSession() -> tuple:
    """
    A fresh conversation: a C{session-id} (what Codex sends per thread,
    R37) and a user text of its own, so no two conversations share a sticky
    session binding (R38) unless a test means them to.

    @return: C{(session id, text)}.
    """
    sid = uuid.uuid4().hex
    return sid, f"hi {sid[:8]}"


async def _httpTurn(stack, entrypoint: str, faulty: str, previous=None) -> Outcome:
    sid, text = newSession()
    headers = {"session-id": [sid]}
    if entrypoint in _MESSAGES:
        path, body = _messagesRequest(entrypoint, text)
        response, data = await stack.postJSON(path, body, headers=headers)
        if response.code != 200:
            return Outcome("terminal_error", response.code, None, _errorMessage(data))
        return messagesOutcome(data, entrypoint in _MESSAGES_SSE, faulty)
    if entrypoint in _CHAT:
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True}
        response, data = await stack.postJSON("/v1/chat/completions", body, headers=headers)
        if response.code != 200:
            return Outcome("terminal_error", response.code, None, _errorMessage(data))
        return chatOutcome(data, faulty)
    body = {"model": MODEL, "input": text, "stream": entrypoint in _SSE}
    if previous:
        body["previous_response_id"] = previous
    response, data = await stack.postJSON("/v1/responses", body, headers=headers)
    retryAfter = response.headers.getRawHeaders(b"retry-after")
    if response.code != 200:
        note = _errorMessage(data)
        if retryAfter:
            note += f" [Retry-After {retryAfter[0].decode()}]"
        return Outcome("terminal_error", response.code, None, note)
    if entrypoint in _SSE:
        return responsesOutcome(sseEvents(data), faulty)
    try:
        parsed = json.loads(data)
    except ValueError:
        return Outcome("broken", 200, None, data[:80].decode("utf-8", "replace"))
    if parsed.get("status") != "completed":
        return Outcome("terminal_error", "in-body", None, json.dumps(parsed.get("error"))[:120])
    return _served(_completedText(parsed), faulty, parsed.get("id"))


def modelFor(entrypoint: str) -> str:
    """
    The model an entrypoint's turns ask for (an account's streaks are per
    model, R11).
    """
    found = _MEDIA_REQUESTS.get(entrypoint)
    return found[1]["model"] if found is not None else MODEL


async def _mediaTurn(stack, entrypoint: str, faulty: str) -> Outcome:
    """
    One embeddings or images request (L{MEDIA_ENTRYPOINTS}); served by the
    account whose generation count grew.
    """
    sid, text = newSession()
    path, body, field = _MEDIA_REQUESTS[entrypoint]
    names = [a.id for a in stack.app.config.accounts]
    before = {name: stack.emulator.generationCount(name) for name in names}
    response, data = await stack.postJSON(path, dict(body, **{field: text}),
                                          headers={"session-id": [sid]})
    if response.code != 200:
        return Outcome("terminal_error", response.code, None, _errorMessage(data))
    try:
        parsed = json.loads(data)
    except ValueError:
        return Outcome("broken", 200, None, data[:80].decode("utf-8", "replace"))
    if not parsed.get("data"):
        return Outcome("broken", 200, None, data[:80].decode("utf-8", "replace"))
    grew = [n for n in names if stack.emulator.generationCount(n) > before[n]]
    who = grew[-1] if grew else None
    return Outcome("served_same" if who == faulty else "served_by_other", None, who,
                   f"{entrypoint} {len(parsed['data'])}")


def chatOutcome(data: bytes, faulty: str) -> Outcome:
    """
    Classify a Chat Completions stream body (protocol.md 3): exactly one role
    chunk, content, a finish reason and C{[DONE]} is a served turn; an error
    chunk or C{event: error} is a terminal error; a second role chunk or an
    error chunk before a completed stream means two attempts reached the
    client (R84).
    """
    roles, errors, text, done, finished = 0, 0, [], False, False
    for block in data.decode("utf-8", "replace").split("\n\n"):
        isError = False
        for line in block.split("\n"):
            if line.startswith("event: error"):
                isError = True
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                continue
            try:
                chunk = json.loads(payload)
            except ValueError:
                continue
            if isError or "error" in chunk:
                errors += 1
                continue
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("role"):
                    roles += 1
                if delta.get("content"):
                    text.append(delta["content"])
                if choice.get("finish_reason"):
                    finished = True
    summary = f"roles={roles} errors={errors} done={done}"
    if roles > 1 or (errors and done):
        return Outcome("mixed_stream", "in-stream", None, summary)
    if errors:
        return Outcome("terminal_error", "in-stream", None, summary)
    if done and finished:
        return _served("".join(text), faulty, detail=summary)
    return Outcome("no_terminal", "in-stream", None, summary)


async def collectTurn(client, timeout: float = WAIT) -> list:
    """
    Read WebSocket events until a terminal event, a status-bearing C{error}
    event or the close; an C{error} without C{status} is information that may
    precede a close (R81), so reading goes on.

    @return: C{(type, data)} pairs; a close is C{("__closed__", {code, reason})}.
    """
    out = []
    while True:
        event = await client.next(timeout)
        out.append((event["type"], event))
        if event["type"] == "__closed__":
            return out
        if event["type"] in ("response.completed", "response.failed", "response.incomplete"):
            return out
        if event["type"] == "error" and (event.get("status") or event.get("status_code")):
            return out


def wsOutcome(events: list, faulty: str) -> Outcome:
    """
    Classify what a WebSocket client saw for one turn.
    """
    last, data = events[-1]
    if last == "__closed__":
        body = [(t, d) for t, d in events[:-1]]
        if any(t == "response.output_text.delta" for t, _ in body) and not any(
                t in ("response.failed", "response.completed") for t, _ in body):
            note = f"after output: {data['reason']}"
        else:
            note = data["reason"] or ""
        return Outcome("retryable_close", data["code"], None, note)
    if last == "error":
        status = data.get("status") or data.get("status_code")
        return Outcome("terminal_error", f"error:{status}", None,
                       json.dumps(data.get("error"))[:120])
    return responsesOutcome(events, faulty)


async def oneTurn(stack, entrypoint: str, faulty: str = "bad", client=None, previous=None):
    """
    Run one ordinary turn through an entrypoint.

    @param client: for WebSocket entrypoints, an open client to reuse (a
        later turn); L{None} connects a new one.
    @param previous: a C{previous_response_id} for a later turn.
    @return: C{(Outcome, client)}; C{client} is the WebSocket client (still
        open unless it was closed) or L{None} for HTTP. The caller closes it
        (L{drain}).
    """
    if entrypoint in MEDIA_ENTRYPOINTS:
        return await _mediaTurn(stack, entrypoint, faulty), None
    if entrypoint in _HTTP:
        return await _httpTurn(stack, entrypoint, faulty, previous), None
    if client is None:
        client = await connectNew(stack)
    client.sendJSON(userTurn(newSession()[1], previous=previous))
    events = await collectTurn(client)
    return wsOutcome(events, faulty), client


async def connectNew(stack):
    """
    Open a relay WebSocket as a new Codex thread would (its own
    C{session-id}, R37).
    """
    return await connect(stack, headers={"session-id": newSession()[0]})


# -- clients that leave ---------------------------------------------------------


class RawHTTP(Protocol):
    """
    A bare HTTP/1.1 client: sends one request, keeps the bytes it gets, and
    can leave at any moment with a FIN (C{loseConnection}) or an RST
    (C{abortConnection}), like a user pressing Ctrl-C.
    """

    def __init__(self, request: bytes):
        self.request = request
        self.data = b""
        self._waiters = []
        self.lost = Deferred()

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.data += data
        for predicate, d in list(self._waiters):
            if predicate(self.data):
                self._waiters.remove((predicate, d))
                d.callback(self.data)

    def connectionLost(self, reason):
        for _, d in self._waiters:
            d.errback(AssertionError(
                f"connection lost before the awaited bytes: {self.data[-300:]!r}"))
        self._waiters = []
        if not self.lost.called:
            self.lost.callback(None)

    def waitFor(self, predicate, timeout: float = WAIT) -> Deferred:
        """
        @return: a Deferred firing once the received bytes satisfy C{predicate}.
        """
        def forget(d):
            self._waiters[:] = [w for w in self._waiters if w[1] is not d]

        d = Deferred(canceller=forget)
        if predicate(self.data):
            d.callback(self.data)
        else:
            self._waiters.append((predicate, d))
        return d.addTimeout(timeout, reactor)

    def leave(self, how: str) -> None:
        """
        @param how: C{"fin"} or C{"rst"}.
        """
        if how == "rst":
            self.transport.abortConnection()
        else:
            self.transport.loseConnection()


async def rawPost(stack, path: str, body: dict) -> RawHTTP:
    """
    Send a POST on a fresh TCP connection without waiting for the answer.
    """
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {RELAY_KEY}\r\n"
        f"session-id: {newSession()[0]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    proto = RawHTTP(head + payload)
    endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", stack.port.getHost().port, timeout=5)
    await connectProtocol(endpoint, proto)
    return proto


def _requestFor(entrypoint: str) -> tuple:
    text = newSession()[1]
    if entrypoint in MEDIA_ENTRYPOINTS:
        path, body, field = _MEDIA_REQUESTS[entrypoint]
        return path, dict(body, **{field: text})
    if entrypoint in _MESSAGES:
        return _messagesRequest(entrypoint, text)
    if entrypoint in _CHAT:
        return "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True}
    return "/v1/responses", {"model": MODEL, "input": text, "stream": entrypoint in _SSE}


def _chatHasContent(data: bytes) -> bool:
    """
    Whether a (possibly chunked, partial) chat stream body holds a chunk
    with non-empty C{delta.content}.
    """
    for line in data.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data: {"):
            continue
        try:
            chunk = json.loads(line[6:])
        except ValueError:
            continue
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                return True
    return False


async def startLeaver(stack, entrypoint: str):
    """
    Start a turn whose client will leave: a raw HTTP request or a WebSocket
    client that has sent its turn.

    @return: the L{RawHTTP} or the WebSocket client.
    """
    if entrypoint in _HTTP or entrypoint in MEDIA_ENTRYPOINTS:
        path, body = _requestFor(entrypoint)
        return await rawPost(stack, path, body)
    client = await connectNew(stack)
    client.sendJSON(userTurn(newSession()[1]))
    return client


async def waitForOutput(stack, entrypoint: str, leaver, credential: str) -> None:
    """
    Wait until the leaving client has received output: the first text delta
    (Responses SSE and WebSocket), the first content chunk (chat), or, for a
    JSON client (one body, no stream), until the upstream is working on it.
    """
    if entrypoint in _SSE:
        await leaver.waitFor(lambda data: b"response.output_text.delta" in data)
    elif entrypoint in _CHAT:
        await leaver.waitFor(_chatHasContent)
    elif entrypoint in _MESSAGES_SSE:
        await leaver.waitFor(lambda data: b'"text_delta"' in data)
    elif entrypoint in ("http_json", "messages_json") or entrypoint in MEDIA_ENTRYPOINTS:
        await waitUntil(lambda: stack.emulator.inflight(credential) >= 1, "the JSON turn upstream")
    else:
        while True:
            event = await leaver.next(WAIT)
            if event["type"] == "response.output_text.delta":
                return
            if event["type"] in ("__closed__", "response.completed", "response.failed", "error"):
                raise AssertionError(f"the turn ended before output: {event}")


def leaveNow(entrypoint: str, leaver, how: str) -> None:
    """
    Leave: C{"rst"} (abortConnection), C{"fin"} (loseConnection; on a
    WebSocket that is a FIN without a close frame) or C{"close"} (a
    WebSocket close frame with 1000; for HTTP the same as C{"fin"}).
    """
    if entrypoint in _HTTP or entrypoint in MEDIA_ENTRYPOINTS:
        leaver.leave("rst" if how == "rst" else "fin")
    elif how == "rst":
        leaver.transport.abortConnection()
    elif how == "fin":
        leaver.transport.loseConnection()
    else:
        leaver.sendClose(1000)


async def leaveMidTurn(stack, entrypoint: str, how: str = "fin", credential: str = BAD) -> None:
    """
    One client that starts a turn and leaves as soon as output reached it.
    """
    leaver = await startLeaver(stack, entrypoint)
    await waitForOutput(stack, entrypoint, leaver, credential)
    leaveNow(entrypoint, leaver, how)


# -- waiting on the relay -------------------------------------------------------


async def waitUntil(predicate, what: str, timeout: float = WAIT) -> None:
    """
    Poll a cheap synchronous predicate on the reactor until it holds.

    @raise AssertionError: after C{timeout} seconds.
    """
    deadline = reactor.seconds() + timeout
    while not predicate():
        if reactor.seconds() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await deferLater(reactor, 0.01, lambda: None)


def metricSamples(stack, name: str) -> dict:
    """
    The samples of one counter from the relay's registry.

    @param name: the sample name, e.g. C{relay_failovers_total}.
    @return: C{{labels tuple: value}} with labels as sorted C{(k, v)} pairs.
    """
    out = {}
    for metric in stack.app.extras["metrics"].registry.collect():
        for sample in metric.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def turnsFinished(stack) -> int:
    """
    How many turns the engine has finished (the last thing L{TurnRunner}
    does for a turn is count it in C{relay_turns_total}).
    """
    return int(sum(metricSamples(stack, "relay_turns_total").values()))


async def settle(stack, turns: int) -> None:
    """
    Wait until the engine has finished C{turns} turns and every account slot
    is free, so the account state read next is final.
    """
    ids = [a.id for a in stack.app.config.accounts]
    deadline = reactor.seconds() + WAIT
    while True:
        loads = await stack.app.admission.load("account", ids)
        done = turnsFinished(stack)
        if done >= turns and all(v == (0, 0) for v in loads.values()):
            break
        if reactor.seconds() > deadline:
            raise AssertionError(f"relay did not settle: {done}/{turns} turns, slots {loads}")
        await deferLater(reactor, 0.01, lambda: None)
    # Bookkeeping scheduled in the same reactor turn as the count lands now.
    await deferLater(reactor, 0, lambda: None)


def departures(stack) -> int:
    """
    How many turns the engine finished because their client had gone (the
    R2 path): a departure that raced the turn's normal end would not count,
    so tests assert this to know the departure really was mid-turn.
    """
    return int(sum(v for labels, v in metricSamples(stack, "relay_turns_total").items()
                   if dict(labels).get("outcome") == "client_gone"))


def decisionCounters(stack) -> dict:
    """
    The relay's decision counters: failovers and same-account retries by
    reason, cooldowns by kind, upstream statuses, slot waits by outcome.
    """
    def byLabel(name, label):
        out = Counter()
        for labels, value in metricSamples(stack, name).items():
            out[dict(labels).get(label)] += int(value)
        return {k: v for k, v in out.items() if v}

    return {
        "failovers": byLabel("relay_failovers_total", "reason"),
        "same_retries": byLabel("relay_same_account_retries_total", "reason"),
        "cooldowns": byLabel("relay_cooldowns_total", "reason"),
        "upstream_status": byLabel("relay_upstream_status_total", "status"),
        "waits": byLabel("relay_waits_total", "outcome"),
    }


# -- the operator view ------------------------------------------------------------


async def adminAccounts(stack) -> dict:
    """
    C{GET /admin/accounts} as C{{account id: row}}.
    """
    response = await treq.get(stack.url + "/admin/accounts",
                              headers={"Authorization": [f"Bearer {ADMIN}"]})
    body = await response.content()
    assert response.code == 200, body
    data = json.loads(body)
    rows = data["accounts"] if isinstance(data, dict) else data
    return {row["id"]: row for row in rows}


def _classOf(text: str) -> str:
    t = (text or "").lower()
    for needle, name in (
        ("circuit", "breaker"), ("breaker", "breaker"),
        ("transient upstream errors", "streak"), ("streak", "streak"),
        ("403", "403_cooldown"),
        ("disabled", "disabled"), ("permanent", "disabled"),
        ("rate", "rate_limited"),
        ("overload", "overloaded"),
        ("transport", "transport"),
        ("quarantin", "proxy"),
        ("model", "model_block"),
    ):
        if needle in t:
            return name
    return t[:24] or "?"


def reasonClass(row: dict) -> str:
    """
    The reason class of an admin row: C{ok}, or the classes of its blocks
    (C{blocks} when the view has them, else its C{reason}), joined by C{+}.
    """
    blocks = row.get("blocks")
    texts = []
    if isinstance(blocks, list) and blocks:
        texts = [f"{b.get('kind') or ''} {b.get('reason') or ''}" for b in blocks]
    elif row.get("reason"):
        texts = [row["reason"]]
    elif row.get("disabled"):
        texts = ["disabled"]
    return "+".join(sorted({_classOf(t) for t in texts})) or "ok"


def accountState(row: dict, model: str = MODEL) -> tuple:
    """
    Normalise an admin row to C{(schedulable, reason class, breaker failures,
    streak)}. The streak is L{None} when the view does not report streaks
    (issue 11 item 3 adds C{streaks: {model: n}}).
    """
    breaker = row.get("breaker")
    failures = breaker.get("failures", 0) if isinstance(breaker, dict) else 0
    streaks = row.get("streaks")
    streak = streaks.get(model, 0) if isinstance(streaks, dict) else None
    return (bool(row.get("schedulable")), reasonClass(row), int(failures or 0), streak)


async def storeState(stack, accountId: str) -> str:
    """
    What the state store holds for an account, briefly (for the printed
    matrix: the engine's truth next to the operator view).
    """
    runtime = (await stack.app.store.getAccountStates([accountId]))[accountId]
    now = stack.app.reactor.seconds()
    parts = []
    if runtime.disabled:
        parts.append("disabled")
    if runtime.blockedUntil > now:
        parts.append(f"blocked {runtime.blockedUntil - now:.0f}s")
    if runtime.rateLimitedUntil > now:
        parts.append(f"rate-limited {runtime.rateLimitedUntil - now:.0f}s")
    if runtime.overloadedUntil > now:
        parts.append(f"overloaded {runtime.overloadedUntil - now:.0f}s")
    for model, until in sorted(runtime.modelBlocks.items()):
        if until > now:
            parts.append(f"model {model} {until - now:.0f}s")
    streak = _storedStreak(stack, accountId)
    if streak:
        parts.append(f"streak {streak}")
    return ",".join(parts) or "-"


def _storedStreak(stack, accountId: str, model: str = MODEL):
    """
    The R11 streak counter as the memory store holds it today, for the
    printed matrix only (a diagnostic next to the operator view; L{None}
    when the store or the key layout is not the one this reads).
    """
    try:
        from relay.policy.health import streakKey

        entry = stack.app.store._counters.get(streakKey(accountId, model))
    except Exception:  # noqa: BLE001 - diagnostics only
        return None
    if entry is None or entry[1] <= stack.app.reactor.seconds():
        return None
    return entry[0]


# -- compaction turns (issue 20, R89) ---------------------------------------------

TRIGGER = {"type": "compaction_trigger"}
COMPACTION_ENTRYPOINTS = ("http_sse", "http_json", "ws_ctx_pool", "ws_passthrough",
                          "ws_http_bridge")
"""Where a compaction turn exists: the Responses entrypoints (chat has none)."""


def _user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def compactionOutcome(items: list, terminal: str, faulty: str, responseId=None) -> Outcome:
    """
    Classify a compaction turn: served when it ended with
    C{response.completed} and exactly one C{compaction} item, by the account
    that sealed it (L{relay.emulator.sealing}).
    """
    from relay.emulator.sealing import sealedFor

    compaction = [i for i in items if isinstance(i, dict) and i.get("type") == "compaction"]
    if terminal != "response.completed" or len(compaction) != 1:
        return Outcome("terminal_error", "in-stream", None,
                       f"{terminal} with {len(compaction)} compaction items")
    who = sealedFor(compaction[0].get("encrypted_content"))
    kind = "served_same" if who == faulty else "served_by_other"
    return Outcome(kind, None, who, f"compaction by {who}", responseId)


async def compactionTurn(stack, entrypoint: str, faulty: str = "bad", client=None,
                         item=None, previous=None):
    """
    One compaction turn (input ending with C{compaction_trigger}) through an
    entrypoint; or, with C{item}, the turn after it, carrying that
    compaction item (HTTP: in full input; WebSocket: chained to
    C{previous} on the same connection).

    @return: C{(Outcome, client, compaction item or None)}.
    """
    sid, text = newSession()
    if item is None:
        items = [_user(text), TRIGGER]
    elif entrypoint in _HTTP:
        items = [_user(text), item, _user("go on")]
    else:
        items = [_user("go on")]
    if entrypoint in _HTTP:
        stream = entrypoint in _SSE
        body = {"model": MODEL, "input": items, "stream": stream}
        response, data = await stack.postJSON("/v1/responses", body,
                                              headers={"session-id": [sid]})
        if response.code != 200:
            return Outcome("terminal_error", response.code, None, _errorMessage(data)), None, None
        if stream:
            events = sseEvents(data)
            done = [d.get("item") for t, d in events if t == "response.output_item.done"]
            last, final = events[-1] if events else (None, {})
            final = final.get("response") or {}
        else:
            final = json.loads(data)
            done, last = final.get("output") or [], (
                "response.completed" if final.get("status") == "completed" else final.get("status"))
    else:
        if client is None:
            client = await connectNew(stack)
        frame = {"type": "response.create", "model": MODEL, "store": False, "stream": True,
                 "input": items}
        if previous:
            frame["previous_response_id"] = previous
        client.sendJSON(frame)
        events = await collectTurn(client)
        last, data = events[-1]
        if last != "response.completed":
            return wsOutcome(events, faulty), client, None
        done = [d.get("item") for t, d in events if t == "response.output_item.done"]
        final = data.get("response") or {}
    if item is not None:
        texts = _completedText(final) or "".join(
            c.get("text", "") for i in done if isinstance(i, dict)
            for c in i.get("content") or [] if isinstance(c, dict))
        return _served(texts, faulty, final.get("id")), client, None
    outcome = compactionOutcome(done, last, faulty, final.get("id"))
    found = [i for i in done if isinstance(i, dict) and i.get("type") == "compaction"]
    return outcome, client, (found[0] if found else None)
