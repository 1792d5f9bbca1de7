"""
Banked rate-limit resets end to end against the emulator (protocol.md
7.3a): the account view shows a login's banked resets, an operator redeems
one with C{POST /admin/accounts/{id}/redeem-reset} (audited), and the
redeem lifts the account's usage-limit cooldown so it serves again.
"""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import reactor

from tests.integration.harness import RELAY_KEY
from tests.integration.oauthstack import emulatorConfig, oauthAccount
from tests.integration.test_oauth_refresh import ADMIN, accountsView, oauthStack, streamTurn

async def admin(stack, method, path):
    r = await treq.request(method, stack.url + "/admin/" + path, data=b"{}",
                           headers={"Authorization": [f"Bearer {ADMIN}"],
                                    "Content-Type": ["application/json"]}, persistent=False)
    return r.code, json.loads(await r.content())


@pytest_twisted.ensureDeferred
async def test_operator_redeems_a_banked_reset():
    """
    The only account is spent (R12's cooldown until its window resets);
    the accounts view shows its 2 banked resets; the operator redeems one:
    the emulator's windows restart at 0 %, 1 reset is left, the audit names
    the change, and the next turn is served at once.
    """
    config = emulatorConfig(("o1",), usage={"primary_used_percent": 100,
                                            "secondary_used_percent": 30, "reset_credits": 2})
    stack = await oauthStack(lambda e: [oauthAccount(e, "o1")], config=config)
    try:
        # What R12 writes for a spent window: a cooldown until its reset.
        await stack.app.store.markAccount("o1", "rate_limited", reactor.seconds() + 3600,
                                          "usage_limit_reached")
        code, events = await streamTurn(stack)
        assert code != 200, events  # the only account cannot serve
        parts = stack.app.extras["controlParts"]
        await parts.resets.list("o1")
        view = await accountsView(stack)
        assert view["o1"]["banked_resets"] == 2
        assert not view["o1"]["schedulable"]

        code, body = await admin(stack, "POST", "accounts/o1/redeem-reset")
        assert code == 200, body
        assert body == {"account": "o1", "code": "reset", "windows_reset": 2, "available": 1}
        wham = stack.emulator.oauth.wham("oauth:o1")
        assert wham["rate_limit"]["primary_window"]["used_percent"] == 0
        assert wham["rate_limit_reset_credits"] == {"available_count": 1}
        view = await accountsView(stack)
        assert view["o1"]["schedulable"], view["o1"]
        assert view["o1"]["banked_resets"] == 1

        code, events = await streamTurn(stack)
        assert code == 200 and events[-1][0] == "response.completed", events

        code, audit = await admin(stack, "GET", "audit?limit=10")
        records = [r for r in audit["audit"] if r["action"] == "account.redeem-reset"]
        assert records and records[0]["account"] == "o1", audit
        assert records[0]["status"] == 200

        code, body = await admin(stack, "POST", "accounts/nope/redeem-reset")
        assert code == 404, body
        r = await treq.post(stack.url + "/admin/accounts/o1/redeem-reset", data=b"{}",
                            headers={"Authorization": [f"Bearer {RELAY_KEY}"]},
                            persistent=False)
        assert r.code == 401
        await r.content()
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_relay_redeems_by_itself_when_the_pool_is_spent():
    """
    C{auto_redeem_resets: true} on one of two accounts: once both are
    spent, relay's own tick asks for its banked resets and redeems one;
    the account serves again without an operator. Its neighbour without
    the option keeps its credit.
    """
    config = emulatorConfig(("o1", "o2"), usage={"primary_used_percent": 100,
                                                  "reset_credits": 1})
    stack = await oauthStack(lambda e: [oauthAccount(e, "o1", auto_redeem_resets=True),
                                        oauthAccount(e, "o2")], config=config,
                             names=("o1", "o2"))
    try:
        for name in ("o1", "o2"):
            await stack.app.store.markAccount(name, "rate_limited", reactor.seconds() + 3600,
                                              "usage_limit_reached")
        # The control service runs this every 5 s (the harness starts no
        # services): one tick.
        await stack.app.extras["controlParts"].resets.tick()
        assert stack.emulator.oauth.wham("oauth:o1")["rate_limit_reset_credits"] == {
            "available_count": 0}
        assert stack.emulator.oauth.wham("oauth:o2")["rate_limit_reset_credits"] == {
            "available_count": 1}
        view = await accountsView(stack)
        assert view["o1"]["schedulable"] and not view["o2"]["schedulable"], view
        code, events = await streamTurn(stack)
        assert code == 200 and events[-1][0] == "response.completed", events
    finally:
        await stack.stop()
