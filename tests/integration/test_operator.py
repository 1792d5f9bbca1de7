"""
The operator surface on a real relay (issue 7): C{/admin/accounts} shows a
cooldown after a forced failure and C{clear} lifts it; C{/metrics} has the
relay's series after traffic; a live settings change applies to the next
attempt; and the outcome report, run on the JSON log of a controlled run,
prints exactly the injected failovers and waits.
"""

import io
import json

import pytest_twisted
import treq
from twisted.internet.defer import Deferred, gatherResults
from twisted.logger import globalLogPublisher, jsonFileLogObserver

from relay.console.report import buildReport, readEvents
from tests.integration.harness import closedPort, sseEvents, startStack

ADMIN = "adm-test-key-000000"


def _accounts(goodConcurrency=3):
    return [
        {"id": "dead", "credential": "sk-dead",
         "base_url": f"http://127.0.0.1:{closedPort()}/v1", "priority": 1},
        {"id": "good", "credential": "sk-good", "priority": 50, "concurrency": goodConcurrency},
    ]


async def _admin(stack, method, path, body=None, key=ADMIN):
    headers = {"Authorization": [f"Bearer {key}"]} if key else {}
    data = json.dumps(body).encode() if body is not None else None
    r = await treq.request(method, stack.url + path, data=data, headers=headers)
    return r.code, await r.content()


async def _stream(stack, text="hi"):
    r, data = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": text, "stream": True})
    return r.code, sseEvents(data)


@pytest_twisted.ensureDeferred
async def test_accounts_view_shows_cooldown_and_clear_lifts_it():
    """
    A refused account appears in C{/admin/accounts} as not schedulable with
    the transport cooldown reason (R4); C{POST …/clear} makes it
    schedulable again; unknown ids are 404; wrong keys 401.
    """
    stack = await startStack(_accounts(), extra=f"admin_key: {ADMIN}\n")
    try:
        code, events = await _stream(stack)
        assert code == 200 and events[-1][0] == "response.completed"
        code, body = await _admin(stack, "GET", "/admin/accounts")
        assert code == 200, body
        data = json.loads(body)
        rows = {r["id"]: r for r in (data["accounts"] if isinstance(data, dict) else data)}
        assert rows["dead"]["schedulable"] is False
        assert "transport" in rows["dead"]["reason"]
        assert rows["dead"]["failovers"] == 1
        assert rows["good"]["schedulable"] is True
        assert rows["good"]["turns"] == 1
        code, _ = await _admin(stack, "POST", "/admin/accounts/dead/clear")
        assert code == 200
        code, body = await _admin(stack, "GET", "/admin/accounts")
        data = json.loads(body)
        rows = {r["id"]: r for r in (data["accounts"] if isinstance(data, dict) else data)}
        assert rows["dead"]["schedulable"] is True
        code, _ = await _admin(stack, "POST", "/admin/accounts/nope/clear")
        assert code == 404
        code, _ = await _admin(stack, "GET", "/admin/accounts", key="wrong")
        assert code == 401
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_admin_disabled_without_key():
    """
    Without C{admin_key} every admin route and C{/metrics} answer 404.
    """
    stack = await startStack(_accounts())
    try:
        for path in ("/admin/accounts", "/admin/settings", "/metrics"):
            code, _ = await _admin(stack, "GET", path)
            assert code == 404, path
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_metrics_after_traffic():
    """
    C{/metrics} exposes turns by outcome, failovers by reason and upstream
    statuses after a failover.
    """
    stack = await startStack(_accounts(), extra=f"admin_key: {ADMIN}\n")
    try:
        await _stream(stack)
        code, body = await _admin(stack, "GET", "/metrics")
        assert code == 200
        text = body.decode()
        assert 'relay_turns_total{entrypoint="http",outcome="completed"} 1.0' in text
        assert "relay_failovers_total{" in text and "transport" in text
        assert 'relay_upstream_status_total{status="200"}' in text
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_live_settings_change_applies_to_next_attempt():
    """
    R74: C{PUT /admin/settings} with C{max_account_switches: 0} makes the
    very next request give up after the first failure (no switch), with
    no restart; putting it back restores failover.
    """
    stack = await startStack(_accounts(), extra=f"admin_key: {ADMIN}\n")
    try:
        code, body = await _admin(stack, "PUT", "/admin/settings", {"max_account_switches": 0})
        assert code == 200, body
        r, data = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "x"})
        assert r.code == 502
        assert stack.emulator.requestsFor("sk-good") == []
        await _admin(stack, "POST", "/admin/accounts/dead/clear")
        code, body = await _admin(stack, "PUT", "/admin/settings", {"max_account_switches": 10})
        assert code == 200
        r, data = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "x"})
        assert r.code == 200
        code, body = await _admin(stack, "PUT", "/admin/settings", {"bogus_key": 1})
        assert code == 400 and b"bogus_key" in body
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_report_matches_a_controlled_run():
    """
    The outcome report, read from the JSON log of a run with one refused
    account (1 failover, dead -> good) and three concurrent requests on a
    one-slot account (2 waits, both acquired), prints those numbers.
    """
    stream = io.StringIO()
    observer = jsonFileLogObserver(stream)
    globalLogPublisher.addObserver(observer)
    stack = await startStack(
        _accounts(goodConcurrency=1),
        emulatorConfig={"default_script": {"text": "slow answer here", "delay": 0.05, "deltas": 4}},
    )
    try:
        code, _ = await _stream(stack, "first")
        assert code == 200
        results = await gatherResults(
            [Deferred.fromCoroutine(_stream(stack, f"c{i}")) for i in range(3)]
        )
        assert [c for c, _ in results] == [200, 200, 200]
    finally:
        globalLogPublisher.removeObserver(observer)
        await stack.stop()
    report = buildReport(readEvents(io.StringIO(stream.getvalue())))
    text = json.dumps(report)
    assert report["turns"] == [
        {**report["turns"][0], "entrypoint": "http", "outcome": "completed", "count": 4,
         "statuses": {"200": 4}}
    ], text
    assert report["turns"][0]["mean_attempts"] == 1.25, text
    assert report["failovers"]["total"] == 1, text
    assert report["failovers"]["by_account"] == [{"from": "dead", "to": "good", "count": 1}], text
    assert report["failovers"]["by_reason"] == [
        {"entrypoint": "http", "reason": "transport_persistent", "count": 1}
    ], text
    [waits] = report["waits"]
    assert (waits["entrypoint"], waits["phase"], waits["total"], waits["acquired"]) == (
        "http", "request", 2, 2
    ), text
    assert waits["queue_full"] == waits["timeout"] == waits["client_gone"] == 0, text
