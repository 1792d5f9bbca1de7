# -*- test-case-name: tests.test_requests -*-
"""
Background responses' usage (behaviour.md R88): counted once per response,
whoever sees it finished first -- the create's stream or JSON answer
(L{relay.engine.httpattempt}), a poll or a stream resume
(L{relay.engine.requests}).
"""

from __future__ import annotations

import hashlib

from twisted.logger import Logger

from relay.model import Turn

_log = Logger()


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
