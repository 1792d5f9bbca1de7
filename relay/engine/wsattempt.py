# -*- test-case-name: tests.test_ws -*-
"""
One attempt of a WebSocket turn on one account: the C{TurnRunner.wsAttempt}
hook (behaviour.md R49-R53, R55, R56, R66, R67, R-B3, R76-R78).

The engine selects, admits, waits, classifies and decides; this function
only turns "send this turn to this account over its upstream transport"
into an L{AttemptResult}:

- C{http_bridge} accounts go through the engine's own HTTP attempt with the
  turn expanded from the connection's history (R52, R77);
- C{ctx_pool} accounts borrow a pooled upstream connection (R49, R50),
  C{passthrough} accounts use the client connection's dedicated one (R51);
- a pool that cannot lend a connection in time is a failover verdict
  without cooldown (R-B3); a dial without a status is R6; a handshake
  rejected with a status is R56;
- frames are fed as events into a L{StreamPump}, which stages and
  classifies pre-output failures exactly as for HTTP;
- a connection that carried turns before and breaks before this turn's
  output is retried once on a new connection (R67).
"""

from __future__ import annotations

from typing import Optional

from attrs import define, evolve
from twisted.logger import Logger
from zope.interface import implementer

from relay.engine.cancel import ClientGone, drained, raceCancel, raceDeparture
from relay.base.clienterrors import previousResponseNotFound
from relay.engine.httpattempt import attemptHTTP
from relay.engine.payload import (
    dropOAuthSampling, encodeBody, scopeCacheKey, upstreamClientHeaders,
)
from relay.engine.pump import AttemptResult, StreamPump, modelRewriter
from relay.interfaces import IAttempt
from relay.base.records import ClientError
from relay.policy import ends
from relay.policy.judgement import WS_BUSY_CLOSE, passVerdict
from relay.wire.sse import eventFromJSON
from relay.upstream.ws import (
    HandshakeRejected,
    PoolBusy,
    PooledConnection,
    dialUpstream,
)

WS_MODE_OFF = "websocket mode is disabled for this account"
RELAY_ONLY_FIELDS = ("stream_id",)
__all__ = ["WS_BUSY_CLOSE", "WebSocketAttempt", "WebSocketPump", "accountMode"]


def accountMode(account, settings) -> str:
    """
    The WebSocket mode of C{account} (R48): its own C{ws_mode}, else the
    gateway default.
    """
    return account.ws_mode or settings.websocket.mode_default


def errorFromEvent(event: dict) -> ClientError:
    """
    The client error for an upstream WebSocket C{error} event that is
    passed through (R81: a status-bearing event the client should see),
    with the upstream's own message: C{error.message}, or the ChatGPT
    backend's C{error.detail} (R112).
    """
    inner = event.get("error") if isinstance(event.get("error"), dict) else {}
    message = inner.get("message")
    if not message and isinstance(inner.get("detail"), str):
        message = inner["detail"]
    status = event.get("status") or event.get("status_code") or 400
    try:
        status = int(status)
    except (TypeError, ValueError):
        status = 400
    return ClientError(
        status,
        str(inner.get("type") or "invalid_request_error"),
        str(message or "Upstream request failed"),
        code=inner.get("code"),
        param=inner.get("param"),
    )


def _eventCode(event: dict) -> str:
    inner = event.get("error")
    if isinstance(inner, dict):
        return str(inner.get("code") or "")
    response = event.get("response")
    if isinstance(response, dict) and isinstance(response.get("error"), dict):
        return str(response["error"].get("code") or "")
    return ""


def isPreviousNotFound(event: dict) -> bool:
    """
    protocol.md 4.5: C{previous_response_not_found}, by code or by the
    message text codex2api also matches -- at the start of the message only,
    where upstream writes it, never inside an echo of the request (R106).
    """
    if _eventCode(event) == "previous_response_not_found":
        return True
    inner = event.get("error")
    message = inner.get("message", "") if isinstance(inner, dict) else ""
    return str(message).lower().lstrip().startswith("previous response with id")


FRAME_TOO_BIG = 1009
"""The WebSocket close code for a message over the peer's limit."""

FRAME_TOO_LARGE_MESSAGE = "request frame too large for the upstream websocket"

_SIZE_CODES = frozenset({"frame_too_large", "payload_too_large", "request_too_large",
                         "message_too_big"})


def isSizeRefusal(event: dict) -> bool:
    """
    R91: an upstream C{error} event that refuses the frame for its size
    (status 413 or a size code).
    """
    status = event.get("status") or event.get("status_code")
    return status == 413 or _eventCode(event) in _SIZE_CODES


def frameTooLargeResult() -> AttemptResult:
    """
    R91: an upstream "frame too big" (close 1009, or a size refusal) is
    the request's fault: it marks nothing (L{ends.Refused}) and does not
    fail over; the client gets an C{error} event with status 400, code
    C{frame_too_large}, and close 1009.
    """
    error = ClientError(400, "invalid_request_error", FRAME_TOO_LARGE_MESSAGE,
                        code="frame_too_large", wsClose=(FRAME_TOO_BIG, FRAME_TOO_LARGE_MESSAGE))
    return AttemptResult(end=ends.Refused("frame_too_large"),
                         verdict=passVerdict(error, "frame_too_large"), status=400)


def isFrameTooLarge(result: AttemptResult) -> bool:
    end = result.end
    return isinstance(end, ends.Refused) and end.reason == "frame_too_large"


RETRY_FULL_INPUT = "full_input"
"""The R66 retry: resend the turn with its chain expanded into full input."""

RETRY_FRESH_CONNECTION = "fresh_connection"
"""The R67 retry: the turn once more on a new upstream connection."""


class WebSocketPump(StreamPump):
    """
    A L{StreamPump} fed with upstream WebSocket frames. An C{error} event
    ends the turn (there is no other terminal on the WebSocket); before
    output it is judged exactly like the HTTP status it stands for
    (behaviour.md R86.1), and C{previous_response_not_found} is reported to
    the attempt for R66. An upstream close mid-turn is a clean end without
    a terminal event when it is a 1000 close (R86.4), else a cut (a read
    error, R86.3).
    """

    _inBandWire = ends.WIRE_WS

    def __init__(self, runner, turn, sink, account, release, rewrite, idleTimeout, conn):
        super().__init__(runner, turn, sink, account, release, rewrite, idleTimeout)
        self.conn = conn
        self.previousNotFound = None

    def start(self) -> None:
        self.conn.proto.listener = self
        self._resetIdle()

    def abort(self) -> None:
        """
        Mark the upstream connection broken; the attempt closes it.
        """
        self.conn.broken = True

    def frameReceived(self, payload: bytes) -> None:
        if self.finished:
            return
        if self._drain is not None and not self._drainRead(len(payload)):
            return  # R107: the drain's byte bound
        self._resetIdle()
        quota = self._runner.quota
        if quota is not None and self._account.type == "oauth":
            quota.observeFrame(self._account, payload)  # codex.rate_limits
        self.feedEvent(eventFromJSON(payload))

    def _beforeOutput(self, event) -> None:
        if event.type != b"error":
            super()._beforeOutput(event)
            return
        data = event.json()
        end = ends.InBandFailure(data, ends.WIRE_WS)
        if isPreviousNotFound(data):
            self.previousNotFound = data
            verdict = passVerdict(
                previousResponseNotFound(self._turn.previousResponseId),
                "previous_response_not_found",
            )
            self._endWith(AttemptResult(end=end, verdict=verdict, status=400), dropUpstream=False)
            return
        if isSizeRefusal(data):
            self._endWith(frameTooLargeResult())  # R91
            return
        verdict = self._runner.judge(self._turn, self._account, end)
        if verdict is None or not verdict.failover:
            # Not a failover (R23): the client sees upstream's own error as a
            # status-bearing error event (R81), unless the judgement gave it
            # a close code. A refused field still gets R7's one retry without
            # it (R106, R112).
            rejected = verdict.rejectedField if verdict is not None else None
            error = verdict.clientError if verdict is not None else None
            if error is None or error.wsClose is None:
                error = errorFromEvent(data)
            verdict = evolve(passVerdict(error, "upstream_error_event"), rejectedField=rejected)
        self._endWith(AttemptResult(end=end, verdict=verdict, status=verdict.status))

    def _afterOutput(self, event, forwardedFailure: bool = False) -> None:
        if event.type == b"error":
            self._release()
            self._write(event)
            self._endWith(
                AttemptResult(end=ends.Forwarded(None), committed=True, status=502)
            )
            return
        if event.terminal:
            response = event.json().get("response") or {}
            if response.get("id"):
                self.conn.lastResponseId = response.get("id")
        super()._afterOutput(event, forwardedFailure)

    def upstreamLost(self, code, reason: str = "") -> None:
        """
        The upstream connection closed mid-turn: a 1000 close is a clean end
        without a terminal event (R86.4), anything else a cut (R86.3).

        @param code: the close code (L{None} when the TCP connection dropped
            without a close frame).
        @param reason: the close reason, for logs.
        """
        self.conn.broken = True
        if self.finished:
            return
        self._cancelIdle()
        if self._turn.cancel.cancelled and self._drain is None:
            self.depart(self._turn.cancel.reason)
            if self.finished:
                return
        detail = f"closed {code} {reason or ''}".strip()
        if code == FRAME_TOO_BIG and not self._outputReachedClient():
            # R91: the request's fault, not the account's.
            self._endWith(frameTooLargeResult(), dropUpstream=False)
            return
        if code == 1000:
            self._fail(ends.StreamEnded(), "OpenAI stream ended before a terminal event")
        else:
            self._fail(
                ends.StreamCut(detail), "OpenAI stream disconnected before completion: " + detail
            )


@implementer(IAttempt)
@define(eq=False)
class WebSocketAttempt:
    """
    The C{wsAttempt} hook; see the module docstring.

    @ivar pool: the L{relay.upstream.ws.UpstreamPool} for C{ctx_pool}.
    @ivar reactor: for dials and timers.
    @ivar tlsPolicy: TLS trust for C{wss} upstreams (L{None}: the
        platform store).
    """

    pool: object
    reactor: object
    tlsPolicy: object = None
    _log = Logger()

    async def __call__(self, runner, turn, sink, account, release) -> AttemptResult:
        s = runner.settings.current
        mode = accountMode(account, s)
        ctx = turn.wsContext
        if mode == "off":
            error = ClientError(
                400, "invalid_request_error", WS_MODE_OFF, wsClose=(1008, WS_MODE_OFF)
            )
            return AttemptResult(
                end=ends.Refused("ws_mode_off"),
                verdict=passVerdict(error, "ws_mode_off"),
                status=400,
            )
        if mode == "http_bridge":
            return await self._bridge(runner, turn, sink, account, release, ctx)
        expanded = ctx.expandedBody(turn) if ctx is not None else None
        useExpanded = fresh = False
        while True:
            result, retry = await self._oneSocket(
                runner, turn, sink, account, release, ctx, mode, expanded, useExpanded, fresh
            )
            if retry == RETRY_FULL_INPUT and not useExpanded:
                useExpanded = True
                self._log.info(
                    "previous_response_id {previous} not found upstream; resending full input",
                    event="ingress_ws_prev_response_recovery",
                    action="drop_previous_response_id",
                    retry=1,
                    account_id=account.id,
                    request_id=turn.requestId,
                )
            elif retry == RETRY_FRESH_CONNECTION and not fresh:
                fresh = True
            elif isFrameTooLarge(result):
                return await self._tooLarge(runner, turn, sink, account, release, ctx)
            else:
                return result

    async def _tooLarge(self, runner, turn, sink, account, release, ctx) -> AttemptResult:
        """
        R91: the upstream WebSocket refused the frame for its size. The turn
        is retried once over HTTP on the same account (R48's bridge, which
        has no frame limit); when it cannot be (a chain relay cannot
        expand), or HTTP refuses the size too, the client is told
        C{frame_too_large}. Nothing is marked either way.
        """
        self._log.info(
            "upstream websocket of {account_id} refused turn {request_id}'s frame for its size;"
            " retrying once over HTTP",
            event="openai.websocket_frame_too_large", account_id=account.id,
            request_id=turn.requestId,
        )
        if turn.previousResponseId and (ctx is None or ctx.expandedBody(turn) is None):
            return frameTooLargeResult()
        result = await self._bridge(runner, turn, sink, account, release, ctx)
        end = result.end
        if isinstance(end, ends.StatusRefused) and end.status == 413:
            return frameTooLargeResult()
        return result

    # -- http_bridge ---------------------------------------------------------

    async def _bridge(self, runner, turn, sink, account, release, ctx) -> AttemptResult:
        """
        R52: one upstream HTTP request; the body is the turn with its chain
        expanded from this connection's own turns (R77). A prewarm
        (C{generate: false}) is answered here, never sent: HTTP has no
        C{generate} and would bill a generation (R53, R93).
        """
        if turn.body.get("generate") is False:
            return localPrewarm(runner, turn, sink, account, release)
        if turn.previousResponseId:
            body = ctx.expandedBody(turn) if ctx is not None else None
            if body is None:
                return AttemptResult(
                    end=ends.Refused("incomplete_history"),
                    verdict=passVerdict(
                        previousResponseNotFound(turn.previousResponseId),
                        "previous_response_not_found",
                    ),
                    status=400,
                )
            self._log.info(
                "bridging turn {request_id} with replayed input",
                event="ingress_ws_http_bridge_replay_input",
                items=len(body.get("input") or []),
                request_id=turn.requestId,
            )
        else:
            body = dict(turn.body)
        body.pop("previous_response_id", None)
        for name in RELAY_ONLY_FIELDS:
            body.pop(name, None)
        bridged = evolve(turn, body=body, stream=True, previousResponseId=None)
        try:
            return await attemptHTTP(runner, bridged, sink, account, release)
        finally:
            if turn.firstOutputAt is None:
                turn.firstOutputAt = bridged.firstOutputAt
            if turn.usage is None:
                turn.usage = bridged.usage

    # -- ctx_pool / passthrough ------------------------------------------------

    async def _acquire(self, turn, account, ctx, mode, s, fresh=False) -> PooledConnection:
        prev = turn.previousResponseId
        if mode == "passthrough":
            current = ctx.dedicated if ctx is not None else None
            if (
                current is not None
                and current.accountId == account.id
                and current.alive
                and not current.busy
            ):
                current.busy = True
                return current
            if current is not None:
                current.broken = True
                current.proto.close()
                ctx.dedicated = None
            proto = await dialUpstream(
                self.reactor, account, upstreamClientHeaders(turn, account),
                s.upstream.connect_timeout_seconds, self.tlsPolicy,
            )
            conn = PooledConnection(
                proto=proto, accountId=account.id, openedAt=self.reactor.seconds(), busy=True
            )
            if ctx is not None:
                ctx.dedicated = conn
            return conn
        owner = turn.client.ownerId  # R104: never lent to another key
        preferred = (
            self.pool.findByResponse(account.id, prev, owner) if prev and not fresh else None
        )
        return await self.pool.acquire(
            account, upstreamClientHeaders(turn, account), preferred, fresh=fresh,
            ownerKey=owner,
        )

    def _giveBack(self, conn: PooledConnection, mode: str, broken: bool) -> None:
        if mode == "passthrough":
            conn.busy = False
            if broken or conn.broken:
                conn.broken = True
                conn.proto.close()
            return
        self.pool.release(conn, broken=broken or conn.broken)

    def _handshakeRejected(self, runner, turn, account, e: HandshakeRejected) -> AttemptResult:
        """
        R56: a rejected upgrade is a status; the engine's judgement applies
        the guard (first turn, no previous_response_id: the HTTP rules
        unchanged; outside it the older mapping). Logged with the action.
        """
        end = ends.StatusRefused(e.status, dict(e.headers or {}), e.body, ends.WIRE_WS_HANDSHAKE)
        verdict = runner.judge(turn, account, end)
        action = "pass_through"
        if verdict is not None and verdict.failover:
            action = "retry_same" if verdict.sameAccount or verdict.oauth429 else "switch"
        self._log.info(
            "upstream websocket handshake on {account_id} rejected with {status}",
            event="ingress_ws_handshake_failover",
            account_id=account.id,
            status=e.status,
            action=action,
            turn=turn.phase,
            request_id=turn.requestId,
        )
        return AttemptResult(end=end, verdict=verdict, status=e.status)

    def _staleRetry(self, turn, account, conn, result, fresh) -> Optional[str]:
        """
        R67: a read or write error on a connection that already carried
        turns, before anything of this turn reached the client, retries the
        turn once on a new connection of the same account; the broken
        connection is not the account's failure, so the first end is not
        recorded. A connection's first turn gets no such retry (its failure
        is the account's), nor does a strict-affinity turn (C{store:false}
        with C{previous_response_id}: only that connection holds its chain).

        @return: L{RETRY_FRESH_CONNECTION} or L{None}.
        """
        end = result.end
        stale = isinstance(end, ends.StreamCut) or (
            isinstance(end, ends.TransportFailure) and end.stage == "write"
        )
        if (
            fresh
            or not stale
            or conn.turns < 2
            or result.committed
            or turn.firstOutputAt is not None
            or turn.cancel.cancelled
        ):
            return None
        stage = "write_upstream" if isinstance(end, ends.TransportFailure) else "read_upstream"
        if turn.previousResponseId and turn.body.get("store") is False:
            self._log.info(
                "not retrying turn {request_id} on a new connection: strict affinity",
                event="ingress_ws_turn_retry_skip",
                reason="strict_affinity",
                stage=stage,
                account_id=account.id,
                request_id=turn.requestId,
            )
            return None
        self._log.info(
            "upstream connection of {account_id} failed ({stage}) before output; "
            "retrying turn {request_id} once on a new connection",
            event="ingress_ws_turn_retry",
            stage=stage,
            account_id=account.id,
            request_id=turn.requestId,
        )
        return RETRY_FRESH_CONNECTION

    async def _oneSocket(
        self, runner, turn, sink, account, release, ctx, mode, expanded, useExpanded,
        fresh=False,
    ):
        """
        One send on one upstream connection.

        @param fresh: on a new connection (the R67 retry).
        @return: (L{AttemptResult}, retry) where C{retry} is L{None},
            L{RETRY_FULL_INPUT} (the R66 full-input resend) or
            L{RETRY_FRESH_CONNECTION} (R67).
        """
        s = runner.settings.current
        try:
            conn = await self._acquire(turn, account, ctx, mode, s, fresh)
        except PoolBusy as e:
            self._log.info(
                "upstream websocket pool of {account_id} busy ({reason})",
                event="openai.websocket_pool_busy",
                account_id=account.id,
                reason=e.reason,
                request_id=turn.requestId,
            )
            return AttemptResult(end=ends.PoolBusy(e.reason), status=503), None
        except HandshakeRejected as e:
            turn.upstreamRequestId = (e.headers or {}).get("x-request-id")
            if runner.metrics is not None:
                runner.metrics.upstreamStatus(e.status)  # like HTTP statuses
            return self._handshakeRejected(runner, turn, account, e), None
        except Exception as e:  # noqa: BLE001
            return AttemptResult(end=ends.TransportFailure(e, "dial"), status=502), None
        turn.upstreamRequestId = (getattr(conn.proto, "responseHeaders", None) or {}).get(
            "x-request-id"
        )
        if not conn.handshakeCounted:
            # A new upstream connection: its 101, counted once.
            conn.handshakeCounted = True
            if runner.metrics is not None:
                runner.metrics.upstreamStatus(101)
            token = (getattr(conn.proto, "responseHeaders", None) or {}).get("x-codex-turn-state")
            if token:
                sessionTurnState(runner, turn, account, token)
        conn.turns += 1
        if turn.cancel.cancelled:
            # A passthrough connection belongs to the client that left.
            self._giveBack(conn, mode, broken=mode == "passthrough")
            raise ClientGone(turn.cancel.reason)
        if runner.quota is not None and account.type == "oauth" and not getattr(
            conn.proto, "usageSeen", False
        ):
            # A fresh connection's handshake headers carry the
            # usage windows (protocol.md 7.3).
            conn.proto.usageSeen = True
            runner.quota.observeHeaders(account, conn.proto.responseHeaders or {}, "handshake")

        prev = turn.previousResponseId
        body = dict(turn.body)
        sentPrev = None
        if prev:
            if not useExpanded and conn.lastResponseId == prev:
                sentPrev = prev
            elif expanded is not None:
                body = dict(expanded)
                self._log.info(
                    "expanding {previous} into full input on {account_id}",
                    event="ingress_ws_prev_response_strict_eval",
                    action="drop_previous_response_id_full_create",
                    previous=prev,
                    account_id=account.id,
                    request_id=turn.requestId,
                )
            else:
                sentPrev = prev  # R76: keep the id; upstream decides.
        for name in RELAY_ONLY_FIELDS:
            body.pop(name, None)
        body["type"] = "response.create"
        if turn.model:
            body["model"] = account.upstreamModel(turn.model)
        scopeCacheKey(turn, body)  # R112, both account types
        if account.type == "oauth":
            body["store"] = False  # R66: forced false on the ChatGPT backend
            dropOAuthSampling(body)
        payload = encodeBody(body, turn.bodySize)

        given = []

        def giveBack(broken=False):
            if not given:
                given.append(True)
                self._giveBack(conn, mode, broken)

        def releaseBoth():
            # Connection idle and slot free before the terminal event is
            # written (protocol.md 8 timing rules).
            giveBack()
            release()

        rewrite = modelRewriter(turn.model, account.upstreamModel(turn.model) if turn.model else None)
        pump = WebSocketPump(
            runner, turn, sink, account, releaseBoth, rewrite,
            s.upstream.stream_idle_timeout_seconds, conn,
        )
        fot = s.first_output_timeout_seconds

        def onFirstOutputTimeout():
            runner._log.warn(
                "no first output from {account_id} within {seconds}s",
                event="openai.first_output_timeout",
                account_id=account.id,
                seconds=fot,
                request_id=turn.requestId,
                phase="websocket_first_semantic_output",
            )
            pump.firstOutputTimeout(fot)

        timer = self.reactor.callLater(fot, onFirstOutputTimeout) if fot > 0 else None
        try:
            pump.start()
            try:
                conn.proto.send(payload)
            except Exception as e:  # noqa: BLE001
                pump.finished = True
                pump.abort()
                giveBack(broken=True)
                result = AttemptResult(end=ends.TransportFailure(e, "write"), status=502)
                return result, self._staleRetry(turn, account, conn, result, fresh)
            try:
                result = await raceDeparture(pump.done, turn.cancel)
            except ClientGone:
                pump.depart(turn.cancel.reason)
                await drained(pump)  # R107: usage read (or estimated) first
                giveBack(broken=True)
                if mode == "passthrough" and not conn.broken:
                    # Drained to its end: the left client's own connection goes.
                    self._giveBack(conn, mode, broken=True)
                raise
        finally:
            if timer is not None and timer.active():
                timer.cancel()
            pump._cancelIdle()
        conn.proto.listener = None
        if (
            pump.previousNotFound is not None
            and sentPrev is not None
            and expanded is not None
            and not useExpanded
        ):
            retry = RETRY_FULL_INPUT
        else:
            retry = self._staleRetry(turn, account, conn, result, fresh)
        giveBack(broken=bool(conn.broken or retry))
        return result, retry


def localPrewarm(runner, turn, sink, account, release) -> AttemptResult:
    """
    R53, R93: a prewarm on an account bridged to HTTP: C{response.created},
    then C{response.completed} with empty output and a relay-minted id a
    later turn may chain to (the connection's transcript records the
    prewarm's input); no upstream request, so nothing is billed.
    """
    import os

    rid = "resp_" + os.urandom(12).hex()
    response = {"id": rid, "object": "response", "created_at": int(runner.clock.seconds()),
                "status": "in_progress", "model": turn.model, "output": []}
    done = dict(response, status="completed",
                usage={"input_tokens": 0, "output_tokens": 0, "total_tokens": 0})
    runner.firstOutput(turn)
    sink.commit({})
    sink.writeEvent(eventFromJSON(_dumps(
        {"type": "response.created", "sequence_number": 0, "response": response})))
    release()
    owned = runner.ownResponse(turn, account, rid)
    sink.writeEvent(eventFromJSON(_dumps(
        {"type": "response.completed", "sequence_number": 1, "response": done})))
    WebSocketAttempt._log.info(
        "answered a prewarm locally with {response_id} (account {account_id} is bridged to HTTP)",
        event="ingress_ws_http_bridge_prewarm", response_id=rid, account_id=account.id,
        request_id=turn.requestId,
    )
    return AttemptResult(end=ends.Completed(rid), committed=True, status=200, ownerRecorded=owned)


def sessionTurnState(runner, turn, account, token: str) -> None:
    """
    R90 on the WebSocket: the upstream handshake gave this session an
    C{x-codex-turn-state}. relay's own 101 went out before an account was
    chosen (R47), so the token is kept for the session
    (L{relay.scheduling.scheduler.turnStateSessionKey}) and carried on the
    101 of its next connection; the account that issued it is remembered
    for the client's replay of it (affinity, like R38).
    """
    from relay.scheduling.scheduler import affinityKey, turnStateSessionKey

    scheduler = runner.scheduler
    scheduler.recordAffinity(affinityKey("turn_state", token), account)
    if turn.sessionHash:
        scheduler.recordValue(turnStateSessionKey(turn.sessionHash), token)


def _dumps(body: dict) -> bytes:
    import json

    return json.dumps(body, separators=(",", ":")).encode("utf-8")
