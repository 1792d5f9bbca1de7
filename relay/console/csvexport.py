# -*- test-case-name: tests.test_usage_series -*-
"""
CSV answers of the admin tables (C{?format=csv}): the usage totals, the
usage series and the request log.

RFC 4180 text (C{csv} module, C{\\r\\n} line ends) with a header row. A
text cell a spreadsheet would read as a formula (starting with C{=},
C{+}, C{-}, C{@}, a tab or a carriage return) is prefixed with C{'}: a
key name or an upstream error message never runs in the reader's
spreadsheet.
"""

from __future__ import annotations

import csv
import io
from typing import Iterable, Optional

__all__ = ["csvBody", "deliverCSV", "respondCSV", "wantsCSV"]

_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def _cell(value) -> object:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        value = ";".join(str(v) for v in value)
    if isinstance(value, str) and value.startswith(_FORMULA):
        return "'" + value
    return value


def csvBody(header: list, rows: Iterable[list]) -> bytes:
    """
    @param header: the column names.
    @param rows: lists of cells (L{None} is empty, lists are joined with
        C{;}).
    @return: the UTF-8 CSV text, header first.
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow([_cell(v) for v in row])
    return out.getvalue().encode("utf-8")


def wantsCSV(request) -> Optional[bool]:
    """
    @return: L{True} for C{format=csv}, L{False} for none or C{json},
        L{None} for another value (a 400).
    """
    values = request.args.get(b"format")
    if not values:
        return False
    value = values[0].decode("utf-8", "replace").strip().lower()
    if value in ("", "json"):
        return False
    return True if value == "csv" else None


def respondCSV(request, filename: str, header: list, rows: Iterable[list],
               headers: Optional[dict] = None) -> bytes:
    """
    Set a 200 CSV answer's headers (an attachment named C{filename}) and
    return its body.

    @param headers: more headers (e.g. C{x-next-cursor}).
    """
    request.setResponseCode(200)
    request.setHeader(b"content-type", b"text/csv; charset=utf-8")
    request.setHeader(b"content-disposition",
                      f'attachment; filename="{filename}"'.encode("ascii", "replace"))
    request.setHeader(b"cache-control", b"no-store")
    request.setHeader(b"x-content-type-options", b"nosniff")
    for name, value in (headers or {}).items():
        request.setHeader(name.encode("ascii"), str(value).encode("utf-8"))
    return csvBody(header, rows)


def deliverCSV(request, d, filename: str, what: str):
    """
    Answer C{request} with the CSV table C{d} fires with, unless the client
    has gone; a failure is a logged 500 in OpenAI's error envelope.

    @param d: a L{Deferred} firing with C{(header, rows)} or C{(header,
        rows, headers)}.
    @param what: what the work was, for the log.
    @return: L{NOT_DONE_YET}.
    """
    import json

    from twisted.logger import Logger
    from twisted.web.server import NOT_DONE_YET

    from relay.base.requestid import requestIdOf

    gone = []
    request.notifyFinish().addErrback(lambda _: gone.append(True))

    def _write(table):
        if gone:
            return
        header, rows = table[0], table[1]
        request.write(respondCSV(request, filename, header, rows,
                                 table[2] if len(table) > 2 else None))
        request.finish()

    def _failed(f):
        Logger().failure("admin request failed while {what}", f, what=what,
                         event="relay.admin_failed")
        if not gone:
            request.setResponseCode(500)
            request.setHeader(b"content-type", b"application/json; charset=utf-8")
            request.write(json.dumps({"error": {
                "message": "Internal error while " + what, "type": "api_error", "param": None,
                "code": "internal_error", "request_id": requestIdOf(request)}}).encode())
            request.finish()

    d.addCallbacks(_write, _failed)
    return NOT_DONE_YET
