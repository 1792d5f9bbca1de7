# -*- test-case-name: tests.test_ws, tests.test_frontdoor -*-
"""
L{WebSocketConversation}: what one client WebSocket knows about its own
conversation (R61, R62, R68, R76, R77, R80, R89, R104), and the turns it
makes of its frames.

The front door (L{relay.frontdoor.door.FrontDoor.frame}) is handed the
conversation, never the protocol: it has the conversation make a parsed
C{response.create} a L{Turn} with its L{WebSocketSink}
(L{WebSocketConversation.turnFor}), runs it and hands the running turn
back (L{WebSocketConversation.turnStarted}). The transport (frames in and
out, timers, close codes) stays in L{relay.entry.ws.RelayWebSocketProtocol},
which owns one conversation per connection and is called back only to
write to or close the socket.
"""

from __future__ import annotations

import json
import os

from attrs import define, field
from twisted.logger import Logger

from relay.base.clienterrors import RESTART_CLOSE, previousResponseNotFound
from relay.base.records import ClientError, Turn
from relay.entry.annotate import annotateTurn
from relay.entry.http import UNAUTHORIZED
from relay.entry.wssink import WebSocketSink, wsErrorEvent
from relay.frontdoor.budgets import parsedEstimate, parsedOver
from relay.frontdoor.parse import FieldRefused, turnFields
from relay.scheduling.session import SESSION_HEADERS, sessionHash, sessionSeed

MSG_ID_MESSAGE = "previous_response_id must be a response.id (resp_*), not a message id"
APPEND_MESSAGE = (
    "response.append is not supported in ws v2; use response.create with previous_response_id"
)
CONNECTION_LIMIT_MESSAGE = (
    "Responses websocket connection limit reached (60 minutes)."
    " Create a new websocket connection to continue."
)
CONNECTION_LIMIT_CLOSE = (1001, "websocket connection limit reached; please reconnect")
"""protocol.md 4.5/4.6: after the status-bearing error event the socket
closes 1001 (going away), not 1000: R81 keeps a plain 1000 for the idle
timeout and a normal end, and 1001 is the R70 family of "please reconnect"
closes that both Codex and the SDK answer with a fresh connection."""
PREEMPTED_CLOSE = (1001, "session preempted by a newer connection")
"""R68 (adopted): the pre-empted connection is told before it is dropped."""
THREAD_HEADERS = ("thread-id", "x-codex-window-id")
"""R-B13: parallel Codex threads sharing a session id do not pre-empt each other."""
KEY_REVOKED_CLOSE = (1008, "api key is no longer valid")
"""The connection's key was removed or rotated by a reload; the
connection takes no new turn (a reconnect with the new key works)."""


class _FrameHold:
    """
    The parsed-size estimate of one admitted frame, held in the bytes in
    flight until its turn ends; released once.
    """

    def __init__(self, budget, keyName: str, n: int):
        self._budget, self._key, self._n = budget, keyName, n

    def release(self) -> None:
        n, self._n = self._n, 0
        if n and self._budget is not None:
            self._budget.release(self._key, n)



def normaliseInput(value) -> list:
    """
    A frame's C{input} as a list of items (a string is one user message).
    """
    if value is None:
        return []
    if isinstance(value, str):
        return [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}
        ]
    if isinstance(value, list):
        return list(value)
    return [value]


COMPACTION_TRIGGER = "compaction_trigger"
"""protocol.md 2.8: the input item that asks for a compaction turn."""


def lastCompaction(items: list) -> int:
    """
    The index of the last C{compaction} item of a transcript, or 0.
    """
    for index in range(len(items) - 1, -1, -1):
        item = items[index]
        if isinstance(item, dict) and item.get("type") == "compaction":
            return index
    return 0


@define(eq=False)
class ConnectionState:
    """
    What one client connection knows about its own conversation
    (R61, R62, R76, R77, R80).

    @ivar items: the complete transcript of this connection's turns (inputs
        and output items, in order), or L{None} when relay does not hold
        the whole conversation (a chain begun before this connection).
    @ivar lastResponseId: the id of the last completed response.
    @ivar accountId: the account of the last completed turn.
    @ivar dedicated: the C{passthrough} upstream connection.
    """

    items: list | None = field(factory=list)
    lastResponseId: str | None = None
    accountId: str | None = None
    dedicated: object = None
    unchecked: tuple = ()
    """R104: the stored-item ids named by prewarms relay answered itself
    (C{http_bridge}, never selected) that the transcript now carries; the
    next chained turn is checked for them too."""

    def expandable(self, previous: str | None) -> bool:
        """
        R62: a chain to this connection's previous response whose history
        is complete.
        """
        return bool(previous) and previous == self.lastResponseId and self.items is not None

    def historyComplete(self, previous: str | None) -> bool:
        """
        R62, R80: a turn without C{previous_response_id} is complete; a
        chained one only when relay can expand it.
        """
        return not previous or self.expandable(previous)

    def expandedBody(self, turn) -> dict | None:
        """
        R61/R66: earlier inputs + earlier outputs + the current input, the
        chain id removed; L{None} when the history is not complete.
        """
        previous = turn.previousResponseId
        if not self.expandable(previous):
            return None
        body = dict(turn.body)
        body.pop("previous_response_id", None)
        body["input"] = list(self.items) + normaliseInput(turn.body.get("input"))
        return body

    def record(self, previous, inputItems: list, response: dict, accountId=None) -> None:
        """
        A turn completed: extend (or restart, or lose) the transcript.

        R89: a C{compaction_trigger} is used once it was sent, so the
        transcript never keeps one (a replayed trigger would no longer be
        the last item, and upstream refuses that); once a C{compaction}
        item arrived, the transcript restarts from it (it stands for
        everything before it).
        """
        outputs = [o for o in (response.get("output") or []) if isinstance(o, dict)]
        inputItems = [i for i in inputItems
                      if not (isinstance(i, dict) and i.get("type") == COMPACTION_TRIGGER)]
        if not previous:
            self.items = list(inputItems) + outputs
        elif self.expandable(previous):
            self.items = list(self.items) + list(inputItems) + outputs
        else:
            self.items = None
        if self.items is not None:
            start = lastCompaction(self.items)
            if start:
                self.items = self.items[start:]
        self.lastResponseId = response.get("id") or self.lastResponseId
        if accountId is not None:
            self.accountId = accountId


def reachable(factory, key) -> list:
    """
    The accounts C{key} may reach (its account group), for the
    connection's mode choice; every account without a key policy.
    """
    policy = getattr(getattr(factory, "runner", None), "keyPolicy", None)
    if policy is None or key is None:
        return list(factory.accounts)
    return policy.reachable(key, factory.accounts)


class WebSocketConversation:
    """
    One client WebSocket's conversation: its key, ids, transcript
    (L{ConnectionState}), model, session and running turn; it makes the
    turns of its frames for the front door (R47, R48, R53, R61, R62, R68,
    R77, R102, R103, R104). Strictly one turn at a time (protocol.md 4.6).

    @ivar proto: the L{relay.entry.ws.RelayWebSocketProtocol} it writes to
        and closes (C{sendText}, C{sendPing}, C{reject}, C{closeWith},
        C{refuseFrame}, C{idle}, C{readNext}, C{isOpen}).
    @ivar key: the connection's L{relay.base.records.ClientKey} (the one
        in force since its last turn).
    @ivar state: the L{ConnectionState} every turn carries as
        C{Turn.wsContext}.
    @ivar running: the running L{Turn}, or L{None}.
    @ivar admitting: a large frame's slot wait's
        L{relay.base.records.CancelSignal} (L{FrontDoor.frame}), or L{None}.
    @ivar turns: turns answered so far.
    """

    _log = Logger()

    def __init__(self, proto, factory, key, headers: dict, ids: tuple, threadId=None,
                 clientAddress=None, userAgent=None, openedAt: float = 0.0):
        """
        @param headers: the upgrade's client headers to forward, by
            lower-case name (L{relay.entry.http.filterClientHeaders}).
        @param ids: C{(connection id, request id, client request id or
            None)}.
        @param openedAt: when the connection opened, by the factory's
            reactor (seconds; protocol.md 4.5's age limit).
        """
        self.proto, self.factory, self.key, self.headers = proto, factory, key, headers
        self.connId, self.requestId, self.clientRequestId = ids
        self.threadId, self.clientAddress, self.userAgent = threadId, clientAddress, userAgent
        self.openedAt = openedAt
        self.state = ConnectionState()
        self.model = None
        self.session = None
        self.turns = 0
        self.running = None
        self.ownerKey = None
        self.admitting = None
        self._ending = None

    def modeName(self):
        """
        The connection's mode now (for the idle close and the close log),
        or L{None} when it cannot be told.
        """
        try:
            return self._modeFor(self.model)
        except Exception:  # noqa: BLE001
            return None

    def leave(self) -> bool:
        """
        The connection closed: give up the session's ownership (R68),
        cancel the running turn and a slot wait (R2), drop the
        C{passthrough} upstream unless a turn still reads it (R107).

        @return: whether a turn was running.
        """
        owners = getattr(self.factory, "sessionOwners", None)
        if owners is not None and self.ownerKey is not None and owners.get(self.ownerKey) is self:
            del owners[self.ownerKey]
        turn = self.running
        if turn is not None:
            turn.cancel.cancel("client_gone")
        admitting = self.admitting
        if admitting is not None:
            admitting.cancel("client_gone")
        dedicated = self.state.dedicated
        if dedicated is not None:
            self.state.dedicated = None
            if not dedicated.busy:
                dedicated.broken = True
                dedicated.proto.close()
            # else the running turn's attempt closes it when it ends, after
            # reading its usage (behaviour.md R107).
        return turn is not None

    # -- for the front door (relay.frontdoor.door.FrontDoor.frame) --------------

    def nextRequestId(self) -> str:
        """
        The request id of the connection's next turn.
        """
        return f"{self.requestId}:{self.turns + 1}"

    def gone(self) -> bool:
        """
        Whether the connection is closing or closed.
        """
        proto = self.proto
        return proto._gone or proto._closing is not None

    def holdFrame(self, payload: bytes):
        """
        Hold a large frame's parsed-size estimate within the key's and the
        process's bytes in flight while its key's slot is awaited (R103),
        like an HTTP body's; refuse the frame (the protocol's C{refuseFrame}) when it
        does not fit.

        @return: the hold (C{release()}), or L{None} when refused.
        """
        f = self.factory
        estimate = parsedEstimate(payload)
        budget, limits = getattr(f, "budget", None), f.settings.current.limits
        if budget is not None:
            error = None
            if parsedOver(estimate, limits) is not None:
                error = ClientError(
                    400, "invalid_request_error",
                    "frame too large once parsed (gateway.limits.body_bytes_in_flight)",
                    code="frame_too_large",
                )
            if error is None:
                error = budget.reserve(
                    self.key.name, estimate, limits.body_bytes_in_flight_per_key,
                    limits.body_bytes_in_flight,
                )
            if error is not None:
                self.proto.refuseFrame(error)
                return None
        return _FrameHold(budget, self.key.name, estimate if budget is not None else 0)

    def slotRefused(self, failure) -> None:
        """
        A large frame's key slot was refused (R32): the engine's close.
        """
        error = getattr(failure.value, "error", None)
        if error is None or error.wsClose is None:
            self._log.failure("admitting a websocket frame failed", failure)
            self.proto.closeWith(1011, "failed to acquire user concurrency slot")
            return
        self.proto.closeWith(*error.wsClose)

    def admissionPing(self) -> None:
        """
        R85 while a frame waits for the key's slot: a ping frame at the
        turn's pace (the engine calls this, L{TurnRunner.keySlot}).
        """
        if not self.gone() and self.proto.isOpen():
            self.proto.sendPing()

    def badJSON(self, nested: bool) -> None:
        """
        A frame that is not JSON (R47): the status-bearing error and close.
        """
        if nested:
            self.proto.reject("invalid JSON payload: nested too deeply", "invalid_json")
            return
        self.proto.reject("invalid JSON payload", "invalid_json")

    def turnFor(self, frame, door):
        """
        The turn a parsed frame asks for, with its sink, or L{None} when
        the frame was answered here (C{response.processed}, a refusal, a
        prewarm answered locally). Its fields are checked as an HTTP
        body's (L{relay.frontdoor.parse.turnFields}).

        @param door: the L{relay.frontdoor.door.FrontDoor} (a prewarm's
            key refusal, R102).
        @return: C{(turn, sink)} or L{None}.
        """
        if not isinstance(frame, dict):
            self.proto.reject("invalid JSON payload", "invalid_json")
            return None
        kind = frame.get("type") or "response.create"
        if kind == "response.processed":
            self.proto.idle()
            return None
        if kind == "response.append":
            self.proto.reject(APPEND_MESSAGE, "unsupported_request_type", "type")
            return None
        if kind != "response.create":
            self.proto.reject(f"unsupported websocket request type: {kind}",
                              "unsupported_request_type", "type")
            return None
        if getattr(self.factory, "draining", False):
            # No new turn while relay stops; reconnect elsewhere.
            self.proto.closeWith(*RESTART_CLOSE)
            return None
        key = self.factory.keys.current(self.key)
        if key is None:
            self._log.info(
                "client websocket {conn_id}: its key was removed or rotated",
                event="ingress_ws_key_revoked",
                conn_id=self.connId,
                client=self.key.name,
            )
            # R81: information without a status, then the close.
            revoked = ClientError(
                401, "invalid_request_error", UNAUTHORIZED.message, code="invalid_api_key"
            )
            self.proto.sendText(json.dumps(wsErrorEvent(revoked, withStatus=False)).encode())
            self.proto.closeWith(*KEY_REVOKED_CLOSE)
            return None
        self.key = key
        if self._overAge():
            return None
        try:
            fields = turnFields(frame, "responses", self.model)
        except FieldRefused as e:
            if e.kind == "missing":
                self.proto.reject(
                    "model is required in first response.create payload",
                    "missing_required_parameter",
                    "model",
                )
            elif e.kind == "empty":
                # Never forwarded as an empty chain id.
                self.proto.reject("invalid JSON payload", "invalid_value", e.param,
                            message=e.error.message)
            else:
                # R47's close reason; the event's message is HTTP's 400.
                self.proto.reject("invalid JSON payload", "invalid_type", e.param,
                            message=e.error.message)
            return None
        model, previous = fields.model, fields.previous
        if previous and previous.startswith("msg_"):
            self.proto.reject(MSG_ID_MESSAGE, "invalid_value", "previous_response_id")
            return None
        self.model = model
        return self._newTurn(frame, model, previous or None, door)

    def _modeFor(self, model) -> str:
        """
        The connection's mode for this turn (R48): the current account's
        when it serves the model, else the one mode every serving account
        shares, else the gateway default. The engine's attempt still uses
        each account's own mode.
        """
        f = self.factory
        default = f.settings.current.websocket.mode_default
        accounts = reachable(f, self.key)
        byId = {a.id: a for a in accounts}
        current = byId.get(self.state.accountId)
        if current is not None and current.servesModel(model):
            return current.ws_mode or default
        modes = {a.ws_mode or default for a in accounts if a.servesModel(model)}
        modes.discard("off")
        if len(modes) == 1:
            return modes.pop()
        return default if default != "off" else "ctx_pool"

    def _newTurn(self, frame: dict, model: str, previous: str | None, door):
        """
        See L{turnFor}: the L{Turn} of a checked C{response.create}.
        """
        state = self.state
        mode = self._modeFor(model)
        inputItems = normaliseInput(frame.get("input"))
        body = dict(frame)
        body.pop("type", None)
        body["model"] = model
        for name in ("stream", "previous_response_id"):
            if body.get(name, False) is None:
                body.pop(name)  # null is absent; never forwarded
        if self.session is None:
            self.session = sessionHash(sessionSeed(self.headers, body, model),
                                        self.key.ownerId)
            self._claimSession(body)
        phase = "first_turn" if self.turns == 0 else "later_turn"
        turn = Turn(
            entrypoint="ws",
            endpoint="responses",
            client=self.key,
            model=model,
            body=body,
            stream=True,
            headers=dict(self.headers),
            sessionHash=self.session,
            previousResponseId=previous,
            historyComplete=state.historyComplete(previous),
            wsMode=mode,
            requestId=f"{self.requestId}:{self.turns + 1}",
            clientRequestId=self.clientRequestId,
            phase=phase,
            preferredAccountId=state.accountId,
            wsContext=state,
            clientAddress=self.clientAddress,
            userAgent=self.userAgent,
        )
        annotateTurn(turn)  # R89, R90 (relay.entry.annotate)
        if previous and state.unchecked:
            turn.itemReferences += state.unchecked  # R104: a local prewarm's items
        body = turn.body
        if mode == "http_bridge":
            if frame.get("generate") is False:
                # R102: a prewarm answered locally is refused
                # exactly like a turn would be.
                error = door.refusal(turn)
                if error is not None:
                    refused = WebSocketSink(self.proto)
                    refused.fail(error)
                    if not refused.closed:
                        self.proto.idle()  # R113: in-band; the socket reads on
                    return None
                self._prewarm(turn, previous, inputItems)
                return None
            if previous:
                expanded = state.expandedBody(turn)
                if expanded is None:
                    # R77: never send a fragment as the whole conversation.
                    error = previousResponseNotFound(previous)
                    self.proto.sendText(json.dumps(wsErrorEvent(error)).encode())
                    self.proto.closeWith(*error.wsClose)
                    return None
                body = expanded
            body.pop("generate", None)
            body.pop("previous_response_id", None)
            body["stream"] = True
            turn.body = body
            turn.previousResponseId = None
            turn.historyComplete = True
        sink = WebSocketSink(self.proto)
        self.running = turn

        def onResponse(responseId, account):
            state.accountId = account.id

        turn.onResponseId = onResponse
        self._ending = (previous, inputItems)
        return turn, sink

    def turnStarted(self, d, turn, sink, frame) -> None:
        """
        The front door handed the frame's turn to the engine: C{d} fires
        when it ends (L{_turnDone}).
        """
        previous, inputItems = self._ending
        self._ending = None
        d.addCallback(self._turnDone, turn, sink, previous, inputItems)
        d.addErrback(lambda fail: self._log.failure("websocket turn failed", fail))

    def _prewarm(self, turn, previous, inputItems) -> None:
        """
        R53 in C{http_bridge}: answer C{generate:false} locally, record its
        input, take no slot.
        """
        rid = "resp_" + os.urandom(12).hex()
        response = {
            "id": rid,
            "object": "response",
            "created_at": int(self.factory.reactor.seconds()),
            "status": "in_progress",
            "model": turn.model,
            "output": [],
        }
        send = self.proto.sendText
        send(json.dumps({"type": "response.created", "sequence_number": 0,
                         "response": response}).encode())
        done = dict(response, status="completed",
                    usage={"input_tokens": 0, "output_tokens": 0, "total_tokens": 0})
        send(json.dumps({"type": "response.completed", "sequence_number": 1,
                         "response": done}).encode())
        self.state.record(previous, inputItems, done)
        self.state.unchecked = (self.state.unchecked if previous else ()) + turn.itemReferences
        self.turns += 1
        self._log.info(
            "answered a prewarm locally with {response_id}",
            event="ingress_ws_http_bridge_prewarm",
            response_id=rid,
            conn_id=self.connId,
            request_id=turn.requestId,
        )
        self.proto.readNext()

    def _turnDone(self, outcome, turn, sink, previous, inputItems) -> None:
        self.running = None
        self.turns += 1
        if sink.terminalType == b"response.completed" and sink.terminal is not None:
            self.state.record(previous, inputItems, sink.terminal)
            self.state.unchecked = ()  # R104: checked by this turn's selection
        if self.gone():
            return
        if sink.closed:
            return
        if getattr(self.factory, "draining", False):
            self.proto.closeWith(*RESTART_CLOSE)
            return
        self.proto.readNext()

    def _claimSession(self, body: dict) -> None:
        """
        R68, R-B13: become the owner of (API key, session hash, thread id)
        and pre-empt an older connection holding the same key on an OAuth
        account. Only an explicit session (a session header or
        C{prompt_cache_key}) counts: a content-derived seed would let two
        unrelated clients that open with the same text cancel each other.
        In-process only (one relay); the owner is dropped when it closes.
        """
        explicit = any(self.headers.get(h) for h in SESSION_HEADERS) or body.get("prompt_cache_key")
        if not self.session or not explicit:
            return
        owners = self.factory.__dict__.setdefault("sessionOwners", {})  # unit-test factories
        key = (self.key.ownerId, self.session, self.threadId)
        older = owners.get(key)
        owners[key] = self
        self.ownerKey = key
        if older is None or older is self or not older.proto.isOpen():
            return
        byId = {a.id: a for a in self.factory.accounts}
        account = byId.get(older.state.accountId)
        if account is None or account.type != "oauth":
            return
        older.preempt(self.connId)

    def preempt(self, by: str) -> None:
        """
        R68: a newer connection owns this session. Cancel the running turn
        (a cancelled turn writes nothing to account state, R2), say so
        with close 1001, and drop.
        """
        self._log.info(
            "client websocket {conn_id} pre-empted by {new_conn_id}",
            event="ingress_ws_session_preempted",
            conn_id=self.connId,
            request_id=self.requestId,
            new_conn_id=by,
            account_id=self.state.accountId,
            while_running=self.running is not None,
        )
        if self.running is not None:
            self.running.cancel.cancel("session_preempted")
        self.proto.closeWith(*PREEMPTED_CLOSE)

    def _overAge(self) -> bool:
        """
        protocol.md 4.5/4.6: a connection older than
        C{client_max_age_seconds} (by the injected clock) answers
        C{response.create} with C{websocket_connection_limit_reached}
        (status 400) and closes, so the client reconnects with full input.
        """
        limit = self.factory.settings.current.websocket.client_max_age_seconds
        age = self.factory.reactor.seconds() - self.openedAt
        if not limit or age < limit:
            return False
        event = {
            "type": "error",
            "status": 400,
            "error": {
                "type": "invalid_request_error",
                "code": "websocket_connection_limit_reached",
                "message": CONNECTION_LIMIT_MESSAGE,
            },
        }
        self._log.info(
            "client websocket {conn_id} reached its age limit ({age:.0f}s)",
            event="ingress_ws_connection_limit_reached",
            conn_id=self.connId,
            request_id=self.requestId,
            age=age,
            limit=limit,
            turns=self.turns,
        )
        self.proto.sendText(json.dumps(event).encode())
        self.proto.closeWith(*CONNECTION_LIMIT_CLOSE)
        return True
