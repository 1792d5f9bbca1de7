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


ANA_PASSWORD = "ana-owner-password-1"
VIC_PASSWORD = "vic-viewer-password-1"


async def signIn(page, url, name, password):
    await page.goto(url + "/admin/")
    await page.waitFor("!document.getElementById('login').classList.contains('hidden')",
                       what="the sign-in form")
    await page.type("#signin-name", name)
    await page.type("#signin-password", password)
    await page.click("#login-form button[type=submit]")
    await page.waitFor("!document.getElementById('dashboard').classList.contains('hidden')",
                       what=f"{name} signed in")


async def section(page, name, loaded):
    await page.click(f"#nav-{name}")
    await page.waitFor(f"document.body.getAttribute('data-{loaded}-loaded') === '1'",
                       what=f"the {name} section")


@pytest_twisted.ensureDeferred
async def test_ownerAddsViewerWhoIsRefusedAndSeesNoSecret(monkeypatch):
    """
    Ana (owner) signs in with her password and adds Vic as a viewer in the
    Operators section; Vic signs in, saving a setting is refused with a
    message saying a viewer changes nothing, and the keys section shows
    a key's hint masked (the secret and hint nowhere on the page); the
    audit, read by Ana, names who did what.
    """
    from relay.operators.passwords import hashPassword

    monkeypatch.setenv("RELAY_OP_ANA", hashPassword(ANA_PASSWORD))
    stack = await keyStack(
        "operators:\n  - {name: ana, role: owner, password_hash_env: RELAY_OP_ANA}\n")
    session = Session()
    try:
        import treq

        r = await treq.post(stack.url + "/admin/keys", json.dumps({"name": "carol"}).encode(),
                            headers={"Authorization": [f"Bearer {ADMIN}"],
                                     "Content-Type": ["application/json"]}, persistent=False)
        issued = json.loads(await r.content())
        secret = issued["secret"]
        hint = [k for k in json.loads(await (await treq.get(
            stack.url + "/admin/keys", headers={"Authorization": [f"Bearer {ADMIN}"]},
            persistent=False)).content())["keys"] if k["name"] == "carol"][0]["hint"]
        assert hint and secret

        page = await session.start(1280, 900)
        await signIn(page, stack.url, "ana", ANA_PASSWORD)
        await section(page, "operators", "operators")
        assert "Signed in as ana (owner)" in await page.text("#op-me")
        await page.type("#op-name", "vic")
        await page.select("#op-new-role", "viewer")
        await page.type("#op-password", VIC_PASSWORD)
        await page.click("#op-add-submit")
        await page.waitFor("!!document.querySelector('tr.operator-row[data-operator=vic]')",
                           what="vic in the list")
        assert "vic added as viewer" in await page.text("#op-msg")
        await shot(page, "owner-added-viewer")
        await page.click("#logout")
        await page.waitFor("!document.getElementById('login').classList.contains('hidden')")

        await signIn(page, stack.url, "vic", VIC_PASSWORD)
        await section(page, "settings", "settings")
        await page.type("#setting-retry-interval-ms", "250")
        await page.click("#settings-save")
        await page.waitFor("document.getElementById('settings-msg').textContent.indexOf("
                           "'viewer') >= 0", what="the refusal")
        refusal = await page.text("#settings-msg")
        assert "viewers read and change nothing" in refusal
        await shot(page, "viewer-refused")
        await section(page, "keys", "keys")
        row = await page.text("tr.key-row[data-key=carol]")
        assert "***" in row
        html = await page.evaluate("document.documentElement.outerHTML")
        assert hint not in html and secret not in html
        await shot(page, "viewer-no-secret")
        await section(page, "operators", "operators")
        assert await page.evaluate(
            "document.getElementById('op-add').classList.contains('hidden')")
        await page.click("#logout")
        await page.waitFor("!document.getElementById('login').classList.contains('hidden')")

        await signIn(page, stack.url, "ana", ANA_PASSWORD)
        await section(page, "audit", "audit")
        audit = await page.evaluate(
            "Array.from(document.querySelectorAll('tr.audit-row')).map(r => r.innerText)")
        joined = "\n".join(audit)
        assert any("operator.create" in a and "ana" in a and "vic" in a for a in audit), joined
        assert any("operator.signin" in a and "vic" in a for a in audit), joined
        assert any("key.create" in a and "admin-key" in a for a in audit), joined
        await shot(page, "audit-who")
    finally:
        await session.stop()
        await stack.stop()
