"""
Issue 22's part of the status page in a real headless Chromium, used as a
person uses it (L{tests.integration.cdp}): the request log with its
filters (type a request id or a key, press Search), one request's detail
with its attempts (click the row), usage and cost per key with the money
budget; and the keys panel: issue a key (the secret shown once, copied with
the Copy button, gone from the page once the panel is closed), disable and
enable it, edit its policy, revoke it, disable a file key; usage and cost
per key. Screenshots are kept as C{artifacts/status-requests.png},
C{artifacts/status-cost.png} and C{artifacts/keys-*.png}.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted

from tests.integration.cdp import Session
from tests.integration.harness import startStack
from tests.integration.test_status_page import ARTIFACTS, CHROMIUM

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)"
)

ADMIN = "tenants-page-key"
PINNED = {"input_tokens": 120, "cached_tokens": 100, "output_tokens": 30, "reasoning_tokens": 12}


@pytest_twisted.ensureDeferred
async def test_request_log_and_cost_page():
    """
    After a failover turn, a refused turn and served turns: the page lists
    them newest first; typing the failover turn's request id and pressing
    Search leaves that one row; clicking it shows both attempts (the 503
    on C{first} and why it was left, C{second} serving), tokens and cost;
    filtering by key narrows the list; the usage table shows each key's
    cost and the money budget spent. No secret is on the page.
    """
    keys = [{"name": "alice", "key": "sk-alice", "concurrency": 0, "daily_usd": 5.0},
            {"name": "bob", "key": "sk-bob", "concurrency": 0, "models": ["o3"]}]
    stack = await startStack(
        [{"id": "first", "credential": "sk-first", "priority": 1},
         {"id": "second", "credential": "sk-second", "priority": 2}],
        keys=json.dumps(keys), emulatorConfig={"default_script": {"usage": PINNED}},
        extra=f"admin_key: {ADMIN}\n")
    session = Session()
    try:
        stack.emulator.setFault("sk-first", {"kind": "status", "code": 503, "times": 1})
        response, _ = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "x"},
                                           key="sk-alice",
                                           headers={"X-Request-Id": ["page-client-1"]})
        assert response.code == 200
        failover = response.headers.getRawHeaders("x-request-id")[0]
        assert failover != "page-client-1"  # R111: relay's own id
        response, _ = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "x"},
                                           key="sk-bob")
        assert response.code == 403
        for _ in range(2):
            await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "x"},
                                 key="sk-alice")

        page = await session.start()
        await page.goto(stack.url + "/admin/#key=" + ADMIN)
        # Issue 40: requests, usage and keys are sections of the console.
        await page.section("requests", "requests-loaded")
        assert await page.evaluate("document.querySelectorAll('tr.request').length") == 4
        first = await page.text("#requests-body tr.request")
        assert "alice" in first and "completed 200" in first

        await page.type("#rq-request-id", failover)
        await page.click("#rq-search")
        await page.waitFor("document.querySelectorAll('tr.request').length === 1 && "
                           "document.querySelector('tr.request').dataset.requestId === %s"
                           % json.dumps(failover))
        await page.click("tr.request")
        await page.waitFor("document.body.getAttribute('data-request-detail') === %s"
                           % json.dumps(failover))
        detail = await page.text("#request-detail")
        attempts = await page.evaluate(
            "Array.from(document.querySelectorAll('#request-detail tr.attempt'))"
            ".map(function (r) { return r.innerText.split('\\t').map(function (c) {"
            " return c.trim(); }); })")
        assert [a[1:3] + a[4:] for a in attempts] == [["first", "503", "switch"],
                                                       ["second", "200", "served"]], attempts
        assert "120 in (100 cached)" in detail and "$0.00105" in detail, detail
        assert "served by\tsecond" in detail or "second" in detail
        assert "client request id" in detail and "page-client-1" in detail, detail
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await page.evaluate("document.getElementById('request-detail')"
                            ".scrollIntoView({block: 'end'})")
        await page.screenshot(ARTIFACTS / "status-requests.png")

        await page.click("#rq-reset")
        await page.waitFor("document.querySelectorAll('tr.request').length === 4")
        await page.type("#rq-client-request-id", "page-client-1")
        await page.click("#rq-search")
        await page.waitFor("document.querySelectorAll('tr.request').length === 1 && "
                           "document.querySelector('tr.request').dataset.requestId === %s"
                           % json.dumps(failover))
        await page.click("#rq-reset")
        await page.waitFor("document.querySelectorAll('tr.request').length === 4")
        await page.type("#rq-key", "bob")
        await page.click("#rq-search")
        await page.waitFor("document.querySelectorAll('tr.request').length === 1")
        refused = await page.text("tr.request")
        assert "bob" in refused and "failed 403" in refused, refused

        await page.section("usage", "usage-loaded")
        usage = await page.text('tr.usage-row[data-group="alice"]')
        assert "$0.00315" in usage, usage  # 3 turns x $0.00105
        budget = await page.text('tr.budget-row[data-key="alice"]')
        assert "$0.00315 / $5.00" in budget, budget
        await page.click("#usage-section")
        await page.evaluate("document.getElementById('usage-section').scrollIntoView()")
        await page.screenshot(ARTIFACTS / "status-cost.png")
        html = await page.evaluate("document.documentElement.outerHTML")
        for secret in ("sk-alice", "sk-bob", ADMIN):
            assert secret not in html
        assert (ARTIFACTS / "status-requests.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        await session.stop()
        await stack.stop()


def keyRow(name):
    return f'tr.key-row[data-key="{name}"]'


@pytest_twisted.ensureDeferred
async def test_keys_panel():
    """
    The keys panel as a person uses it: issue a key with a policy (the
    secret shown once; Copy puts it on the clipboard; closing the panel
    removes it from the page); the key serves and its usage and cost show
    in its row; disable refuses it (401) and enable lets it back; Edit
    changes its rpm (the next turn is a 429); Revoke, then Confirm, refuses
    it; a file key has no Edit or Revoke but can be disabled; the audit
    names each change. The issued secret is on no page, answer or log.
    """
    keys = [{"name": "bob", "key": "sk-bob-file", "concurrency": 0}]
    stack = await startStack(
        [{"id": "first", "credential": "sk-first", "priority": 1}],
        keys=json.dumps(keys), emulatorConfig={"default_script": {"usage": PINNED}},
        extra=f"admin_key: {ADMIN}\ngroups: {{staff: [first]}}\n")
    session = Session()
    answers = []

    async def turn(secret):
        response, data = await stack.postJSON("/v1/responses", {"model": "gpt-5.5",
                                                                "input": "x"}, key=secret)
        answers.append(data)
        return response.code

    try:
        page = await session.start()
        await session.grant(stack.url)
        await page.goto(stack.url + "/admin/#key=" + ADMIN)
        await page.section("keys", "keys-loaded")
        assert await page.evaluate(f"!!document.querySelector('{keyRow('bob')}')")
        assert await page.evaluate(
            f"document.querySelector('{keyRow('bob')} button.key-edit') === null && "
            f"document.querySelector('{keyRow('bob')} button.key-revoke') === null")

        await page.click("#key-issue-open")
        await page.type("#key-name", "dana")
        await page.type("#key-label", "Dana's laptop")
        await page.type("#key-models", "gpt-5.5, gpt-5.4")
        await page.type("#key-daily-usd", "2")
        await page.select("#key-group", "staff")
        await page.click("#key-submit")
        await page.waitFor("!document.getElementById('key-secret-panel').classList"
                           ".contains('hidden')")
        secret = await page.value("#key-secret")
        assert secret.startswith("sk-relay-") and len(secret) == 52, secret
        await page.focus()
        await page.click("#key-copy")
        await page.waitFor("document.getElementById('key-copy-status').innerText === 'copied'")
        assert await page.clipboard() == secret
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await page.screenshot(ARTIFACTS / "keys-issued.png")
        await page.click("#key-secret-close")
        await page.waitFor("document.getElementById('key-secret-panel').classList"
                           ".contains('hidden')")
        assert await page.value("#key-secret") == ""
        everything = ("document.documentElement.outerHTML + Array.from(document.querySelectorAll("
                      "'input, textarea')).map(function (e) { return e.value; }).join(' ')")
        assert secret not in await page.evaluate(everything)

        assert await turn(secret) == 200
        assert await turn(secret) == 200
        await page.waitFor(f"(document.querySelector('{keyRow('dana')} .usage-today') || {{}})"
                           ".innerText === 'today: 2 turns · 300 tok · $0.00210'", timeout=10)
        row = await page.text(keyRow("dana"))
        assert "admin" in row and "Dana's laptop" in row and "active" in row, row
        assert "models gpt-5.5, gpt-5.4" in row and "$2.00/day" in row, row
        assert "group staff" in row, row

        await page.click(f"{keyRow('dana')} button.key-disable")
        await page.waitFor(f"document.querySelector('{keyRow('dana')}').dataset.disabled === '1'")
        assert await turn(secret) == 401
        await page.click(f"{keyRow('dana')} button.key-enable")
        await page.waitFor(f"document.querySelector('{keyRow('dana')}').dataset.disabled === '0'")
        assert await turn(secret) == 200

        await page.click(f"{keyRow('dana')} button.key-edit")
        await page.waitFor("!document.getElementById('key-form-panel').classList"
                           ".contains('hidden')")
        assert await page.value("#key-models") == "gpt-5.5, gpt-5.4"
        await page.type("#key-rpm", "1")
        await page.click("#key-submit")
        await page.waitFor(f"document.querySelector('{keyRow('dana')} .key-policy')"
                           ".innerText.indexOf('rpm 1') >= 0")
        assert "changed: rpm" in await page.text("#keys-msg")
        assert await turn(secret) == 200
        assert await turn(secret) == 429
        await page.screenshot(ARTIFACTS / "keys-panel.png")

        await page.click(f"{keyRow('bob')} button.key-disable")
        await page.waitFor(f"document.querySelector('{keyRow('bob')}').dataset.disabled === '1'")
        assert await turn("sk-bob-file") == 401
        await page.click(f"{keyRow('bob')} button.key-enable")
        await page.waitFor(f"document.querySelector('{keyRow('bob')}').dataset.disabled === '0'")
        assert await turn("sk-bob-file") == 200

        await page.click(f"{keyRow('dana')} button.key-revoke")
        await page.waitFor(f"document.querySelector('{keyRow('dana')} button.key-revoke')"
                           ".innerText === 'Confirm revoke'")
        await page.click(f"{keyRow('dana')} button.key-revoke")
        await page.waitFor(f"document.querySelector('{keyRow('dana')}') === null")
        assert await turn(secret) == 401
        assert await page.evaluate("document.body.getAttribute('data-overflow-x')") != "1"
        await page.section("audit", "audit-loaded")
        await page.waitFor("document.querySelector('#audit-body tr[data-action=\"key.delete\"]')"
                           " !== null", timeout=10)
        actions = await page.evaluate(
            "Array.from(document.querySelectorAll('#audit-body tr.audit-row'))"
            ".map(function (r) { return r.dataset.action; })")
        assert actions[:7] == ["key.delete", "key.enable", "key.disable", "key.update",
                               "key.enable", "key.disable", "key.create"], actions
        await page.section("keys", "keys-loaded")
        await page.evaluate("document.getElementById('section-keys').scrollIntoView()")
        await page.screenshot(ARTIFACTS / "keys-revoked.png")
        assert secret not in await page.evaluate(everything)
        for raw in answers:
            assert secret.encode() not in raw
    finally:
        await session.stop()
        await stack.stop()
