"""
Issue 12: losing a rotated refresh token must be impossible. relay runs as a
child process against the emulator and is killed with SIGKILL at every step
of a proactive token refresh: before the in-flight marker is written, before
the request is sent, while the emulator holds the token request, after the
emulator answered but before the new tokens were persisted, and after they
were persisted. After a restart the emulator has counted 0 reuse attempts,
and the account either still works or is honestly C{needs_login} with the
reason C{refresh_in_doubt} (the server may have rotated a token relay never
received; relay never sends that refresh token again by itself).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList

from relay.emulator import Emulator
from tests.integration.oauthstack import emulatorConfig, oauthStats, sleep, waitFor
from tests.integration.relayproc import RelayProcess, writeConfig

ACCESS_TTL = 12
"""The first access token's lifetime, seconds; refresh is due 8 s in (margin 4 s): time
for the five relays of L{outcomes}, started at once, to be healthy before it."""

# step -> (how relay dies, whether the account must still work afterwards)
STEPS = {
    "before_mark": ("hook", True),
    "before_request": ("hook", False),
    "held_request": ("held", False),
    "after_response": ("hook", False),
    "after_persist": ("hook", True),
}


async def killMidRefresh(step):
    """
    Issue 12 kill test (see the module docstring) for one step: its own
    emulator, relay process and database.
    """
    how, works = STEPS[step]
    emulator = Emulator(reactor=reactor, config=emulatorConfig(("o1",), ttl=600))
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-kill-")
    accounts = [{
        "id": "o1", "type": "oauth", "base_url": emulator.baseURL("oauth"),
        "access_token": emulator.mintAccessToken("o1", ACCESS_TTL),
        "refresh_token": "rt-o1-0", "auth_base_url": emulator.baseURL("root"),
    }]
    path = os.path.join(tmp, "relay.yaml")
    writeConfig(path, 0, accounts)  # port filled below
    relay = RelayProcess(config=path, log=os.path.join(tmp, "relay.log"))
    writeConfig(path, relay.port, accounts,
                extra=f"database: {os.path.join(tmp, 'relay.sqlite')}\n",
                gateway="{oauth: {refresh_margin_seconds: 4}}")
    try:
        if how == "held":
            emulator.oauth.setFault("o1", {"kind": "hold", "times": 1})
            relay.start()
            await relay.waitHealthy()
            await waitFor(lambda: emulator.oauth.held, timeout=20)
            relay.kill()
            emulator.oauth.release()  # the server rotates; the answer is lost
        else:
            relay.start({"RELAY_TEST_CRASH_AT": step})
            await relay.waitHealthy()
            code = await relay.waitExit(timeout=30)
            assert code == -9, relay.tail()
        rotated = oauthStats(emulator, "o1")["refreshes"]
        assert rotated == (0 if step in ("before_mark", "before_request") else 1)

        relay.start()
        await relay.waitHealthy()
        # Past the old token's expiry and the dead holder's lock (15 s).
        deadline = reactor.seconds() + 40
        while reactor.seconds() < deadline:
            view = (await relay.accounts())["o1"]
            if view["token_status"] == "needs_login" or (
                view["token_status"] == "ok" and view["token_expires_at"]
                and view["token_expires_at"] > reactor.seconds() + 60
            ):
                break
            await sleep(0.5)
        code, body = await relay.post({"model": "gpt-5.5", "input": "after", "stream": True})
        view = (await relay.accounts())["o1"]
        stats = oauthStats(emulator, "o1")
        assert stats["reuse_attempts"] == 0, (stats, relay.tail())
        if works:
            assert code == 200 and b"response.completed" in body, (code, body, relay.tail())
            assert view["token_status"] == "ok", view
        else:
            assert view["token_status"] == "needs_login", view
            assert view["token_reason"] == "refresh_in_doubt", view
            assert view["schedulable"] is False
            assert code == 503, (code, body)
    finally:
        relay.stop()
        await emulator.stop()


@pytest_twisted.async_fixture(scope="module")
async def outcomes():
    """
    Every step's kill test run at once: each waits out the old token's expiry
    and a dead holder's lock (15 s, not configurable), so one after the other
    they took 5 x ~19 s; side by side about 20 s. Each step has its own
    emulator, relay process and database, so nothing is shared between them.

    @return: step -> C{(succeeded, result or Failure)} as L{DeferredList} gives it.
    """
    steps = list(STEPS)
    results = await DeferredList(
        [Deferred.fromCoroutine(killMidRefresh(step)) for step in steps], consumeErrors=True)
    return dict(zip(steps, results))


@pytest.mark.parametrize("step", list(STEPS))
def test_kill_mid_refresh_never_reuses(outcomes, step):
    """
    Issue 12 kill test (see the module docstring) for one step: the step's
    run (L{killMidRefresh}, in L{outcomes}) raised none of its assertions.
    """
    succeeded, result = outcomes[step]
    if not succeeded:
        result.raiseException()
