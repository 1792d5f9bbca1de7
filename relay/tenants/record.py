# -*- test-case-name: tests.test_tenants_requestlog -*-
"""
The one structured record of a turn.

The engine builds a L{TurnRecord} once, when a turn ends, from what it
already holds (the L{relay.base.records.Turn}, its failover state, the outcome);
nothing is parsed or formatted on the hot path. The request log
(L{relay.tenants.requestlog}) keeps it; the access line, the decision log
and C{relay-report} can read the same record (L{TurnRecord.asDict} is the
JSON shape the admin API serves and the stores keep).

A record never holds a prompt or an output, except a debug sample
(C{request_log.sample_rate}, off by default): then C{sample} holds the
request body and the output as the client received it, each cut to
C{request_log.sample_max_bytes}.
"""

from __future__ import annotations

from typing import Optional

from attrs import define

from relay.wire.jsoncodec import dumpsRecord

__all__ = ["Attempt", "TurnRecord", "fromDict"]


@define(slots=True)
class Attempt:
    """
    One upstream attempt of a turn and why it was left.

    @ivar account: the account id.
    @ivar status: the upstream status (or relay's for a transport
        failure), or L{None} (e.g. a stream that ended without one).
    @ivar reason: the attempt's end: C{ok}, or the failure reason
        (C{rate_limited}, C{server_error}, C{transport}, ...).
    @ivar decision: what the engine did next: C{served}, C{switch},
        C{same} (retried on the same account), C{pass} (the error went to
        the client), C{exhausted}, C{rewrite}/C{refresh} (a one-shot same
        account replay), or C{failed} (after output, R19 step 2).
    """

    account: str
    status: Optional[int] = None
    reason: Optional[str] = None
    decision: Optional[str] = None

    def asList(self) -> list:
        return [self.account, self.status, self.reason, self.decision]


@define(slots=True)
class TurnRecord:
    """
    One turn (one HTTP request or one WebSocket C{response.create}).

    Times are Unix seconds; durations milliseconds. Token fields are
    L{None} when the turn reported no usage; C{cost_nanos} is L{None} when
    it reported none or ran on a model without a price (C{unpriced}).
    """

    time: float
    request_id: str
    key: str
    entrypoint: str
    endpoint: str
    mode: Optional[str]
    stream: bool
    model: Optional[str]
    account: Optional[str]
    attempts: list
    outcome: str
    status: int
    first_output_ms: Optional[int]
    duration_ms: int
    input_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    reasoning_tokens: Optional[int] = None
    cost_nanos: Optional[int] = None
    unpriced: bool = False
    usage_estimated: bool = False
    """R107: the token fields are relay's estimate (the client left and the
    upstream's usage could not be read)."""
    error_code: Optional[str] = None
    error: Optional[str] = None
    client_ip: Optional[str] = None
    user_agent: Optional[str] = None
    upstream_request_id: Optional[str] = None
    switches: int = 0
    waited_ms: int = 0
    sample: Optional[dict] = None
    client_request_id: Optional[str] = None
    """The id the client sent (R111), or L{None}; C{request_id} is relay's."""
    seq: Optional[str] = None
    """The store's id of the record (set when read back), for paging."""

    @property
    def accounts(self) -> list:
        """
        Every account tried, in order, without repeats.
        """
        seen = []
        for attempt in self.attempts:
            if attempt.account not in seen:
                seen.append(attempt.account)
        return seen

    def asDict(self) -> dict:
        """
        @return: the record as JSON-ready values (C{cost_usd} in dollars;
            C{attempts} as objects).
        """
        return {
            "time": self.time,
            "request_id": self.request_id,
            "client_request_id": self.client_request_id,
            "key": self.key,
            "entrypoint": self.entrypoint,
            "endpoint": self.endpoint,
            "mode": self.mode,
            "stream": self.stream,
            "model": self.model,
            "account": self.account,
            "accounts": self.accounts,
            "attempts": [
                {"account": a.account, "status": a.status, "reason": a.reason,
                 "decision": a.decision}
                for a in self.attempts
            ],
            "outcome": self.outcome,
            "status": self.status,
            "first_output_ms": self.first_output_ms,
            "duration_ms": self.duration_ms,
            "input_tokens": self.input_tokens,
            "cached_input_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "cost_usd": None if self.cost_nanos is None else round(self.cost_nanos / 1e9, 9),
            "unpriced": self.unpriced,
            "usage_estimated": self.usage_estimated,
            "error_code": self.error_code,
            "error": self.error,
            "client_ip": self.client_ip,
            "user_agent": self.user_agent,
            "upstream_request_id": self.upstream_request_id,
            "switches": self.switches,
            "waited_ms": self.waited_ms,
            "sample": self.sample,
        }

    def toJSON(self) -> str:
        """
        The compact stored form (L{fromDict} reads it back): orjson's,
        through L{relay.wire.jsoncodec.dumpsRecord} (one record per
        relayed turn; ~1 us instead of ~8).
        """
        return dumpsRecord(self.asDict())


def fromDict(data: dict, seq: Optional[str] = None) -> TurnRecord:
    """
    Read a record back from L{TurnRecord.asDict}'s shape.

    @param seq: the store's id of the record.
    """
    cost = data.get("cost_usd")
    return TurnRecord(
        time=data.get("time") or 0.0,
        request_id=data.get("request_id") or "",
        key=data.get("key") or "",
        entrypoint=data.get("entrypoint") or "",
        endpoint=data.get("endpoint") or "",
        mode=data.get("mode"),
        stream=bool(data.get("stream")),
        model=data.get("model"),
        account=data.get("account"),
        attempts=[
            Attempt(a.get("account") or "", a.get("status"), a.get("reason"), a.get("decision"))
            for a in data.get("attempts") or []
        ],
        outcome=data.get("outcome") or "",
        status=data.get("status") or 0,
        first_output_ms=data.get("first_output_ms"),
        duration_ms=data.get("duration_ms") or 0,
        input_tokens=data.get("input_tokens"),
        cached_tokens=data.get("cached_input_tokens"),
        output_tokens=data.get("output_tokens"),
        reasoning_tokens=data.get("reasoning_tokens"),
        cost_nanos=None if cost is None else int(round(cost * 1e9)),
        unpriced=bool(data.get("unpriced")),
        usage_estimated=bool(data.get("usage_estimated")),
        error_code=data.get("error_code"),
        error=data.get("error"),
        client_ip=data.get("client_ip"),
        user_agent=data.get("user_agent"),
        upstream_request_id=data.get("upstream_request_id"),
        switches=data.get("switches") or 0,
        waited_ms=data.get("waited_ms") or 0,
        sample=data.get("sample"),
        client_request_id=data.get("client_request_id"),
        seq=seq,
    )
