# -*- test-case-name: tests.test_runner -*-
"""
One attempt of a turn over upstream HTTP (the C{TurnRunner} calls it for
HTTP turns and for the WebSocket's C{http_bridge} mode): dial, then stream
the SSE body through a L{StreamPump} or read the JSON body, and report how
it ended as a fact (L{relay.policy.ends}). No decisions here: the engine
judges and records the end (behaviour.md R86).
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from relay.interfaces import IPiecesDialer
from relay.engine.background import countBackgroundOnce
from relay.engine.cancel import ClientGone, drained, raceCancel, raceDeparture
from relay.engine.payload import (
    isEmptyCompleted,
    translatesChat,
    upstreamBody,
    upstreamClientHeaders,
    upstreamPath,
    upstreamStreams,
)
from relay.engine.pump import AttemptResult, StreamPump, clientHeaders, modelRewriter
from relay.engine.upstreambody import (
    ERROR_BODY_LIMIT,
    JSON_BODY_LIMIT,
    BodyBroken,
    readBody,
)
from relay.wire.jsoncodec import loads
from relay.base.records import Turn
from relay.policy import ends
from relay.translate.imagesink import ImagesSink
from relay.translate.media import MEDIA_ENDPOINTS, mediaBody, translatesImages
from relay.translate.anthropic.sink import MessagesSink
from relay.translate.sink import ChatCompletionsSink
from relay.usage.estimate import estimatedCounts
from relay.usage.tokens import fromBody, mediaCounts

_log = Logger()


async def attemptHTTP(runner, turn: Turn, sink, account, release) -> AttemptResult:
    """
    One HTTP attempt: dial, then stream (SSE) or read (JSON).

    A chat turn on an OAuth account goes to C{/responses}; the pump
    stages and classifies its Responses events as on any other turn and
    a L{ChatCompletionsSink} translates them on write (R84).
    """
    s = runner.settings.current
    stream = upstreamStreams(turn, account)
    path = upstreamPath(turn, account)
    if translatesChat(turn, account):
        sink = ChatCompletionsSink(sink, turn, runner.clock.seconds())
    elif turn.endpoint == "messages":
        sink = MessagesSink(sink, turn)  # R115: Messages events on write
    headers = upstreamClientHeaders(turn, account)
    headers["accept"] = "text/event-stream" if stream else "application/json"
    if turn.endpoint in MEDIA_ENDPOINTS:
        # R115: embeddings and images; only the translation is the surface's
        body, headers["content-type"] = mediaBody(turn, account)
        if translatesImages(turn, account):
            sink = ImagesSink(sink, turn, runner.clock.seconds())
    else:
        body = upstreamBody(turn, account, IPiecesDialer.providedBy(runner.dialer))
    fot = s.first_output_timeout_seconds if stream else 0
    pump = None
    timedOut = []
    requestD = runner.dialer.request(account, b"POST", path, body, headers, s.upstream)
    del body  # sent, or queued by the transport: a Codex history is not held for the turn

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
            await drained(pump)  # R107: usage read (or estimated) first
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
        note(clientHeaders(turn, headers))
    from relay.scheduling.scheduler import affinityKey

    runner.scheduler.recordAffinity(affinityKey("turn_state", headers[_TURN_STATE]), account)


async def _readJSON(runner, turn, sink, account, response, release, rewrite) -> AttemptResult:
    """
    A non-streaming upstream body: check for a silent refusal, then
    answer the client with it.
    """
    idle = runner.settings.current.upstream.stream_idle_timeout_seconds
    try:
        body = await readAnswer(runner, turn, account, response, JSON_BODY_LIMIT,
                                lambda parsed: _countJSON(runner, turn, account, parsed))
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
        from relay.wire.sse import Event

        body = rewrite(Event(b"", body)).data
    _countJSON(runner, turn, account, parsed)
    release()
    runner.firstOutput(turn)
    responseId = parsed.get("id")
    # R39/R40: the owner is known before the client can chain from the body.
    owned = runner.ownResponse(turn, account, responseId, parsed)
    sink.writeBody(200, clientHeaders(turn, response.headers), body)
    return AttemptResult(
        end=ends.Completed(responseId), committed=True, status=200, ownerRecorded=owned
    )


def _countJSON(runner, turn, account, parsed: dict) -> None:
    """
    Count the usage of a non-streaming answer: once per turn; a background
    response's once per response, whoever sees it first (R88).
    """
    counts = fromBody(parsed)
    if turn.endpoint in MEDIA_ENDPOINTS:
        counts = mediaCounts(turn, parsed, counts)  # R109: per image
    if counts is None:
        return
    if turn.background:
        countBackgroundOnce(runner, turn, account, dict(parsed, background=True), counts)
    else:
        runner.recordUsage(turn, account, counts)


async def readAnswer(runner, turn, account, response, limit: int, count) -> bytes:
    """
    Read a non-streaming upstream answer's body (L{readBody}) for a client
    that may leave while it arrives. The answer's status and headers came,
    so upstream produced it: a client that leaves now does not stop the
    read (R107, L{_drainJSON}); the turn then ends with L{ClientGone} once
    the usage was counted.

    @param limit: the body's size cap, bytes.
    @param count: called with the parsed body (a L{dict}) to count its usage.
    @return: the body.
    @raise BodyBroken: the body broke or went idle (the client still there).
    @raise ClientGone: the client left (after the drain).
    """
    idle = runner.settings.current.upstream.stream_idle_timeout_seconds
    reading = readBody(response, limit, idle, runner.clock)
    if reading.called and not turn.cancel.cancelled:
        body = reading.result
        if body.__class__ is bytes:
            return body  # the whole body came with its head: nothing to race
    got = []
    view = Deferred(lambda _: None)  # cancelled by a departure; C{reading} goes on

    def arrived(result):
        got.append(result)
        if not view.called:
            view.callback(result)

    reading.addBoth(arrived)
    try:
        return await raceCancel(view, turn.cancel)
    except ClientGone:
        await _drainJSON(runner, turn, account, reading, got, count)
        raise


async def _drainJSON(runner, turn, account, reading, got: list, count) -> None:
    """
    R107: the client of a non-streaming turn left while its answer's body
    was arriving. Read the body on for its usage, at most
    C{gateway.usage_drain_seconds} (the body keeps its own size cap); a body
    that broke, was cut off by the bound, or carries no usage is counted
    from relay's estimate (input from the request). Nothing reaches the
    client and no account state is written (R2).

    @param reading: the body's Deferred (its result goes to C{got}).
    @param got: the body's result once it arrived (bytes or a Failure).
    @param count: counts the parsed body's usage (see L{readAnswer}).
    """
    s = runner.settings.current
    if not got:
        if s.usage_drain_seconds > 0 and turn.cancel.tell is None:
            arrival = Deferred()
            reading.addBoth(lambda _: arrival.callback(None))
            timer = runner.clock.callLater(s.usage_drain_seconds, reading.cancel)
            await arrival
            if timer.active():
                timer.cancel()
        else:
            reading.cancel()
    body = got[0] if got else None
    parsed = None
    if isinstance(body, bytes):
        try:
            parsed = loads(body)
        except ValueError:
            parsed = None
    if isinstance(parsed, dict) and fromBody(parsed) is not None:
        count(parsed)
        return
    counted = turn.request is None or turn.request.usage == "always"
    if turn.usage is None and not turn.background and counted:
        counts = estimatedCounts(turn.body, 0, 0)
        _log.info(
            "turn {request_id}'s usage estimated ({why}): {input_tokens} in, {output_tokens} out",
            event="relay.usage_estimated", request_id=turn.requestId, account_id=account.id,
            why="json_body_unread", input_tokens=counts.input, output_tokens=counts.output,
        )
        runner.recordUsage(turn, account, counts)
