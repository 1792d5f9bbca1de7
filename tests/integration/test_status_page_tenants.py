"""
Issue 22's part of the status page in a real headless Chromium, used as a
person uses it (L{tests.integration.cdp_tenants}): the request log with its
filters (type a request id or a key, press Search), one request's detail
with its attempts (click the row), and usage and cost per key with the
money budget. Screenshots are kept as C{artifacts/status-requests.png} and
C{artifacts/status-cost.png}.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted

from tests.integration.cdp_tenants import Browser
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
    browser = Browser(CHROMIUM)
    try:
        stack.emulator.setFault("sk-first", {"kind": "status", "code": 503, "times": 1})
        response, _ = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "x"},
                                           key="sk-alice")
        assert response.code == 200
        failover = response.headers.getRawHeaders("x-request-id")[0]
        response, _ = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "x"},
                                           key="sk-bob")
        assert response.code == 403
        for _ in range(2):
            await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "x"},
                                 key="sk-alice")

        await browser.start()
        page = await browser.open(stack.url + "/admin/#key=" + ADMIN)
        await page.waitFor("document.body.getAttribute('data-requests-loaded') === '1'")
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
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await page.evaluate("document.getElementById('request-detail')"
                            ".scrollIntoView({block: 'end'})")
        await page.screenshot(ARTIFACTS / "status-requests.png")

        await page.click("#rq-reset")
        await page.waitFor("document.querySelectorAll('tr.request').length === 4")
        await page.type("#rq-key", "bob")
        await page.click("#rq-search")
        await page.waitFor("document.querySelectorAll('tr.request').length === 1")
        refused = await page.text("tr.request")
        assert "bob" in refused and "failed 403" in refused, refused

        await page.waitFor("document.body.getAttribute('data-usage-loaded') === '1'")
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
        await browser.stop()
        await stack.stop()
