"""
HTTP slot admission through the real relay (issue 4, behaviour.md R26-R33):
waiting with SSE keepalives, queue full and wait timeout with relay's own
429 codes, the error in-stream once keepalives began, the per-key slot,
and a client leaving mid-wait.
"""

import json

import attrs
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.task import deferLater

from tests.integration.harness import RELAY_KEY, sseEvents, startStack

SLOW = {"default_script": {"text": "a slow answer", "delay": 0.1, "deltas": 6}}


def _tune(stack, **scheduling):
    """
    Change the live scheduling settings (R74: read on every attempt).
    """
    current = stack.app.settings.current
    stack.app.settings.current = attrs.evolve(
        current, scheduling=attrs.evolve(current.scheduling, **scheduling)
    )


async def _post(stack, text, stream=True, key=RELAY_KEY):
    response, data = await stack.postJSON(
        "/v1/responses", {"model": "gpt-5.5", "input": text, "stream": stream}, key=key
    )
    return response.code, data


@pytest_twisted.ensureDeferred
async def test_full_account_waits_with_keepalives_then_completes():
    """
    R27/R31: a turn that finds the only slot busy waits for it, gets SSE
    keepalive comments while waiting, and then completes on that account.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-adm-a1", "concurrency": 1}],
                             emulatorConfig=SLOW)
    try:
        _tune(stack, ping_interval=0.1)
        results = await gatherResults(
            [Deferred.fromCoroutine(_post(stack, f"q{i}")) for i in range(2)]
        )
        assert [code for code, _ in results] == [200, 200]
        waited = [data for _, data in results if data.startswith(b":\n\n")]
        assert len(waited) == 1
        assert sseEvents(waited[0])[-1][0] == "response.completed"
        assert stack.emulator.peak("sk-adm-a1") == 1
        assert (await stack.app.admission.load("account", ["a1"]))["a1"] == (0, 0)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_queue_full_and_wait_timeout_are_relays_own_429s():
    """
    R32: a full queue answers 429 C{rate_limit_error} "Too many pending
    requests, please retry later" (code C{relay_queue_full}); a wait that
    times out answers 429 "Concurrency limit exceeded for account, please
    retry later" (code C{relay_wait_timeout}) -- distinguishable from an
    upstream 429. Nothing extra reaches upstream.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-adm-a1", "concurrency": 1}],
                             emulatorConfig={"default_script": {"text": "slow", "delay": 0.3, "deltas": 4}})
    try:
        _tune(stack, fallback_wait_timeout=0.3, fallback_max_waiting=1, ping_interval=30)
        results = await gatherResults(
            [Deferred.fromCoroutine(_post(stack, f"q{i}")) for i in range(3)]
        )
        codes = sorted(code for code, _ in results)
        assert codes == [200, 429, 429], results
        errors = sorted(json.loads(data)["error"]["code"] for code, data in results if code == 429)
        assert errors == ["relay_queue_full", "relay_wait_timeout"]
        messages = {json.loads(d)["error"]["code"]: json.loads(d)["error"]["message"]
                    for c, d in results if c == 429}
        assert messages["relay_queue_full"] == "Too many pending requests, please retry later"
        assert messages["relay_wait_timeout"] == (
            "Concurrency limit exceeded for account, please retry later"
        )
        assert len(stack.emulator.requestsFor("sk-adm-a1")) == 1
        assert (await stack.app.admission.load("account", ["a1"]))["a1"] == (0, 0)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_timeout_after_keepalives_is_in_stream():
    """
    R31/R17: once a keepalive committed the SSE headers, a wait timeout
    arrives in-stream as a terminal C{response.failed} with code
    C{rate_limit_exceeded} (and the turn's C{request_id}, issue 15), not as
    an HTTP 429.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-adm-a1", "concurrency": 1}],
                             emulatorConfig={"default_script": {"text": "slow", "delay": 0.3, "deltas": 4}})
    try:
        _tune(stack, fallback_wait_timeout=0.5, ping_interval=0.1)
        results = await gatherResults(
            [Deferred.fromCoroutine(_post(stack, f"q{i}")) for i in range(2)]
        )
        assert [code for code, _ in results] == [200, 200]
        failed = [sseEvents(d) for _, d in results if d.startswith(b":\n\n")]
        assert len(failed) == 1
        kind, event = failed[0][-1]
        assert kind == "response.failed"
        error = event["response"]["error"]
        assert error.pop("request_id").startswith("req_")  # issue 15
        assert error == {
            "code": "rate_limit_exceeded",
            "message": "Concurrency limit exceeded for account, please retry later",
        }
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_per_key_slot_waits_and_times_out():
    """
    R26: the per-key slot (C{keys[].concurrency}) makes a second request of
    the same key wait; when the wait times out the client gets 429
    "Concurrency limit exceeded for user, please retry later".
    """
    keys = json.dumps([{"name": "small", "key": "sk-relay-small", "concurrency": 1}])
    stack = await startStack([{"id": "a1", "credential": "sk-adm-a1", "concurrency": 5}],
                             emulatorConfig={"default_script": {"text": "slow", "delay": 0.3, "deltas": 4}},
                             keys=keys)
    try:
        _tune(stack, user_wait_timeout=0.3, ping_interval=30)
        results = await gatherResults(
            [Deferred.fromCoroutine(_post(stack, f"q{i}", key="sk-relay-small"))
             for i in range(2)]
        )
        assert sorted(code for code, _ in results) == [200, 429]
        [error] = [json.loads(d)["error"] for c, d in results if c == 429]
        assert error["message"] == "Concurrency limit exceeded for user, please retry later"
        assert error["code"] == "relay_wait_timeout"
        assert (await stack.app.admission.load("user", ["small"]))["small"] == (0, 0)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_client_leaving_mid_wait_frees_its_place():
    """
    R2/R33: a client that leaves while waiting for a slot leaves the wait
    queue (count back to 0), never reaches upstream, and writes no cooldown.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-adm-a1", "concurrency": 1}],
                             emulatorConfig={"default_script": {"text": "slow", "delay": 0.2, "deltas": 5}})
    try:
        first = Deferred.fromCoroutine(_post(stack, "holder"))
        await deferLater(reactor, 0.2, lambda: None)
        body = json.dumps({"model": "gpt-5.5", "input": "leaver", "stream": True}).encode()
        waiting = treq.post(
            stack.url + "/v1/responses", body,
            headers={"Authorization": [f"Bearer {RELAY_KEY}"]}, unbuffered=True,
        )
        await deferLater(reactor, 0.2, lambda: None)
        assert (await stack.app.admission.load("account", ["a1"]))["a1"] == (1, 1)
        waiting.cancel()
        waiting.addErrback(lambda f: None)
        await deferLater(reactor, 0.2, lambda: None)
        assert (await stack.app.admission.load("account", ["a1"]))["a1"][1] == 0
        code, _ = await first
        assert code == 200
        assert len(stack.emulator.requestsFor("sk-adm-a1")) == 1
        states = await stack.app.store.getAccountStates(["a1"])
        assert states["a1"].unschedulable(reactor.seconds()) is None
    finally:
        await stack.stop()
