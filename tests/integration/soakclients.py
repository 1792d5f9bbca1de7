"""
The chaos soak's simulated clients (issue 14): HTTP SSE, HTTP JSON, chat (stream and not)
and the Responses WebSocket, each running 2-turn conversations against one of several relays
picked at random, cancelling some turns at random moments, and writing down how every turn
ended (L{TurnRecord}).

Every client turn has its own id (C{s<seed>-c<client>-v<conversation>-t<n>}): HTTP clients
send it as C{X-Request-Id} (relay keeps it as the turn's C{client_request_id} beside an id of
its own, R111, and sends it upstream as C{X-Client-Request-Id}); WebSocket clients send the
conversation's id as the upgrade's C{X-Request-Id} (kept as each turn's C{client_request_id};
the checks name the connection's turns C{<id>:<n>}) and each turn's id as
C{client_metadata.turn_id} in the frame (forwarded upstream as Codex's turn metadata). The
emulator's turn ledger (L{relay.emulator.chaos}) counts requests and generations per id.

Randomness comes from one C{random.Random} per client, seeded from the soak's seed and the
client's number, so each client makes the same choices on every run; how far each client
gets in the time allowed depends on the machine.

Outcomes (L{TurnRecord.outcome}):

  - C{completed}: a terminal C{response.completed}/C{incomplete}, a chat stream's last
    chunk and C{[DONE]}, a 200 JSON answer;
  - C{error_status}: an HTTP status >= 400 with OpenAI's error envelope
    (C{{"error": {"message": str, "type": str, ...}}}), or a refused WebSocket upgrade;
  - C{error_stream}: an in-stream C{response.failed} or C{error} event, a chat error chunk;
  - C{ws_close}: the relay closed the WebSocket with a code other than 1000/1005/1006;
  - C{cancelled}: the client left on purpose before the end (its plan, L{CANCEL_SHARE});
  - C{unanswered}: the connection was dropped before any response byte (HTTP) or upgrade
    answer (WebSocket) -- what a client sees when it connects the instant a relay closes its
    listening socket (the kernel resets connections it had queued but the process never
    accepted); L{tests.integration.soakchecks.unansweredExcused} decides whether relay had
    anything to do with it;
  - C{unclear}: anything else (a stream that ended without a terminal event, a reset, a
    1006 close, an error body without the envelope) -- the soak fails on it;
  - C{hung}: no end before the turn's deadline -- the soak fails on it.
"""

from __future__ import annotations

import json
import random
import re
from io import BytesIO

from attrs import define, field
from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredQueue
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectError, ConnectionRefusedError
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.web.client import (
    Agent,
    FileBodyProducer,
    HTTPConnectionPool,
    ResponseDone,
    ResponseNeverReceived,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers

KEY = "sk-relay-soak"
"""The soak's client key."""

CHAIN_MODEL = "gpt-5.4"
"""The model of chained HTTP Responses conversations: only API-key accounts serve it, so
C{previous_response_id} can work (R42: API-key accounts keep chains)."""

MODEL = "gpt-5.5"
"""The model of chat and WebSocket conversations (every account)."""

KINDS = (("sse", 25), ("json", 10), ("chat_stream", 15), ("chat_json", 10), ("ws", 40))
"""Conversation kinds and their weights."""

CANCEL_SHARE = 0.10
"""The share of turns a client plans to cancel."""

TURN_DEADLINE = 45.0
"""Seconds a client waits for one turn before it counts the turn as hung."""

CLEAR = ("completed", "error_status", "error_stream", "ws_close", "cancelled")
"""Outcomes that are a completed answer, a clear error, or the client's own leaving."""

TERMINAL_OK = ("response.completed", "response.incomplete")


@define(eq=False)
class TurnRecord:
    """
    What one client turn did.

    @ivar id: the client turn id (the emulator's turn key).
    @ivar requestId: the client's id for the turn (HTTP: C{id}; WebSocket:
        C{<conversation>:<n>}); relay logs it as C{client_request_id} beside its own id
        (R111, L{tests.integration.soakchecks.clientIds}).
    @ivar kind: the conversation kind (L{KINDS}).
    @ivar relay: the index of the relay that served it (after a refused connection, the
        other one).
    @ivar started: when the client started it (Unix seconds).
    @ivar ended: when the client saw its end, or L{None}.
    @ivar departed: when the client stopped waiting (its end, its cancel or its
        deadline), or L{None} while running.
    @ivar outcome: see the module docstring.
    @ivar detail: a short description (status, event, close code).
    @ivar cancelPlan: C{None}, or the plan: C{early}, C{waiting} or C{mid_stream}.
    @ivar cancelPhase: where the client actually was when it left: C{before_headers},
        C{mid_stream}, or L{None}.
    @ivar rerouted: how many relays refused the connection first.
    @ivar responseId: the completed response's id.
    @ivar text: the completed answer's text (chat history).
    """

    id: str
    requestId: str
    kind: str
    relay: int
    started: float
    ended: float | None = None
    departed: float | None = None
    outcome: str = "running"
    detail: str = ""
    cancelPlan: str | None = None
    cancelPhase: str | None = None
    rerouted: int = 0
    responseId: str | None = None
    text: str = ""

    def finish(self, outcome: str, detail: str = "") -> None:
        """
        Record the turn's end once (later calls do nothing).
        """
        if self.outcome != "running":
            return
        now = reactor.seconds()
        self.outcome, self.detail = outcome, detail[:200]
        self.ended = now
        if self.departed is None:
            self.departed = now


def envelopeOK(data: bytes) -> bool:
    """
    Whether an error body is OpenAI's envelope (C{error.message} and C{error.type} strings).
    """
    try:
        error = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return False
    return (isinstance(error, dict) and isinstance(error.get("message"), str)
            and isinstance(error.get("type"), str))


def sseData(blob: bytes) -> list:
    """
    The C{data:} payloads of complete SSE events in C{blob}.
    """
    out = []
    for block in blob.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].strip() for line in block.split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines).decode("utf-8", "replace"))
    return out


def classifyResponses(status: int, data: bytes, stream: bool, clean: bool) -> tuple:
    """
    Classify a Responses answer.

    @param clean: whether the body ended normally (not cut).
    @return: C{(outcome, detail, response id, text)}.
    """
    if status != 200:
        return ("error_status" if envelopeOK(data) else "unclear", f"{status}", None, "")
    if not stream:
        try:
            body = json.loads(data)
        except ValueError:
            return "unclear", f"200 body not JSON (clean={clean})", None, ""
        if clean and body.get("status") in ("completed", "incomplete"):
            return "completed", body.get("status"), body.get("id"), _outputText(body)
        return "unclear", f"200 status {body.get('status')}", None, ""
    text = []
    for payload in sseData(data):
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        kind = event.get("type")
        if kind == "response.output_text.delta":
            text.append(event.get("delta") or "")
        if kind in TERMINAL_OK:
            return "completed", kind, (event.get("response") or {}).get("id"), "".join(text)
        if kind in ("response.failed", "error"):
            error = event.get("error") or (event.get("response") or {}).get("error") or {}
            return "error_stream", f"{kind} {error.get('code')}", None, ""
    return "unclear", f"stream without terminal event (clean={clean})", None, ""


def _outputText(body: dict) -> str:
    """
    The text of a JSON Responses answer.
    """
    out = []
    for item in body.get("output") or []:
        for part in item.get("content") or []:
            if part.get("type") == "output_text":
                out.append(part.get("text") or "")
    return "".join(out)


def classifyChat(status: int, data: bytes, stream: bool, clean: bool) -> tuple:
    """
    Classify a Chat Completions answer.

    @return: C{(outcome, detail, None, text)}.
    """
    if status != 200:
        return ("error_status" if envelopeOK(data) else "unclear", f"{status}", None, "")
    if not stream:
        try:
            body = json.loads(data)
        except ValueError:
            return "unclear", f"200 body not JSON (clean={clean})", None, ""
        choices = body.get("choices") or []
        if clean and choices:
            return "completed", "chat.completion", None, (
                (choices[0].get("message") or {}).get("content") or "")
        return "unclear", "200 without choices", None, ""
    done = finished = False
    text = []
    for payload in sseData(data):
        if payload == "[DONE]":
            done = True
            continue
        try:
            chunk = json.loads(payload)
        except ValueError:
            continue
        if "error" in chunk:
            return "error_stream", f"chat error {chunk['error'].get('code')}", None, ""
        for choice in chunk.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or "")
            if choice.get("finish_reason"):
                finished = True
    if done and finished:
        return "completed", "[DONE]", None, "".join(text)
    return "unclear", f"chat stream done={done} finished={finished} clean={clean}", None, ""


class _Body(Protocol):
    """
    Collects an HTTP body; counts SSE events so a client can leave after the k-th.
    """

    def __init__(self, onEvent) -> None:
        self.data = b""
        self.events = 0
        self.done = Deferred()
        self._onEvent = onEvent

    def dataReceived(self, data: bytes) -> None:
        """
        Keep the bytes; count complete events.
        """
        self.data += data
        events = self.data.count(b"\n\n")
        if events != self.events:
            self.events = events
            self._onEvent(events)

    def connectionLost(self, reason) -> None:
        """
        The body ended: fire C{done} with whether it ended normally.
        """
        clean = reason.check(ResponseDone, PotentialDataLoss) is not None
        self.done.callback(clean)

    def leave(self) -> None:
        """
        Stop reading and close the connection (the client goes away mid-stream).
        """
        if self.transport is not None:
            self.transport.stopProducing()


@define(eq=False)
class SoakClients:
    """
    Runs the simulated clients against the relays until told to stop.

    @ivar seed: the soak's seed.
    @ivar urls: the relays' base URLs (C{http://127.0.0.1:<port>}).
    @ivar turns: every L{TurnRecord}, in start order.
    @ivar stopAt: no conversation starts after this time (Unix seconds).
    """

    seed: int
    urls: list
    stopAt: float = 0.0
    turns: list = field(factory=list)
    conversations: int = 0
    _pool: HTTPConnectionPool = field(init=False)
    _agent: Agent = field(init=False)

    def __attrs_post_init__(self) -> None:
        self._pool = HTTPConnectionPool(reactor, persistent=False)
        self._agent = Agent(reactor, pool=self._pool, connectTimeout=5)

    async def run(self, clients: int, duration: float) -> None:
        """
        Run C{clients} clients for C{duration} seconds, then wait for their last turns.
        """
        self.stopAt = reactor.seconds() + duration
        waits = [Deferred.fromCoroutine(self._client(n)) for n in range(clients)]
        for d in waits:
            await d

    async def _client(self, number: int) -> None:
        rng = random.Random(f"{self.seed}:client:{number}")
        # Spread the start over the first two seconds.
        await deferLater(reactor, rng.random() * 2.0, lambda: None)
        conversation = 0
        while reactor.seconds() < self.stopAt:
            conversation += 1
            kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
            prefix = f"s{self.seed}-c{number:03d}-v{conversation}"
            self.conversations += 1
            try:
                if kind == "ws":
                    await self._wsConversation(rng, prefix)
                else:
                    await self._httpConversation(rng, prefix, kind)
            except Exception as e:  # a bug in the client itself must not hang the soak
                record = TurnRecord(prefix + "-bug", prefix, kind, -1, reactor.seconds())
                record.finish("unclear", f"client error {e!r}")
                self.turns.append(record)
            await deferLater(reactor, 0.3 + rng.random() * 1.2, lambda: None)

    def _cancelPlan(self, rng: random.Random) -> tuple:
        """
        C{(plan, delay or event count)}: whether and when this turn is cancelled.
        """
        if rng.random() >= CANCEL_SHARE:
            return None, None
        plan = rng.choice(("early", "waiting", "mid_stream"))
        if plan == "early":
            return plan, rng.random() * 0.3
        if plan == "waiting":
            return plan, 0.5 + rng.random() * 2.5
        return plan, rng.randint(1, 6)

    # -- HTTP ------------------------------------------------------------------------------

    async def _httpConversation(self, rng: random.Random, prefix: str, kind: str) -> None:
        chat = kind.startswith("chat")
        stream = kind in ("sse", "chat_stream")
        previous = None
        messages = []
        for n in (1, 2):
            text = f"turn {n} of {prefix}"
            if chat:
                messages.append({"role": "user", "content": text})
                path, body = "/v1/chat/completions", {"model": MODEL, "messages": list(messages)}
                if stream:
                    body["stream"] = True
            else:
                path = "/v1/responses"
                body = {"model": CHAIN_MODEL, "input": text, "stream": stream}
                if previous:
                    body["previous_response_id"] = previous
            record = await self._httpTurn(rng, f"{prefix}-t{n}", kind, path, body, stream, chat)
            if record.outcome != "completed":
                return
            previous = record.responseId
            if chat:
                messages.append({"role": "assistant", "content": record.text})

    async def _httpTurn(self, rng, turnId, kind, path, body, stream, chat) -> TurnRecord:
        first = rng.randrange(len(self.urls))
        plan, when = self._cancelPlan(rng)
        record = TurnRecord(turnId, turnId, kind, first, reactor.seconds(), cancelPlan=plan)
        self.turns.append(record)
        headers = Headers({"Authorization": [f"Bearer {KEY}"],
                           "Content-Type": ["application/json"], "X-Request-Id": [turnId]})
        data = json.dumps(body).encode()
        state = {"response": None, "body": None, "request": None}

        def leave(outcome: str) -> None:
            if record.outcome != "running" or record.departed is not None:
                return
            record.departed = reactor.seconds()
            record.cancelPhase = "before_headers" if state["response"] is None else "mid_stream"
            record.finish(outcome, f"left {record.cancelPhase}")
            if state["response"] is None:
                if state["request"] is not None:
                    state["request"].cancel()
            elif state["body"] is not None:
                state["body"].leave()

        timers = [reactor.callLater(TURN_DEADLINE, leave, "hung")]
        if plan in ("early", "waiting"):
            timers.append(reactor.callLater(when, leave, "cancelled"))

        def onEvent(events: int) -> None:
            if plan == "mid_stream" and events >= when:
                leave("cancelled")

        try:
            for attempt in range(len(self.urls)):
                index = (first + attempt) % len(self.urls)
                record.relay = index
                state["request"] = self._agent.request(
                    b"POST", (self.urls[index] + path).encode(), headers,
                    FileBodyProducer(BytesIO(data)))
                try:
                    response = await state["request"]
                except (ConnectionRefusedError, ConnectError):
                    if record.departed is not None:
                        return record
                    record.rerouted += 1
                    continue
                except ResponseNeverReceived as e:
                    record.finish("unanswered", f"no response: {e.reasons[0].value!r}")
                    return record
                break
            else:
                record.finish("unclear", "every relay refused the connection")
                return record
            state["response"] = response
            if record.departed is not None:
                # The client left while the headers were on their way.
                proto = _Body(lambda n: None)
                response.deliverBody(proto)
                proto.leave()
                return record
            proto = _Body(onEvent)
            state["body"] = proto
            response.deliverBody(proto)
            clean = await proto.done
            if record.outcome != "running":
                return record
            classify = classifyChat if chat else classifyResponses
            outcome, detail, responseId, text = classify(response.code, proto.data, stream,
                                                         clean)
            record.responseId, record.text = responseId, text
            record.finish(outcome, detail)
            return record
        except Exception as e:
            # After the client's own leaving (cancel, deadline) the failure is its doing.
            record.finish("unclear", f"{type(e).__name__}: {e}")
            return record
        finally:
            for timer in timers:
                if timer.active():
                    timer.cancel()

    # -- WebSocket -------------------------------------------------------------------------

    async def _wsConversation(self, rng: random.Random, prefix: str) -> None:
        first = rng.randrange(len(self.urls))
        client = None
        relay = first
        refused = 0
        for attempt in range(len(self.urls)):
            relay = (first + attempt) % len(self.urls)
            try:
                client = await self._connect(self.urls[relay], prefix)
                break
            except (ConnectionRefusedError, ConnectError):
                refused += 1
            except _HandshakeRefused as e:
                record = TurnRecord(f"{prefix}-t1", f"{prefix}:1", "ws", relay,
                                    reactor.seconds(), rerouted=refused)
                self.turns.append(record)
                record.finish("error_status" if e.clear else "unanswered", str(e))
                return
        if client is None:
            record = TurnRecord(f"{prefix}-t1", f"{prefix}:1", "ws", relay, reactor.seconds(),
                                rerouted=refused)
            self.turns.append(record)
            record.finish("unclear", "every relay refused the connection")
            return
        try:
            previous = None
            for n in (1, 2):
                record = TurnRecord(f"{prefix}-t{n}", f"{prefix}:{n}", "ws", relay,
                                    reactor.seconds(), rerouted=refused)
                self.turns.append(record)
                frame = {
                    "type": "response.create", "model": MODEL, "store": False, "stream": True,
                    "input": [{"type": "message", "role": "user",
                               "content": [{"type": "input_text", "text": f"turn {n}"}]}],
                    "client_metadata": {"turn_id": record.id},
                }
                if previous:
                    frame["previous_response_id"] = previous
                await self._wsTurn(rng, client, record, frame)
                if record.outcome != "completed":
                    return
                previous = record.responseId
        finally:
            client.bye()

    async def _connect(self, url: str, prefix: str):
        port = int(url.rsplit(":", 1)[1])
        factory = WebSocketClientFactory(
            f"ws://127.0.0.1:{port}/v1/responses", reactor=reactor,
            headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": prefix})
        factory.protocol = _WSClient
        factory.setProtocolOptions(openHandshakeTimeout=20, closeHandshakeTimeout=2)
        proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5).connect(factory)
        await proto.opened
        return proto

    async def _wsTurn(self, rng, client, record: TurnRecord, frame: dict) -> None:
        plan, when = self._cancelPlan(rng)
        abort = rng.random() < 0.5  # drawn now: the rng must not depend on timing
        record.cancelPlan = plan
        text = []

        def leave(outcome: str) -> None:
            if record.outcome != "running":
                return
            record.departed = reactor.seconds()
            record.cancelPhase = "mid_stream" if client.eventCount else "before_headers"
            record.finish(outcome, f"left {record.cancelPhase}")
            if abort:
                client.dropConnection(abort=True)
            else:
                client.bye()

        timers = [reactor.callLater(TURN_DEADLINE, leave, "hung")]
        if plan in ("early", "waiting"):
            timers.append(reactor.callLater(when, leave, "cancelled"))
        client.eventCount = 0
        try:
            client.sendJSON(frame)
            while record.outcome == "running":
                event = await client.events.get()
                kind = event.get("type")
                if kind == "__closed__":
                    code = event.get("code")
                    if code in (None, 1000, 1005, 1006):
                        record.finish("unclear", f"close {code} {event.get('reason')}")
                    else:
                        record.finish("ws_close", f"close {code} {event.get('reason')}")
                    return
                client.eventCount += 1
                if plan == "mid_stream" and client.eventCount >= when:
                    leave("cancelled")
                    return
                if kind == "response.output_text.delta":
                    text.append(event.get("delta") or "")
                if kind in TERMINAL_OK:
                    record.responseId = (event.get("response") or {}).get("id")
                    record.text = "".join(text)
                    record.finish("completed", kind)
                elif kind == "response.failed":
                    record.finish("error_stream", "response.failed")
                elif kind == "error" and (event.get("status") or event.get("status_code")):
                    record.finish("error_stream",
                                  f"error {event.get('status')} "
                                  f"{(event.get('error') or {}).get('code')}")
        finally:
            for timer in timers:
                if timer.active():
                    timer.cancel()


class _HandshakeRefused(Exception):
    """
    The relay refused the upgrade; C{clear} when it answered an HTTP status.
    """

    def __init__(self, message: str, clear: bool) -> None:
        super().__init__(message)
        self.clear = clear


class _WSClient(WebSocketClientProtocol):
    """
    A Responses WebSocket client: events go to a queue; a close is a C{__closed__} event.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events = DeferredQueue()
        self.opened = Deferred()
        self.eventCount = 0

    def onOpen(self) -> None:
        """
        The upgrade succeeded.
        """
        self.opened.callback(self)

    def onMessage(self, payload, isBinary) -> None:
        """
        Queue one event (a frame that is not JSON is queued as C{__garbage__}).
        """
        try:
            self.events.put(json.loads(payload))
        except ValueError:
            self.events.put({"type": "__garbage__"})

    def onClose(self, wasClean, code, reason) -> None:
        """
        Fail the upgrade (a refused handshake), or queue a C{__closed__} event.
        """
        if not self.opened.called:
            # autobahn: "WebSocket connection upgrade failed (503 - Service Unavailable)".
            why = f"{reason} {getattr(self, 'wasNotCleanReason', '')}"
            match = re.search(r"upgrade failed \((\d{3})", why)
            clear = match is not None and int(match.group(1)) >= 400
            self.opened.errback(_HandshakeRefused(f"handshake refused: {code} {why}", clear))
            return
        self.events.put({"type": "__closed__", "code": code, "reason": reason})

    def sendJSON(self, frame: dict) -> None:
        """
        Send one frame while the connection is open.
        """
        if self.state == self.STATE_OPEN:
            self.sendMessage(json.dumps(frame).encode(), False)

    def bye(self) -> None:
        """
        Close cleanly (1000) while the connection is open.
        """
        if self.state == self.STATE_OPEN:
            self.sendClose(1000)
