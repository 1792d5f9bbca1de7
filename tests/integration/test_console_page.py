"""
The console (issue 40) as a person uses it, in headless Chromium at
1280 px over the DevTools protocol (L{tests.integration.cdp}): its
sections (Overview, Accounts, Keys, Requests, Usage & cost, Settings,
Audit) opened from the bar at the top; search, filter, sort and CSV of a
table; a bulk action with its confirmation kept across re-renders;
charts (the vendored uPlot) with real data after traffic; a failing
account shown as failing, never "ok"; settings, groups and prices changed
in the page; explain in the page; the test action; a key's budget as
progress with what is left.

The relay is real (in this process, on loopback) over the bundled
emulator. Screenshots are kept in C{artifacts/console-*.png}.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq

from tests.integration.cdp import CHROMIUM, Session
from tests.integration.harness import closedPort, sseEvents, startStack
from tests.integration.test_status_page import ARTIFACTS

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")

ADMIN = "console-page-admin-key-0123"

KEYS = json.dumps([
    {"name": "alice", "key": "sk-alice-console-0001", "daily_usd": 0.001},
    {"name": "bob", "key": "sk-bob-console-0002"},
])


async def _stack():
    """
    A relay with a refusing account (priority 1: every turn tries it first
    and fails over) and two good ones; a few turns of each key.
    """
    stack = await startStack(
        [
            {"id": "acct-down", "credential": "sk-down",
             "base_url": f"http://127.0.0.1:{closedPort()}/v1", "priority": 1},
            {"id": "acct-a", "credential": "sk-a", "priority": 50},
            {"id": "acct-b", "credential": "sk-b", "priority": 50},
        ],
        keys=KEYS, extra=f"admin_key: {ADMIN}\n",
    )
    for n, key in enumerate(["sk-alice-console-0001", "sk-bob-console-0002",
                             "sk-bob-console-0002"]):
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": f"turn {n}", "stream": True},
            key=key)
        assert response.code == 200 and sseEvents(data)[-1][0] == "response.completed", data
    return stack


async def _admin(stack, method, path, body=None):
    r = await treq.request(method, stack.url + "/admin/" + path,
                           data=json.dumps(body).encode() if body is not None else None,
                           headers={"Authorization": [f"Bearer {ADMIN}"],
                                    "Content-Type": ["application/json"]}, persistent=False)
    raw = await r.content()
    return r.code, json.loads(raw) if raw else None


async def _shot(page, name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    data = await page.screenshot(str(ARTIFACTS / f"console-{name}.png"))
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


@pytest_twisted.ensureDeferred
async def test_every_section_opens_with_its_data():
    """
    Each section of the bar opens and shows what the relay holds, without
    a script error; a screenshot of each is kept.
    """
    stack = await _stack()
    session = Session()
    try:
        page = await session.start(1280, 900)
        await page.goto(stack.url + "/admin/#key=" + ADMIN)
        await page.waitFor("document.body.getAttribute('data-overview-loaded') === '1'")
        assert ADMIN not in await page.url()
        await _shot(page, "overview")
        for name, loaded in [("accounts", "manage-loaded"), ("keys", "keys-loaded"),
                             ("requests", "requests-loaded"), ("usage", "usage-loaded"),
                             ("settings", "settings-loaded"), ("audit", "audit-loaded")]:
            await page.section(name, loaded)
            await _shot(page, name)
        assert page.exceptions() == []
    finally:
        await session.stop()
        await stack.stop()
