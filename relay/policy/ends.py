# -*- test-case-name: tests.test_policy -*-
"""
How one upstream attempt ended, as facts (behaviour.md R86).

Every transport's attempt code (HTTP SSE and JSON, chat, the WebSocket's
ctx_pool, passthrough and http_bridge) reports one of these values and
nothing else: what upstream said or did, never what that means for the
account. L{relay.policy.judgement} turns a fact into a verdict and
L{relay.policy.bookkeeping} turns it into account state, both from the
fact's meaning, so the same fault is treated the same on every entrypoint
whatever its wire form (an HTTP status, a WebSocket handshake status, an
in-band C{error} event).

L{Departed} is an end of its own: the client left, or relay cancelled the
attempt for the client (pre-emption, shutdown). It carries nothing that
bookkeeping could act on (behaviour.md R2, R86.3).
"""

from __future__ import annotations

from typing import Any, Optional

from attrs import field, frozen

#: L{StatusRefused.wire}: an HTTP response status.
WIRE_HTTP = "http"
#: L{StatusRefused.wire}: a WebSocket upgrade answered with a status (R56).
WIRE_WS_HANDSHAKE = "ws_handshake"

#: L{InBandFailure.wire}: an SSE event (C{response.failed} or C{error}).
WIRE_SSE = "sse"
#: L{InBandFailure.wire}: a WebSocket C{error} / C{response.failed} frame.
WIRE_WS = "ws"
#: L{InBandFailure.wire}: a chat completions error chunk (R84).
WIRE_CHAT = "chat"

#: L{RelayTimeout.which}: the first-output deadline (R20).
FIRST_OUTPUT = "first_output"
#: L{RelayTimeout.which}: upstream silence inside a body or stream (R24).
IDLE = "idle"


@frozen
class Completed:
    """
    The turn's terminal event (C{response.completed},
    C{response.incomplete}) or JSON body reached the client: a success.

    @ivar responseId: the response id, or L{None}.
    """

    responseId: Optional[str] = None


@frozen
class Forwarded:
    """
    Upstream's own failure reached the client as the turn's end: a
    C{response.failed} or C{error} event after output, or before output one
    that R23 does not fail over (a policy refusal, a context-window error).
    Upstream answered, so it is neither a success nor an account failure
    (R17, R23).

    @ivar responseId: the response id, or L{None}.
    """

    responseId: Optional[str] = None


@frozen
class StatusRefused:
    """
    Upstream answered with an error status before any output: an HTTP
    status >= 300 or a rejected WebSocket upgrade (R8, R56).

    @ivar status: the status code.
    @ivar headers: lower-cased header name -> value.
    @ivar body: at most 512 KiB of the error body (R7).
    @ivar wire: L{WIRE_HTTP} or L{WIRE_WS_HANDSHAKE}.
    """

    status: int
    headers: dict = field(factory=dict, hash=False)
    body: bytes = b""
    wire: str = WIRE_HTTP


@frozen
class InBandFailure:
    """
    A failure event inside a stream before the first semantic output: a
    C{response.failed}, an C{error} event (with or without a status), or a
    chat error chunk (R23, R49 step 5, R84, R86.1).

    @ivar event: the parsed event.
    @ivar wire: L{WIRE_SSE}, L{WIRE_WS} or L{WIRE_CHAT}.
    """

    event: dict = field(hash=False)
    wire: str = WIRE_SSE


@frozen
class TransportFailure:
    """
    The attempt ended without any HTTP status: proxy CONNECT, TCP, DNS or
    TLS failure, a reset before the headers, a header timeout, a failed
    upstream send (R1).

    @ivar reason: the exception or L{twisted.python.failure.Failure}.
    @ivar stage: C{dial}, C{headers} or C{write}, for logs.
    """

    reason: Any = field(hash=False)
    stage: str = "dial"


@frozen
class StreamCut:
    """
    The upstream stream or body broke with a read error (a reset, an
    abnormal WebSocket close) before its terminal event (R23, R86.3).

    @ivar detail: a short reason for logs and messages.
    @ivar afterOutput: output had already reached the client.
    """

    detail: str = ""
    afterOutput: bool = False


@frozen
class StreamEnded:
    """
    The upstream stream ended cleanly without a terminal event: the HTTP
    body ended, or the upstream WebSocket closed 1000 mid-turn (R23,
    R86.4). A stream failure, not a transport failure.

    @ivar afterOutput: output had already reached the client.
    """

    afterOutput: bool = False


@frozen
class EmptyCompletion:
    """
    A C{response.completed} with no output, no usage and no error: a
    silent upstream refusal (R23).

    @ivar event: the parsed terminal event or body.
    """

    event: dict = field(factory=dict, hash=False)


@frozen
class RelayTimeout:
    """
    relay gave up on a silent upstream: the first-output deadline (R20) or
    the stream idle timeout (R24). relay cancelled the attempt, so it is
    never a transport failure (R86.3).

    @ivar which: L{FIRST_OUTPUT} or L{IDLE}.
    @ivar seconds: the timeout that expired.
    @ivar afterOutput: output had already reached the client.
    """

    which: str
    seconds: float = 0.0
    afterOutput: bool = False


@frozen
class StagingOverflow:
    """
    Held-back events before the first output exceeded the cap, or one
    SSE line exceeded the line guard (R22).

    @ivar size: bytes held.
    """

    size: int = 0


@frozen
class PoolBusy:
    """
    The ctx_pool could not lend an upstream connection in time (R-B3).

    @ivar reason: C{timeout} or C{conn_queue_full}.
    """

    reason: str = ""


@frozen
class Departed:
    """
    The client left, or relay cancelled the attempt on the client's behalf
    (pre-emption R68, shutdown). Nothing is judged and nothing is written
    for it: it has no fields bookkeeping could read (R2).

    @ivar reason: why, for logs only.
    """

    reason: str = "client_gone"


@frozen
class Refused:
    """
    relay did not send the turn to this account at all (its WebSocket mode
    is C{off}, R48). No upstream was involved, so nothing is recorded.

    @ivar reason: why, for logs.
    """

    reason: str = ""


#: Every attempt end but L{Completed}, L{Forwarded}, L{Departed} and
#: L{Refused}: the failures.
FAILURES = (
    StatusRefused,
    InBandFailure,
    TransportFailure,
    StreamCut,
    StreamEnded,
    EmptyCompletion,
    RelayTimeout,
    StagingOverflow,
    PoolBusy,
)


def afterOutput(end) -> bool:
    """
    Whether C{end} happened after output had reached the client (then
    nothing fails over, R19 step 2).

    @param end: an attempt end.
    """
    return bool(getattr(end, "afterOutput", False))
