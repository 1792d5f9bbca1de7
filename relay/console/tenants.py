# -*- test-case-name: tests.test_tenants_admin -*-
"""
The tenants' admin resources, mounted under C{/admin} beside
L{relay.console.admin}'s, behind the same admin key (behaviour.md R99):

  - C{GET /admin/requests?key=&account=&model=&outcome=&since=&until=&request_id=}
    C{&client_request_id=&limit=&cursor=}
    - the request log (L{relay.tenants.requestlog}), newest first
    (C{request_id} is relay's id of a turn, C{client_request_id} the id a
    client sent, which turns of several keys may share: R111):
    C{{"requests": [record, ...], "next": cursor or null}}; C{since} and
    C{until} are Unix seconds or ISO 8601 times; C{limit} 1..500 (50);
    C{format=csv}: the page as CSV (L{CSV_COLUMNS}; C{limit} up to 5000),
    the next page's cursor in the C{x-next-cursor} header;
  - C{GET /admin/explain?key=&model=&session=&previous_response_id=&entrypoint=&endpoint=}
    - the next turn's decision for a key, without admitting anything
    (L{relay.console.explain}).

Bad parameters are a 400 in OpenAI's error envelope naming the parameter.
No answer holds a secret: records name keys, never their values.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred

from relay.console.admin import deliverLater, errorBody, Guarded, notFound, respond
from relay.console.csvexport import deliverCSV, wantsCSV
from relay.tenants.requestlog import RequestQuery
from relay.usage.query import UsageQueryError, parseSince

__all__ = ["ExplainResource", "RequestsResource"]

OUTCOMES = ("completed", "failed", "client_gone", "error", "relay_cancelled")
DEFAULT_LIMIT = 50
MAX_LIMIT = 500
MAX_CSV_LIMIT = 5000
"""The largest page of C{format=csv} (an export, not a page to show)."""

CSV_COLUMNS = [
    "time_iso", "time", "request_id", "client_request_id", "key", "entrypoint", "endpoint",
    "stream", "model", "account", "accounts", "outcome", "status", "error_code", "error",
    "input_tokens", "cached_input_tokens", "output_tokens", "reasoning_tokens", "cost_usd",
    "duration_ms", "first_output_ms", "switches", "waited_ms",
]
"""The request log's CSV columns (C{format=csv}); C{accounts} joined by C{;}."""


def _iso(seconds: float) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _arg(request, name: str):
    values = request.args.get(name.encode("ascii"))
    if not values:
        return None
    text = values[0].decode("utf-8", "replace").strip()
    return text or None


def _bad(request, message: str, param: str) -> bytes:
    return respond(request, 400, errorBody(message, "invalid_request_error", "invalid_value",
                                             param))


class RequestsResource(Guarded):
    """
    C{GET /admin/requests} (see the module docstring).
    """

    def __init__(self, adminKey, log, clock):
        """
        @param log: the L{relay.interfaces.IRequestLog}.
        @param clock: the L{IReactorTime}.
        """
        super().__init__(adminKey)
        self.log = log
        self.clock = clock

    def render_GET(self, request):
        """
        The matching records, newest first, with the next page's cursor.
        """
        if request.postpath not in ([], [b""]):
            return notFound(request)
        csv = wantsCSV(request)
        if csv is None:
            return _bad(request, "format must be json or csv", "format")
        now = self.clock.seconds()
        times = {}
        for name in ("since", "until"):
            text = _arg(request, name)
            if text is None:
                times[name] = None
                continue
            try:
                times[name] = parseSince(text, now)
            except UsageQueryError:
                return _bad(request, f"{name} must be Unix seconds or an ISO 8601 time", name)
        outcome = _arg(request, "outcome")
        if outcome is not None and outcome not in OUTCOMES:
            return _bad(request, "outcome must be one of " + ", ".join(OUTCOMES), "outcome")
        limit = DEFAULT_LIMIT
        text = _arg(request, "limit")
        if text is not None:
            try:
                limit = int(text)
            except ValueError:
                limit = 0
            most = MAX_CSV_LIMIT if csv else MAX_LIMIT
            if not 1 <= limit <= most:
                return _bad(request, f"limit must be an integer from 1 to {most}", "limit")
        cursor = _arg(request, "cursor")
        if cursor is not None and not all(c.isdigit() or c == "-" for c in cursor):
            return _bad(request, "cursor must be a value from a previous answer's next", "cursor")
        filters = RequestQuery(
            key=_arg(request, "key"), account=_arg(request, "account"),
            model=_arg(request, "model"), outcome=outcome, since=times["since"],
            until=times["until"], request_id=_arg(request, "request_id"),
            client_request_id=_arg(request, "client_request_id"),
        )
        d = self.log.query(filters, limit, cursor)
        if csv:
            def _cbTable(found):
                records, nextCursor = found
                rows = [[_iso(r.time)] + [r.asDict()[n] for n in CSV_COLUMNS[1:]]
                        for r in records]
                return CSV_COLUMNS, rows, {"x-next-cursor": nextCursor} if nextCursor else {}

            return deliverCSV(request, d.addCallback(_cbTable), "requests.csv",
                              "reading the request log")

        def _cbAnswer(found):
            records, nextCursor = found
            return 200, {"requests": [r.asDict() for r in records], "next": nextCursor,
                         "now": now}

        return deliverLater(request, d, _cbAnswer, "reading the request log")


class ExplainResource(Guarded):
    """
    C{GET /admin/explain} (see the module docstring).
    """

    def __init__(self, adminKey, explainer):
        """
        @param explainer: the L{relay.console.explain.Explainer}.
        """
        super().__init__(adminKey)
        self.explainer = explainer

    def render_GET(self, request):
        """
        The decision, or a 400 naming a missing or bad parameter, or a 404
        for an unknown key.
        """
        if request.postpath not in ([], [b""]):
            return notFound(request)
        name, model = _arg(request, "key"), _arg(request, "model")
        if name is None:
            return _bad(request, "key is required (a client key's name)", "key")
        if model is None:
            return _bad(request, "model is required", "model")
        entrypoint = _arg(request, "entrypoint") or "http"
        if entrypoint not in ("http", "ws"):
            return _bad(request, "entrypoint must be http or ws", "entrypoint")
        endpoint = _arg(request, "endpoint") or "responses"
        if endpoint not in ("responses", "chat"):
            return _bad(request, "endpoint must be responses or chat", "endpoint")
        previous = _arg(request, "previous_response_id")
        key = self.explainer.keyNamed(name)
        if key is None:
            return respond(request, 404, errorBody(
                f"No client key is named {name!r}", "invalid_request_error", "unknown_key", "key"))
        d = Deferred.fromCoroutine(self.explainer.explain(
            key, model, session=_arg(request, "session"), previous=previous,
            entrypoint=entrypoint, endpoint=endpoint,
        ))
        return deliverLater(request, d, lambda answer: (200, answer), "explaining a decision")
