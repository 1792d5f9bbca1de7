# -*- test-case-name: tests.test_operations -*-
"""
The graceful stop: on C{SIGTERM} twistd stops the service, and
the service stops relay in this order (L{relay.process.app.RelayService}):

 1. B{Stop accepting}: the listening port closes, so new connections are
    refused.
 2. B{Drain} (L{GracefulDrain.drain}):
    - from now on an HTTP request that arrives on a kept-alive connection
      is answered 503 with C{Retry-After} and C{Connection: close} in
      OpenAI's error envelope (L{DrainGate}), and so is a WebSocket
      upgrade;
    - idle client WebSockets are closed 1001 "server restarting" at once,
      busy ones when their turn ends, and a C{response.create} that
      arrives meanwhile is answered the same way, so Codex reconnects
      (to another relay, or to this one once it is back). relay sends
      1001 ("going away") where behaviour.md R70 lists 1012 for "relay
      shutting down"; both make Codex and the SDK reconnect (protocol.md
      4.6);
    - running turns finish, for up to C{gateway.shutdown_grace_seconds}
      (default 30; read when the stop begins, so a reload changes it);
    - when the grace runs out, every turn still running is cancelled by
      relay (L{relay.base.records.CancelSignal.cancel} with C{tell}): the attempt
      ends as L{relay.policy.ends.Departed}, so no account state is
      written (R2), and once it has unwound its client gets a terminal
      error (L{shuttingDown}: 503 before output, an in-stream
      C{response.failed} after, or a 1001 close on a WebSocket);
    - every slot and wait ticket the process still holds is given back,
      and the Redis commands doing so have landed
      (L{relay.interfaces.ISlotDrain}).
 3. B{Stop the rest}: pooled upstream connections, periodic jobs, the
    Redis client, the settings store; then twistd exits 0.

L{GracefulDrain} is a reusable piece: a supervising parent (the
supervisor of C{workers: N}) can trigger it in each worker the same way (each worker's
service stop runs it).
"""

from __future__ import annotations

from attrs import define, field, frozen
from twisted.internet.defer import Deferred, DeferredList
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.base.clienterrors import RESTART_CLOSE
from relay.interfaces import ISlotDrain
from relay.base.records import ClientError

__all__ = [
    "DrainGate",
    "DrainReport",
    "GracefulDrain",
    "shuttingDown",
]

RETRY_AFTER_SECONDS = 1
"""C{Retry-After} on relay's own 503 while it drains: another relay (or
this one, restarted) serves the retry."""

RELAY_SHUTDOWN = "relay_shutdown"
"""The cancellation reason of a turn relay cancelled at the end of the grace."""

SHUTDOWN_MESSAGE = "relay is restarting; please retry the request"


def shuttingDown() -> ClientError:
    """
    The error a client gets from a draining relay: a request that arrives
    during the drain, or a turn cancelled when the grace ran out.

    @return: 503, C{api_error}, code C{server_restarting}, with
        C{Retry-After} and C{Connection: close}; on the WebSocket a close
        1001 "server restarting" (L{RESTART_CLOSE}).
    """
    return ClientError(
        503,
        "api_error",
        SHUTDOWN_MESSAGE,
        code="server_restarting",
        headers=((b"retry-after", str(RETRY_AFTER_SECONDS).encode()), (b"connection", b"close")),
        wsClose=RESTART_CLOSE,
    )


@frozen
class DrainReport:
    """
    How a drain went.

    @ivar finished: turns that ended by themselves within the grace.
    @ivar cancelled: turns relay cancelled when the grace ran out.
    @ivar released: slot leases relay released itself at the end (turns
        release their own; a non-zero count is worth a look).
    @ivar seconds: how long the drain took, on the injected clock.
    """

    finished: int = 0
    cancelled: int = 0
    released: int = 0
    seconds: float = 0.0


def _observe(d: Deferred) -> Deferred:
    """
    A Deferred that fires (with L{None}) when C{d} does, without touching
    C{d}'s result or chain; safe to cancel (a timeout) before C{d} fires.
    """
    w = Deferred()

    def _fire(result):
        if not w.called:
            w.callback(None)
        return result

    d.addBoth(_fire)
    return w


async def _waitAll(deferreds, seconds: float, clock) -> bool:
    """
    Wait until every one of C{deferreds} has fired, at most C{seconds}.

    @return: whether they all fired in time.
    """
    if not deferreds:
        return True
    waits = DeferredList([_observe(d) for d in deferreds], consumeErrors=True)
    # A timeout cancels the observers; the list then fires normally.
    await waits.addTimeout(max(seconds, 0), clock)
    return all(d.called for d in deferreds)


@define(eq=False)
class GracefulDrain:
    """
    Drains one relay process (see the module docstring).

    @ivar clock: the L{IReactorTime}.
    @ivar runner: the L{relay.engine.runner.TurnRunner} (its C{inflight}).
    @ivar settings: the L{relay.state.settings.RuntimeSettings} (the grace).
    @ivar admission: the L{relay.interfaces.ISlotAdmission}; released at the
        end when it provides L{ISlotDrain}.
    @ivar wsFactory: the client WebSocket factory (its C{openConnections}
        and C{draining}), or L{None}.
    @ivar unwindSeconds: how long cancelled turns may take to unwind
        (their upstream calls are cancelled at once; this only bounds a
        stuck one).
    @ivar releaseSeconds: how long the final slot release may wait for the
        store.
    @ivar draining: true from the moment the drain starts.
    """

    clock: object
    runner: object
    settings: object
    admission: object = None
    wsFactory: object = None
    unwindSeconds: float = 10.0
    releaseSeconds: float = 5.0
    draining: bool = False
    _result: Deferred | None = field(default=None, init=False)
    _log = Logger()

    def start(self) -> None:
        """
        Enter the draining state: new requests are refused (L{DrainGate}),
        idle client WebSockets close 1001, busy ones when their turn ends.
        Idempotent.
        """
        if self.draining:
            return
        self.draining = True
        factory = self.wsFactory
        if factory is None:
            return
        factory.draining = True
        for connection in list(getattr(factory, "openConnections", ())):
            try:
                connection.drain()
            except Exception:  # noqa: BLE001 - logged; one bad part must not stop the rest
                self._log.failure("draining a client websocket failed", event="relay.drain_failed")

    def drain(self, grace: float | None = None) -> Deferred:
        """
        Drain: L{start}, wait for running turns up to the grace, cancel the
        rest, give back every slot. Calling it again returns the same
        outcome.

        @param grace: seconds; default C{gateway.shutdown_grace_seconds}.
        @return: a Deferred firing with a L{DrainReport}; it never fails.
        """
        if self._result is None:
            self._result = Deferred.fromCoroutine(self._drain(grace))
            self._result.addErrback(self._ebDrain)
        d = Deferred()
        self._result.addBoth(_relay, d)
        return d

    def _ebDrain(self, failure) -> DrainReport:
        """
        A bug while draining: log it; the stop goes on.
        """
        self._log.failure("draining failed", failure, event="relay.drain_failed")
        return DrainReport()

    async def _drain(self, grace: float | None) -> DrainReport:
        started = self.clock.seconds()
        if grace is None:
            grace = self.settings.current.shutdown_grace_seconds
        inflight = self.runner.inflight
        running = len(inflight)
        self._log.info(
            "draining: {turns} turn(s) running, {websockets} client websocket(s) open,"
            " grace {grace}s",
            event="relay.drain_started",
            turns=running,
            websockets=len(getattr(self.wsFactory, "openConnections", ())),
            grace=grace,
        )
        self.start()
        deadline = started + grace
        # Nothing new should start while draining; wait for late ones too.
        while inflight and self.clock.seconds() < deadline:
            await _waitAll(list(inflight.values()), deadline - self.clock.seconds(), self.clock)
        cancelled = 0
        for pump in list(getattr(self.runner, "drains", ())):
            # R107: turns whose client left, still reading their usage: an
            # estimate now, before the process goes.
            pump.hurry()
        if inflight:
            left = list(inflight.items())
            cancelled = len(left)
            for turn, _ in left:
                self._log.warn(
                    "grace over: cancelling turn {request_id}",
                    event="relay.drain_cancelled",
                    request_id=turn.requestId,
                    entrypoint=turn.entrypoint,
                )
                turn.cancel.cancel(RELAY_SHUTDOWN, tell=shuttingDown())
            if not await _waitAll([d for _, d in left], self.unwindSeconds, self.clock):
                self._log.warn(
                    "{count} cancelled turn(s) did not unwind within {seconds}s",
                    event="relay.drain_stuck",
                    count=len(inflight),
                    seconds=self.unwindSeconds,
                )
        for connection in list(getattr(self.wsFactory, "openConnections", ())):
            connection.drain()
        released = 0
        if ISlotDrain.providedBy(self.admission):
            try:
                released = await self.admission.releaseAll(self.releaseSeconds)
            except Exception:  # noqa: BLE001 - logged; one bad part must not stop the rest
                self._log.failure("releasing slots failed", event="relay.drain_failed")
        report = DrainReport(
            finished=running - cancelled,
            cancelled=cancelled,
            released=released,
            seconds=self.clock.seconds() - started,
        )
        self._log.info(
            "drained in {seconds:.1f}s: {finished} turn(s) finished, {cancelled} cancelled,"
            " {released} slot(s) released by relay",
            event="relay.drain_finished",
            seconds=report.seconds,
            finished=report.finished,
            cancelled=report.cancelled,
            released=report.released,
        )
        return report


def _relay(result, d: Deferred):
    """
    Hand C{result} to C{d} and keep it for the next caller.
    """
    d.callback(result)
    return result


class _Refusal(Resource):
    """
    The answer of a draining relay to any request: 503 in OpenAI's error
    envelope, C{Retry-After}, C{Connection: close} (and the connection is
    closed once it is written).
    """

    isLeaf = True

    def render(self, request):
        """
        Write L{shuttingDown} and close the connection after it.
        """
        from relay.entry.sinks import writeError

        channel = getattr(request, "channel", None)
        if channel is not None:
            channel.persistent = False
        writeError(request, shuttingDown())
        return NOT_DONE_YET


class DrainGate(Resource):
    """
    The site's root while relay may drain: passes every request to the real
    root until the drain starts, then answers each with L{_Refusal}.

    @ivar root: the relay's resource tree.
    """

    def __init__(self, root: Resource, drain: GracefulDrain):
        """
        @param root: the real root resource.
        @param drain: the L{GracefulDrain} whose C{draining} is read.
        """
        super().__init__()
        self.root = root
        self._drain = drain

    def getChildWithDefault(self, path, request):
        """
        Route to the real root, or refuse while draining.
        """
        if self._drain.draining and path != b"readyz":
            return _Refusal()  # /readyz itself answers "not ready" (R105)
        return self.root.getChildWithDefault(path, request)

    def putChild(self, path, child) -> None:
        """
        Mount C{child} on the real root.
        """
        self.root.putChild(path, child)

    def render(self, request):
        """
        The root itself (no path segment), or the refusal.
        """
        if self._drain.draining:
            return _Refusal().render(request)
        return self.root.render(request)
