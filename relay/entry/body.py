# -*- test-case-name: tests.test_body -*-
"""
Request bodies: the size limit and C{Content-Encoding} (issue 13 items 2
and 3).

  - B{Limit} (C{gateway.max_request_body_bytes}, default 64 MiB): a
    C{Content-Length} above it is answered 413 as soon as the headers are
    read, before any of the body is; a chunked (or compressed) body is
    counted while it arrives and answered 413 the moment it crosses the
    limit. Either way relay stops storing the body at once (nothing more is
    spooled to a file), writes the 413 with C{Connection: close} and the
    request's id (C{X-Request-Id} and C{error.request_id}, adopted or made
    by L{relay.requestid.requestIdOf} as for every answer), and
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
from typing import Callable, Optional

import zstandard
from twisted.logger import Logger
from twisted.web.server import Request

from relay.entry.sinks import errorBody, writeError
from relay.model import ClientError
from relay.requestid import requestIdOf

DEFAULT_MAX_BODY_BYTES = 64 * 2**20
"""The default of C{gateway.max_request_body_bytes} (config.md)."""

LINGER_SECONDS = 2.0
"""How long relay keeps reading (and discarding) after a 413 before it drops
the connection, so the client reads the answer instead of a reset."""

CHUNK = 64 * 2**10
"""The most a decompressor produces per step (bytes)."""

SPOOL_BYTES = 2**20
"""Bodies up to this size stay in memory; larger ones go to a temporary file
(twisted.web's own threshold is 100 000 bytes for a known length)."""

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
        except zstandard.ZstdError as e:
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
        return io.BytesIO()
    return tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)


class LimitedBodyRequest(Request):
    """
    A twisted.web L{Request} that enforces the body limit and decodes
    C{Content-Encoding} (see the module docstring). The limit is the site's
    C{maxRequestBodyBytes} (L{DEFAULT_MAX_BODY_BYTES} when unset).

    @ivar bodyLimit: the limit in force for this request, bytes.
    @ivar contentEncoding: the decoded C{Content-Encoding} value, or L{None}.
    """

    _log = Logger()
    bodyLimit = DEFAULT_MAX_BODY_BYTES
    contentEncoding = None
    _decoder = None
    _bodyError: Optional[ClientError] = None
    _refused = False
    _received = 0
    _linger = None

    def gotLength(self, length: Optional[int]) -> None:
        """
        The headers are in: refuse a declared length over the limit at once,
        and set up the decoder.
        """
        site = getattr(self.channel, "site", None)
        self.bodyLimit = getattr(site, "maxRequestBodyBytes", DEFAULT_MAX_BODY_BYTES)
        if length is not None and length > self.bodyLimit:
            self.content = None
            self._refuseNow(length)
            return
        header = self.requestHeaders.getRawHeaders(b"content-encoding", [None])[0]
        try:
            self._decoder = contentDecoder(header, self.bodyLimit, self._decoded)
        except UnsupportedEncoding as e:
            self._bodyError = unsupported(e.encoding)
        if self._decoder is not None:
            self.contentEncoding = header.decode("latin-1")
            self.content = _contentFile(None)
        else:
            self.content = _contentFile(length)

    def _decoded(self, data: bytes) -> None:
        self.content.write(data)

    def handleContentChunk(self, data: bytes) -> None:
        """
        A piece of the body: count it, decode or store it, or drop it once
        the answer is decided.
        """
        if self._refused:
            return
        self._received += len(data)
        if self._received > self.bodyLimit:
            self._refuseNow(None)
            return
        if self._bodyError is not None:
            return
        if self._decoder is None:
            self.content.write(data)
            return
        try:
            self._decoder.write(data)
        except BodyTooLarge:
            self._refuseNow(None)
        except CorruptBody as e:
            self._bodyFailed(corrupt(str(e)))

    def _bodyFailed(self, error: ClientError) -> None:
        """
        Answer C{error} once the body has arrived; store nothing more.
        """
        self._bodyError = error
        self._decoder = None
        self._dropContent()
        self.content = io.BytesIO()

    def _dropContent(self) -> None:
        if self.content is not None:
            self.content.close()
            self.content = None

    def requestReceived(self, command, path, version) -> None:
        """
        The whole body is in: finish decoding, then process (or, when the
        413 was already written, nothing).
        """
        if self._refused:
            return
        if self._decoder is not None:
            try:
                self._decoder.close()
            except BodyTooLarge:  # pragma: no cover - close produces nothing new
                self._refuseNow(None)
                return
            except CorruptBody as e:
                self._bodyFailed(corrupt(str(e)))
            else:
                self.requestHeaders.removeHeader(b"content-encoding")
        super().requestReceived(command, path, version)

    def process(self) -> None:
        """
        Render, or answer the body's error (400 corrupt, 415 unknown
        encoding) in OpenAI's envelope.
        """
        if self._bodyError is None:
            return super().process()
        self.site = self.channel.site
        self._log.info(
            "request body refused with {status}: {message}", event="http.request_body_refused",
            status=self._bodyError.status, message=self._bodyError.message,
            request_id=requestIdOf(self),
        )
        writeError(self, self._bodyError)

    def _refuseNow(self, declared: Optional[int]) -> None:
        """
        413 at once: stop storing, write the answer with C{Connection:
        close} and the request's id (L{requestIdOf}: the client's
        C{X-Request-Id} when well-formed, else a new one; issue 15) as
        C{X-Request-Id} and C{error.request_id}, half-close, and drop the
        connection after L{LINGER_SECONDS} at the latest.
        """
        self._refused = True
        self._decoder = None
        self._dropContent()
        self.requestHeaders.removeHeader(b"expect")  # no "100 Continue" after the answer
        requestId = requestIdOf(self)
        self._log.info(
            "request body over {limit} bytes refused (declared {declared}, received "
            "{received})", event="http.request_body_too_large", limit=self.bodyLimit,
            declared=declared, received=self._received, request_id=requestId,
        )
        body = errorBody(tooLarge(self.bodyLimit), requestId)
        transport = self.channel.transport
        transport.write(
            b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n"
            b"x-request-id: " + requestId.encode("ascii") + b"\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
            + body
        )
        halfClose = getattr(transport, "loseWriteConnection", None)
        if halfClose is None:
            self.channel.loseConnection()
            return
        halfClose()
        self._linger = self.channel.callLater(LINGER_SECONDS, transport.abortConnection)

    def connectionLost(self, reason) -> None:
        """
        Cancel the linger timer with the connection; the rest as
        twisted.web does.
        """
        if self._linger is not None and self._linger.active():
            self._linger.cancel()
        self._linger = None
        super().connectionLost(reason)
