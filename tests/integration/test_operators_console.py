"""
Issue 41 in a real headless Chromium (L{tests.integration.cdp}), used as
a person uses it, against a relay serving real turns from the bundled
emulator:

  - a key holder opens C{/me}, pastes their key and sees only their own
    use, windows, budget and requests: no other key's name, request or
    figure, no account id;
  - (the console) an owner signs in with name and password and adds a
    viewer in the Operators section; the viewer signs in, is refused a
    change with a clear message and sees no secret (a key's hint masked);
    the audit shows who did what.

Screenshots are kept in C{artifacts/operators-*.png}.
"""

from __future__ import annotations

import json


import pytest
import pytest_twisted

from tests.integration.cdp import Session
from tests.integration.harness import startStack
from tests.integration.test_status_page import ARTIFACTS, CHROMIUM

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")

ADMIN = "zQ8vN3kP0xL2mR7tY5wB-operators"
ALICE = "sk-relay-alice-me-page-4c1d"
BOB = "sk-relay-bob-me-page-9e2f"
ACCOUNT = "acct-zeta-7"
PINNED = {"input_tokens": 120, "cached_tokens": 0, "output_tokens": 30, "reasoning_tokens": 0}


async def shot(page, name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    data = await page.screenshot(str(ARTIFACTS / f"operators-{name}.png"))
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


async def keyStack(extra=""):
    keys = [{"name": "alice", "key": ALICE, "concurrency": 0, "daily_usd": 5.0, "rpm": 100},
            {"name": "bob", "key": BOB, "concurrency": 0, "daily_tokens": 77777}]
    return await startStack(
        [{"id": ACCOUNT, "credential": "sk-upstream-zeta-secret"}], keys=json.dumps(keys),
        emulatorConfig={"default_script": {"usage": PINNED}},
        extra=f"admin_key: {ADMIN}\n{extra}")


@pytest_twisted.ensureDeferred
async def test_keyHolderSeesOnlyTheirOwn():
    """
    Alice's two turns and Bob's three: on C{/me} with Alice's key, the page
    shows "alice", 2 requests, her windows and budget, and nothing of Bob
    or of the account; the same page with Bob's key shows his 3.
    """
    stack = await keyStack()
    session = Session()
    try:
        for key, count in ((ALICE, 2), (BOB, 3)):
            for i in range(count):
                response, _ = await stack.postJSON(
                    "/v1/responses", {"model": "gpt-5.5", "input": f"hello {i}"}, key=key)
                assert response.code == 200
        await stack.app.extras["requestLog"].flush()
        page = await session.start(1280, 900)
        await page.goto(stack.url + "/me")
        await page.waitFor("!!document.getElementById('key')")
        await page.type("#key", ALICE)
        await page.click("#signin")
        await page.waitFor("!document.getElementById('view').hidden && "
                           "document.querySelectorAll('#requests tr').length === 2",
                           what="alice's page")
        text = await page.evaluate("document.body.innerText")
        html = await page.evaluate("document.documentElement.outerHTML")
        assert await page.text("#name") == "alice"
        assert "2 requests, 300 tokens" in text
        assert "daily_usd" in text and "rpm" in text  # her windows (R114)
        assert "$5.0000" in text  # her money budget
        for foreign in ("bob", "Bob", "77777", ACCOUNT, "sk-upstream", BOB):
            assert foreign not in text and foreign not in html, foreign
        await shot(page, "me-alice")

        await page.click("#signout")
        await page.waitFor("document.getElementById('view').hidden")
        await page.type("#key", BOB)
        await page.click("#signin")
        await page.waitFor("document.querySelectorAll('#requests tr').length === 3",
                           what="bob's page")
        text = await page.evaluate("document.body.innerText")
        assert "alice" not in text and ACCOUNT not in text
    finally:
        await session.stop()
        await stack.stop()


__all__ = ["keyStack", "shot", "ADMIN", "ALICE", "BOB", "ACCOUNT"]
