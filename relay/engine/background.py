# -*- test-case-name: tests.test_requests -*-
"""
Background responses' usage (behaviour.md R88, R107): counted once per
response, whoever sees it finished first -- the create's stream or JSON
answer (L{relay.engine.httpattempt}), a poll or a stream resume
(L{relay.engine.requests}), or relay itself (L{watchBackground}) when no
client stayed to see it finish.
"""

from __future__ import annotations

import hashlib
from urllib.parse import quote

from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.logger import Logger

from relay.wire.jsoncodec import loads
from relay.base.records import Turn

_log = Logger()

WATCH_FIRST_SECONDS = 5.0
"""R107: the first look at an unfinished background response, seconds after
its create ended."""

WATCH_MAX_SECONDS = 60.0
"""R107: looks at an unfinished background response back off (doubling) to
this interval, seconds."""

_UNFINISHED = frozenset({"queued", "in_progress"})


def countBackgroundOnce(runner, turn: Turn, account, response: dict, counts) -> None:
    """
    R88: a background response's usage is counted once, by whichever of
    its create stream, a poll or a stream resume sees it finished first
    (across processes: an atomic counter in the state store). A stored
    response that is not a background one was counted when it was created.

    @param response: the response object carrying C{usage}.
    """
    responseId = response.get("id")
    if response.get("background") is not True or not isinstance(responseId, str):
        return
    digest = hashlib.sha256(responseId.encode("utf-8")).hexdigest()
    ttl = runner.settings.current.scheduling.previous_response_ttl_seconds
    d = runner.scheduler.claimOnce(f"openai:background-usage:{digest}", ttl)

    def counted(first):
        if first:
            runner.recordUsage(turn, account, counts)

    d.addCallback(counted)
    d.addErrback(lambda f: _log.failure("counting background usage failed", f,
                                        request_id=turn.requestId))


def watchBackground(runner, turn: Turn, account, responseId: str) -> Deferred:
    """
    R107, R88: a background create ended before its response finished (a
    non-streaming create answers C{queued}; a streaming client left before
    the end, or its drain stopped): relay looks at the response on its
    owner account until it finished -- after L{WATCH_FIRST_SECONDS}, then
    doubling to L{WATCH_MAX_SECONDS}, for at most
    C{scheduling.previous_response_ttl_seconds} -- and counts its usage
    through L{countBackgroundOnce}, so it is counted once whether a client
    polls it, polls it twice, or never. The looks are C{GET
    /responses/{id}} with the account's own credential; they write no
    account state (what they meet is no fault of the account: R2) and a
    404 ends them.

    @param turn: the create's L{Turn} (its key is charged).
    @param account: the account that owns the response.
    @param responseId: the response id.
    @return: a Deferred firing with L{None} when the watch ends; it never
        fails.
    """
    d = Deferred.fromCoroutine(_watch(runner, turn, account, responseId))
    d.addErrback(lambda f: _log.failure("watching background response {response_id} failed",
                                        f, response_id=responseId, request_id=turn.requestId))
    return d


async def _watch(runner, turn: Turn, account, responseId: str) -> None:
    from relay.engine.upstreambody import JSON_BODY_LIMIT, readBody

    clock = runner.clock
    deadline = clock.seconds() + runner.settings.current.scheduling.previous_response_ttl_seconds
    delay = WATCH_FIRST_SECONDS
    path = "/responses/" + quote(responseId, safe="")
    while clock.seconds() + delay <= deadline:
        await deferLater(clock, delay, lambda: None)
        delay = min(delay * 2, WATCH_MAX_SECONDS)
        s = runner.settings.current
        try:
            current = runner.credentials.current(account) if runner.credentials else account
            response = await runner.dialer.request(
                current, b"GET", path, None, {"accept": "application/json"}, s.upstream)
            body = await readBody(response, JSON_BODY_LIMIT,
                                  s.upstream.stream_idle_timeout_seconds, clock)
        except Exception:  # noqa: BLE001 - a transport failure: look again later
            continue
        if response.code == 404:
            return
        if response.code >= 300:
            continue
        try:
            parsed = loads(body)
        except ValueError:
            continue
        if not isinstance(parsed, dict) or parsed.get("status") in _UNFINISHED:
            continue
        from relay.usage.tokens import fromBody

        counts = fromBody(parsed)
        if counts is not None:
            countBackgroundOnce(runner, turn, account, dict(parsed, background=True), counts)
        return
