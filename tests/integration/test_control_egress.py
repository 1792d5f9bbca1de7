"""
Issue 21, behaviour.md R97: a ChatGPT login's traffic (the device code
request, its polls, the code exchange) and a usage probe of the account it
created go through the account's egress proxy -- a real microsocks with a
password -- and never directly: every connection the emulator accepted
belongs to the proxy process.
"""

from __future__ import annotations

import json
import os

import pytest
import pytest_twisted
import treq

from tests.integration.harness import startStack
from tests.integration.oauthstack import sleep

ADMIN = "admin-control-egress"


@pytest.mark.skipif(not os.path.exists("/usr/bin/microsocks"), reason="microsocks not installed")
@pytest_twisted.ensureDeferred
async def test_login_and_probe_through_the_accounts_proxy():
    """
    R97: the device login of a new account with a SOCKS5 proxy, and its
    usage probe, reach the emulator only through that proxy.
    """
    from tests.integration.proxy_servers import startMicrosocks
    from tests.integration.test_proxy_relay import proxyURL, recordPeers

    proxy = startMicrosocks("loginuser", "loginpass")
    config = {"oauth": {"device_interval": 1},
              "accounts": [{"name": "o-proxied", "type": "oauth",
                            "chatgpt_account_id": "acct-o-proxied"}]}

    def accounts(emulator):
        return []

    stack = await startStack(accounts, emulatorConfig=config, extra=f"admin_key: {ADMIN}\n")
    emulator = stack.emulator
    peers = recordPeers(emulator, emulator.listeningPort)
    headers = {"Authorization": [f"Bearer {ADMIN}"], "Content-Type": ["application/json"]}
    try:
        body = {"flow": "device", "account": {
            "id": "o-proxied", "proxy": proxyURL(proxy), "base_url": emulator.baseURL("oauth"),
            "auth_base_url": emulator.baseURL("root")}}
        r = await treq.post(stack.url + "/admin/logins", json.dumps(body).encode(),
                            headers=headers, persistent=False)
        login = json.loads(await r.content())
        assert r.code == 201, login
        assert "loginpass" not in json.dumps(login)
        ok, message = emulator.oauth.login.approve(login["login"]["user_code"], "o-proxied")
        assert ok, message
        for _ in range(60):
            r = await treq.get(stack.url + "/admin/logins/" + login["login"]["id"],
                               headers=headers, persistent=False)
            view = json.loads(await r.content())["login"]
            if view["status"] not in ("pending", "exchanging"):
                break
            await sleep(0.1)
        assert view["status"] == "completed", view
        account = stack.app.live.accounts.byId("o-proxied")
        assert account is not None and account.proxy.host == "127.0.0.1"
        parts = stack.app.extras["controlParts"]
        snapshot = await parts.probe.probe(account)
        assert snapshot is not None and snapshot.source == "probe"
        paths = [r.path for r in emulator.requests]
        for path in ("/api/accounts/deviceauth/usercode", "/api/accounts/deviceauth/token",
                     "/oauth/token", "/backend-api/wham/usage"):
            assert path in paths, paths
        assert peers and all(owners == {proxy.process.pid} for owners in peers), peers
    finally:
        proxy.stop()
        await stack.stop()
