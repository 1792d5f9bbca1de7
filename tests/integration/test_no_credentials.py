"""
behaviour.md R99/R100 on real sockets (issue 19): accounts whose egress
proxy URL and upstream C{base_url} carry userinfo fail (the proxy and the
upstream refuse the connection); neither the client's error (JSON and
in-stream), nor the status page's accounts view (C{last_error} included),
nor C{/metrics}, nor a log line relay writes contains the userinfo, plain
or as the base64 of C{Proxy-Authorization}.
"""

from __future__ import annotations

import base64

import pytest_twisted
import treq
from twisted.logger import globalLogPublisher

from relay.base.logs import SecretRedactor, formatTextLine
from tests.integration.harness import closedPort, startStack

ADMIN = "admin-nocreds-0123456789"
SECRETS = ("puser-name", "pw-proxy-secret", "upuser-name", "up-url-secret",
           base64.b64encode(b"puser-name:pw-proxy-secret").decode())


def assertClean(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, (secret, where)


@pytest_twisted.ensureDeferred
async def test_failing_accounts_with_userinfo_leak_nothing():
    dead = closedPort()
    accounts = [
        {"id": "a1", "credential": "sk-nocreds-a1",
         "proxy": f"http://puser-name:pw-proxy-secret@127.0.0.1:{dead}"},
        {"id": "a2", "credential": "sk-nocreds-a2",
         "base_url": f"http://upuser-name:up-url-secret@127.0.0.1:{dead}/v1"},
    ]
    lines = []
    stack = await startStack(accounts, extra=f"admin_key: {ADMIN}\n")
    from relay.configuration.parse import secretsOf

    redactor = SecretRedactor(lambda e: lines.append(formatTextLine(e)),
                              secretsOf(stack.app.config))
    globalLogPublisher.addObserver(redactor)
    try:
        for stream in (False, True):
            response, data = await stack.postJSON(
                "/v1/responses", {"model": "gpt-5.5", "input": "hi", "stream": stream})
            assert response.code >= 500 or b"response.failed" in data, data
            assertClean(data.decode("utf-8", "replace"), f"client stream={stream}")
        url = f"http://127.0.0.1:{stack.port.getHost().port}"
        bodies = {}
        for path in ("/admin/accounts", "/metrics", "/admin/metrics"):
            response = await treq.get(url + path, headers={"Authorization": [f"Bearer {ADMIN}"]})
            bodies[path] = body = (await response.content()).decode("utf-8", "replace")
            assert response.code == 200, (path, body[:200])
            assertClean(body, path)
        import json

        view = {a["id"]: a for a in json.loads(bodies["/admin/accounts"])["accounts"]}
        assert view["a1"]["last_error"] and view["a2"]["last_error"], view
        assert view["a1"]["proxy_id"]
        assert lines
        assertClean("\n".join(lines), "log")
    finally:
        globalLogPublisher.removeObserver(redactor)
        await stack.stop()
