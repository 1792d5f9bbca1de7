"""
Admin key guessing against a real relay on loopback (behaviour.md R99;
L{relay.entry.adminguard}): after a few wrong keys an address is answered
429 with a growing C{Retry-After}, its key not compared (a right key
waits too); a right key after the wait resets it; the log has one
throttled warning, not a line per guess; C{/metrics} is guarded the same.
"""

from __future__ import annotations

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.logger import globalLogPublisher

from relay.entry import adminguard
from tests.integration.harness import startStack

ADMIN = "admin-guess-0123456789"


@pytest_twisted.ensureDeferred
async def test_guessing_backs_off_per_address():
    """
    Five wrong keys, then 429 with C{Retry-After: 1} (even for the right
    key and on C{/metrics}); a wrong key after the wait doubles it; the
    right key after it is served and resets; one warning, no per-request
    refusal lines.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}],
                             extra=f"admin_key: {ADMIN}\n")
    events = []
    globalLogPublisher.addObserver(events.append)
    base = f"http://127.0.0.1:{stack.port.getHost().port}"

    async def get(key, path="/admin/settings"):
        response = await treq.get(base + path, headers={"Authorization": [f"Bearer {key}"]})
        await response.content()
        return response.code, response.headers.getRawHeaders("retry-after", [None])[0]

    try:
        codes = [(await get(f"guess-{i}"))[0] for i in range(adminguard.THRESHOLD)]
        assert codes == [401] * adminguard.THRESHOLD
        code, retry = await get(ADMIN)
        assert (code, retry) == (429, "1")  # not compared while waiting
        code, retry = await get("guess-x", "/metrics")
        assert code == 429
        await deferLater(reactor, 1.05, lambda: None)
        assert (await get("guess-y"))[0] == 401
        code, retry = await get("guess-z")
        assert (code, retry) == (429, "2")
        await deferLater(reactor, 2.05, lambda: None)
        assert (await get(ADMIN))[0] == 200
        assert (await get("guess-after-reset"))[0] == 401  # reset: counting again
        warnings = [e for e in events if e.get("event") == "relay.admin_key_backoff"]
        assert len(warnings) == 1, warnings
        refused = [e for e in events if e.get("event") == "relay.intake_refused"
                   and e.get("route") in ("admin", "metrics")]
        assert refused == []
    finally:
        globalLogPublisher.removeObserver(events.append)
        await stack.stop()
