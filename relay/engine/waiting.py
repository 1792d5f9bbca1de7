# -*- test-case-name: tests.test_runner -*-
"""
The turn engine's waits: a slot tried at once, else waited for in its
queue (R27, R30-R33), the retry interval and same-account delay (R71,
R73), and the downstream keepalives that run through them (R24, R31,
R85).

Functions of the L{relay.engine.runner.TurnRunner} that waits: they read
its C{clock}, C{admission}, C{settings} and C{metrics}.
"""

from __future__ import annotations

from twisted.internet.task import deferLater

from relay.base import clienterrors as E
from relay.engine.cancel import ClientGone, raceCancel
from relay.engine.keepalive import StreamKeepalive
from relay.base.records import AdmissionError, ClientError, Turn, WaitPlan
from relay.scheduling.scheduler import NO_SLOT


class AdmissionFailed(Exception):
    """
    Admission refused; carries the L{ClientError} (R32).
    """

    def __init__(self, error: ClientError):
        super().__init__(error.message)
        self.error = error


async def retakeSameAccount(runner, turn, sink, account, state=None):
    """
    Retake the slot for a same-account retry, waiting per the sticky
    plan (R60, R64 step 2). A request that takes no slot (R87) retakes
    none.
    """
    if turn.request is not None and not turn.request.usesSlot:
        return NO_SLOT
    s = runner.settings.current.scheduling
    plan = WaitPlan(
        kind="account",
        id=account.id,
        max_concurrency=account.concurrency,
        timeout=s.sticky_session_wait_timeout,
        max_waiting=s.sticky_session_max_waiting,
        plan="sticky",
    )
    return await tryThenWait(runner, turn, sink, plan, "same_account_retry", state)


async def tryThenWait(runner, turn: Turn, sink, plan: WaitPlan, reason: str, state=None):
    """
    One immediate try on C{plan}'s slot, else wait on it (R27 steps 1-3).
    """
    try:
        lease = await runner.admission.tryAcquire(plan.kind, plan.id, plan.max_concurrency)
    except AdmissionError as e:
        # R35 / R101: a slot acquire error (Redis silent or down) is
        # R32's service error (503 / 1011), never an internal error.
        runner._log.warn(
            "{kind} slot acquire failed for {id}: {error}",
            event="openai.account_slot_acquire_error"
            if plan.kind == "account" else "openai.user_slot_acquire_error",
            kind=plan.kind, id=plan.id, error=str(e), request_id=turn.requestId,
        )
        raise AdmissionFailed(E.admissionError(e, plan.kind))
    if lease is not None:
        return lease
    return await wait(runner, turn, sink, plan, reason, state)


async def wait(runner, turn: Turn, sink, plan: WaitPlan, reason: str, state=None):
    """
    Wait for a slot on C{plan} (R27, R30-R33), with SSE keepalives
    (R31) and the wait events of R32.

    @raise AdmissionFailed: queue full, timeout or error (R32).
    @raise ClientGone: the client left while waiting.
    """
    ws = turn.entrypoint == "ws"
    prefix = "openai.websocket_account_wait" if ws else "openai.account_wait"
    phase = turn.phase if turn.phase != "request" else "request"
    if reason == "same_account_retry":
        phase = "same_account_retry"
    fields = dict(
        entrypoint=turn.entrypoint,
        mode=turn.wsMode,
        phase=phase,
        reason=reason,
        account_id=plan.id if plan.kind == "account" else None,
        key_name=plan.id if plan.kind == "user" else None,
        plan=plan.plan,
        request_id=turn.requestId,
    )
    runner._log.info(
        "waiting for a {plan} slot on key {key_name}"
        if plan.kind == "user" else "waiting for a {plan} slot on {account_id}",
        event=prefix + "_started", **fields,
    )
    start = runner.clock.seconds()
    keepalive = _keepalive(runner, state)
    try:
        lease = await runner.admission.acquire(plan, turn.cancel)
    except AdmissionError as e:
        outcome = "client_gone" if turn.cancel.cancelled else e.reason
        _waitFinished(runner, prefix, fields, outcome, start, 0)
        if outcome == "client_gone":
            raise ClientGone(turn.cancel.reason)
        raise AdmissionFailed(E.admissionError(e, plan.kind))
    except ClientGone:
        _waitFinished(runner, prefix, fields, "client_gone", start, 0)
        raise
    finally:
        if keepalive is not None:
            keepalive.endWait()
        if state is not None:
            state.waited += runner.clock.seconds() - start
    _waitFinished(runner, prefix, fields, "acquired", start, getattr(lease, "queuePosition", 0))
    if turn.cancel.cancelled:
        lease.release()
        raise ClientGone(turn.cancel.reason)
    return lease


def _waitFinished(runner, prefix, fields, outcome, start, position) -> None:
    """
    Log the end of a slot wait (R32) and count it: the text names the
    account, or the client key (by name) for a per-key slot.
    """
    waitMs = int((runner.clock.seconds() - start) * 1000)
    runner._log.info(
        "wait for key {key_name} finished: {outcome} after {wait_ms} ms"
        if fields["key_name"] is not None
        else "wait for {account_id} finished: {outcome} after {wait_ms} ms",
        event=prefix + "_finished",
        outcome=outcome,
        wait_ms=waitMs,
        queue_position=position,
        **fields,
    )
    if runner.metrics is not None:
        runner.metrics.waitFinished(fields["entrypoint"], outcome, waitMs / 1000.0)


def startKeepalive(runner, turn: Turn, sink) -> StreamKeepalive | None:
    """
    The turn's downstream keepalive (R24, R85): for every streaming
    turn, from now until the turn ends, an SSE comment or WebSocket
    ping after C{stream_keepalive_interval} seconds of silence.
    Non-streaming turns get none (R31).

    @return: the running L{StreamKeepalive}, or L{None}.
    """
    if not turn.stream:
        return None
    keepalive = StreamKeepalive(
        clock=runner.clock,
        send=sink.keepalive,
        interval=runner.settings.current.stream_keepalive_interval,
        requestId=turn.requestId,
    )
    watch = getattr(sink, "watchWrites", None)
    if watch is not None:
        watch(keepalive.touch)
    # A request whose key's slot was awaited before its body
    # was parsed may have had keepalives already; the silence counts
    # from the last one (R85), not from the turn's start.
    keepalive.start(since=getattr(sink, "quietSince", None))
    return keepalive


def _keepalive(runner, state) -> StreamKeepalive | None:
    """
    A wait or retry sleep begins: keepalives at least every
    C{ping_interval} seconds while it runs (R31); the caller calls
    C{endWait} on the result.
    """
    keepalive = state.keepalive if state is not None else None
    if keepalive is not None:
        keepalive.beginWait(runner.settings.current.scheduling.ping_interval)
    return keepalive


async def sleep(runner, turn: Turn, sink, seconds: float, state=None) -> None:
    """
    The retry interval / same-account delay (R71, R73): cancellable by
    the client, keepalives continue, no slot is held.
    """
    if seconds <= 0:
        return
    runner._log.info(
        "waiting {interval_ms} ms before the next attempt",
        event="openai.retry_interval_wait",
        interval_ms=int(seconds * 1000),
        request_id=turn.requestId,
    )
    keepalive = _keepalive(runner, state)
    began = runner.clock.seconds()
    try:
        await raceCancel(deferLater(runner.clock, seconds), turn.cancel)
    finally:
        if keepalive is not None:
            keepalive.endWait()
        if state is not None:
            state.waited += runner.clock.seconds() - began
