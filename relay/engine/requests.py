# -*- test-case-name: tests.test_requests -*-
"""
Requests of their own kind (behaviour.md R87-R92; architecture.md "Non-turn
routes"): the Responses API routes that are not turns -- remote compaction,
retrieve, delete, input items, cancel, input token counts -- and the
upstream model lists.

They run through the one engine (L{relay.engine.runner.TurnRunner}) like a
turn: the same selection (the owning account where a response id names one,
L{relay.scheduling.scheduler.AccountScheduler.select}), admission where they
use a slot, the R8 classification and the same failover policy, the same
logs, metrics and usage. What differs is declared here, as data on the
turn (L{RequestKind} in C{Turn.request}), and the attempt, which never takes
the generation path: L{forwardAttempt} sends one upstream request and
answers with the upstream's JSON (or, for a stream resume, its events);
L{relay.engine.compaction.oauthCompactAttempt} serves C{compact} on an
OAuth account as the equivalent compaction turn and answers the compact
shape (R87).

Deterministic upstream refusals (R8 "anything else": a 4xx that does not
fail over) are answered with the upstream's own status and body after one
attempt and mark nothing (R87).
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from attrs import evolve, frozen
from twisted.logger import Logger

from relay.engine.background import countBackgroundOnce
from relay.engine.cancel import ClientGone, drained, raceCancel, raceDeparture
from relay.engine.httpattempt import readAnswer
from relay.engine.payload import scopeCacheKey, upstreamClientHeaders
from relay.engine.pump import AttemptResult, StreamPump, passHeaders
from relay.engine.upstreambody import ERROR_BODY_LIMIT, JSON_BODY_LIMIT, BodyBroken, readBody
from relay.base.records import ClientError, Turn
from relay.policy import ends
from relay.policy.judgement import passVerdict
from relay.usage.reader import UsageTap
from relay.usage.tokens import fromBody

_log = Logger()

INPUT_TOKENS_MESSAGE = "counting input tokens requires an OpenAI API-key account"
"""R87: the ChatGPT backend has no C{/responses/input_tokens}."""


@frozen
class RequestKind:
    """
    What the engine needs to know about a request that is not a turn.

    @ivar name: C{compact}, C{retrieve}, C{stream}, C{delete},
        C{input_items}, C{cancel}, C{input_tokens}, C{models} or
        C{manifest} (logs and metrics).
    @ivar method: the upstream method (C{b"GET"}, C{b"POST"}, C{b"DELETE"}).
    @ivar path: the upstream path under the account's base URL, with any
        query string (e.g. C{/responses/resp_1/input_items?limit=5}).
    @ivar responseId: the response id the request is about, or L{None}.
    @ivar ownerAccountId: the account that owns C{responseId}; set, the
        request goes to that account only and never moves (R87, R104).
    @ivar usesSlot: the request holds an account slot (and the key's slot)
        while it runs: a compaction, a token count, a stream resume (R88);
        a poll, delete, cancel or listing does not.
    @ivar billed: the key's token budget applies (a compaction is a model
        run).
    @ivar accountType: only accounts of this type serve it: C{apikey}
        (input token counts) or C{oauth} (the Codex models manifest); L{None}
        for any.
    @ivar accountTypeMessage: the 400 when no such account serves the model.
    @ivar stream: the answer is an SSE stream (a background stream resume).
    @ivar usage: when the answer's usage is counted: C{always} (a
        compaction), C{background} (once per background response, whoever
        sees it first: the create's stream, a poll or a resume) or C{never}.
    @ivar etag: sent upstream as C{If-None-Match} (a manifest revalidation;
        a 304 is then an answer, not a refusal).
    @ivar attempt: the attempt function, called like
        L{relay.engine.httpattempt.attemptHTTP}.
    """

    name: str
    method: bytes
    path: str
    responseId: Optional[str] = None
    ownerAccountId: Optional[str] = None
    usesSlot: bool = False
    billed: bool = False
    accountType: Optional[str] = None
    accountTypeMessage: str = ""
    stream: bool = False
    usage: str = "never"
    etag: Optional[str] = None
    attempt: Optional[Callable] = None

    def run(self, runner, turn, sink, account, release):
        """
        One attempt of this request on C{account}: L{attempt}, else
        L{forwardAttempt} (C{compact} on an OAuth account:
        L{oauthCompactAttempt}).
        """
        if self.attempt is not None:
            return self.attempt(runner, turn, sink, account, release)
        if self.name == "compact" and account.type == "oauth":
            from relay.engine.compaction import oauthCompactAttempt

            return oauthCompactAttempt(runner, turn, sink, account, release)
        return forwardAttempt(runner, turn, sink, account, release)


# -- building requests ------------------------------------------------------------


def compactRequest() -> RequestKind:
    """
    C{POST /v1/responses/compact} (R87): the selected account's
    C{/responses/compact} on API-key accounts, the equivalent compaction
    turn on OAuth accounts. A model run: it takes slots, is billed, and its
    usage is counted.
    """
    return RequestKind("compact", b"POST", "/responses/compact", usesSlot=True, billed=True,
                       usage="always")


def inputTokensRequest() -> RequestKind:
    """
    C{POST /v1/responses/input_tokens} (R87): API-key accounts only.
    """
    return RequestKind("input_tokens", b"POST", "/responses/input_tokens", usesSlot=True,
                       accountType="apikey", accountTypeMessage=INPUT_TOKENS_MESSAGE)


def ownedRequest(name: str, method: bytes, responseId: str, ownerAccountId: str,
                 suffix: str = "", query: bytes = b"") -> RequestKind:
    """
    A request about one response, bound to its owner account (R87, R88):
    C{retrieve} (a poll), C{stream} (a resume: holds a slot while it
    streams), C{delete}, C{input_items}, C{cancel}.

    @param suffix: the path after C{/responses/{id}} (C{/input_items},
        C{/cancel}) or C{""}.
    @param query: the client's raw query string, passed through.
    """
    path = f"/responses/{responseId}{suffix}"
    if query:
        path += "?" + query.decode("latin-1")
    stream = name == "stream"
    return RequestKind(name, method, path, responseId=responseId, ownerAccountId=ownerAccountId,
                       usesSlot=stream, stream=stream,
                       usage="background" if name in ("retrieve", "stream", "cancel") else "never")


MANIFEST_MESSAGE = "the Codex models manifest comes from a ChatGPT (OAuth) account"
"""R92: only the ChatGPT backend serves C{/models?client_version=...}."""


def manifestRequest(clientVersion: str, etag: Optional[str] = None) -> RequestKind:
    """
    The Codex models manifest of an OAuth account (R92):
    C{GET /models?client_version=...}, revalidated with the cached ETag.
    """
    from urllib.parse import quote

    return RequestKind("manifest", b"GET", f"/models?client_version={quote(clientVersion)}",
                       accountType="oauth", accountTypeMessage=MANIFEST_MESSAGE, etag=etag)


def modelsRequest(accountId: str, path: str) -> RequestKind:
    """
    One account's upstream model list (R92, for an account that declares
    no C{models}): C{GET /models} (or, on an OAuth account, its manifest),
    bound to that account.
    """
    return RequestKind("models", b"GET", path, ownerAccountId=accountId)


# -- the attempts ------------------------------------------------------------------


def upstreamError(status: int, headers: dict, body: bytes) -> ClientError:
    """
    The upstream's own refusal, passed through as it came (R87: a
    deterministic 4xx is answered with upstream's status and body).

    @param headers: the upstream response headers (lower-case names).
    @param body: the upstream error body.
    """
    contentType = str(headers.get("content-type") or "")
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and "json" in contentType:
        return ClientError(
            status, str(error.get("type") or "invalid_request_error"),
            str(error.get("message") or ""), code=error.get("code"), param=error.get("param"),
            rawBody=body, contentType="application/json",
        )
    detail = parsed.get("detail") if isinstance(parsed, dict) else None
    return ClientError(status, "invalid_request_error",
                       str(detail or "The upstream refused the request"))


async def _refused(runner, turn, account, response, release) -> AttemptResult:
    """
    An upstream status >= 300: judged by R8 like any attempt's refusal; one
    that does not fail over reaches the client as upstream sent it, with no
    marking (R87).
    """
    idle = runner.settings.current.upstream.stream_idle_timeout_seconds
    try:
        body = await raceCancel(readBody(response, ERROR_BODY_LIMIT, idle, runner.clock),
                                turn.cancel)
    except BodyBroken as e:
        body = e.partial
    release()
    headers = dict(response.headers)
    end = ends.StatusRefused(response.code, headers, body)
    verdict = runner.judge(turn, account, end)
    if verdict is not None and not verdict.failover:
        verdict = evolve(passVerdict(upstreamError(response.code, headers, body), verdict.reason),
                         rejectedField=verdict.rejectedField)
    return AttemptResult(end=end, verdict=verdict, status=response.code)


async def forwardAttempt(runner, turn: Turn, sink, account, release) -> AttemptResult:
    """
    One upstream request for a L{RequestKind}: its method and path on the
    account, the turn's body for a C{POST}, the client's headers through
    the dialer's allow-list (never its credentials). A JSON answer is
    written to the sink as it came (its usage counted per
    L{RequestKind.usage}); a stream (a resume) goes through the
    L{StreamPump} like any SSE stream. Facts only: the engine judges the
    end (R86).
    """
    s = runner.settings.current
    kind = turn.request
    body = None
    if kind.method == b"POST":
        sent = dict(turn.body)
        scopeCacheKey(turn, sent)  # R112, both account types
        if turn.model and isinstance(sent.get("model"), str):
            sent["model"] = account.upstreamModel(turn.model)
        body = json.dumps(sent, separators=(",", ":")).encode("utf-8")
    headers = upstreamClientHeaders(turn, account)
    headers["accept"] = "text/event-stream" if kind.stream else "application/json"
    if kind.etag:
        headers["if-none-match"] = kind.etag
    requestD = runner.dialer.request(account, kind.method, kind.path, body, headers, s.upstream)
    try:
        response = await raceCancel(requestD, turn.cancel)
    except ClientGone:
        raise
    except Exception as e:  # noqa: BLE001 - a transport failure, judged by the engine
        return AttemptResult(end=ends.TransportFailure(e, "headers"), status=502)
    turn.upstreamRequestId = response.headers.get("x-request-id")
    if runner.metrics is not None:
        runner.metrics.upstreamStatus(response.code)
    if response.code >= 300 and response.code != 304:
        return await _refused(runner, turn, account, response, release)
    if kind.stream:
        pump = StreamPump(runner, turn, sink, account, release, None,
                          s.upstream.stream_idle_timeout_seconds)
        pump.start(response)
        try:
            return await raceDeparture(pump.done, turn.cancel)
        except ClientGone:
            pump.depart(turn.cancel.reason)
            await drained(pump)  # R107: usage read (or estimated) first
            raise
    idle = s.upstream.stream_idle_timeout_seconds
    try:
        # R107: a client that leaves while the answer arrives is still counted.
        data = await readAnswer(runner, turn, account, response, JSON_BODY_LIMIT,
                                lambda parsed: countUsage(runner, turn, account, parsed))
    except BodyBroken as e:
        if e.idle:
            return AttemptResult(end=ends.RelayTimeout(ends.IDLE, idle), status=502)
        return AttemptResult(end=ends.StreamCut(e.detail), status=502)
    parsed = None
    if data.strip():
        try:
            parsed = json.loads(data)
        except ValueError:
            return AttemptResult(end=ends.StreamEnded(), status=502)
    release()
    runner.firstOutput(turn)
    countUsage(runner, turn, account, parsed)
    out = passHeaders(response.headers)
    for name in ("etag", "content-type"):
        if name in response.headers:
            out[name] = response.headers[name]
    sink.writeBody(response.code, out, data)
    return AttemptResult(end=ends.Completed(None), committed=True, status=response.code)


def countUsage(runner, turn: Turn, account, response) -> None:
    """
    Count the usage of a request's JSON answer per L{RequestKind.usage}.

    @param response: the parsed answer (a response, a compaction, ...), or
        L{None}.
    """
    if not isinstance(response, dict):
        return
    policy = turn.request.usage
    counts = fromBody(response)
    if counts is None or policy == "never":
        return
    if policy == "always":
        runner.recordUsage(turn, account, counts)
        return
    countBackgroundOnce(runner, turn, account, response, counts)


def onceUsageTap(runner, turn: Turn, account) -> UsageTap:
    """
    The usage reader of a stream whose usage is counted per
    L{RequestKind.usage} (a resume, an OAuth compaction turn) or once per
    background response (a background create's stream, R88).
    """
    policy = "background" if turn.request is None else turn.request.usage
    holder = []

    def record(counts):
        if policy == "never":
            return
        if policy == "always":
            runner.recordUsage(turn, account, counts)
            return
        event = holder[0].event
        response = event.json().get("response") if event is not None else None
        if isinstance(response, dict):
            countBackgroundOnce(runner, turn, account, response, counts)

    tap = _EventTap(record=record, requestId=turn.requestId)
    holder.append(tap)
    return tap


_FINISHED = ("request {request_id} ({request_kind}) {outcome} with status {status}"
             " on {account_id} after {attempts} attempt(s)")
_FINISHED_NO_ACCOUNT = ("request {request_id} ({request_kind}) {outcome} with status {status}"
                        " with no account after {attempts} attempt(s)")
"""C{relay.request_finished}'s text, as C{relay.turn_finished}'s
(L{relay.engine.record}): never C{on None}."""


def requestFinished(runner, turn: Turn, state, outcome: str, status: int, accountId,
                    start: float) -> None:
    """
    The end of a request (the counterpart of C{relay.turn_finished}): logged
    as C{relay.request_finished} with its kind, counted in
    C{relay_requests_total{kind, outcome}}; never counted as a turn.
    """
    now = runner.clock.seconds()
    kind = turn.request
    counts = turn.usage
    _log.info(
        _FINISHED if accountId is not None else _FINISHED_NO_ACCOUNT,
        event="relay.request_finished",
        request_id=turn.requestId,
        client_request_id=turn.clientRequestId,
        request_kind=kind.name,
        client=turn.client.name,
        model=turn.model,
        response_id=kind.responseId,
        outcome=outcome,
        status=status,
        account_id=accountId,
        attempts=state.attempts,
        switches=state.switches,
        duration_ms=int((now - start) * 1000),
        input_tokens=None if counts is None else counts.input,
        output_tokens=None if counts is None else counts.output,
        upstream_request_id=turn.upstreamRequestId,
    )
    if runner.metrics is not None:
        if state.pendingFailover is not None:
            runner.metrics.failoverTo(state.pendingFailover, None)
            state.pendingFailover = None
        runner.metrics.requestFinished(kind.name, outcome)


class _EventTap(UsageTap):
    """
    A L{UsageTap} that keeps the event it counted, so its recorder can read
    the response id (L{onceUsageTap}).
    """

    event = None

    def _count(self, event) -> None:
        self.event = event
        super()._count(event)


__all__ = [
    "RequestKind", "compactRequest", "countUsage", "forwardAttempt", "inputTokensRequest",
    "manifestRequest", "modelsRequest", "onceUsageTap", "ownedRequest", "requestFinished",
    "upstreamError",
]
