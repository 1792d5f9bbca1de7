# -*- test-case-name: tests.test_headblock -*-
"""
A request's header block read in one pass: the header
lines twisted.web's L{HTTPChannel} reads one L{LineReceiver} line at a time
(C{lineReceived} -> C{headerReceived} per line, ~190 k instructions for a
turn's block) are split and checked here in one function, and
L{relay.entry.site.RelayHTTPChannel} files them into the request as
twisted.web would.

Only a I{plain} block is read here: complete in one read, no obs-fold, no
stray CR, LF or NUL, well under the line limits (so neither the 414/431
answers nor twisted.web's header-size 400 can apply), a request line and
header names twisted.web accepts, at most one C{Content-Length} of digits
and no C{Transfer-Encoding}. Anything else returns L{None} and twisted.web
reads the bytes itself, line by line, with every check and answer it (and
relay's overrides) gives today; C{tests.test_headblock} feeds a table of
edge inputs through both and compares the answers.
"""

from __future__ import annotations

from typing import Optional

from twisted.web.http import _parseRequestLine
from twisted.web.http_headers import InvalidHeaderName, _nameEncoder

PLAIN_BLOCK_BYTES = 8192
"""The largest header block (request line and header lines, bytes) read
here; a larger one goes to twisted.web (its limits are 16 KiB per line and
16 KiB in all, L{relay.entry.site})."""

MAX_FIELDS = 100
"""The most header lines read here (twisted.web allows 500)."""

_LINES: dict = {}
"""Request lines twisted.web's C{_parseRequestLine} accepted -> its parts
(a client sends the same few lines, e.g. C{POST /v1/responses
HTTP/1.1}, on every request; each is checked once)."""

_LINES_MAX = 256
"""The most request lines L{_LINES} keeps (it is emptied when full)."""

_LINE_CACHED_BYTES = 512
"""The longest request line L{_LINES} keeps."""

_CACHE = _nameEncoder._canonicalHeaderCache
_LENGTH = b"Content-Length"
_TRANSFER = b"Transfer-Encoding"


def readHead(data: bytes) -> Optional[tuple]:
    """
    Read the header block at the start of C{data} when it is plain.

    @param data: the bytes read from the connection, at the start of a
        request (no earlier byte of it read).
    @return: L{None} (not plain, or not complete: twisted.web reads it), or
        C{(command, path, version, fields, length, size, blank)}: the
        request line's three parts, the header lines as C{[(canonical name,
        value stripped of SP/HTAB)]} in order, the C{Content-Length}
        (L{None} without one), the bytes of the block's lines without
        their CRLFs (twisted.web's C{_receivedHeaderSize}), and the offset
        of the blank line that ends the block in C{data}.
    """
    end = data.find(b"\r\n\r\n", 0, PLAIN_BLOCK_BYTES + 4)
    if end <= 0:
        return None
    block = data[:end]
    crlf = block.count(b"\r\n")
    if (
        block.count(b"\n") != crlf or block.count(b"\r") != crlf or 0 in block
        or block.find(b"\r\n ") >= 0 or block.find(b"\r\n\t") >= 0 or crlf > MAX_FIELDS
    ):
        return None
    lines = block.split(b"\r\n")
    line = lines[0]
    parsed = _LINES.get(line)
    if parsed is None:
        try:
            parsed = _parseRequestLine(line)
        except ValueError:
            return None
        if len(line) <= _LINE_CACHED_BYTES:
            if len(_LINES) >= _LINES_MAX:
                # Many distinct lines (retrieves by id, scanners): start
                # over, so the lines sent now are the ones kept.
                _LINES.clear()
            _LINES[line] = parsed
    command, path, version = parsed
    fields = []
    length = None
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            return None
        canonical = _CACHE.get(name)
        if canonical is None:
            try:
                canonical = _nameEncoder.encode(name)
            except InvalidHeaderName:
                return None
        value = value.strip(b" \t")
        if canonical == _LENGTH:
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif canonical == _TRANSFER:
            return None
        fields.append((canonical, value))
    return command, path, version, fields, length, end - 2 * crlf, end + 2
