# -*- test-case-name: tests.test_frontdoor, tests.test_tenancy, tests.test_intake -*-
"""
L{FrontDoor}: where every entrypoint hands a turn over (behaviour.md R102,
R103, R105, R108).

An HTTP resource and the WebSocket protocol build a L{relay.base.records.Turn}
and its sink and call L{FrontDoor.enter}; the door checks the key
(L{relay.frontdoor.keychecks}) and hands the admitted turn to
L{relay.engine.runner.TurnRunner.run}, or has the engine record it as
refused (L{relay.engine.runner.TurnRunner.refuse}), its sink writing the
refusal in the transport's form (HTTP: OpenAI's error body, status and
C{Retry-After}; WebSocket: its C{error} event and close, R81, or, for a
key's own limit, the in-band event with the socket kept open, R113). A
WebSocket frame goes through L{FrontDoor.frame}: held and admitted (R103),
parsed once (L{relay.frontdoor.parse}), turned into a turn by its
connection, then L{enter}.

A request whose body is not decoded yet takes its key's slot through
L{FrontDoor.admitSlot} (R26, R103); the slot travels in an
L{relay.frontdoor.record.Admission}. A turn that reaches the engine
without one (a small WebSocket frame, parsed freely) waits for its slot in
the engine's own wait (the same wait plan, inside the turn's coroutine: no
extra Deferred per turn). A money budget's refusal of what the I{chosen}
account serves (R109) needs that account, so it stays in the engine.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from relay.engine.cancel import ClientGone
from relay.engine.keepalive import StreamKeepalive
from relay.frontdoor.keychecks import KeyChecks, Refused
from relay.frontdoor.parse import RequestRefused, readJSON
from relay.frontdoor.record import Admission, Slot
from relay.base.logs import ClassLogger
from relay.base.records import CancelSignal, Turn

PARSE_FREELY_BYTES = 256 * 1024
"""Client frames up to this size are parsed without the key's slot (a
C{response.processed}, a short turn): bounded work. Larger ones wait for
the slot first (R103), their parsed-size estimate held in the bytes in
flight."""


class FrontDoor:
    """
    See the module docstring.

    @ivar runner: the L{relay.engine.runner.TurnRunner} (or any object with
        C{run}; C{refuse}, C{keySlot} and the parts L{KeyChecks} reads
        when those are used).
    @ivar checks: the L{KeyChecks}.
    """

    _log = ClassLogger()

    def __init__(self, runner):
        self.runner = runner
        self.checks = KeyChecks(runner)

    # -- a turn ------------------------------------------------------------------

    def enter(self, turn: Turn, sink) -> Deferred:
        """
        Check C{turn}'s key and run it (or end it refused).

        @param turn: the L{Turn}; C{keyAdmitted}/C{keyLease} set when its
            slot was admitted before its body was parsed.
        @param sink: its L{relay.interfaces.ITurnSink}.
        @return: the engine's Deferred (the turn's outcome string).
        """
        checks = self.checks
        stores = checks.stores()
        if not checks.pending(turn, stores):
            # the common case: nothing to wait for, no coroutine
            try:
                checks.checkNow(turn)
            except Refused as e:
                return self.runner.refuse(turn, sink, e.error)
            return self.runner.run(turn, sink)
        since = self.runner.clock.seconds()
        # a streaming turn that waits here is kept alive meanwhile (R85; a
        # rate window's wait at a slot wait's pace, R113)
        keepalive = self._keepalive(turn, sink)
        d = Deferred.fromCoroutine(checks.check(turn, stores, keepalive))
        if d.called:
            keepalive = None
        elif keepalive is not None:
            keepalive.start(since=getattr(sink, "quietSince", None))
        d.addBoth(self._checked, turn, sink, keepalive, since)
        if not d.called:
            # a turn waiting at the door is a turn in the making: a
            # graceful stop waits for it and cancels it (R2)
            inflight = self.runner.inflight
            inflight[turn] = d
            d.addBoth(lambda result: (inflight.pop(turn, None), result)[1])
        return d

    def _checked(self, result, turn: Turn, sink, keepalive, since: float) -> Deferred:
        """
        The checks of L{enter} are done: run the turn, or end it refused
        (L{Refused}), gone (L{ClientGone}) or failed (any other exception:
        the engine logs it and answers 502). Its duration counts from
        C{since}, when it reached the door.
        """
        if keepalive is not None:
            keepalive.stop()
        if not isinstance(result, Failure):
            return self.runner.run(turn, sink, since)
        reason = result.value
        if isinstance(reason, Refused):
            reason = reason.error
        elif isinstance(reason, ClientGone):
            reason = None
        return self.runner.refuse(turn, sink, reason, since)

    def _keepalive(self, turn: Turn, sink):
        """
        R85: a streaming turn that waits at the door (the start-up gate, a
        budget or window store, its key's rate window) gets keepalives at
        the engine's pace (C{stream_keepalive_interval}) until it goes on;
        L{None} for a turn that does not stream. Built unstarted: the
        caller starts it once the checks wait.
        """
        settings = getattr(self.runner, "settings", None)
        if not turn.stream or settings is None:
            return None
        return StreamKeepalive(
            clock=self.runner.clock, send=sink.keepalive,
            interval=settings.current.stream_keepalive_interval, requestId=turn.requestId,
        )

    def refusal(self, turn: Turn):
        """
        What a turn answered without a generation (an C{http_bridge}
        prewarm) is refused with, like a turn (R102), or L{None}.
        """
        return self.checks.refusal(turn)

    # -- the key's slot (R26, R103) ---------------------------------------------

    def takesSlot(self, key) -> bool:
        """
        Whether C{key} has a slot to admit (R26): L{admitSlot} of a key
        without one (C{concurrency} 0: unlimited) fires at once with no
        lease.
        """
        return key.concurrency > 0

    def admitSlot(self, key, cancel, requestId: str = "", entrypoint: str = "http",
                  keepalive=None) -> Deferred:
        """
        Admit C{key}'s slot (R26) for a request whose body is not decoded
        yet (R103); the lease then goes to the turn (C{Turn.keyLease},
        C{keyAdmitted=True}) and the engine releases it.

        @param key: the authenticated L{relay.base.records.ClientKey}.
        @param cancel: the request's L{relay.base.records.CancelSignal}.
        @param requestId: for the wait's log lines.
        @param entrypoint: C{http} or C{ws}.
        @param keepalive: a no-argument callable writing one keepalive (an
            SSE comment, a ping frame; R85, R31), or L{None}.
        @return: a Deferred firing with the lease (L{None} for an unlimited
            key), or failing with an exception whose C{error} is the R32
            L{relay.base.records.ClientError} (or with L{ClientGone}).
        """
        if key.concurrency <= 0:
            # an unlimited key has no slot: no Turn, coroutine or keepalive
            return succeed(None)
        standIn = Turn(
            entrypoint=entrypoint, endpoint="responses", client=key, model=None, body={},
            stream=False, requestId=requestId, cancel=cancel,
        )
        d = self.runner.keySlot(standIn, keepalive)
        if not d.called:
            # a request waiting for its key's slot is a turn in the making
            # (a graceful stop waits for it, then cancels it)
            inflight = self.runner.inflight
            inflight[standIn] = d
            d.addBoth(lambda result: (inflight.pop(standIn, None), result)[1])
        return d

    # -- a WebSocket frame ------------------------------------------------------

    def frame(self, conn, payload: bytes) -> None:
        """
        One client WebSocket frame outside a running turn, from
        C{onMessage} to the engine: a frame over L{PARSE_FREELY_BYTES}
        first has its parsed-size estimate held within the key's and the
        process's bytes in flight and its key's slot admitted (R103, like
        an HTTP body); then it is parsed (L{readJSON}), the connection
        makes it a turn (C{conn.turnFor}), and the turn goes to L{enter}.
        The door talks to the connection's conversation only, never to its
        transport (C{relay.entry.ws}).

        @param conn: the L{relay.entry.conversation.WebSocketConversation}
            (C{key}, C{nextRequestId}, C{holdFrame}, C{slotRefused},
            C{badJSON}, C{admissionPing}, C{gone}, C{turnFor},
            C{turnStarted}, C{admitting}).
        """
        if len(payload) <= PARSE_FREELY_BYTES or getattr(self.runner, "keySlot", None) is None:
            self._parsed(conn, payload, None)
            return
        hold = conn.holdFrame(payload)
        if hold is None:
            return
        cancel = CancelSignal()
        conn.admitting = cancel
        d = self.admitSlot(conn.key, cancel, conn.nextRequestId(), "ws",
                           keepalive=conn.admissionPing)

        def admitted(lease):
            conn.admitting = None
            admission = Admission(key=conn.key, admitted=True,
                                  slot=Slot(lease) if lease is not None else None, hold=hold)
            if conn.gone():
                admission.giveBack()
                return
            self._parsed(conn, payload, admission)

        def refused(failure):
            conn.admitting = None
            hold.release()
            if conn.gone():
                return
            conn.slotRefused(failure)

        d.addCallbacks(admitted, refused)
        d.addErrback(lambda fail: self._log.failure("websocket frame admission", fail))

    def _parsed(self, conn, payload: bytes, admission) -> None:
        try:
            frame = readJSON(payload)
        except RequestRefused as e:
            if admission is not None:
                admission.giveBack()
            conn.badJSON(e.nested)
            return
        try:
            made = conn.turnFor(frame, self)
        except BaseException:
            if admission is not None:
                admission.giveBack()
            raise
        if made is None:
            if admission is not None:
                admission.giveBack()
            return
        turn, sink = made
        if admission is not None:
            admission.handOver(turn)  # R103: admitted before the frame was parsed
        d = self.enter(turn, sink)
        if admission is not None:
            d.addBoth(lambda result: (admission.hold.release(), result)[1])
        conn.turnStarted(d, turn, sink, frame)
