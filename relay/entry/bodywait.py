# -*- test-case-name: tests.test_body, tests.test_requestside, tests.test_intake -*-
"""
What a request body waits for before its request goes on, apart from the
request (L{relay.entry.body.LimitedBodyRequest}, which owns one of each
when it needs it):

  - L{KeysWait}: the key ring at start (R103, R105): the connection's
    reads paused, what came with the headers kept aside undecoded;
  - L{SlotWait}: the key's slot once the raw body is in (R26, R103);
  - L{BodyRate}: the minimum body rate (C{gateway.limits.min_body_bytes_per_second}
    over C{body_rate_window_seconds}): a body slower than that is answered
    408 and the connection closed.

Transport only; no policy (architecture.md invariant 1).
"""

from __future__ import annotations

import io

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from relay.entry import intake as _intake
from relay.entry.logthrottle import suppressedNote, throttleOf
from relay.frontdoor.record import Admission, Slot
from relay.base.records import CancelSignal, ClientError
from relay.base.requestid import requestIdOf

HELD_BEFORE_KEY_BYTES = 256 * 1024
"""The most body bytes kept aside (undecoded) for a request waiting at its
headers for the key ring at start (L{KeysWait})."""


class KeysWait:
    """
    The key ring cannot tell keys yet (the control store's first read
    is pending at start): wait for it (at most
    L{relay.entry.intake.KEYS_WAIT_SECONDS}) with the connection's
    reads paused, so nothing of the body is read, decoded or parsed
    before the key is known (R103, R105). What twisted.web had already
    read with the headers (at most one socket read) is kept aside,
    undecoded, and counted once the key is known; an
    C{Expect: 100-continue} is answered only then.

    The request holds it as C{_keysWait} while it waits and calls
    L{end} (through its C{_endKeysWait}) when it stops waiting.

    @ivar received: C{(command, path, version)} once the whole body came
        with the headers (L{relay.entry.body.LimitedBodyRequest.requestReceived}),
        else L{None}.
    """

    def __init__(self, request, pending, args: tuple):
        """
        @param request: the L{relay.entry.body.LimitedBodyRequest}.
        @param pending: the key ring's Deferred (fires when keys can be told).
        @param args: C{(length, policy, route, method)} for the request's
            C{_headersIn} once they can.
        """
        self._request = request
        self._pending = pending
        self._args = args
        self._held = []
        self._heldBytes = 0
        self._timer = None
        self._producer = None
        self.received = None
        self._expect = bool(request.requestHeaders.getRawHeaders(b"expect"))
        request.requestHeaders.removeHeader(b"expect")

    def start(self) -> None:
        """
        Pause the connection's reads and wait (the request holds this wait
        already: the ring may answer at once).
        """
        channel = self._request.channel
        producer = getattr(channel, "_networkProducer", None)
        if producer is not None:
            producer.pauseProducing()
            self._producer = producer
        self._timer = channel.callLater(_intake.KEYS_WAIT_SECONDS, self._keysKnown)
        self._pending.addBoth(self._keysKnown)

    def _keysKnown(self, result=None):
        """
        The key ring can tell keys now (or the wait ran out): resume
        reading and go on as if the headers had just come in.
        """
        from twisted.internet.defer import CancelledError
        from twisted.python.failure import Failure

        if isinstance(result, Failure):
            result.trap(CancelledError)
            result = None
        request = self._request
        if request._keysWait is not self:
            return result
        request._endKeysWait()
        if request._done or request._refused:
            return result
        held, self._held = self._held, []
        request._headersIn(*self._args)
        if request._refused:
            return result
        if self._expect and getattr(request.channel, "transport", None) is not None:
            request.channel._send100Continue()
        for data in held:
            request.handleContentChunk(data)
            if request._refused:
                return result
        if self.received is not None:
            request.requestReceived(*self.received)
        return result

    def hold(self, data: bytes) -> None:
        """
        Body bytes twisted.web read with the headers while the key ring is
        awaited: kept aside undecoded (reads are paused, so this is at most
        about one socket read); more than L{HELD_BEFORE_KEY_BYTES} is
        answered at once (503, retry) rather than kept.
        """
        self._heldBytes += len(data)
        if self._heldBytes > HELD_BEFORE_KEY_BYTES:
            from relay.tenants.keypolicy import KEYS_LOADING

            self._held = []
            request = self._request
            request._endKeysWait()
            request._answerNow(KEYS_LOADING)
            return
        self._held.append(data)

    def end(self, refused: bool) -> None:
        """
        Stop waiting for the key ring: the timer, the wait, and the paused
        reads (left paused when the request was C{refused}).
        """
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()
        wait = self._pending
        if wait is not None and not wait.called:
            wait.cancel()
        producer, self._producer = self._producer, None
        if producer is not None and not refused:
            producer.resumeProducing()


class BodyRate:
    """
    The minimum body rate of one request's body: every
    C{body_rate_window_seconds} (site clock) at least
    C{min_body_bytes_per_second} times the window must have arrived, else
    the request is answered 408 from the transport and closed.
    """

    __slots__ = ("_request", "_call", "_mark", "_late")

    def __init__(self, request):
        """
        @param request: the L{relay.entry.body.LimitedBodyRequest} (its
            C{_received} byte count, C{_limits()}, C{channel}).
        """
        self._request = request
        self._call = None
        self._mark = 0
        self._late = False

    def arm(self, limits) -> None:
        """
        Start a window now, with C{limits} (a rate is configured).
        """
        request = self._request
        self._mark = request._received
        if getattr(request.channel, "relayBodyIn", None) is request:
            # The whole body came in the read that brought the
            # headers and is handed to this request in this same call, so
            # it is in before any timer could fire; the timer is armed only
            # if it is not (L{armLate}), instead of armed and cancelled.
            self._late = True
            return
        self._call = request.channel.callLater(limits.body_rate_window_seconds, self._checkRate)

    def armLate(self, start=None) -> None:
        """
        The read that brought the headers and the whole body is handled
        (L{relay.entry.site.RelayHTTPChannel._relayHead}): arm the minimum
        body rate's timer if the body is still not in (it was held back in
        L{arm}).

        @param start: the byte count the window starts at when the request
            held it back itself (no L{arm} was called:
            L{relay.entry.body.LimitedBodyRequest._armRate}), else L{None}.
        """
        if start is not None:
            self._mark, self._late = start, True
        if not self._late:
            return
        self._late = False
        request = self._request
        limits = request._limits()
        if request._refused or request._done or limits is None or request.channel is None:
            return
        self._call = request.channel.callLater(limits.body_rate_window_seconds, self._checkRate)

    def _checkRate(self) -> None:
        self._call = None
        request = self._request
        if request._refused:
            return
        limits = request._limits()
        window = limits.body_rate_window_seconds
        need = limits.min_body_bytes_per_second * window
        got = request._received - self._mark
        if got >= need:
            self.arm(limits)
            return
        address = request.getClientAddress()
        throttle = throttleOf(getattr(request.channel, "site", None))
        suppressed = throttle.admit("relay.intake_slow_body") if throttle is not None else 0
        if suppressed is not None:
            request._log.warn(
                "request body from {client} too slow ({got} bytes in {window:.0f} s, the minimum"
                " is {rate} bytes/s): closing" + suppressedNote(suppressed, "more closed"),
                event="relay.intake_slow_body", client=getattr(address, "host", "-"), got=got,
                window=window, rate=limits.min_body_bytes_per_second, suppressed=suppressed,
            )
        request._dropContent()
        request._answerNow(ClientError(
            408, "invalid_request_error",
            "The request body arrived too slowly (gateway.limits.min_body_bytes_per_second is "
            f"{limits.min_body_bytes_per_second}).", code="request_timeout",
        ))

    def stop(self) -> None:
        """
        The body is in (or the request ended): no more windows.
        """
        self._late = False
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None


class SlotWait:
    """
    The key's slot for a request whose whole raw body is in, before it is
    decoded or parsed (R26, R103; L{relay.frontdoor.door.FrontDoor.admitSlot}
    through the site's intake), with the engine's keepalives meanwhile
    for a streaming turn (R85, R31). Admitted, the request decodes and
    processes its body; refused, it answers the refusal.

    The request holds it as C{_slotWait} until it is answered.

    @ivar cancel: the wait's L{relay.base.records.CancelSignal} (the
        request cancels it when the client leaves).
    """

    __slots__ = ("_request", "_line", "_streams", "cancel")

    def __init__(self, request, command, path, version):
        """
        @param request: the L{relay.entry.body.LimitedBodyRequest}.
        """
        self._request = request
        self._line = (command, path, version)
        self._streams = None
        self.cancel = CancelSignal()

    def start(self, admit) -> None:
        """
        Ask C{admit} (the intake's C{admitKey}) for the request's key's
        slot.
        """
        request = self._request
        command, path, _ = self._line
        keepalive = None
        if command.upper() == b"POST" and _intake.isTurnPath(path):
            keepalive = self._keepalive
        d = admit(request.admission.key, self.cancel, requestIdOf(request), keepalive=keepalive)
        if d.called and not d.paused and not isinstance(d.result, Failure):
            # admitted at once (a free slot): what the callback chain would
            # do now, without it
            try:
                self._admitted(d.result)
            except BaseException:
                # what the chain would have done with it: an unhandled
                # error of a Deferred, logged when it is collected
                Deferred().errback()
            return
        d.addCallbacks(self._admitted, self._notAdmitted)

    def _keepalive(self) -> None:
        """
        The engine's keepalive while the request waits for its key's slot
        (behaviour.md R85, R31; L{relay.frontdoor.door.FrontDoor.admitSlot}):
        for a turn whose raw body says C{"stream": true}
        (L{relay.entry.intake.bodyStreams}, read once, at the first tick;
        a C{Content-Encoding}-ed body is not decoded before the slot, so it
        gets none), the first commits 200 and the SSE headers and every one
        writes an SSE comment, as the turn's own keepalives do
        (L{relay.entry.sinks.SSESink}); later errors are written in-stream.
        """
        request = self._request
        if request._done or request._refused or request.content is None:
            return
        if self._streams is None:
            self._streams = False
            if request._encoding is None:
                request.content.seek(0)
                self._streams = _intake.bodyStreams(request.content.read()) is True
                request.content.seek(0, io.SEEK_END)
        if not self._streams:
            return
        if not request.notes.sseStarted:
            request.method, request.uri, request.clientproto = self._line
            request.path = request.uri.split(b"?", 1)[0]
            request.notes.sseStarted = True
            request.setResponseCode(200)
            request.setHeader(b"content-type", b"text/event-stream")
            request.setHeader(b"cache-control", b"no-cache")
            request.setHeader(b"x-accel-buffering", b"no")
        request.write(b":\n\n")
        clock = getattr(getattr(request.channel, "site", None), "clock", None)
        if clock is not None:
            request.notes.quietSince = clock.seconds()

    def _admitted(self, lease) -> None:
        request = self._request
        request._slotWait = None
        if request._done:
            if lease is not None:
                lease.release()
            return
        request.admission = Admission(key=request.admission.key, admitted=True,
                                      slot=Slot(lease) if lease is not None else None)
        request._decodeAndProcess(*self._line)

    def _notAdmitted(self, failure) -> None:
        request = self._request
        request._slotWait = None
        if request._done:
            return
        error = getattr(failure.value, "error", None)
        if not isinstance(error, ClientError):
            request._log.failure("admitting a request failed", failure)
            error = ClientError(
                503, "api_error", "Service temporarily unavailable, please retry later",
            )
        request._bodyFailed(error)
        request._requestReceived(*self._line)
