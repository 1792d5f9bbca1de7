"""
HTTPS to a direct upstream (no egress proxy) through relay's lean client
(issue 16, L{relay.upstream.httpclient}): the certificate is verified
against relay's trust root exactly as treq's Agent did. A name the
certificate covers completes, streaming and not; a name it does not
cover is a transient TLS failure that switches to the next account.
"""

from __future__ import annotations

import json

import pytest_twisted

from tests.integration.harness import sseEvents
from tests.integration.test_proxy_relay import (  # noqa: F401 (fixture)
    STREAM,
    blockedUntil,
    logs,
    named,
    startProxiedStack,
)
from tests.integration.tlsca import TestCA


@pytest_twisted.ensureDeferred
async def test_direct_tls_verifies_the_upstream(logs):  # noqa: F811
    """
    C{https://localhost:<port>/v1} (the certificate's name) serves a
    stream and a JSON turn; C{https://127.0.0.1:<port>/v1} fails
    verification before any byte is sent, and the turn fails over
    without a cooldown.
    """
    ca = TestCA.create(("localhost",))
    stack = None
    try:
        stack = await startProxiedStack(
            [{"id": "good", "credential": "sk-good", "priority": 1,
              "base_url": "https://localhost:{tls_port}/v1"}],
            tls=ca,
        )
        response, data = await stack.postJSON("/v1/responses", STREAM)
        assert response.code == 200, data
        assert sseEvents(data)[-1][0] == "response.completed"
        response, data = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "hi"})
        assert response.code == 200, data
        assert json.loads(data)["status"] == "completed"
        assert len(stack.emulator.requestsFor("sk-good")) == 2
        await stack.stop()
        stack = await startProxiedStack(
            [
                {"id": "badname", "credential": "sk-bad", "priority": 1,
                 "base_url": "https://127.0.0.1:{tls_port}/v1"},
                {"id": "good", "credential": "sk-good", "priority": 50,
                 "base_url": "https://localhost:{tls_port}/v1"},
            ],
            tls=ca,
        )
        response, data = await stack.postJSON("/v1/responses", STREAM)
        assert response.code == 200, data
        assert sseEvents(data)[-1][0] == "response.completed"
        assert stack.emulator.requestsFor("sk-bad") == []
        assert len(stack.emulator.requestsFor("sk-good")) == 1
        failed = [e for e in named(logs, "openai.ops_event") if e["account_id"] == "badname"]
        assert failed and failed[0]["kind"] == "request_error"
        assert await blockedUntil(stack, "badname") is None
    finally:
        if stack is not None:
            await stack.stop()
        ca.cleanup()
