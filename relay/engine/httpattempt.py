# -*- test-case-name: tests.test_runner -*-
"""
One attempt of a turn over upstream HTTP (the C{TurnRunner} calls it for
HTTP turns and for the WebSocket's C{http_bridge} mode): dial, then stream
the SSE body through a L{StreamPump} or read the JSON body, and report how
it ended as a fact (L{relay.policy.ends}). No decisions here: the engine
judges and records the end (behaviour.md R86).
"""

from __future__ import annotations

from twisted.logger import Logger

from relay.engine.background import countBackgroundOnce
from relay.engine.cancel import ClientGone, raceCancel, raceDeparture
from relay.engine.payload import (
    isEmptyCompleted,
    translatesChat,
    upstreamBody,
    upstreamClientHeaders,
    upstreamPath,
    upstreamStreams,
)
from relay.engine.pump import AttemptResult, StreamPump, modelRewriter, passHeaders
from relay.engine.upstreambody import (
    ERROR_BODY_LIMIT,
    JSON_BODY_LIMIT,
    BodyBroken,
    readBody,
)
from relay.jsoncodec import loads
from relay.model import Turn
from relay.policy import ends
from relay.translate.sink import ChatCompletionsSink
from relay.usage.tokens import fromBody

_log = Logger()


async def attemptHTTP(runner, turn: Turn, sink, account, release) -> AttemptResult:
    """
    One HTTP attempt: dial, then stream (SSE) or read (JSON).

    A chat turn on an OAuth account goes to C{/responses}; the pump
    stages and classifies its Responses events as on any other turn and
    a L{ChatCompletionsSink} translates them on write (issue 13, R84).
    """
    s = runner.settings.current
    stream = upstreamStreams(turn, account)
    path = upstreamPath(turn, account)
    if translatesChat(turn, account):
        sink = ChatCompletionsSink(sink, turn, runner.clock.seconds())
    headers = upstreamClientHeaders(turn, account)
    headers["accept"] = "text/event-stream" if stream else "application/json"
    body = upstreamBody(turn, account)
    fot = s.first_output_timeout_seconds if stream else 0
    pump = None
    timedOut = []
    requestD = runner.dialer.request(account, b"POST", path, body, headers, s.upstream)

    def _onFirstOutputTimeout():
        timedOut.append(True)
        _log.warn(
            "no first output from {account_id} within {seconds}s",
            event="openai.first_output_timeout",
            account_id=account.id,
            seconds=fot,
            request_id=turn.requestId,
        )
        if pump is not None:
            pump.firstOutputTimeout(fot)
        else:
            requestD.cancel()

    timer = runner.clock.callLater(fot, _onFirstOutputTimeout) if fot > 0 else None
    try:
        try:
            response = await raceCancel(requestD, turn.cancel)
        except ClientGone:
            raise
        except Exception as e:
            if timedOut:
                return AttemptResult(
                    end=ends.RelayTimeout(ends.FIRST_OUTPUT, fot), status=504
                )
            return AttemptResult(end=ends.TransportFailure(e, "headers"), status=502)
        turn.upstreamRequestId = response.headers.get("x-request-id")
        if runner.metrics is not None:
            runner.metrics.upstreamStatus(response.code)
        if runner.quota is not None and account.type == "oauth":
            runner.quota.observeHeaders(account, response.headers)
        if response.code >= 300:
            idle = s.upstream.stream_idle_timeout_seconds
            try:
                errorBody = await raceCancel(
                    readBody(response, ERROR_BODY_LIMIT, idle, runner.clock), turn.cancel
                )
            except BodyBroken as e:
                errorBody = e.partial  # the status decides; the body is a hint
            release()
            end = ends.StatusRefused(response.code, dict(response.headers), errorBody)
            return AttemptResult(end=end, status=response.code)
        if _TURN_STATE in response.headers:
            turnState(runner, turn, sink, account, response.headers)
        rewrite = modelRewriter(turn.model, account.upstreamModel(turn.model) if turn.model else None)
        if not stream:
            return await _readJSON(runner, turn, sink, account, response, release, rewrite)
        pump = StreamPump(
            runner, turn, sink, account, release, rewrite, s.upstream.stream_idle_timeout_seconds
        )
        pump.start(response)
        try:
            return await raceDeparture(pump.done, turn.cancel)
        except ClientGone:
            pump.depart(turn.cancel.reason)
            raise
    finally:
        if timer is not None and timer.active():
            timer.cancel()

_TURN_STATE = "x-codex-turn-state"


def turnState(runner, turn, sink, account, headers: dict) -> None:
    """
    R90: the upstream gave the turn an C{x-codex-turn-state}. It reaches the
    client with the response headers: a sink that commits them early (a
    keepalive while the upstream is still silent) is told now
    (C{noteHeaders}); and the account that issued it is remembered, so the
    client's replay of the token routes back to it (R38-like affinity).
    """
    note = getattr(sink, "noteHeaders", None)
    if note is not None:
        note(passHeaders(headers))
    from relay.scheduling.scheduler import affinityKey

    runner.scheduler.recordAffinity(affinityKey("turn_state", headers[_TURN_STATE]), account)


async def _readJSON(runner, turn, sink, account, response, release, rewrite) -> AttemptResult:
    """
    A non-streaming upstream body: check for a silent refusal, then
    answer the client with it.
    """
    idle = runner.settings.current.upstream.stream_idle_timeout_seconds
    try:
        body = await raceCancel(
            readBody(response, JSON_BODY_LIMIT, idle, runner.clock), turn.cancel
        )
    except BodyBroken as e:
        # R1/R23/R24/R86.3: a body that broke before its end is a read
        # error before output (nothing reached the client), exactly like
        # a cut stream; one that went silent is relay's idle timeout.
        if e.idle:
            return AttemptResult(end=ends.RelayTimeout(ends.IDLE, idle), status=502)
        return AttemptResult(end=ends.StreamCut(e.detail), status=502)
    try:
        parsed = loads(body)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        # R86.4: a JSON body that ended cleanly but is not a whole JSON
        # object is the non-stream form of "ended before a terminal
        # event": a stream failure that fails over, never a 200.
        return AttemptResult(end=ends.StreamEnded(), status=502)
    if turn.endpoint == "responses" and isEmptyCompleted(parsed):
        return AttemptResult(end=ends.EmptyCompletion(parsed), status=502)
    if rewrite is not None:
        from relay.sse import Event

        body = rewrite(Event(b"", body)).data
    counts = fromBody(parsed)
    if counts is not None:
        if turn.background:
            # R88: once per background response, whoever sees it first.
            countBackgroundOnce(runner, turn, account, dict(parsed, background=True), counts)
        else:
            runner.recordUsage(turn, account, counts)
    release()
    runner.firstOutput(turn)
    responseId = parsed.get("id")
    # R39/R40: the owner is known before the client can chain from the body.
    owned = runner.ownResponse(turn, account, responseId, parsed)
    sink.writeBody(200, passHeaders(response.headers), body)
    return AttemptResult(
        end=ends.Completed(responseId), committed=True, status=200, ownerRecorded=owned
    )
