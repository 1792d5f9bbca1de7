# -*- test-case-name: tests.test_runner -*-
"""
The stream pump: reads one upstream attempt's events (an SSE body, or
WebSocket frames fed by L{relay.engine.wsattempt}), holds them back until
the first semantic output (behaviour.md R22), reports pre-output failures as
facts (R23, R86), then passes upstream bytes through to the client's sink,
watching only for the terminal event.

It never decides anything about the account: the attempt's end goes to the
turn engine as an L{AttemptResult} carrying a L{relay.policy.ends} fact.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

from attrs import define, evolve
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import PotentialDataLoss, ResponseDone
from zope.interface import implementer

from relay.policy import failures as F
from relay.base import clienterrors as E
from relay.engine.payload import isEmptyCompleted, isSemanticOutput, translatesChat
from relay.policy import ends
from relay.tenants.keyusage import limitHeaders, limitsEvent
from relay.wire.jsoncodec import dumpsRecord
from relay.wire.sse import DONE, Event, LineTooLong, SSEParser
from relay.usage.estimate import DELTA_MARK, estimatedCounts
from relay.usage.tokens import USAGE_CHUNK

_log = Logger()

STAGING_CAP = 8 * 2**20
"""Held-back bytes before the first output, at most (behaviour.md R22)."""


@define(eq=False)
class AttemptResult:
    """
    What one attempt on one account ended with.

    @ivar end: the attempt end, a fact from L{relay.policy.ends}.
    @ivar verdict: the verdict when the attempt code already judged the end
        (an in-band failure must be judged where it is read: it fails over
        or is forwarded); else L{None} and the engine judges it.
    @ivar committed: output reached the client (no failover any more).
    @ivar status: HTTP-like status of the outcome for logs.
    @ivar ownerRecorded: the response's owner was recorded before its
        terminal event or body went to the client
        (L{relay.engine.runner.TurnRunner.ownResponse}); the engine does not
        record it again.
    """

    end: object = None
    verdict: Optional[F.Verdict] = None
    committed: bool = False
    status: int = 200
    ownerRecorded: bool = False

    @property
    def ok(self) -> bool:
        """
        The turn completed: a terminal event or body reached the client.
        """
        return isinstance(self.end, ends.Completed)

    @property
    def responseId(self) -> Optional[str]:
        """
        The response id of a completed or forwarded turn, else L{None}.
        """
        return getattr(self.end, "responseId", None)


@implementer(IPushProducer)
class StreamPump(Protocol):
    """
    Reads one upstream SSE body: holds events back until the first semantic
    output (R22), classifies pre-output failures (R23), then passes bytes
    through, watching only for the terminal event. Registered as a
    streaming producer on the sink, so a slow client pauses upstream.

    It reports how the attempt ended as a fact (L{relay.policy.ends}) and
    never writes account state (behaviour.md R86): the engine judges and
    records the end. A pump the client left (the sink stops producing, or
    the engine calls L{depart}) ends with L{ends.Departed}, so nothing that
    happens to the upstream connection afterwards can count (R2).

    A client that leaves after the first output does not end the pump at
    once (R107): it I{drains}, reading the upstream to its terminal event
    for the turn's usage, bounded by C{gateway.usage_drain_seconds} and
    C{usage_drain_bytes}, writing nothing more to the client; where that
    usage cannot be read (the upstream cut, a bound hit) it records relay's
    estimate (L{relay.usage.estimate}). It still ends with
    L{ends.Departed}: the drain reads usage only, never account state (R2).

    @ivar done: fires with an L{AttemptResult}.
    """

    def __init__(self, runner, turn, sink, account, release, modelRewrite, idleTimeout):
        self._runner = runner
        self._turn = turn
        self._sink = sink
        self._account = account
        self._release = release
        self._rewrite = modelRewrite
        self._idleTimeout = idleTimeout
        self._parser = SSEParser()
        # The upstream speaks chat completions chunks only for a chat turn
        # forwarded as is; a translated one (OAuth) streams Responses events.
        self._chat = turn.endpoint == "chat" and not translatesChat(turn, account)
        # Raw pass-through needs a sink that takes bytes and no model-name
        # rewrite; Responses streams must already be in event:+data: form.
        self._rawWrite = getattr(sink, "writeRaw", None) if modelRewrite is None else None
        self._rawPrefix = b"data: " if self._chat else b"event: "
        self._usage = runner.usageTap(turn, account)
        self._usageChunk = self._usage.chunk if self._usage.chat else None
        self._mark = _USAGE_MARKS if self._usage.chat else _TERMINAL_MARKS
        self._staged = []
        self._stagedBytes = 0
        self._headers = {}
        self._batch = None
        self._idle = None
        self._relayed = 0
        self._deltas = 0
        self._drain = None
        self._drainLeft = 0
        self._drainCall = None
        self.committed = False
        self.finished = False
        self.done = Deferred()

    # -- wiring ------------------------------------------------------------

    def start(self, response) -> None:
        """
        Begin reading C{response} (an L{relay.interfaces.IUpstreamResponse}).
        """
        self._headers = response.headers
        response.deliverBody(self)

    def connectionMade(self) -> None:
        self._resetIdle()

    def pauseProducing(self) -> None:
        if self.transport is not None and not self.finished:
            self.transport.pauseProducing()

    def resumeProducing(self) -> None:
        if self.transport is not None and not self.finished:
            self.transport.resumeProducing()

    def stopProducing(self) -> None:
        """
        The client's connection went away under us (twisted.web stops the
        registered producer): the attempt ended because the client left.
        """
        self.depart("client_gone")

    def depart(self, reason: str = "client_gone") -> None:
        """
        The client left. Before the first output: end the attempt as
        L{ends.Departed} and drop the upstream connection at once (R2).
        After it: drain the upstream for the turn's usage (R107, see the
        class docstring), or, when draining is off or relay itself cancelled
        the turn (a graceful stop), record the estimate and end at once.
        L{done} fires (with L{ends.Departed}) when the drain ends.
        Idempotent; a no-op once the attempt ended or while it drains.

        @param reason: why, for logs.
        """
        if self.finished or self._drain is not None:
            return
        if self.committed:
            s = self._runner.settings.current
            if (s.usage_drain_seconds > 0 and s.usage_drain_bytes > 0
                    and self._turn.cancel.tell is None):
                self._startDrain(reason, s.usage_drain_seconds, s.usage_drain_bytes)
                return
            self._estimate("not_drained")
        self._endWith(AttemptResult(end=ends.Departed(reason), status=499))

    @property
    def draining(self) -> bool:
        """
        The client left after output and the pump reads on for usage (R107).
        """
        return self._drain is not None and not self.finished

    def _startDrain(self, reason: str, seconds: float, limit: int) -> None:
        """
        R107: read on without the client. Nothing more reaches the client's
        sink; the client's back-pressure no longer holds the upstream.
        """
        self._drain = reason
        detach = getattr(self._sink, "detachProducer", None)
        if detach is not None:
            detach()
        self._sink = _GONE
        if self._rawWrite is not None:
            self._rawWrite = _discard
        self._drainLeft = limit
        self._drainCall = self._runner.clock.callLater(seconds, self._drainBound, "drain_timeout")
        self._runner.drains.add(self)
        if self.transport is not None:
            self.transport.resumeProducing()
        _log.info(
            "client of turn {request_id} left after output; reading upstream for its usage",
            event="relay.usage_drain", request_id=self._turn.requestId,
            account_id=self._account.id, reason=reason,
        )

    def hurry(self) -> None:
        """
        End a drain now, with an estimate unless the usage was read (relay
        is stopping: L{relay.process.drain}). A no-op when not draining.
        """
        if self.draining:
            self._drainBound("relay_stop")

    def _drainRead(self, size: int) -> bool:
        """
        Count C{size} upstream bytes against the drain's byte bound.

        @return: L{False} when the bound was passed (the pump then ended
            with an estimate); L{True} otherwise, and when not draining.
        """
        if self._drain is None:
            return True
        self._drainLeft -= size
        if self._drainLeft >= 0:
            return True
        self._drainBound("drain_bytes")
        return False

    def _drainBound(self, why: str) -> None:
        """
        A drain bound was hit (R107): estimate, drop the upstream, end.
        """
        self._drainCall = None
        if self.finished:
            return
        self._estimate(why)
        self._endWith(AttemptResult(end=ends.Departed(self._drain), status=499))

    def _estimate(self, why: str) -> None:
        """
        R107: record relay's estimate when the turn's usage was not read: input
        from the request body, output from what was relayed (L{_relayed},
        L{_deltas}). A background response is not estimated: its run goes on
        upstream and is counted once when it finishes, by whoever sees it
        finished (R88); nor is a request whose kind counts no usage.

        @param why: what stopped the usage from being read, for logs.
        """
        turn = self._turn
        if self._usage.counted is not None or turn.usage is not None or turn.background:
            return
        if turn.request is not None and turn.request.usage != "always":
            return
        counts = estimatedCounts(turn.body, self._deltas, self._relayed)
        _log.info(
            "turn {request_id}'s usage estimated ({why}): {input_tokens} in, {output_tokens} out",
            event="relay.usage_estimated", request_id=turn.requestId,
            account_id=self._account.id, why=why, input_tokens=counts.input,
            output_tokens=counts.output,
        )
        self._runner.recordUsage(turn, self._account, counts)

    def abort(self) -> None:
        """
        Drop the upstream connection. A WebSocket attempt overrides this to
        close or retire its upstream socket.
        """
        if self.transport is not None:
            self.transport.stopProducing()

    def _resetIdle(self) -> None:
        clock = self._runner.clock
        if self._idle is not None and self._idle.active():
            self._idle.reset(self._idleTimeout)
        elif self._idleTimeout > 0:
            self._idle = clock.callLater(self._idleTimeout, self._idleExpired)

    def _cancelIdle(self) -> None:
        if self._idle is not None and self._idle.active():
            self._idle.cancel()
        self._idle = None

    # -- data ---------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self.finished:
            return  # style.md trap T15: bytes after pause/abort
        if self._drain is not None and not self._drainRead(len(data)):
            return
        self._resetIdle()
        if self._rawWrite is None:
            self._eventByEvent(data)
            return
        # What one read brings to the client goes out in one
        # write (whole events, in order; flushed before the slot is
        # released for a terminal event and before any ending). Events are
        # parsed one by one only until the first output; after it whole
        # events pass through up to the first that may be terminal.
        self._batch = []
        try:
            if not self.committed:
                try:
                    data = self._parser.feedWhile(data, self.feedEvent, self._beforeFirstOutput)
                except LineTooLong as e:
                    self._fail(ends.StagingOverflow(e.args[0]), "OpenAI stream line too long")
                    return
                if not data or self.finished:
                    return
            data = self._passThrough(data)
            if data is not None:
                self._eventByEvent(data)
        finally:
            self._flush()
            self._batch = None

    def _eventByEvent(self, data: bytes) -> None:
        """
        Parse C{data} into events and handle each.
        """
        try:
            events = self._parser.feed(data)
        except LineTooLong as e:
            self._fail(ends.StagingOverflow(e.args[0]), "OpenAI stream line too long")
            return
        for event in events:
            if self.finished:
                return
            self.feedEvent(event)

    def _flush(self) -> None:
        """
        Write the events batched by L{dataReceived} (L{_write}).
        """
        batch = self._batch
        if batch:
            data = b"".join(batch)
            batch.clear()
            self._rawWrite(data)

    def _raw(self, data: bytes) -> None:
        """
        Write whole upstream events: into the read's batch when one is open.
        """
        self._relayed += len(data)
        self._deltas += data.count(DELTA_MARK)
        if self._batch is not None:
            self._batch.append(data)
        else:
            self._rawWrite(data)

    def _beforeFirstOutput(self) -> bool:
        return not self.committed and not self.finished

    def _passThrough(self, data: bytes) -> Optional[bytes]:
        """
        The hot path after first output: write whole upstream events as
        they came, in one write per chunk, scanning only for a terminal
        event (DEVELOPERS.md "pass upstream bytes through"). The whole
        events before the first that may be terminal are written so too;
        from there on, and for a chunk with a CR, events take
        the event-by-event path.

        @return: L{None} when C{data} was handled; else the bytes for the
            event-by-event path (the parser's pending bytes included when
            it was emptied).
        """
        if 13 in data:  # b"\r": an int is looked up without a TypeError (bytes_contains)
            return data
        parser = self._parser
        buf = parser._buf + data if parser._buf else data
        end = buf.rfind(b"\n\n")
        if end < 0:
            if len(buf) > parser.maxLine:
                return data
            parser._buf = buf
            return None
        complete = buf[: end + 2]
        if not complete.startswith(self._rawPrefix):
            return data
        mark = self._mark.first(complete)
        if mark < 0:
            parser._buf = buf[end + 2 :]
            self._raw(complete)
            return None
        cut = complete.rfind(b"\n\n", 0, mark) + 2
        if cut < 2:
            return data
        parser._buf = b""
        self._raw(buf[:cut])
        return buf[cut:]

    def feedEvent(self, event) -> None:
        """
        Handle one upstream event (from SSE or a WebSocket frame): held back
        and classified before the first output, passed through after it.
        Transport-agnostic; a WebSocket attempt feeds frames here.
        """
        if self.finished:
            return
        if self.committed:
            self._afterOutput(event)
        else:
            self._beforeOutput(event)

    def _failureEvent(self, event) -> Optional[dict]:
        """
        The parsed event when C{event} is an in-band failure before output:
        a C{response.failed} or C{error} event, or a chat error chunk
        (C{{"error": {...}}}, R84); else L{None}.
        """
        t = event.type
        if t == b"response.failed" or t == b"error":
            return event.json()
        if self._chat and t != DONE:
            data = event.json()
            if isinstance(data.get("error"), dict) and "choices" not in data:
                return data
        return None

    def _beforeOutput(self, event) -> None:
        failure = self._failureEvent(event)
        if failure is not None:
            wire = ends.WIRE_CHAT if self._chat else self._inBandWire
            end = ends.InBandFailure(failure, wire)
            verdict = self._runner.judge(self._turn, self._account, end)
            if verdict is not None and (verdict.failover or verdict.rejectedField is not None):
                # A failover, or R7's rejected field (R106, R112): the engine
                # retries; if it cannot, the verdict's error is the answer.
                self._endWith(AttemptResult(end=end, verdict=verdict, status=verdict.status))
                return
            # R23: not a failover; the client sees upstream's own failure.
            self._commit()
            self._afterOutput(event, forwardedFailure=True)
            return
        t = event.type
        if self._turn.background and t in _BACKGROUND_FIRST:
            self._ownBackground(event)
        if t == b"response.completed":
            response = event.json().get("response") or {}
            if isEmptyCompleted(response) and self._turn.body.get("generate") is not False:
                self._endWith(AttemptResult(end=ends.EmptyCompletion(event.json()), status=502))
                return
        if event.terminal or isSemanticOutput(event, self._chat):
            self._commit()
            self._afterOutput(event)
            return
        self._staged.append(event)
        self._stagedBytes += len(event.data)
        if self._stagedBytes > STAGING_CAP:
            self._endWith(AttemptResult(end=ends.StagingOverflow(self._stagedBytes), status=502))

    _inBandWire = ends.WIRE_SSE

    _owned = False

    def _ownBackground(self, event) -> None:
        """
        R88: a background response's owner is recorded at its first event,
        before the client could drop the stream and resume it elsewhere.
        """
        if self._owned:
            return
        response = event.json().get("response")
        if isinstance(response, dict) and response.get("id"):
            self._owned = True
            self._runner.ownResponse(self._turn, self._account, response["id"])

    _batch: Optional[list] = None
    """Raw events of the current read waiting for one write (L{dataReceived})."""

    def _commit(self) -> None:
        """
        First output: fix the response and flush what was held back (R22).
        """
        self.committed = True
        self._runner.firstOutput(self._turn)
        self._sink.commit(clientHeaders(self._turn, self._headers))
        attach = getattr(self._sink, "attachProducer", None)
        if attach is not None:
            attach(self)
        staged, self._staged = self._staged, []
        for event in staged:
            self._write(event)
        if self._turn.entrypoint == "ws" and not any(e.type == RATE_LIMITS for e in staged):
            # R114: a WebSocket turn carries the key's windows even where
            # the upstream sends no codex.rate_limits event (an API-key
            # account), after what was held back; an upstream one is
            # replaced in _write
            limits = keyLimitsEvent(self._turn)
            if limits is not None and self._batch is not None:
                self._batch.append(limits.raw)
            elif limits is not None:
                self._sink.writeEvent(limits)

    def _write(self, event) -> None:
        if self._usageChunk is not None and self._usageChunk(event):
            return  # a chat usage chunk the client did not ask for
        data = event.data
        self._relayed += len(data)
        self._deltas += data.count(DELTA_MARK)
        if self._rewrite is not None:
            event = self._rewrite(event)
        if event.type == RATE_LIMITS:
            event = keyLimitsEvent(self._turn)  # R114: never an account's windows
            if event is None:
                return
        elif event.type == b"error" and b"x-codex-" in event.data:
            event = withoutAccountWindows(event)
        if self._batch is not None:
            self._batch.append(event.raw)
            return
        self._sink.writeEvent(event)

    def _afterOutput(self, event, forwardedFailure: bool = False) -> None:
        if not event.terminal and not forwardedFailure:
            self._write(event)
            return
        # Release the slot before the terminal event reaches the client:
        # Codex sends its next request the instant it reads it
        # (architecture.md invariant 4, protocol.md 8).
        responseId = response = None
        if event.type != DONE:
            response = event.json().get("response")
            if isinstance(response, dict):
                responseId = response.get("id")
        self._usage.terminal(event)
        self._flush()
        self._release()
        forwarded = forwardedFailure or event.type == b"response.failed"
        # R39/R40: the owner too is known before the client can chain from
        # the response (found by the chaos soak).
        owned = not forwarded and self._runner.ownResponse(
            self._turn, self._account, responseId, response)
        self._write(event)
        end = ends.Forwarded(responseId) if forwarded else ends.Completed(responseId)
        self._endWith(
            AttemptResult(end=end, committed=True, status=200, ownerRecorded=owned),
            dropUpstream=False,
        )

    # -- endings -------------------------------------------------------------

    def _outputReachedClient(self) -> bool:
        """
        R19 step 2 counts bytes written to the client: a sink that holds
        everything back until the terminal event (C{holdsOutput}, the JSON
        sink of a non-streaming client) has written nothing yet, so a
        failure before the terminal event may still fail over.
        """
        return self.committed and not getattr(self._sink, "holdsOutput", False)

    def _endWith(self, result: AttemptResult, dropUpstream: bool = True) -> None:
        if self.finished:
            return
        if self._drain is not None:
            # R107: however the drain ended, the turn's client left (R2);
            # usage unread by now is estimated.
            if self._drainCall is not None and self._drainCall.active():
                self._drainCall.cancel()
            self._drainCall = None
            self._runner.drains.discard(self)
            if not isinstance(result.end, ends.Departed):
                self._estimate(type(result.end).__name__)
            result = AttemptResult(end=ends.Departed(self._drain), status=499)
        self._flush()
        self.finished = True
        self._cancelIdle()
        result.committed = result.committed or self._outputReachedClient()
        if dropUpstream:
            self.abort()
        detach = getattr(self._sink, "detachProducer", None)
        if detach is not None and self.committed:
            detach()
        self.done.callback(result)

    def _fail(self, end, message: str, error=None) -> None:
        """
        End with a stream failure: before output the engine judges it and
        may fail over; after output the client gets a terminal error
        in-stream (R17, R23) and C{end} is recorded as happening after
        output.

        @param end: the attempt end (a L{relay.policy.ends} failure).
        @param message: the client's message after output.
        @param error: the L{ClientError} to write after output (default:
            L{E.streamBrokenError} of C{message}).
        """
        if self.finished:
            return
        if not self._outputReachedClient():
            self._endWith(AttemptResult(end=end, status=502))
            return
        if hasattr(end, "afterOutput"):
            end = evolve(end, afterOutput=True)
        self._flush()
        self._release()
        self._sink.fail(error if error is not None else E.streamBrokenError(message))
        self._endWith(AttemptResult(end=end, committed=True, status=502))

    def _idleExpired(self) -> None:
        """
        R24: the upstream stream went silent. After output: an in-stream
        C{stream_timeout} error without failover. Before output relay fails
        over as for a read error (nothing reached the client yet).
        """
        self._idle = None
        if self.finished:
            return
        end = ends.RelayTimeout(ends.IDLE, self._idleTimeout)
        self._fail(end, "Upstream stream idle timeout", E.streamTimeoutError())

    def firstOutputTimeout(self, seconds: float) -> None:
        """
        Called by the runner when the first-output timer fires (R20).

        @param seconds: the deadline that expired.
        """
        if not self.finished and not self.committed:
            self._endWith(
                AttemptResult(end=ends.RelayTimeout(ends.FIRST_OUTPUT, seconds), status=504)
            )

    def connectionLost(self, reason) -> None:
        self._cancelIdle()
        if self.finished:
            return
        if self._turn.cancel.cancelled and self._drain is None:
            self.depart(self._turn.cancel.reason)
            if self.finished:
                return
        clean = reason.check(ResponseDone, PotentialDataLoss) is not None
        tail = self._parser.feed(b"\n\n") if clean and self._parser.pending else []
        for event in tail:
            if self.finished:
                return
            (self._afterOutput if self.committed else self._beforeOutput)(event)
        if self.finished:
            return
        if clean:
            self._fail(ends.StreamEnded(), "OpenAI stream ended before a terminal event")
        else:
            detail = shortReason(reason)
            self._fail(
                ends.StreamCut(detail), "OpenAI stream disconnected before completion: " + detail
            )


class _GoneSink:
    """
    The sink of a client that left (R107's drain): writes go nowhere.
    """

    def commit(self, headers) -> None:
        pass

    def writeEvent(self, event) -> None:
        pass

    def fail(self, error) -> None:
        pass


_GONE = _GoneSink()


def _discard(data: bytes) -> None:
    """
    The raw writer of a drain: the client left (R107).
    """


def shortReason(reason: Failure) -> str:
    """
    A short text of a stream failure, for logs and messages.
    """
    value = reason.value
    inner = getattr(value, "reasons", None)
    if inner:
        value = inner[0].value
    return type(value).__name__


_TERMINAL_MARK = re.compile(
    rb"response\.(?:completed|failed|incomplete|done|cancell?ed)|\[DONE\]"
)
"""Anything that may be a terminal event (protocol.md 2.5); a false hit
only sends the chunk down the event-by-event path."""

_USAGE_MARK = re.compile(_TERMINAL_MARK.pattern + b"|" + USAGE_CHUNK.pattern)
"""On a chat stream also the chunk that carries usage."""


class _Marks:
    """
    Finds the first of several marks in a chunk: each pattern searched on
    its own (a pattern with a literal prefix is scanned for that prefix at
    C speed; their alternation was six times slower on a 40-event chunk)
    and plain substrings with C{bytes.find}.
    """

    def __init__(self, patterns, literals):
        self._patterns = patterns
        self._literals = literals

    def first(self, data: bytes) -> int:
        """
        @return: where the earliest mark starts in C{data}, or -1.
        """
        best = -1
        for pattern in self._patterns:
            m = pattern.search(data)
            if m is not None and (best < 0 or m.start() < best):
                best = m.start()
        for literal in self._literals:
            i = data.find(literal)
            if i >= 0 and (best < 0 or i < best):
                best = i
        return best


_BACKGROUND_FIRST = frozenset({b"response.queued", b"response.created"})
"""The events a background stream starts with (R88)."""

_RESPONSES_TERMINAL = re.compile(rb"response\.(?:completed|failed|incomplete|done|cancell?ed)")

_TERMINAL_MARKS = _Marks((_RESPONSES_TERMINAL,), (b"[DONE]",))
"""L{_TERMINAL_MARK}, faster."""

_USAGE_MARKS = _Marks((_RESPONSES_TERMINAL, USAGE_CHUNK), (b"[DONE]",))
"""L{_USAGE_MARK}, faster."""

_PASSED_RESPONSE_HEADERS = (
    ("x-codex-turn-state", "x-codex-turn-state"),
    ("x-request-id", "x-upstream-request-id"),
    ("openai-model", "openai-model"),
)
"""(upstream name, name the client sees). The upstream's C{x-request-id}
reaches the client as C{X-Upstream-Request-Id}; C{X-Request-Id} is the
turn's own id (L{relay.base.requestid})."""


def passHeaders(headers: dict) -> dict:
    """
    Upstream response headers that reach the client on commit (R22: headers
    are staged with the events), renamed by L{_PASSED_RESPONSE_HEADERS}.
    """
    return {ours: headers[theirs] for theirs, ours in _PASSED_RESPONSE_HEADERS if theirs in headers}


RATE_LIMITS = b"codex.rate_limits"
"""An account's usage windows on the stream (protocol.md 7.3)."""


def clientHeaders(turn, headers: dict) -> dict:
    """
    L{passHeaders} plus, R114, the key's own C{x-codex-*} rate-limit
    headers (L{relay.tenants.keyusage.limitHeaders}); an account's never
    pass.
    """
    out = passHeaders(headers)
    out.update(limitHeaders(turn.keyLimits))
    return out


def keyLimitsEvent(turn):
    """
    R114: the C{codex.rate_limits} event with the key's windows that stands
    for an account's, or L{None} (dropped) when they are not known.
    """
    event = limitsEvent(turn.keyLimits)
    if event is None:
        return None
    return Event(RATE_LIMITS, dumpsRecord(event).encode(), None)


def withoutAccountWindows(event):
    """
    R114: an upstream C{error} event passed on carries its headers in a
    C{headers} object (protocol.md 7.3); the account's C{x-codex-*} ones
    are dropped from it.
    """
    data = event.json()
    headers = data.get("headers")
    if not isinstance(headers, dict):
        return event
    data["headers"] = {k: v for k, v in headers.items() if not k.lower().startswith("x-codex-")}
    return Event(event.type, dumpsRecord(data).encode(), None)


def modelRewriter(requested: Optional[str], upstream: Optional[str]) -> Optional[Callable]:
    """
    When relay mapped the model name, rewrite C{"model":"<upstream>"} back
    to the requested name in forwarded events (protocol.md 4.3). A bytes
    replace: no JSON re-serialisation on the hot path.

    @return: a function L{Event} -> L{Event}, or L{None} when no mapping.
    """
    if not requested or not upstream or requested == upstream:
        return None
    from relay.wire.sse import Event

    pairs = [
        (b'"model":' + sep + b'"' + upstream.encode() + b'"',
         b'"model":' + sep + b'"' + requested.encode() + b'"')
        for sep in (b"", b" ")
    ]

    def rewrite(event):
        data = event.data
        for old, new in pairs:
            if old in data:
                data = data.replace(old, new)
        if data is event.data:
            return event
        dataOnly = event._raw is not None and event._raw.startswith(b"data: ")
        return Event(event.type, data, b"data: " + data + b"\n\n" if dataOnly else None)

    return rewrite
