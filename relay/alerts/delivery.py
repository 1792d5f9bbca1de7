# -*- test-case-name: tests.test_alerts -*-
"""
Webhook bodies and their delivery (docs/operating.md "Alerts").

Bodies: relay's plain JSON object (L{plainBody}) or, for a target with
C{slack: true}, Slack's incoming-webhook shape C{{"text": ...}}
(L{slackBody}).

L{WebhookSender} POSTs a body to a target on the reactor with treq over
one persistent connection pool, never on a turn's path. A try that fails
(no connection, a timeout, a 408, 429 or 5xx answer) is tried again after
1, 2, 4, 8... seconds (at most 60) until C{attempts} tries were made; any
other 4xx is not retried. A target's URL is a secret (it often carries a
token): logs and metrics name it by its label (C{webhooks[i] (host)}).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from attrs import define, field
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from zope.interface import implementer

from relay.alerts.book import FIRING, Notice
from relay.interfaces import IWebhookPoster

RETRY_BASE_SECONDS = 1.0
RETRY_MAX_SECONDS = 60.0
_RETRIED_STATUSES = frozenset({408, 425, 429})


def _iso(seconds: float) -> str:
    """
    @return: Unix seconds as ISO-8601 UTC, whole seconds.
    """
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def plainBody(notice: Notice) -> dict:
    """
    relay's JSON body for a notice::

        {"source": "relay", "event": "pool_exhausted", "status": "firing",
         "subject": "gpt-5.5", "summary": "...", "details": {...},
         "at": "2026-12-06T04:00:00Z", "since": "2026-12-06T04:00:00Z"}

    C{status} is C{firing} or C{resolved}; C{details} holds the facts of
    the event (docs/operating.md lists them), never a secret.
    """
    c = notice.condition
    return {
        "source": "relay", "event": c.event, "status": notice.state, "subject": c.subject,
        "summary": c.summary if notice.state == FIRING else "resolved: " + c.summary,
        "details": c.details, "at": _iso(notice.at), "since": _iso(notice.since),
    }


def slackBody(notice: Notice) -> dict:
    """
    Slack's incoming-webhook body for a notice: C{{"text": "..."}}.
    """
    c = notice.condition
    if notice.state == FIRING:
        text = f":rotating_light: relay {c.event}: {c.summary}"
    else:
        text = f":white_check_mark: relay {c.event} resolved: {c.summary}"
    return {"text": text}


def bodyFor(target, notice: Notice) -> bytes:
    """
    @param target: a L{relay.base.alertsettings.WebhookTarget}.
    @return: the JSON body, UTF-8.
    """
    body = slackBody(notice) if target.slack else plainBody(notice)
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode("utf-8")


def backoff(attempt: int) -> float:
    """
    @param attempt: the try that failed, from 1.
    @return: seconds before the next try.
    """
    return min(RETRY_MAX_SECONDS, RETRY_BASE_SECONDS * 2 ** (attempt - 1))


@implementer(IWebhookPoster)
class TreqPoster:
    """
    POSTs with treq over one persistent L{HTTPConnectionPool}.
    """

    def __init__(self, reactor) -> None:
        """
        @param reactor: the reactor (connections and timeouts).
        """
        import treq
        from twisted.web.client import Agent, HTTPConnectionPool

        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = 2
        self.pool.retryAutomatically = False
        self._client = treq.client.HTTPClient(Agent(reactor, pool=self.pool, connectTimeout=10))

    def post(self, url: str, body: bytes, timeout: float) -> Deferred:
        """
        See L{IWebhookPoster.post}.
        """
        return Deferred.fromCoroutine(self._post(url, body, timeout))

    async def _post(self, url: str, body: bytes, timeout: float) -> int:
        """
        @return: the answer's status (its body read and dropped).
        """
        response = await self._client.post(
            url, data=body, headers={"Content-Type": ["application/json"],
                                     "User-Agent": ["relay-alerts"]},
            timeout=timeout)
        await response.content()
        return response.code

    def close(self) -> Deferred:
        """
        See L{IWebhookPoster.close}.
        """
        return self.pool.closeCachedConnections()


@define(eq=False)
class WebhookSender:
    """
    See the module docstring.

    @ivar clock: the injected L{IReactorTime}.
    @ivar poster: the L{IWebhookPoster} (L{TreqPoster} in production).
    @ivar attempts: tries per notice and target.
    @ivar timeout: one try's limit, seconds.
    @ivar onDelivered: C{(target, notice)} after a 2xx answer.
    @ivar onFailed: C{(target, notice)} after the last try failed.
    """

    clock: IReactorTime
    poster: Any
    attempts: int = 6
    timeout: float = 10.0
    onDelivered: Optional[Callable] = None
    onFailed: Optional[Callable] = None
    pending: set = field(factory=set)
    _log = Logger()

    def send(self, target, notice: Notice) -> Deferred:
        """
        Deliver in the background.

        @return: a Deferred firing with C{True} (delivered) or C{False}
            (given up); it never fails.
        """
        d = Deferred.fromCoroutine(self._send(target, notice))
        self.pending.add(d)
        d.addBoth(lambda r: (self.pending.discard(d), r)[1])
        return d

    async def _send(self, target, notice: Notice) -> bool:
        """
        Try, wait, try again (see the module docstring).

        @return: whether a try was answered 2xx.
        """
        body = bodyFor(target, notice)
        event = notice.condition.event
        for attempt in range(1, self.attempts + 1):
            retry, problem = True, None
            try:
                status = await ensureDeferred(
                    self.poster.post(target.url, body, self.timeout)
                ).addTimeout(self.timeout, self.clock)
            except Exception as e:  # noqa: BLE001 - any failure is a failed try
                problem = type(e).__name__ + _redacted(e, target)
            else:
                if 200 <= status < 300:
                    self._log.info(
                        "alert {alert_event} {state} delivered to {target}",
                        event="relay.alert_delivered", alert_event=event, state=notice.state,
                        target=target.label, attempt=attempt)
                    if self.onDelivered is not None:
                        self.onDelivered(target, notice)
                    return True
                problem = f"status {status}"
                retry = status >= 500 or status in _RETRIED_STATUSES
            if not retry or attempt == self.attempts:
                break
            delay = backoff(attempt)
            self._log.warn(
                "alert {alert_event} to {target} failed ({problem}); try {next} in {delay:g} s",
                event="relay.alert_retry", alert_event=event, target=target.label,
                problem=problem, next=attempt + 1, delay=delay)
            await deferLater(self.clock, delay, lambda: None)
        self._log.error(
            "alert {alert_event} {state} to {target} not delivered ({problem})",
            event="relay.alert_failed", alert_event=event, state=notice.state,
            target=target.label, problem=problem, attempts=attempt)
        if self.onFailed is not None:
            self.onFailed(target, notice)
        return False


def _redacted(error: Exception, target) -> str:
    """
    @return: C{": <message>"} without the target's URL, or C{""}.
    """
    text = str(error)
    if not text:
        return ""
    text = text.replace(target.url, target.label)
    return ": " + " ".join(text.split())[:200]
