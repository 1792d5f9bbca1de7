"""
Client cancellation through a real relay to the emulator on loopback
(behaviour.md R2, R19 step 1, R71): when the client goes while relay waits
for headers, holds output back, or sleeps the retry interval, relay stops
at once: no cooldown or health state is written, the account slot is free,
and no further upstream attempt is made.
"""

from __future__ import annotations

import pytest
import pytest_twisted
from attrs import evolve
from twisted.internet import reactor
from twisted.internet.defer import CancelledError
from twisted.internet.task import deferLater
from twisted.logger import globalLogPublisher
from twisted.web._newclient import ResponseNeverReceived

from tests.integration.harness import startStack

BAD = "cred-bad"
GOOD = "cred-good"


def _accounts(kind="apikey"):
    return [
        {"id": "bad", "type": kind, "credential": BAD, "priority": 1},
        {"id": "good", "type": kind, "credential": GOOD, "priority": 50},
    ]


async def _until(predicate, timeout=2.0):
    """
    Poll the real reactor until C{predicate()} is true.
    """
    waited = 0.0
    while not predicate():
        if waited > timeout:
            raise AssertionError("condition not reached")
        await deferLater(reactor, 0.02, lambda: None)
        waited += 0.02


class _Events:
    """
    Collects relay log events by name while a test runs.
    """

    def __init__(self):
        self.events = []

    def __call__(self, event):
        if "event" in event:
            self.events.append(event)

    def named(self, name):
        return [e for e in self.events if e.get("event") == name]


async def _cancelScenario(stack, stream, cancelWhen, settle, switched=False):
    """
    Send a request, cancel it once C{cancelWhen()} holds, wait C{settle}
    seconds, and check R2's promises.
    """
    log = _Events()
    globalLogPublisher.addObserver(log)
    try:
        d = stack.post("/v1/responses", {"model": "gpt-5.5", "input": "hi", "stream": stream})
        await _until(cancelWhen)
        d.cancel()
        with pytest.raises((CancelledError, ResponseNeverReceived)):
            await d
        await _until(lambda: log.named("relay.turn_finished"))
        await deferLater(reactor, settle, lambda: None)
    finally:
        globalLogPublisher.removeObserver(log)
    finished = log.named("relay.turn_finished")
    assert [e["outcome"] for e in finished] == ["client_gone"]
    assert finished[0]["status"] == 499
    # No switch, no cooldown, no health state (R2).
    assert len(log.named("openai.upstream_failover_switching")) == (1 if switched else 0)
    assert log.named("openai.account_temp_unscheduled_transport") == []
    assert log.named("relay.account_cooldown_set") == []
    assert stack.emulator.requestsFor(GOOD) == []
    states = await stack.app.store.getAccountStates(["bad", "good"])
    for state in states.values():
        assert state.blockedUntil == 0 and not state.disabled
        assert state.rateLimitedUntil == 0 and state.overloadedUntil == 0
    assert stack.app.health.localBlock("bad") is None
    load = await stack.app.admission.load("account", ["bad", "good"])
    assert load == {"bad": (0, 0), "good": (0, 0)}
    return log


@pytest.mark.parametrize("stream", [False, True])
@pytest_twisted.ensureDeferred
async def test_client_gone_waiting_for_headers(stream):
    """
    R2: the client leaves while upstream hangs before its headers; relay
    drops the attempt, marks nothing, frees the slot and tries no other
    account (the header timeout would otherwise switch after 0.5 s).
    """
    stack = await startStack(_accounts())
    try:
        s = stack.app.settings.current
        stack.app.settings.current = evolve(
            s, upstream=evolve(s.upstream, connect_timeout_seconds=0.3, header_timeout_seconds=0.3)
        )
        stack.emulator.setFault(BAD, {"kind": "hang_before_headers"})
        await _cancelScenario(
            stack, stream, lambda: stack.emulator.requestsFor(BAD), settle=0.9
        )
        assert len(stack.emulator.requestsFor(BAD)) == 1
    finally:
        await stack.stop()


@pytest.mark.parametrize("kind", ["apikey", "oauth"])
@pytest_twisted.ensureDeferred
async def test_client_gone_while_output_held_back(kind):
    """
    R2, R22: the client leaves while relay holds back the first events
    (upstream delays its first output); the upstream stream is dropped and
    nothing is written about the account, even with a stream idle timeout
    that would have failed over.
    """
    stack = await startStack(_accounts(kind))
    try:
        s = stack.app.settings.current
        stack.app.settings.current = evolve(
            s, upstream=evolve(s.upstream, stream_idle_timeout_seconds=0.4)
        )
        stack.emulator.setFault(BAD, {"kind": "delay_first_output", "seconds": 5})
        await _cancelScenario(
            stack, True, lambda: stack.emulator.state.inflight(BAD) > 0, settle=0.7
        )
        assert len(stack.emulator.requestsFor(BAD)) == 1
        await _until(lambda: stack.emulator.state.inflight(BAD) == 0)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_client_gone_during_retry_interval():
    """
    R71: the client leaves during C{retry_interval_ms}; the wait stops at
    once and no further attempt is made. The failed attempt itself was a
    transient reset (no cooldown, R4).
    """
    stack = await startStack(_accounts())
    try:
        stack.app.settings.current = evolve(stack.app.settings.current, retry_interval_ms=1000)
        stack.emulator.setFault(BAD, {"kind": "reset_before_headers"})
        log = _Events()
        globalLogPublisher.addObserver(log)
        try:
            await _cancelScenario(
                stack,
                True,
                lambda: log.named("openai.retry_interval_wait"),
                settle=1.2,
                switched=True,
            )
        finally:
            globalLogPublisher.removeObserver(log)
        waits = log.named("openai.retry_interval_wait")
        assert [w["interval_ms"] for w in waits] == [1000]
        assert len(stack.emulator.requestsFor(BAD)) == 1
    finally:
        await stack.stop()
