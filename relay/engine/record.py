# -*- test-case-name: tests.test_tenants_requestlog -*-
"""
What a turn leaves behind: its usage (counted once per turn, priced, its
budget reservation settled, R108, R109), the owner of the response it
produced (R39, R40, R104), and at its end one structured record
(L{relay.tenants.record.TurnRecord}), the C{relay.turn_finished} line and
the turn's metrics.

Functions of the L{relay.engine.runner.TurnRunner} the turn ran on: they
read its C{clock}, C{settings}, C{scheduler}, C{usage}, C{prices},
C{keyPolicy}, C{requestLog}, C{metrics}, C{history} and C{bookkeeping}.
"""

from __future__ import annotations

from typing import Optional

from attrs import evolve

from relay.engine.background import watchBackground
from relay.engine.compaction import recordCompaction
from relay.engine.payload import translatesChat
from relay.engine.pump import AttemptResult
from relay.engine.requests import onceUsageTap, requestFinished
from relay.base.records import Turn
from relay.scheduling.itemowners import outputItemIds
from relay.tenants.record import TurnRecord
from relay.usage.reader import UsageTap, clientAskedUsage
from relay.usage.tokens import imageCalls


def usageTap(runner, turn: Turn, account) -> UsageTap:
    """
    The usage reader of one attempt: records into
    the runner's C{usage} and onto C{turn.usage}. A chat stream's usage chunk is
    dropped when the client did not ask for it (relay always asks
    upstream, L{relay.engine.payload.upstreamBody}).
    """
    if turn.request is not None or turn.background:
        return onceUsageTap(runner, turn, account)  # R87, R88
    # Chat chunks carry usage only when the upstream speaks chat; a
    # translated chat turn (OAuth) ends with a Responses terminal event.
    chat = turn.endpoint == "chat" and turn.stream and not translatesChat(turn, account)
    return UsageTap(
        record=lambda counts: runner.recordUsage(turn, account, counts),
        chat=chat,
        dropUsageChunk=chat and not clientAskedUsage(turn.body),
        requestId=turn.requestId,
    )


def recordUsage(runner, turn: Turn, account, counts) -> None:
    """
    Count C{counts} for the turn's key, C{account} and the upstream
    model relay asked for; once per turn.
    """
    if turn.usage is not None:
        return
    model = account.upstreamModel(turn.model) if turn.model else ""
    if turn.hostedCalls and not counts.tools:
        # R109: the calls were reported in the stream's items only.
        counts = evolve(counts, tools=tuple(sorted(turn.hostedCalls.items())))
    if turn.endpoint in ("images", "image_edits"):
        counts = imageCalls(counts, turn.body)  # R115: OAuth's tool calls are images
    if runner.prices is not None:
        # The turn's cost, once, by the upstream model.
        counts = runner.prices.priced(model, counts)
    turn.usage = counts
    if runner.keyPolicy is not None and turn.client.tpm:
        runner.keyPolicy.countTokens(turn.client, counts.total)
    if runner.usage is None:
        return
    hold = turn.budgetHold
    if hold is not None:
        # R108: the reservation settles to the real figure (one place
        # for every way usage is learnt).
        try:
            runner.usage.settle(hold, counts)
            keepChain(runner, turn, None)
        except Exception:  # noqa: BLE001 - logged; accounting never breaks a turn
            runner._log.failure("settling the budget hold failed",
                              event="relay.usage_failed", request_id=turn.requestId)
    try:
        runner.usage.record(turn.client.name, account.id, model, counts)
    except Exception:  # noqa: BLE001 - logged; accounting never breaks a turn
        runner._log.failure(
            "recording usage failed", event="relay.usage_failed", request_id=turn.requestId,
            account_id=account.id,
        )


async def succeeded(runner, turn, account, result: AttemptResult) -> None:
    """
    A completed turn: remember which account owns the response (R39),
    unless the attempt already did (L{ownResponse}).
    """
    if turn.compactionItems:
        recordCompaction(runner, turn, account)
    if result.responseId:
        keepChain(runner, turn, result.responseId)
        if not result.ownerRecorded:
            await runner.scheduler.recordResponse(turn, result.responseId, account)
        if turn.onResponseId is not None:
            turn.onResponseId(result.responseId, account)


def keepChain(runner, turn: Turn, responseId: Optional[str]) -> None:
    """
    R108: once a turn of a key with a budget has both its response id
    and its usage, keep its input + output for a turn chained on it
    (for C{previous_response_ttl_seconds}).
    """
    hold = turn.budgetHold
    if hold is None or hold.chainKept:
        return
    if responseId and hold.responseId is None:
        hold.responseId = responseId
    if hold.responseId and turn.usage is not None:
        hold.chainKept = True
        runner.usage.rememberChain(
            hold.responseId, turn.usage.total,
            runner.settings.current.scheduling.previous_response_ttl_seconds)


def ownResponse(runner, turn: Turn, account, responseId: Optional[str],
                response=None) -> bool:
    """
    Record that C{account} owns C{responseId} (R39) and the turn's key
    may use it (R40), called by the attempt just I{before} the terminal
    event or body goes to the client: a client chains from a response
    the instant it reads it, possibly through another relay process, so
    the owner must already be in the local map (set synchronously here)
    and its store writes already on their way (sent ahead of the
    client's bytes; a later read from any process sees them). The
    writes are not awaited: the terminal event is not held back, and a
    store error is logged by the scheduler (R35 fail-open).

    @param responseId: the response id, or L{None} (nothing recorded).
    @param response: the completed response object (the terminal
        event's, or the JSON body), or L{None}: its output items are
        the key's too (R104, at most
        L{relay.scheduling.itemowners.MAX_OWNED_ITEMS}), recorded in
        the same store operation.
    @return: whether the owner was recorded.
    """
    if not responseId:
        return False
    keepChain(runner, turn, responseId)
    if turn.background and turn.request is None:
        runner.backgroundOwners[turn] = (account, responseId)
    if response is not None:
        turn.outputItemIds = tuple(outputItemIds(response))
    d = runner.scheduler.recordResponse(turn, responseId, account)
    if not d.called or d.result is not None:
        # A write already done (the memory store's) needs no errback.
        d.addErrback(
            lambda f: runner._log.failure(
                "recording the owner of {response_id} failed", f,
                response_id=responseId, request_id=turn.requestId,
            )
        )
    return True


_FINISHED = ("turn {request_id} {outcome} with status {status} on {account_id}"
             " after {attempts} attempt(s)")
_FINISHED_NO_ACCOUNT = ("turn {request_id} {outcome} with status {status} with no account"
                        " after {attempts} attempt(s)")
"""C{relay.turn_finished}'s text: with the account the turn ended on, or,
when it had none (refused before any was tried), saying so (not C{on
None}); the fields are the same."""


def finished(runner, turn, state, outcome, status, accountId, start) -> None:
    """
    A turn ended: its trace, a background create's watch (R107), then the
    turn's record (L{turnRecord}), its C{relay.turn_finished} line, the
    account's counters and the metrics; a request of its own kind (R87)
    ends in L{relay.engine.requests.requestFinished} instead.

    @param state: the turn's L{relay.engine.decide.TurnState}.
    @param outcome: C{completed}, C{failed}, C{client_gone}, C{error} or
        C{relay_cancelled}.
    @param accountId: the account that had the turn last, or L{None}.
    @param start: when the turn started, seconds on the runner's clock.
    """
    if state.trace is not None:
        state.trace.turnEnded(outcome, status, accountId, state)
    owned = runner.backgroundOwners.pop(turn, None) if runner.backgroundOwners else None
    if owned is not None and turn.usage is None:
        # R107, R88: counted once when it finishes, even if nobody polls.
        watchBackground(runner, turn, owned[0], owned[1])
    if turn.request is not None:
        requestFinished(runner, turn, state, outcome, status, accountId, start)
        return
    now = runner.clock.seconds()
    first = turn.firstOutputAt
    usage = turn.usage
    if runner.requestLog is not None:
        try:
            runner.requestLog.add(
                turnRecord(turn, state, outcome, status, accountId, start, now)
            )
        except Exception:  # noqa: BLE001 - logged; the log never breaks a turn
            runner._log.failure("recording turn {request_id} failed",
                              event="relay.request_log_failed", request_id=turn.requestId)
    runner._log.info(
        _FINISHED if accountId is not None else _FINISHED_NO_ACCOUNT,
        event="relay.turn_finished",
        request_id=turn.requestId,
        client_request_id=turn.clientRequestId,
        entrypoint=turn.entrypoint,
        endpoint=turn.endpoint,
        client=turn.client.name,
        model=turn.model,
        outcome=outcome,
        status=status,
        account_id=accountId,
        attempts=state.attempts,
        switches=state.switches,
        duration_ms=int((now - start) * 1000),
        first_output_ms=None if first is None else int((first - start) * 1000),
        # The token fields (L{usageFields}, inlined).
        input_tokens=None if usage is None else usage.input,
        cached_input_tokens=None if usage is None else usage.cached,
        output_tokens=None if usage is None else usage.output,
        reasoning_tokens=None if usage is None else usage.reasoning,
        upstream_request_id=turn.upstreamRequestId,
    )
    if accountId is not None:
        runner.bookkeeping.accountStats(accountId)["turns"] += 1
        if first is not None and runner.history is not None:
            runner.history.firstOutput(accountId, first - start)
    if runner.metrics is not None:
        if state.pendingFailover is not None:
            # A switch that found no next account (exhausted, or the
            # client left during the retry interval).
            runner.metrics.failoverTo(state.pendingFailover, None)
            state.pendingFailover = None
        runner.metrics.turnFinished(turn.entrypoint, outcome)
        if first is not None:
            runner.metrics.firstOutput(first - start)


def usageFields(counts) -> dict:
    """
    The token fields of C{relay.turn_finished}; L{None}
    when the turn reported no usage.
    """
    if counts is None:
        return {"input_tokens": None, "cached_input_tokens": None,
                "output_tokens": None, "reasoning_tokens": None}
    return {"input_tokens": counts.input, "cached_input_tokens": counts.cached,
            "output_tokens": counts.output, "reasoning_tokens": counts.reasoning}


def turnRecord(turn, state, outcome, status, accountId, start, now) -> TurnRecord:
    """
    The turn's one structured record, from what the engine holds
    at its end (no parsing, no formatting).
    """
    first = turn.firstOutputAt
    usage = turn.usage
    error = getattr(state.sink, "failed", None)
    sample = None
    if isinstance(state.sink, SamplingSink):
        sample = state.sink.sample(turn.body)
    return TurnRecord(
        time=start,
        request_id=turn.requestId,
        client_request_id=turn.clientRequestId,
        key=turn.client.name,
        entrypoint=turn.entrypoint,
        endpoint=turn.endpoint,
        mode=turn.wsMode,
        stream=turn.stream,
        model=turn.model,
        account=accountId,
        attempts=state.tried,
        outcome=outcome,
        status=status,
        first_output_ms=None if first is None else int((first - start) * 1000),
        duration_ms=int((now - start) * 1000),
        input_tokens=None if usage is None else usage.input,
        cached_tokens=None if usage is None else usage.cached,
        output_tokens=None if usage is None else usage.output,
        reasoning_tokens=None if usage is None else usage.reasoning,
        cost_nanos=None if usage is None or usage.unpriced else usage.cost,
        unpriced=usage is not None and bool(usage.unpriced),
        usage_estimated=usage is not None and bool(usage.estimated),
        error_code=None if error is None else error.code,
        error=None if error is None else error.message,
        client_ip=turn.clientAddress,
        user_agent=turn.userAgent,
        upstream_request_id=turn.upstreamRequestId,
        switches=state.switches,
        waited_ms=int(state.waited * 1000),
        sample=sample,
    )


class SamplingSink:
    """
    The request log's debug sampling (C{request_log.sample_rate}, off by default):
    a sink that forwards everything to the turn's sink and keeps a copy of
    what the client received, up to C{limit} bytes. Only sampled turns pay
    for it.
    """

    def __init__(self, sink, limit: int):
        self._sink = sink
        self._limit = limit
        self._kept: list = []
        self._size = 0
        if hasattr(sink, "writeRaw"):
            self.writeRaw = self._writeRaw

    def __getattr__(self, name):
        return getattr(self._sink, name)

    def _keep(self, data: bytes) -> None:
        if self._size < self._limit:
            part = data[: self._limit - self._size]
            self._kept.append(part)
            self._size += len(part)

    def writeEvent(self, event) -> None:
        self._keep(event.raw or event.data)
        self._sink.writeEvent(event)

    def _writeRaw(self, data: bytes) -> None:
        self._keep(data)
        self._sink.writeRaw(data)

    def writeBody(self, status, headers, body) -> None:
        self._keep(body)
        self._sink.writeBody(status, headers, body)

    def sample(self, body) -> dict:
        """
        @return: C{{"request": <body JSON>, "output": <what the client got>}},
            each cut to the limit.
        """
        import json

        request = json.dumps(body, ensure_ascii=False, default=str)
        return {
            "request": request[: self._limit],
            "output": b"".join(self._kept).decode("utf-8", "replace"),
        }
