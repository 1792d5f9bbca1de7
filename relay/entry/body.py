# -*- test-case-name: tests.test_body, tests.test_requestside -*-
"""
Request bodies: the size limit and C{Content-Encoding},
held raw and decoded only after the key's slot is admitted
(behaviour.md R103; the order of checks is L{relay.entry.intake}'s).

  - B{Limit} (C{gateway.max_request_body_bytes}, default 64 MiB): a
    C{Content-Length} above it is answered 413 as soon as the headers are
    read, before any of the body is; a chunked (or compressed) body is
    counted while it arrives and answered 413 the moment it crosses the
    limit. Either way relay stops storing the body at once (nothing more is
    spooled to a file), writes the 413 with C{Connection: close} and the
    request's id (C{X-Request-Id} and C{error.request_id}, adopted or made
    by L{relay.base.requestid.requestIdOf} as for every answer), and
    half-closes: it keeps reading and discarding what the client is still
    sending for at most L{LINGER_SECONDS}, so that the client reads the 413
    instead of a reset, then drops the connection.
  - B{Content-Encoding}: C{gzip} (and C{x-gzip}), C{deflate} (zlib-wrapped or
    raw), C{zstd}, C{identity}, and chains of them (C{gzip, zstd} was
    gzipped, then zstd-compressed) are decoded while the body arrives, by
    streaming decompressors whose output is bounded: no stage ever produces
    more than the limit (a 1 MB -> 1 GB bomb is refused with 413 after
    inflating at most the limit, in 64 KiB steps). The application then
    sees the decoded JSON (routing and session hashing read it) and no
    C{Content-Encoding} header; upstream gets plain JSON re-serialised by
    relay with its own length. Corrupt or truncated data is answered 400,
    an encoding relay does not know 415 (both in OpenAI's error envelope,
    once the body has arrived; it is discarded, not stored).

Transport adapter only; no policy (architecture.md invariant 1).
"""

from __future__ import annotations

import io
import tempfile
import zlib
from urllib.parse import unquote_to_bytes
from typing import Callable, Optional

from attrs import evolve
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import Request as HTTPRequest
from twisted.web.http import parse_qs
from twisted.web.http_headers import Headers, _nameEncoder
from twisted.web.resource import _IEncodingResource, getChildForRequest
from twisted.web.server import Request, Site
from twisted.web.server import version as _SERVER

from relay.entry import intake as _intake
from relay.entry.bodywait import BodyRate, KeysWait, SlotWait
from relay.base.requestnotes import RequestNotes
from relay.entry.sinks import errorBody, isMessagesPath, writeError
from relay.translate.anthropic.errors import anthropicBody, anthropicStatus
from relay.frontdoor.budgets import parsedBound, parsedEstimate, parsedOver, shapeEstimate
from relay.frontdoor.record import Admission
from relay.frontdoor.parse import NOT_JSON_MESSAGE, RequestRefused, readJSON
from relay.wire.jsoncodec import LARGE_BODY_BYTES
from relay.wire.rawjson import RawObject
from relay.wire.sendnow import socketOf
from relay.base.records import ClientError
from relay.base.requestid import requestIdOf

_CANONICAL = _nameEncoder._canonicalHeaderCache

# One byte is looked for in bytes by its int value. CPython 3.11's
# C{b"x" in data} first tries the operand as an int, raising and clearing a
# formatted TypeError (~1,900 instructions), before it searches.
_CR, _LF, _PERCENT, _QUESTION = 13, 10, 37, 63

DEFAULT_MAX_BODY_BYTES = 64 * 2**20
"""The default of C{gateway.max_request_body_bytes} (config.md)."""

LINGER_SECONDS = 2.0
"""How long relay keeps reading (and discarding) after a 413 before it drops
the connection, so the client reads the answer instead of a reset."""

CHUNK = 64 * 2**10
"""The most a decompressor produces per step (bytes)."""

SPOOL_BYTES = 8 * 2**20
"""Bodies up to this size stay in memory; larger ones go to a temporary file
(twisted.web's own threshold is 100 000 bytes for a known length). A Codex
history of a few MiB is parsed whole once it is in, so it is kept in memory
from the start (its bytes count against the bytes in flight either way)."""

READ_BYTES = 2**20
"""The most one read of the connection takes while a body of a known
length above 64 KiB (Twisted's read size) arrives: a 1 MiB Codex history
comes in a few reads (and reactor rounds) instead of sixteen."""

ZSTD_MAX_WINDOW = 2**27
"""The largest zstd window relay accepts (128 MiB, zstd's own default
limit); a frame that needs more is corrupt input."""

ENCODINGS = ("gzip", "x-gzip", "deflate", "zstd", "identity")
"""The C{Content-Encoding} tokens relay decodes."""


class BodyTooLarge(Exception):
    """
    A body (or one decoding stage's output) went past the limit.
    """


class CorruptBody(Exception):
    """
    Compressed data that does not decode (or ends early).
    """


class UnsupportedEncoding(Exception):
    """
    A C{Content-Encoding} token relay does not know.

    @ivar encoding: the token.
    """

    def __init__(self, encoding: str):
        super().__init__(encoding)
        self.encoding = encoding


def tooLarge(limit: int) -> ClientError:
    """
    The 413 envelope.

    @param limit: the limit in bytes, named in the message.
    """
    return ClientError(
        413, "invalid_request_error",
        f"Request payload is too large (the limit is {limit} bytes).",
        code="request_too_large",
    )


def corrupt(detail: str) -> ClientError:
    """
    The 400 envelope for a body that does not decode.
    """
    return ClientError(
        400, "invalid_request_error",
        f"We could not decode the request body ({detail}).", code="invalid_content_encoding",
    )


def unsupported(encoding: str) -> ClientError:
    """
    The 415 envelope for an unknown C{Content-Encoding}.
    """
    return ClientError(
        415, "invalid_request_error",
        f"Unsupported Content-Encoding {encoding!r}; relay accepts gzip, deflate and zstd.",
        code="unsupported_content_encoding",
    )


class _Counted:
    """
    The end of a decoding stage: counts its output against the limit, then
    passes it on.
    """

    def __init__(self, out: Callable[[bytes], None], limit: int):
        self._out = out
        self._limit = limit
        self.total = 0

    def __call__(self, data: bytes) -> None:
        if not data:
            return
        self.total += len(data)
        if self.total > self._limit:
            raise BodyTooLarge(self.total)
        self._out(data)


class _ZlibStage:
    """
    gzip or deflate, bounded: each step inflates at most L{CHUNK} bytes.
    Concatenated gzip members are decoded one after another (RFC 1952).
    """

    def __init__(self, gzip: bool, out: Callable[[bytes], None]):
        self._gzip = gzip
        self._out = out
        self._d = zlib.decompressobj(31) if gzip else None
        self._head = b""
        self._done = False

    def _start(self, data: bytes) -> bytes:
        """
        deflate: zlib-wrapped (RFC 1950) or raw (RFC 1951), told by the
        first two bytes.
        """
        data = self._head + data
        if len(data) < 2:
            self._head = data
            return b""
        self._head = b""
        cmf, flg = data[0], data[1]
        wrapped = cmf & 0x0F == 8 and (cmf * 256 + flg) % 31 == 0
        self._d = zlib.decompressobj(15 if wrapped else -15)
        return data

    def write(self, data: bytes) -> None:
        if self._d is None:
            data = self._start(data)
            if not data:
                return
        name = "gzip" if self._gzip else "deflate"
        try:
            while True:
                if self._done:
                    rest = data.lstrip(b"\0") if self._gzip else data
                    if not rest:
                        return
                    if not self._gzip:
                        raise CorruptBody("deflate: data after the end of the stream")
                    self._d, self._done, data = zlib.decompressobj(31), False, rest
                piece = self._d.decompress(data, CHUNK)
                self._out(piece)
                if self._d.eof:
                    self._done, data = True, self._d.unused_data
                    continue
                data = self._d.unconsumed_tail
                if not data and len(piece) < CHUNK:
                    return
        except zlib.error as e:
            raise CorruptBody(f"{name}: {e}") from e

    def close(self) -> None:
        if self._d is None:
            if self._head:
                raise CorruptBody("deflate: truncated")
            return
        if not self._done:
            raise CorruptBody(("gzip" if self._gzip else "deflate") + ": truncated")


class _ZstdStage:
    """
    zstd, bounded: python-zstandard's stream writer hands its output to
    L{_Counted} in L{CHUNK}-sized pieces, and L{BodyTooLarge} raised there
    stops the decompression mid-frame.
    """

    def __init__(self, out: Callable[[bytes], None]):
        stage = self

        class _Writer:
            def write(self, data: bytes) -> int:
                stage._produced = True
                out(data)
                return len(data)

        import zstandard  # late, for RSS: only once a zstd body comes

        self._zstd = zstandard
        self._produced = False
        self._seen = False
        self._w = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).stream_writer(
            _Writer(), write_size=CHUNK, write_return_read=True
        )

    def write(self, data: bytes) -> None:
        if not data:
            return
        self._seen = True
        try:
            self._w.write(data)
        except self._zstd.ZstdError as e:
            raise CorruptBody("zstd: " + str(e)) from e

    def close(self) -> None:
        if self._seen and not self._produced:
            raise CorruptBody("zstd: no complete frame")


def contentDecoder(header: Optional[bytes], limit: int, out: Callable[[bytes], None]):
    """
    A decoder for C{header} (the C{Content-Encoding} value) whose decoded
    output goes to C{out}, or L{None} when the body is not encoded.

    @param header: the raw header value, e.g. C{b"gzip, zstd"}.
    @param limit: the most any stage may produce, in bytes.
    @param out: called with each piece of decoded body.
    @return: an object with C{write(bytes)} and C{close()} (which raise
        L{BodyTooLarge} or L{CorruptBody}), or L{None}.
    @raise UnsupportedEncoding: for a token not in L{ENCODINGS}.
    """
    if not header:
        return None
    tokens = [t.strip().lower() for t in header.decode("latin-1").split(",")]
    tokens = [t for t in tokens if t and t != "identity"]
    for token in tokens:
        if token not in ENCODINGS:
            raise UnsupportedEncoding(token)
    if not tokens:
        return None
    stages = []
    sink = _Counted(out, limit)
    for token in tokens:  # the first listed was applied first: decoded last
        if token == "zstd":
            stage = _ZstdStage(sink)
        else:
            stage = _ZlibStage(token in ("gzip", "x-gzip"), sink)
        stages.append(stage)
        sink = _Counted(stage.write, limit)
    return _Chain(stages[::-1])


class _Chain:
    """
    Decoding stages, outermost first.
    """

    def __init__(self, stages: list):
        self._stages = stages

    def write(self, data: bytes) -> None:
        self._stages[0].write(data)

    def close(self) -> None:
        for stage in self._stages:
            stage.close()


def _contentFile(length: Optional[int]):
    """
    Where a body is kept while it arrives.
    """
    if length is not None and length < SPOOL_BYTES:
        content = io.BytesIO()
        if length > CHUNK:
            # Sized once for the declared length: a growing buffer copies
            # itself about 40 times on the way to 1 MiB.
            content.seek(length - 1)
            content.write(b"\0")
            content.seek(0)
        return content
    return tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)


RATIO_FLOOR_BYTES = 2**20
"""A compressed body may always decode to this much, whatever its ratio."""


def decodeHeld(raw, encoding: bytes, limit: int, ratio, received: int):
    """
    Decode a held raw body, bounded by the limit and by the
    decompression ratio, into a new content file.

    @param raw: the raw body's file (read from its start; closed unless
        its data does not decode).
    @param encoding: the C{Content-Encoding} header value.
    @param limit: the request's body limit, bytes.
    @param ratio: C{gateway.limits.max_decompression_ratio}, or L{None}.
    @param received: the raw body's size, bytes.
    @return: the decoded body's file (at its end), or the L{ClientError}
        refusing it: 413 (over the limit or the ratio), 400 (corrupt).
    """
    raw.seek(0)
    bound = limit
    ratioBound = None
    if ratio:
        ratioBound = max(int(ratio * max(received, 1)), RATIO_FLOOR_BYTES)
        bound = min(bound, ratioBound)
    out = _contentFile(None)
    try:
        decoder = contentDecoder(encoding, bound, out.write)
        while True:
            piece = raw.read(CHUNK)
            if not piece:
                break
            decoder.write(piece)
        decoder.close()
    except BodyTooLarge:
        out.close()
        raw.close()
        if ratioBound is not None and bound == ratioBound and ratioBound < limit:
            return ClientError(
                413, "invalid_request_error",
                f"The compressed request body decodes to more than {ratio:g} times its size"
                " (gateway.limits.max_decompression_ratio).",
                code="decompression_ratio_exceeded",
            )
        return tooLarge(limit)
    except CorruptBody as e:
        out.close()
        return corrupt(str(e))
    raw.close()
    out.seek(0, io.SEEK_END)
    return out


def chargeParsed(content, budget, keyName: str, limits, charged: int):
    """
    Replace the raw bytes counted for a body by what it may take once
    parsed, until the request ends (R103). A large body (more than
    L{LARGE_BODY_BYTES}, a Codex history) is held at L{parsedBound}, the
    most its parse can take, when that fits: no pass over its bytes, and
    L{relayJSON} brings the hold down to L{shapeEstimate} as soon as it has
    read the body. Otherwise (a small body, or the bound does not fit) the
    hold is L{parsedEstimate}, one pass over the bytes.

    @param content: the decoded body's file (left at its end).
    @param budget: the bodies in flight (C{reserve}, C{release}).
    @param keyName: the key the bytes count against.
    @param limits: the C{gateway.limits} in force.
    @param charged: the raw bytes counted so far (released here).
    @return: C{(bytes now counted, None)}, or C{(0, the ClientError)}:
        413 over a bound, else what the budget refused with.
    """
    length = content.seek(0, io.SEEK_END)
    budget.release(keyName, charged)
    if length > LARGE_BODY_BYTES:
        bound = parsedBound(length)
        if parsedOver(bound, limits) is None and budget.reserve(
            keyName, bound, limits.body_bytes_in_flight_per_key, limits.body_bytes_in_flight
        ) is None:
            return bound, None
    if content.__class__ is io.BytesIO:
        data = content.getvalue()  # what seek, read, seek gives
    else:
        content.seek(0)
        data = content.read()
    content.seek(0, io.SEEK_END)
    estimate = parsedEstimate(data)
    del data
    over = parsedOver(estimate, limits)
    if over is not None:
        return 0, tooLargeParsed(estimate, *over)
    error = budget.reserve(keyName, estimate, limits.body_bytes_in_flight_per_key,
                           limits.body_bytes_in_flight)
    if error is not None:
        return 0, error
    return estimate, None


def tooLargeParsed(estimate: int, scope: str, limit: int) -> ClientError:
    """
    The 413 for a body whose parsed size's C{estimate} is over a bound
    (L{parsedOver}'s C{scope} and C{limit}).
    """
    name = ("gateway.limits.body_bytes_in_flight_per_key" if scope == "key"
            else "gateway.limits.body_bytes_in_flight")
    return ClientError(
        413, "invalid_request_error",
        f"Request payload is too large: it would take about {estimate} bytes once"
        f" parsed, over {name} ({limit} bytes).",
        code="request_too_large",
    )


def reasonPhrase(status: int) -> bytes:
    """
    The reason phrase relay writes for C{status} on an answer it writes to
    the transport itself.
    """
    from http import HTTPStatus

    if status == 413:
        return b"Payload Too Large"
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b"Error"


def rawAnswer(error: ClientError, requestId: str, path: bytes = b"") -> tuple[bytes, int]:
    """
    An answer relay writes to the transport itself, before (the rest of)
    the body: C{error} in OpenAI's envelope (Anthropic's on the Messages
    surface, R115) with C{Connection: close} and the request's id
    (C{X-Request-Id} and C{error.request_id}).

    @param path: the request target, when known.
    @return: C{(the whole answer's bytes, its body's length)}.
    """
    if isMessagesPath(path):
        status, _, headers = anthropicStatus(error)
        error = evolve(error, status=status, headers=tuple(
            (n.decode("latin-1") if isinstance(n, bytes) else n,
             v.decode("latin-1") if isinstance(v, bytes) else v) for n, v in headers))
        body = anthropicBody(error, requestId)
    else:
        body = errorBody(error, requestId)
    phrase = reasonPhrase(error.status)
    extra = b"".join(
        name.encode("latin-1") + b": " + str(value).encode("latin-1") + b"\r\n"
        for name, value in (error.headers or ())
    )
    return (
        b"HTTP/1.1 %d " % error.status + phrase + b"\r\ncontent-type: application/json\r\n"
        b"x-request-id: " + requestId.encode("ascii") + b"\r\n"
        b"cache-control: no-store\r\n" + extra
        + b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
        + body
    ), len(body)


_BLANK = object()
"""What L{LimitedBodyRequest.relayJSON} read from an empty body."""


class _Headers(Headers):
    """
    twisted.web's L{Headers} with a shorter path for the calls a turn makes
    (~40 header reads and writes per turn, each through
    C{_NameEncoder.encode} and the value sanitiser): a C{bytes} name
    twisted.web has canonicalised before (its C{_canonicalHeaderCache},
    where every constant name relay and twisted.web use lands on first use)
    is looked up once, and a C{bytes} value with no CR or LF is stored as
    is (what C{_sanitizeLinearWhitespace} returns for it). Anything else
    goes to twisted.web's own method. Same layout (no slots of its own), so
    a request's two L{Headers} become these by a class change
    (L{LimitedBodyRequest.__init__}); C{tests.test_requestside} compares both
    classes' results on names and values of every kind.
    """

    __slots__ = ()

    def getRawHeaders(self, name, default=None):
        if name.__class__ is bytes:
            canonical = _CANONICAL.get(name)
            if canonical is not None:
                values = self._rawHeaders.get(canonical)
                return values if values else default
        elif name.__class__ is str:
            canonical = _CANONICAL.get(name)
            if canonical is not None:
                values = self._rawHeaders.get(canonical)
                return [v.decode("utf8") for v in values] if values else default
        return Headers.getRawHeaders(self, name, default)

    def setRawHeaders(self, name, values) -> None:
        if name.__class__ is bytes and values.__class__ is list and len(values) == 1:
            value = values[0]
            canonical = _CANONICAL.get(name)
            if (
                canonical is not None and value.__class__ is bytes
                and _CR not in value and _LF not in value
            ):
                self._rawHeaders[canonical] = [value]
                return
        Headers.setRawHeaders(self, name, values)


_newHeaders = _Headers.__new__


class _OnGone:
    """
    A L{Request.notifications} entry that is no L{Deferred}: twisted.web
    calls C{callback(None)} on every entry when the answer is finished and
    C{errback(reason)} when the connection is lost first; only the latter
    calls C{f(reason)} (L{LimitedBodyRequest.relayOnGone}).
    """

    __slots__ = ("_f",)

    def __init__(self, f):
        self._f = f

    def callback(self, result) -> None:
        pass

    def errback(self, reason) -> None:
        try:
            self._f(reason)
        except Exception:  # noqa: BLE001 - as a Deferred keeps it: the other entries run
            LimitedBodyRequest._log.failure("Unhandled error in a request's gone callback")


class LimitedBodyRequest(Request):
    """
    A twisted.web L{Request} that checks credentials from the headers,
    bounds and holds the raw body, admits the key's slot, then decodes
    C{Content-Encoding} (see the module docstring and
    L{relay.entry.intake}). The limit is the site's C{maxRequestBodyBytes}
    (L{DEFAULT_MAX_BODY_BYTES} when unset); the intake is the site's
    C{intake} (L{None}: no credential check, as in unit tests of this
    module).

    @ivar bodyLimit: the limit in force for this request, bytes.
    @ivar contentEncoding: the decoded C{Content-Encoding} value, or L{None}.
    @ivar notes: the request's L{relay.base.requestnotes.RequestNotes}.
    @ivar admission: the L{relay.frontdoor.record.Admission} of a client
        route's request: its key, authenticated from the headers, and the
        key's slot admitted before decoding, until a resource hands it to
        a turn (L{relay.frontdoor.record.Admission.handOver}); else L{None}.
    """

    _log = Logger()
    bodyLimit = DEFAULT_MAX_BODY_BYTES
    contentEncoding = None
    admission = None
    _intake = None
    _encoding = None
    _bodyError: Optional[ClientError] = None
    _refused = False
    _discard = False
    _received = 0
    _charged = 0
    _atBound = False
    """The body is held at L{parsedBound} (L{chargeParsed}) until
    L{relayJSON} has read it, or the resource has rendered."""
    _linger = None
    _rate = None
    _rateFrom = None
    """The byte count the minimum body rate's window starts at, while its
    L{BodyRate} waits for L{relayArmLate} (L{_armRate})."""
    _chunked = False
    _keysWait = None
    _slotWait = None
    _widened = None
    _json = None
    _parsed = False
    relayBodySize = 0
    relayRawBody = None
    """A large body's bytes and top-level values (L{RawObject}), once
    L{relayJSON} read it (a turn's L{relay.base.records.Turn.rawBody})."""
    """The decoded body's bytes, once L{relayJSON} read it (a turn's
    L{relay.base.records.Turn.bodySize})."""
    _done = False
    """The request's id once L{relay.base.requestid.requestIdOf} chose it."""
    relayRawHeaders = True
    """C{getHeader} is twisted.web's, over C{requestHeaders._rawHeaders}
    (L{relay.base.requestid.requestIdOf} reads the id headers there)."""

    def __init__(self, channel, *args, **kwargs):
        if len(args) > 1 or kwargs or not getattr(channel, "relayPlainRequests", False):
            super().__init__(channel, *args, **kwargs)
            self.notes = RequestNotes()
            self.requestHeaders.__class__ = _Headers
            self.responseHeaders.__class__ = _Headers
            return
        # What twisted.web's server.Request and http.Request
        # __init__ (and Componentized's) set, without their three calls,
        # for a channel of relay's own (RelayHTTPChannel, which has a site);
        # tests.test_requestside compares both requests' attributes.
        self.notifications = []
        self.channel = channel
        _, self.client, self.host = channel._addresses()  # getPeer(), getHost()
        self.requestHeaders = headers = _newHeaders(_Headers)  # _Headers(), without its call
        headers._rawHeaders = {}
        self.received_cookies = {}
        self.responseHeaders = headers = _newHeaders(_Headers)
        headers._rawHeaders = {}
        self.cookies = []
        self.transport = channel.transport
        self.queued = args[0] if args else False
        self._adapterCache = {}
        self.notes = RequestNotes()

    def relayOnGone(self, f) -> None:
        """
        Call C{f(reason)} if the connection is lost before the answer is
        finished: what C{notifyFinish().addErrback(f)} does, in the same
        order among the request's notifications, without a L{Deferred}
        (L{relay.entry.sinks}).
        """
        self.notifications.append(_OnGone(f))

    @property
    def _parsePOSTFormSubmission(self) -> bool:
        """
        relay reads JSON only: twisted.web never parses a form or
        multipart body (R103).
        """
        return False

    @_parsePOSTFormSubmission.setter
    def _parsePOSTFormSubmission(self, value: bool) -> None:
        pass

    # -- headers in ------------------------------------------------------------

    def gotLength(self, length: Optional[int]) -> None:
        """
        The headers are in: check the credentials (R103), refuse a declared
        length over the limit at once, and prepare to hold the raw body.
        A client request whose key the ring cannot tell yet (the control
        store's first read at start, R105) waits first, its body unread
        (L{_holdForKeys}).
        """
        I = _intake

        site = getattr(self.channel, "site", None)
        clock = getattr(site, "clock", None)
        if clock is not None and self.notes.startedAt is None:
            # the access line of an answer written from the headers has a
            # duration too (relay.process.app._Site.log; process() sets it anew)
            self.notes.startedAt = clock.seconds()
        self.bodyLimit = getattr(site, "maxRequestBodyBytes", DEFAULT_MAX_BODY_BYTES)
        self._chunked = length is None
        overCap = getattr(self.channel, "relayOverCap", None)
        if overCap is not None and not I.isHealthPath(getattr(self.channel, "_path", b"")):
            # a connection of the over-cap allowance answers the health
            # routes only (relay.entry.site.OVER_CAP_ALLOWANCE)
            self.content = None
            refuse = getattr(site, "refuseOverCap", None)
            if refuse is not None:
                refuse(getattr(self.getClientAddress(), "host", "-"), overCap)
            self._answerNow(I.TOO_MANY_CONNECTIONS)
            return
        policy = getattr(site, "intake", None)
        if policy is None:
            self._headersIn(length, None, None, None)
            return
        method = (getattr(self.channel, "_command", b"") or b"").upper()
        path = getattr(self.channel, "_path", b"") or b"/"
        route = I.routeClass(path, method)
        self.notes.route = route
        if route == I.ROUTE_CLIENT:
            pending = policy.keysReady()
            if pending is not None:
                self._holdForKeys(pending, length, policy, route, method, path)
                return
        self._headersIn(length, policy, route, method)

    def _headersIn(self, length, policy, route, method) -> None:
        """
        See L{gotLength}: the checks once the key can be told.
        """
        I = _intake

        if policy is not None:
            key, error = policy.authenticate(route, self)
            if error is not None:
                self.content = None
                policy.logRefused(self, route, error)
                self._answerNow(error)
                return
            self._intake = policy
            if key is not None:
                self.admission = Admission(key)
            self.bodyLimit = policy.bodyLimit(route, self.bodyLimit)
            if route == I.ROUTE_OPEN or method not in I.BODY_METHODS:
                self._discard = True
        if self._discard:
            # docs/security.md: a body the route does not read is discarded
            # unread -- whatever its size or encoding, but still under the
            # minimum body rate.
            self.content = io.BytesIO()
            if length != 0:
                self._armRate()
            return
        if length is not None and length > self.bodyLimit:
            self.content = None
            self._refuseNow(length)
            return
        sent = self.requestHeaders._rawHeaders.get(b"Content-Encoding")
        if sent:
            header = sent[0]
            try:
                self._encoding = header if contentDecoder(header, 1, lambda d: None) else None
            except UnsupportedEncoding as e:
                self._bodyError = unsupported(e.encoding)
        self.content = _contentFile(length)
        if length and not self._reserve(length):
            return
        if length != 0:
            self._armRate()
        if length is not None and length > CHUNK:
            self._widenReads(min(length + CHUNK, READ_BYTES))

    def _widenReads(self, size: int) -> None:
        """
        Read the connection C{size} bytes at a time (a plain TCP connection
        only; Twisted's own read size comes back with the body's end,
        L{requestReceived}).
        """
        conn = socketOf(self.channel.transport) if self.channel is not None else None
        if conn is not None:
            conn.bufferSize = size
            self._widened = conn

    def _narrowReads(self) -> None:
        conn, self._widened = self._widened, None
        if conn is not None:
            del conn.bufferSize  # the class's (Twisted's) read size again

    # -- waiting for the key ring at start (R105) ---------------------------------

    def _holdForKeys(self, pending, length, policy, route, method, path) -> None:
        """
        The key ring cannot tell keys yet: wait for it, the body unread
        (L{relay.entry.bodywait.KeysWait}; R103, R105).
        """
        self.method, self.uri = method, path  # for an access line while held
        self.content = io.BytesIO()
        wait = self._keysWait = KeysWait(self, pending, (length, policy, route, method))
        wait.start()

    def _endKeysWait(self) -> None:
        """
        Stop waiting for the key ring (L{relay.entry.bodywait.KeysWait.end}).
        """
        wait, self._keysWait = self._keysWait, None
        if wait is not None:
            wait.end(self._refused)

    def _limits(self):
        intake = self._intake
        return intake.limits() if intake is not None and intake.limits is not None else None

    def _reserve(self, n: int) -> bool:
        """
        Count C{n} more bytes against the key's and the process's bodies in
        flight; answer at once when over.

        @return: whether the bytes are held.
        """
        admission = self.admission
        limits = self._limits()
        if admission is None or limits is None:
            return True
        key = admission.key
        error = self._intake.budget.reserve(
            key.name, n, limits.body_bytes_in_flight_per_key, limits.body_bytes_in_flight
        )
        if error is None:
            self._charged += n
            return True
        self._intake.logRefused(self, self.notes.route, error)
        self._dropContent()
        self._answerNow(error)
        return False

    def _readJSON(self, raw: bytes) -> None:
        """
        Parse the body (the one reader, L{relay.frontdoor.parse.readJSON}),
        a large one as the extension of one its key sent before when it is
        one (L{relay.frontdoor.reuse.HistoryReuse}); bring its hold down to
        its shape's estimate (up by what its strings that are not ASCII take
        beyond their bytes, when the pass's estimate was held); keep a
        large one's bytes for the splice (L{RawObject}) and for the key's
        next turn.

        @raise RequestRefused: not JSON; 413 or 429 when the shape's
            estimate does not fit the bytes in flight (R103).
        """
        large = len(raw) > LARGE_BODY_BYTES
        histories = getattr(self._intake, "histories", None) if large else None
        # the key's owner (R104): a key issued again under the name is another
        key = self.admission.key.ownerId if histories is not None and self.admission else None
        found = histories.read(key, raw) if key is not None else None
        if found is not None:
            self._json, counts, extends, layout = found
            self.relayRawBody = RawObject(raw, self._json, layout)  # spliced upstream
        else:
            shape = []
            self._json = readJSON(raw, shape)
            counts, extends = (shape[0] if shape else None), None
            if large and self._json.__class__ is dict:
                self.relayRawBody = RawObject(raw, self._json)  # spliced upstream
        if counts is not None:
            estimate = shapeEstimate(len(raw), *counts)
            wide = counts[3:]  # what strings that are not ASCII take, when some
            if wide and estimate > self._charged > 0:
                # held at the pass's estimate, which counts their bytes only
                self._holdMore(min(estimate, self._charged + wide[0]))
            self._settleParsed(estimate)
        elif self._atBound:
            # read by the standard library (orjson's reading was not
            # certain): the bound would stay held for the whole turn
            self._settleParsed(parsedEstimate(raw))
        if self.relayRawBody is not None and key is not None and counts is not None:
            histories.remember(key, self.relayRawBody, counts, extends)

    def _holdMore(self, estimate: int) -> None:
        """
        Hold C{estimate} (a read body's shape's estimate, above the pass's
        estimate held while it was read) until the request ends.

        @raise RequestRefused: the 413 or 429 of L{chargeParsed}.
        """
        limits, name = self._limits(), self.admission.key.name
        over = parsedOver(estimate, limits)
        error = tooLargeParsed(estimate, *over) if over is not None else self._intake.budget.reserve(
            name, estimate - self._charged, limits.body_bytes_in_flight_per_key,
            limits.body_bytes_in_flight)
        if error is not None:
            raise RequestRefused(error)
        self._charged = estimate

    def _settleParsed(self, estimate: int) -> None:
        """
        Bring the body's hold down to C{estimate}, its parsed size's
        estimate once read (L{chargeParsed}); never up.
        """
        self._atBound = False
        if self._charged > estimate and self._intake is not None and self.admission is not None:
            self._intake.budget.release(self.admission.key.name, self._charged - estimate)
            self._charged = estimate

    def _settleUnread(self) -> None:
        """
        The resource rendered without reading the body as JSON (a
        multipart image edit, a route that ignores its body, a body that
        is not JSON): L{parsedBound} was held for a parse that did not
        come; hold L{parsedEstimate} instead (one pass over the bytes),
        for the rest of the request (R103).
        """
        content = self.content
        if not self._charged or content is None or content.closed:
            self._atBound = False
            return
        if content.__class__ is io.BytesIO:
            data = content.getvalue()
        else:
            at = content.tell()
            content.seek(0)
            data = content.read()
            content.seek(at)
        self._settleParsed(parsedEstimate(data))

    def _releaseBudget(self) -> None:
        if self._charged and self._intake is not None and self.admission is not None:
            self._intake.budget.release(self.admission.key.name, self._charged)
        self._charged = 0

    # -- the minimum body rate -------------------------------------------------

    def _armRate(self) -> None:
        """
        Start the minimum body rate's window (L{relay.entry.bodywait.BodyRate})
        when a rate is configured. While the read that brought the headers
        hands the whole body over (C{relayBodyIn}, see
        L{relay.entry.bodywait.BodyRate.arm}) only the window's start is
        noted: the L{BodyRate} is built by L{relayArmLate} if the body is
        still not in then (most bodies are in before: no object, no timer).
        """
        limits = self._limits()
        if limits is None or not limits.min_body_bytes_per_second:
            return
        rate = self._rate
        if rate is None:
            if getattr(self.channel, "relayBodyIn", None) is self:
                self._rateFrom = self._received
                return
            rate = self._rate = BodyRate(self)
        rate.arm(limits)

    def relayArmLate(self) -> None:
        """
        See L{relay.entry.bodywait.BodyRate.armLate}
        (L{relay.entry.site.RelayHTTPChannel._relayHead}).
        """
        start = self._rateFrom
        if start is not None:
            self._rateFrom = None
            rate = self._rate = BodyRate(self)
            rate.armLate(start)
        elif self._rate is not None:
            self._rate.armLate()

    def _stopRate(self) -> None:
        # Dropped, not kept: the rate refers to the request, and a request
        # left in that cycle keeps its body and its parse alive until a
        # full collection (dozens of 1 MiB Codex bodies at c=32).
        self._rateFrom = None
        rate, self._rate = self._rate, None
        if rate is not None:
            rate.stop()

    # -- the body arrives ------------------------------------------------------

    def handleContentChunk(self, data: bytes) -> None:
        """
        A piece of the body: count it and hold it raw, or drop it once the
        answer is decided (or when the route reads no body).
        """
        if self._refused:
            return
        if self._keysWait is not None:
            self._keysWait.hold(data)
            return
        self._received += len(data)
        if self._discard:
            return
        if self._received > self.bodyLimit:
            self._refuseNow(None)
            return
        if self._bodyError is not None:
            return
        if self._chunked and not self._reserve(len(data)):
            return  # chunked: held bytes are counted as they come
        self.content.write(data)

    def _bodyFailed(self, error: ClientError) -> None:
        """
        Answer C{error} once the body has arrived; store nothing more.
        """
        self._bodyError = error
        self._dropContent()
        self.content = io.BytesIO()

    def _dropContent(self) -> None:
        if self.content is not None:
            self.content.close()
            self.content = None

    def requestReceived(self, command, path, version) -> None:
        """
        The whole raw body is in: admit the key's slot (R103, through the
        site's intake), then decode and process (or, when the answer was
        already written, nothing).
        """
        if self._rate is not None or self._rateFrom is not None:
            self._stopRate()
        if self._widened is not None:
            self._narrowReads()
        if self._refused:
            return
        if self._keysWait is not None:
            # R105: the whole body came with the headers; it is looked at
            # once the key can be told (L{relay.entry.bodywait.KeysWait}).
            self._keysWait.received = (command, path, version)
            return
        admit = self._intake.admitKey if self._intake is not None else None
        if self._intake is not None and self.admission is not None and self._intake.draining():
            # relay drains; the drain gate answers 503. No slot is
            # taken and the body is neither decoded nor parsed.
            self._encoding = None
            self._dropContent()
            self.content = io.BytesIO()
            self._decodeAndProcess(command, path, version)
            return
        if (
            admit is not None and self.admission is not None and not self._discard
            and self._bodyError is None and self._received
        ):
            takesSlot = self._intake.takesSlot
            if takesSlot is not None and not takesSlot(self.admission.key):
                # R26: a key without a slot is admitted at once, with no
                # lease (the front door's rule): nothing to wait for
                self.admission = Admission(self.admission.key, True)
                self._decodeAndProcess(command, path, version)
                return
            wait = self._slotWait = SlotWait(self, command, path, version)
            wait.start(admit)  # then _decodeAndProcess (relay.entry.bodywait)
            return
        self._decodeAndProcess(command, path, version)

    def _decodeAndProcess(self, command, path, version) -> None:
        if self._encoding is not None and self._bodyError is None and self.content is not None:
            self._decode()
        if self._bodyError is None and self.content is not None and not self._discard:
            if self.admission is not None:
                limits = self._limits()
                if limits is not None:
                    self._chargeParsed(limits)
        self._requestReceived(command, path, version)

    def _decode(self) -> None:
        """
        Decode the held raw body into a new content file (L{decodeHeld}).
        """
        limits = self._limits()
        ratio = limits.max_decompression_ratio if limits is not None else None
        decoded = decodeHeld(self.content, self._encoding, self.bodyLimit, ratio, self._received)
        if isinstance(decoded, ClientError):
            self._bodyFailed(decoded)
            if decoded.status == 413:
                self._logRefusedBody()
            return
        self.contentEncoding = self._encoding.decode("latin-1")
        self.requestHeaders.removeHeader(b"content-encoding")
        self.content = decoded

    def _chargeParsed(self, limits) -> None:
        """
        Count the decoded body at its parsed size's estimate until the
        request ends (L{chargeParsed}).

        @param limits: the C{gateway.limits} in force.
        """
        charged, self._charged = self._charged, 0
        self._charged, error = chargeParsed(self.content, self._intake.budget,
                                            self.admission.key.name, limits, charged)
        self._atBound = error is None and self._charged == parsedBound(self.content.tell())
        if error is not None:
            self._bodyFailed(error)
            self._logRefusedBody()

    def _logRefusedBody(self) -> None:
        self._log.info(
            "request body refused with {status}: {message}", event="http.request_body_refused",
            status=self._bodyError.status, message=self._bodyError.message,
            request_id=requestIdOf(self),
        )

    # -- for resources (relay.entry.intake) ---------------------------------------

    def relayJSON(self, allowEmpty: bool = False):
        """
        The decoded body parsed as JSON, once (L{relay.frontdoor.parse.readJSON}).
        The one body reader of every resource behind the intake: client
        routes (turns, C{/v1/responses/*}) and admin routes (through
        L{relay.control.web.readJSONBody}).

        @param allowEmpty: an empty (or blank) body reads as C{{}} (routes
            whose body is optional) instead of a 400.
        @raise relay.frontdoor.parse.RequestRefused: a 400 for a body that is
            not JSON (or nests too deep).
        """
        if not self._parsed:
            content = self.content
            if content.__class__ is io.BytesIO and not content.tell():
                raw = content.getvalue()  # the buffer itself, not a copy of it
                content.seek(0, io.SEEK_END)
            else:
                raw = content.read() if content is not None else b""
            self._parsed = True
            self.relayBodySize = len(raw)
            if not raw.strip():
                self._json, self.notes.bodyBlank = _BLANK, True
            else:
                try:
                    self._readJSON(raw)
                except RequestRefused as e:
                    self._json = e
            del raw
        if self._json is _BLANK:
            if allowEmpty:
                return {}
            self._json = RequestRefused(ClientError(
                400, "invalid_request_error", NOT_JSON_MESSAGE))
        if isinstance(self._json, RequestRefused):
            raise self._json
        return self._json

    def process(self) -> None:
        """
        Render, or answer the body's error (400 corrupt, 413, 415 unknown
        encoding, 429 bytes in flight) in OpenAI's envelope.
        """
        if self._bodyError is None:
            self._render()
            if self._atBound:
                self._settleUnread()
            return None
        self.site = self.channel.site
        self._log.info(
            "request body refused with {status}: {message}", event="http.request_body_refused",
            status=self._bodyError.status, message=self._bodyError.message,
            request_id=requestIdOf(self),
        )
        writeError(self, self._bodyError)

    def _render(self) -> None:
        """
        twisted.web's C{server.Request.process} (Twisted 26), re-done for
        two of its costs, on a site that offers
        C{httpDate} (L{relay.entry.site.RelaySite.httpDate}; any other site:
        twisted.web's own):

          - the C{Date} header is the site's, formatted once per second of
            its clock, instead of formatted for every request;
          - a path with no C{%} is split into C{postpath} without
            unquoting each segment (C{unquote_to_bytes} returns such a
            segment as it is).

        The rest is twisted.web's, in its order: C{Server}, C{Date},
        C{prepath}/C{postpath}, C{*}, the resource, its encoder, render,
        C{processingFailed}. C{tests.test_requestside} compares both on answers
        and on what a resource sees.
        """
        site = self.site = self.channel.site
        date = getattr(site, "httpDate", None)
        if date is None:
            return Request.process(self)
        headers = self.responseHeaders
        if headers.__class__ is _Headers:
            # setHeader's, as _Headers.setRawHeaders stores a value with no
            # CR or LF
            raw = headers._rawHeaders
            raw[b"Server"] = [_SERVER]
            raw[b"Date"] = [date()]
        else:
            self.setHeader(b"Server", _SERVER)
            self.setHeader(b"Date", date())
        self.prepath = []
        path = self.path
        if _PERCENT in path:
            self.postpath = list(map(unquote_to_bytes, path[1:].split(b"/")))
        else:
            self.postpath = path[1:].split(b"/")
        if path == b"*":
            self._handleStar()
            return None
        try:
            if type(site).getResourceFor is Site.getResourceFor:
                # twisted.web's own, without its copy.copy of the empty
                # prepath
                self.sitepath = []
                resrc = getChildForRequest(site.resource, self)
            else:
                resrc = site.getResourceFor(self)
            if _IEncodingResource.providedBy(resrc):
                encoder = resrc.getEncoder(self)
                if encoder is not None:
                    self._encoder = encoder
            self.render(resrc)
        except BaseException:
            self.processingFailed(Failure())
        return None

    def _requestReceived(self, command, path, version) -> None:
        """
        twisted.web's C{http.Request.requestReceived} (Twisted 26) for a
        request whose form body is never parsed (L{_parsePOSTFormSubmission}
        is always false here, so its C{Content-Type} is not read): the body
        rewound, C{method}, C{uri}, C{clientproto}, C{path}, C{args} (the
        query parsed only when there is one), then L{process}.
        C{tests.test_requestside} compares both.
        """
        self.content.seek(0, 0)
        self.args = {}
        self.method, self.uri = command, path
        self.clientproto = version
        if _QUESTION in path:
            self.path, argstring = path.split(b"?", 1)
            self.args = parse_qs(argstring, 1)
        else:
            self.path = path
        self.process()

    # -- answering from the transport --------------------------------------------

    def _refuseNow(self, declared: Optional[int]) -> None:
        """
        413 at once (see L{_answerNow}).
        """
        self._log.info(
            "request body over {limit} bytes refused (declared {declared}, received "
            "{received})", event="http.request_body_too_large", limit=self.bodyLimit,
            declared=declared, received=self._received, request_id=requestIdOf(self),
        )
        self._dropContent()
        self._answerNow(tooLarge(self.bodyLimit))

    def _answerNow(self, error: ClientError) -> None:
        """
        Answer C{error} at once, before (the rest of) the body: stop
        storing, write the answer with C{Connection: close} and the
        request's id (L{requestIdOf}: the client's C{X-Request-Id} when
        well-formed, else a new one) as C{X-Request-Id} and
        C{error.request_id}, half-close, and drop the connection after
        L{LINGER_SECONDS} at the latest (the client reads the answer
        instead of a reset).
        """
        self._refused = True
        self._stopRate()
        self._endKeysWait()
        self._encoding = None
        self._dropContent()
        self._releaseBudget()
        self.requestHeaders.removeHeader(b"expect")  # no "100 Continue" after the answer
        answer, length = rawAnswer(
            error, requestIdOf(self), getattr(self.channel, "_path", b"") or b"")
        transport = self.channel.transport
        transport.write(answer)
        self._accessLine(error.status, length)
        halfClose = getattr(transport, "loseWriteConnection", None)
        if halfClose is None:
            self.channel.loseConnection()
            return
        halfClose()
        self._linger = self.channel.callLater(LINGER_SECONDS, transport.abortConnection)

    def _accessLine(self, status: int, length: int) -> None:
        """
        The access line of an answer written from the transport (401 from
        the headers, 413, 429, 408): the site logs it like every finished
        request (twisted.web's C{finish} would).
        """
        channel = self.channel
        site = getattr(channel, "factory", None) or getattr(channel, "site", None)
        if site is None:
            return
        self.method = getattr(channel, "_command", None) or self.method
        self.uri = getattr(channel, "_path", None) or self.uri
        self.code, self.sentLength = status, length
        try:
            site.log(self)
        except Exception:  # noqa: BLE001 - an access line must never break the answer
            self._log.failure("writing the access line failed")

    # -- the end -----------------------------------------------------------------

    def _relayDone(self) -> None:
        """
        The request ended (answered or the client left): give back the
        bytes it held and a slot no turn took; stop a running admission.
        """
        if self._done:
            return
        self._done = True
        if self._rate is not None or self._rateFrom is not None:
            self._stopRate()
        if self._keysWait is not None:
            self._endKeysWait()
        if self._charged:
            self._releaseBudget()
        if self.admission is not None and self.admission.slot is not None:
            self.admission.slot.release()  # no turn took it
        if self._slotWait is not None:
            self._slotWait.cancel.cancel("client_gone")

    def finish(self):
        """
        Finish as twisted.web does, then L{_relayDone}.
        """
        try:
            if self._encoder:
                return super().finish()
            # server.Request.finish without an encoder is http.Request's
            return HTTPRequest.finish(self)
        finally:
            self._relayDone()

    def connectionLost(self, reason) -> None:
        """
        Cancel the linger timer with the connection and end the request
        (L{_relayDone}); the rest as twisted.web does.
        """
        if self._linger is not None and self._linger.active():
            self._linger.cancel()
        self._linger = None
        self._narrowReads()
        self._relayDone()
        super().connectionLost(reason)
