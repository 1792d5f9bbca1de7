# -*- test-case-name: tests.test_admin -*-
"""
The operator's HTTP surface: the admin API under C{/admin} and the
Prometheus scrape at C{/metrics}.

Routes under the resource returned by L{buildAdminResource} (mounted at
C{/admin}):

  - C{GET /admin/} - the status page (L{STATUS_PAGE}; its files under
    C{/admin/static/}, L{relay.console.assets}); served without the
    key, its data fetches need it;
  - C{GET /admin/settings} - the runtime settings, nested (behaviour.md R74);
  - C{PUT /admin/settings} - a partial change, nested or flat dotted JSON;
  - C{GET /admin/settings/schema} - each runtime setting's value, type and
    range, for an editor;
  - C{GET /admin/accounts} - every account's live state for the page;
  - C{GET /admin/history} - per account, the last 15 minutes in one-minute
    buckets (L{relay.console.history}) for the page's charts;
  - C{POST /admin/accounts/{id}/clear} - lift an account's runtime states;
  - C{POST /admin/accounts/{id}/refresh} - force an OAuth token refresh
    (body C{{"retry_in_doubt": true}} to resend an in-doubt refresh token);
    C{{"refreshed": false}} comes with a C{reason} and a C{hint} saying
    what to do (e.g. pass C{retry_in_doubt});
  - C{PUT /admin/accounts/{id}/tokens} - new OAuth tokens (C{refresh_token},
    C{access_token}, C{id_token}, or a Codex C{auth.json}), clearing
    C{needs_login} without a restart;
  - C{GET /admin/metrics} - the same metrics as C{/metrics}, behind the key;
  - C{GET /admin/usage?since=<ISO 8601 or Unix seconds>&group_by=key|account|model|hour}
    - token totals, with the per-key budgets (C{format=csv}: the rows as
    CSV);
  - C{GET /admin/usage/series?range=24h|7d|30d&bucket=hour|day&group_by=...}
    - usage, cost and failures over time (L{relay.console.usageseries});
  - C{POST /admin/reload} - re-read the configuration file and apply it
    live.

Authentication is C{Authorization: Bearer <admin key>}. Without a
configured admin key every C{/admin} route answers 404: the admin API is
then disabled, never open (config.md C{admin_key}). Errors use OpenAI's
envelope (protocol.md 2.6).

This module decides nothing about failover or admission (architecture.md
invariant 1); it only shows state and hands changes to
L{relay.state.settings.RuntimeSettings} and the C{clearAccount} callable.
"""

from __future__ import annotations

import hmac
import json
from importlib import resources
from typing import Any, Callable, Optional

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relay.console.assets import PAGE_CSP, StaticFiles, loadAssets
from relay.console.fields import BOOLEAN, STRING, FieldTypeError, checkTypes, objectOf
from relay.console.masking import masked
from relay.console.metrics import withoutCreated
from relay.base.requestid import requestIdOf
from relay.base.requestnotes import notesOf
from relay.state.settings import RuntimeSettings, SettingsError

__all__ = ["STATUS_PAGE", "buildAdminResource", "metricsResource"]

#: The status page file, next to this module (packaged as C{entry/*.html}).
STATUS_PAGE = "static/index.html"

#: The largest settings body accepted.
_MAX_BODY = 64 * 1024

_log = Logger()

_TOKEN_FIELDS = {name: STRING for name in (
    "access_token", "refresh_token", "id_token", "account_id", "last_refresh")}

TOKENS_BODY = dict(_TOKEN_FIELDS, tokens=objectOf(_TOKEN_FIELDS))
"""The JSON types of C{PUT /admin/accounts/{id}/tokens}: the tokens, or a
Codex C{auth.json} (its C{tokens} object) (L{relay.console.fields})."""

REFRESH_BODY = {"retry_in_doubt": BOOLEAN}
"""The JSON types of C{POST /admin/accounts/{id}/refresh}."""


def errorBody(message: str, type: str, code: Optional[str], param: Optional[str] = None):
    """
    @return: OpenAI's error envelope as a dict.
    """
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def respond(request, status: int, obj: Any) -> bytes:
    """
    Set the status and JSON headers, and return the encoded body. An error
    envelope gets the request's id as C{error.request_id}.
    """
    if status >= 400 and isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        obj["error"]["request_id"] = requestIdOf(request)
    operator = notesOf(request).operator
    if operator is not None and not getattr(operator, "seesSecrets", True):
        obj = masked(obj)  # a viewer sees no secret
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json; charset=utf-8")
    request.setHeader(b"cache-control", b"no-store")
    request.setHeader(b"x-content-type-options", b"nosniff")
    return json.dumps(obj, default=str).encode("utf-8")


def notFound(request) -> bytes:
    return respond(
        request, 404, errorBody("Not found", "invalid_request_error", "not_found")
    )


def deliverLater(request, d, onResult: Callable[[Any], tuple], what: str):
    """
    Answer C{request} when C{d} fires, unless the client has gone.

    @param d: the L{Deferred} of the work.
    @param onResult: turns the result into C{(status, obj)}; its exceptions
        (and C{d}'s failures) become a 500 that is logged.
    @param what: what the work was, for the log.
    @return: L{NOT_DONE_YET}.
    """
    gone = []
    request.notifyFinish().addErrback(lambda _: gone.append(True))

    def _ebAnswer(f: Failure):
        _log.failure(
            "admin request failed while {what}", f, what=what, event="relay.admin_failed"
        )
        return 500, errorBody(
            "Internal error while " + what, "api_error", "internal_error"
        )

    def _write(answer):
        if gone:
            return
        status, obj = answer
        request.write(respond(request, status, obj))
        request.finish()

    d.addCallback(onResult)
    d.addErrback(_ebAnswer)
    d.addCallback(_write)
    d.addErrback(lambda f: _log.failure("writing admin answer", f, event="relay.admin_failed"))
    return NOT_DONE_YET


def _keyOf(adminKey) -> Optional[str]:
    """
    @param adminKey: a key, L{None}, or a callable returning either.
    @return: the key in force.
    """
    return adminKey() if callable(adminKey) else adminKey


class Guarded(Resource):
    """
    A leaf admin resource: checks the admin key, then dispatches to
    C{render_METHOD}, answering unknown methods with a JSON 405.

    @ivar adminKey: the configured key, or L{None} (every route 404).
    """

    isLeaf = True
    requireKey = True

    def __init__(self, adminKey):
        """
        @param adminKey: the key, L{None}, or a no-argument callable
            returning either, read per request (a live reload rotates the
            key).
        """
        super().__init__()
        self._adminKey = adminKey

    @property
    def adminKey(self) -> Optional[str]:
        """
        @return: the admin key in force, or L{None} when disabled.
        """
        return _keyOf(self._adminKey)

    def _authorised(self, request) -> bool:
        """
        @return: whether C{request} carries C{Authorization: Bearer <key>},
            or the intake let it in as a console operator (its session
            checked, L{relay.entry.intake.IntakePolicy.consoleGate}).
        """
        if notesOf(request).operator is not None:
            return True
        header = request.getHeader(b"authorization") or ""
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        return hmac.compare_digest(
            token.strip().encode("utf-8"), self.adminKey.encode("utf-8")
        )

    def render(self, request):
        """
        404 when disabled, 401 without the key, 405 for other methods.
        """
        if self.adminKey is None:
            return notFound(request)
        if self.requireKey and not self._authorised(request):
            request.setHeader(b"www-authenticate", b'Bearer realm="relay-admin"')
            return respond(
                request,
                401,
                errorBody(
                    "Missing or invalid admin key",
                    "authentication_error",
                    "invalid_admin_key",
                ),
            )
        method = request.method.decode("ascii", "replace").upper()
        if method == "HEAD":
            method = "GET"
        handler = getattr(self, "render_" + method, None)
        if handler is None:
            allowed = sorted(n[len("render_"):] for n in dir(self) if n.startswith("render_"))
            request.setHeader(b"allow", ", ".join(allowed).encode("ascii"))
            return respond(
                request,
                405,
                errorBody(
                    f"Method {method} is not allowed here",
                    "invalid_request_error",
                    "method_not_allowed",
                ),
            )
        return handler(request)


class _SettingsResource(Guarded):
    """
    C{GET}/C{PUT /admin/settings} (behaviour.md R74).
    """

    def __init__(self, adminKey, settings: RuntimeSettings):
        super().__init__(adminKey)
        self.settings = settings

    def render_GET(self, request):
        """
        The runtime settings in force, nested as under C{gateway:};
        C{/admin/settings/schema}: each with its type and range
        (L{relay.state.settings.describe}).
        """
        if request.postpath == [b"schema"]:
            from relay.state.settings import describe

            return respond(request, 200, {"settings": describe(self.settings.current)})
        if request.postpath not in ([], [b""]):
            return notFound(request)
        return respond(request, 200, self.settings.snapshot())

    def render_PUT(self, request):
        """
        Apply a partial change; answer C{{"settings": ..., "changed": ...}}
        once persisted. Unknown keys or wrong types: 400 naming them.
        """
        if request.postpath not in ([], [b""]):
            return notFound(request)
        raw = request.content.read(_MAX_BODY + 1) if request.content is not None else b""
        if len(raw) > _MAX_BODY:
            return respond(
                request,
                413,
                errorBody("Settings body too large", "invalid_request_error", "body_too_large"),
            )
        try:
            body = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):  # deep nesting is a 400 too
            return respond(
                request,
                400,
                errorBody(
                    "Request body is not valid JSON", "invalid_request_error", "invalid_json"
                ),
            )
        if not isinstance(body, dict):
            return respond(
                request,
                400,
                errorBody(
                    "Request body must be a JSON object", "invalid_request_error", "invalid_json"
                ),
            )
        try:
            d = self.settings.update(body)
        except SettingsError as e:
            code = "unknown_setting" if e.unknownKeys else "invalid_setting_value"
            _log.info(
                "refused settings change: {message}",
                message=str(e),
                event="relay.settings_refused",
                keys=e.keys,
            )
            return respond(
                request,
                400,
                errorBody(str(e), "invalid_request_error", code, e.keys[0] if e.keys else None),
            )
        return deliverLater(
            request,
            d,
            lambda changed: (200, {"settings": self.settings.snapshot(), "changed": changed}),
            "persisting settings",
        )


class _AccountsResource(Guarded):
    """
    C{GET /admin/accounts} and C{POST /admin/accounts/{id}/clear}.
    """

    def __init__(self, adminKey, accountsView, clearAccount, recentFailovers, clock,
                 tokenActions=None):
        super().__init__(adminKey)
        self.accountsView = accountsView
        self.clearAccount = clearAccount
        self.recentFailovers = recentFailovers
        self.clock = clock
        self.tokenActions = tokenActions

    def render_GET(self, request):
        """
        C{{"accounts": [...], "failovers": [...], "now": seconds}}.
        """
        if request.postpath not in ([], [b""]):
            return notFound(request)

        def _cbView(accounts):
            failovers = self.recentFailovers() if self.recentFailovers is not None else []
            now = self.clock.seconds() if self.clock is not None else None
            return 200, {"accounts": list(accounts), "failovers": list(failovers), "now": now}

        return deliverLater(
            request, maybeDeferred(self.accountsView), _cbView, "reading account state"
        )

    def render_POST(self, request):
        """
        C{/admin/accounts/{id}/clear}: 200 C{{"cleared": id}}, 404 for an
        unknown id.
        """
        path = request.postpath
        if len(path) == 2 and path[1] == b"refresh" and path[0] and self.tokenActions:
            return self._tokens(request, path[0], "refresh")
        if len(path) != 2 or path[1] != b"clear" or not path[0]:
            return notFound(request)
        try:
            accountId = path[0].decode("utf-8")
        except UnicodeDecodeError:
            return notFound(request)
        d = maybeDeferred(self.clearAccount, accountId)

        unknown = object()

        def _ebUnknown(f):
            f.trap(KeyError)
            return unknown

        d.addCallbacks(lambda _: accountId, _ebUnknown)

        def _cbCleared(result):
            if result is unknown:
                return 404, errorBody(
                    f"No account {accountId!r}",
                    "invalid_request_error",
                    "account_not_found",
                    "id",
                )
            return 200, {"cleared": accountId}  # logged where it happened (health)

        return deliverLater(request, d, _cbCleared, "clearing account")

    def render_PUT(self, request):
        """
        C{/admin/accounts/{id}/tokens}: 200 with the token view;
        400 for a body without tokens or a non-OAuth account; 404 for an
        unknown id.
        """
        path = request.postpath
        if len(path) != 2 or path[1] != b"tokens" or not path[0] or not self.tokenActions:
            return notFound(request)
        return self._tokens(request, path[0], "tokens")

    def _tokens(self, request, rawId: bytes, action: str):
        """
        Run a token action (C{refresh} or C{tokens}) for one account.
        """
        try:
            accountId = rawId.decode("utf-8")
        except UnicodeDecodeError:
            return notFound(request)
        raw = request.content.read(_MAX_BODY + 1) if request.content is not None else b""
        if len(raw) > _MAX_BODY:
            return respond(request, 413, errorBody(
                "Body too large", "invalid_request_error", "body_too_large"))
        try:
            body = json.loads(raw.decode("utf-8")) if raw.strip() else {}
        except (ValueError, UnicodeDecodeError, RecursionError):  # deep nesting is a 400 too
            body = None
        if not isinstance(body, dict):
            return respond(request, 400, errorBody(
                "Request body must be a JSON object", "invalid_request_error", "invalid_json"))
        try:
            checkTypes(body, REFRESH_BODY if action == "refresh" else TOKENS_BODY)
        except FieldTypeError as e:
            return respond(request, 400, errorBody(
                e.message, "invalid_request_error", "invalid_tokens", e.param))
        if action == "refresh":
            d = maybeDeferred(self.tokenActions.refreshAccount, accountId, body)
        else:
            d = maybeDeferred(self.tokenActions.setTokens, accountId, body)
        problem = object()

        def _ebKnown(f):
            error = f.trap(KeyError, ValueError)
            return (problem, error, f.getErrorMessage())

        d.addErrback(_ebKnown)

        def _cbAnswer(result):
            if isinstance(result, tuple) and result and result[0] is problem:
                if result[1] is KeyError:
                    return 404, errorBody(f"No account {accountId!r}", "invalid_request_error",
                                           "account_not_found", "id")
                return 400, errorBody(result[2], "invalid_request_error", "invalid_tokens")
            if action == "refresh":
                refreshed, view = result[0], result[1]
                why = (result[2] if len(result) > 2 else None) or {}
                outcome = "refreshed" if refreshed else (
                    "not refreshed (" + why.get("reason", "see the log") + ")"
                )
                _log.info("token refresh of {account_id} forced by admin: {outcome}",
                          account_id=accountId, refreshed=refreshed, outcome=outcome,
                          reason=why.get("reason"), event="relay.oauth_admin_refresh")
                answer = {"account": accountId, "refreshed": refreshed, "token": view}
                if not refreshed:
                    answer.update(reason=why.get("reason"), hint=why.get("hint"))
                return 200, answer
            return 200, {"account": accountId, "token": result}

        return deliverLater(request, d, _cbAnswer, "handling tokens")


class _UsageResource(Guarded):
    """
    C{GET /admin/usage}: the token totals since C{since}
    (default: the last 24 hours; rounded down to the hour), grouped by
    C{group_by} (default C{key}).
    """

    #: Renders C{GET /admin/usage/series} (L{relay.console.usageseries},
    #: set once the request log is built), or L{None} (404).
    series = None

    def __init__(self, adminKey, ledger, clock):
        super().__init__(adminKey)
        self.ledger = ledger
        self.clock = clock

    def render_GET(self, request):
        """
        C{{"since", "group_by", "now", "rows": [...], "total": {...},
        "budgets": [...]}}; each row has the group value and C{requests},
        C{input_tokens}, C{cached_input_tokens}, C{output_tokens},
        C{reasoning_tokens}, C{total_tokens}. A bad parameter is a 400
        naming it. C{format=csv}: the rows as CSV. C{/admin/usage/series}:
        L{relay.console.usageseries}.
        """
        from relay.console.csvexport import wantsCSV
        from relay.usage.query import UsageQueryError, parseGroupBy, parseSince
        from relay.usage.store import hourOf

        if request.postpath == [b"series"] and self.series is not None:
            return self.series(request)
        if request.postpath not in ([], [b""]):
            return notFound(request)
        csv = wantsCSV(request)
        if csv is None:
            return respond(request, 400, errorBody(
                "format must be json or csv", "invalid_request_error", "invalid_value",
                "format"))
        now = self.clock.seconds()

        def arg(name):
            values = request.args.get(name.encode("ascii"))
            return values[0].decode("utf-8", "replace") if values else None

        try:
            since = hourOf(parseSince(arg("since"), now))
            groupBy = parseGroupBy(arg("group_by"))
        except UsageQueryError as e:
            return respond(
                request, 400, errorBody(str(e), "invalid_request_error", "invalid_value", e.param)
            )

        def _cbRows(rows):
            total = {}
            for row in rows:
                for name, value in row.items():
                    if name != groupBy:
                        total[name] = total.get(name, 0) + value
            if csv:
                header = [groupBy] + [n for n in (rows[0] if rows else {}) if n != groupBy]
                return header, [[row[n] for n in header] for row in rows]
            return 200, {
                "since": since,
                "group_by": groupBy,
                "now": now,
                "rows": rows,
                "total": total,
                "budgets": self.ledger.budgetView(now),
            }

        d = Deferred.fromCoroutine(self.ledger.totals(since, groupBy))
        if csv:
            from relay.console.csvexport import deliverCSV

            return deliverCSV(request, d.addCallback(_cbRows), f"usage-by-{groupBy}.csv",
                              "reading usage")
        return deliverLater(request, d, _cbRows, "reading usage")


class _HistoryResource(Guarded):
    """
    C{GET /admin/history}: L{relay.interfaces.IAccountHistory.snapshot}.
    """

    def __init__(self, adminKey, history: Callable[[], dict]):
        """
        @param history: returns the snapshot (a JSON-ready dict).
        """
        super().__init__(adminKey)
        self.history = history

    def render_GET(self, request):
        """
        The snapshot as JSON.
        """
        if request.postpath not in ([], [b""]):
            return notFound(request)
        return respond(request, 200, self.history())


class _ReloadResource(Guarded):
    """
    C{POST /admin/reload}: re-read the configuration file and
    apply it (L{relay.process.reload.ConfigReloader}). In a worker
    (C{workers: N}) an applied reload is then forwarded to the other
    workers (L{relay.process.workers.SupervisorChannel}); the answer is this
    process's own result.
    """

    def __init__(self, adminKey, reload: Callable[[str], Any]):
        """
        @param reload: called with the source C{"admin"}; returns a
            L{relay.process.reload.ReloadResult}.
        """
        super().__init__(adminKey)
        self.reload = reload

    def render_POST(self, request):
        """
        200 with C{{"applied": true, "problems": [], "refused": [...],
        "changes": {...}}} when the file applied (C{refused} lists keys
        kept until a restart); 400 in OpenAI's error envelope, with the
        same fields, when the file has a problem and nothing changed.
        """
        if request.postpath not in ([], [b""]):
            return notFound(request)
        result = self.reload("admin")
        answer = result.asDict()
        if result.applied:
            return respond(request, 200, answer)
        problems = list(result.problems)
        body = errorBody(
            "configuration not reloaded: " + "; ".join(problems),
            "invalid_request_error",
            "invalid_configuration",
        )
        body.update(answer)
        return respond(request, 400, body)


class _MetricsResource(Resource):
    """
    The Prometheus text exposition of one registry, rendered synchronously
    (no threads, no global reactor, unlike C{prometheus_client.twisted}),
    without C{_created} series (L{relay.console.metrics.withoutCreated}).
    """

    isLeaf = True

    def __init__(self, registry: CollectorRegistry):
        super().__init__()
        self.registry = registry

    def render_GET(self, request):
        """
        The metrics, in the format the C{Accept} header asks for.
        """
        accept = request.getHeader(b"accept") or ""
        if isinstance(accept, bytes):
            accept = accept.decode("latin-1")
        encoder, contentType = choose_encoder(accept)
        request.setResponseCode(200)
        request.setHeader(b"content-type", contentType.encode("ascii"))
        request.setHeader(b"cache-control", b"no-store")
        return encoder(withoutCreated(self.registry))

    render_HEAD = render_GET


class GuardedMetrics(Guarded):
    """
    C{/admin/metrics}: the metrics behind the admin key; C{/metrics} also
    opens to the read-only C{metrics_key} (R99).
    """

    def __init__(self, adminKey, registry, readKey=None):
        """
        @param readKey: a no-argument callable returning the read-only
            metrics key or L{None}; L{None} for admin-only.
        """
        super().__init__(adminKey)
        self._metrics = _MetricsResource(registry)
        self._readKey = readKey

    @property
    def adminKey(self) -> Optional[str]:
        """
        @return: the admin key, or (when only a metrics key is configured)
            the metrics key, so the route is enabled.
        """
        admin = _keyOf(self._adminKey)
        if admin is None and self._readKey is not None:
            return self._readKey()
        return admin

    def _authorised(self, request) -> bool:
        if super()._authorised(request):
            return True
        key = self._readKey() if self._readKey is not None else None
        if key is None:
            return False
        header = request.getHeader(b"authorization") or b""
        scheme, _, token = header.decode("latin-1").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("utf-8"), key.encode("utf-8")
        )

    def render_GET(self, request):
        """
        Delegate to the plain metrics resource.
        """
        return self._metrics.render_GET(request)


class _StatusPage(Guarded):
    """
    C{GET /admin/}: the status page. Served without the key (its data
    fetches carry it); 404 when the admin API is disabled.
    """

    requireKey = False

    def __init__(self, adminKey, page: bytes):
        super().__init__(adminKey)
        self.page = page

    def render_GET(self, request):
        """
        The page, uncached, with a strict content security policy.
        """
        if request.postpath not in ([], [b""]):
            return notFound(request)
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"x-content-type-options", b"nosniff")
        request.setHeader(b"x-frame-options", b"DENY")
        request.setHeader(b"referrer-policy", b"no-referrer")
        request.setHeader(b"content-security-policy", PAGE_CSP)
        return self.page


class _AdminRoot(Resource):
    """
    C{/admin}: routes to the leaves; C{/admin} itself redirects to
    C{/admin/} so the page's relative fetches resolve.
    """

    def __init__(self, adminKey, children: dict):
        super().__init__()
        self._adminKey = adminKey
        self._routes = children

    @property
    def adminKey(self) -> Optional[str]:
        """
        @return: the admin key in force, or L{None} when disabled.
        """
        return _keyOf(self._adminKey)

    def putRoute(self, path: bytes, resource) -> None:
        """
        Mount another leaf under C{/admin} (the request log and
        explain resources of L{relay.console.tenants}).

        @param path: the segment, e.g. C{b"requests"}.
        @param resource: a guarded leaf resource.
        """
        self._routes[path] = resource
    def route(self, path: bytes):
        """
        @return: the resource routed at C{path} (e.g. C{b"accounts"}), or
            L{None}; the control plane puts its own in front of some
            (L{relay.control.audit.resource.ControlAdmin}).
        """
        return self._routes.get(path)

    def getChild(self, path, request):
        """
        Route one segment; unknown ones (and all when disabled) are 404.
        """
        if self.adminKey is not None and path in self._routes:
            return self._routes[path]
        return _NotFoundLeaf()

    def render(self, request):
        """
        Redirect C{/admin} to C{/admin/}; 404 when disabled.
        """
        if self.adminKey is None:
            return notFound(request)
        request.setResponseCode(301)
        request.setHeader(b"location", request.uri.split(b"?", 1)[0] + b"/")
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
        return b"moved to /admin/\n"


class _NotFoundLeaf(Resource):
    """
    A JSON 404 for every method.
    """

    isLeaf = True

    def render(self, request):
        return notFound(request)


def _loadPage() -> bytes:
    """
    @return: the bytes of L{STATUS_PAGE} (the page's HTML shell; its
        styles and scripts are L{relay.console.assets} files).
    """
    return resources.files("relay.console").joinpath(STATUS_PAGE).read_bytes()


def buildAdminResource(
    adminKey: Optional[str],
    settings: RuntimeSettings,
    accountsView: Callable[[], Any],
    clearAccount: Callable[[str], Any],
    registry: Optional[CollectorRegistry] = None,
    *,
    recentFailovers: Optional[Callable[[], list]] = None,
    clock=None,
    usage=None,
    history: Optional[Callable[[], dict]] = None,
    tokenActions=None,
    reload: Optional[Callable[[str], Any]] = None,
) -> Resource:
    """
    Build the resource tree to mount at C{/admin}.

    @param adminKey: the admin key, or L{None} to disable every route (404),
        or a no-argument callable returning either, read per request.
    @param settings: the process's L{RuntimeSettings}.
    @param accountsView: returns (a L{Deferred} of) a list of dicts, one per
        account, with keys C{id}, C{type}, C{priority}, C{concurrency},
        C{in_use}, C{waiting}, C{schedulable} (false while any block is in
        force, account- or model-wide), C{reason}, C{until}, C{blocks} (every
        block selection honours: C{scope} account/model/proxy, C{model},
        C{kind}, C{reason}, C{until}, C{until_iso}, C{seconds_left}),
        C{blocked_models}, C{streaks} (R11, model -> count),
        C{rate_limited_until}, C{breaker}, C{disabled}, C{last_error},
        C{last_error_at}, C{last_success_at}, C{turns}, C{failovers},
        C{proxy_id}, C{proxy_state}, C{health} (the last 15 minutes'
        attempt ends and the state shown: L{relay.policy.outcomes.healthState})
        (times in Unix seconds unless named C{*_iso}; missing keys are shown
        as empty).
    @param clearAccount: called with an account id; returns (a L{Deferred}
        of) anything, or raises/fails with L{KeyError} for an unknown id.
    @param registry: the metrics registry for C{/admin/metrics}, or L{None}
        for no such route.
    @param recentFailovers: optional; returns recent failovers (e.g.
        L{relay.console.metrics.RelayMetrics.recentFailovers}) for the page.
    @param clock: optional L{IReactorTime}; its time is sent as C{now} so
        the page counts down cooldowns on the server's clock.
    @param usage: optional L{relay.usage.ledger.UsageLedger} for
        C{/admin/usage} (needs C{clock}).
    @param history: optional; returns the charts' data (e.g.
        L{relay.console.history.AccountHistory.snapshot}) for C{/admin/history}.
    @param tokenActions: optional object with C{refreshAccount(id,
        options)} (firing with C{(refreshed, view, why)}) and C{setTokens(id, body)} (L{relay.console.view.OperatorView})
        for the OAuth routes; they return (Deferreds of) results and raise
        L{KeyError} for an unknown account, L{ValueError} for a bad request.
    @param reload: optional; C{reload(source)} re-reads the configuration
        and returns a L{relay.process.reload.ReloadResult}, served as
        C{POST /admin/reload}.
    @rtype: L{Resource}
    """
    routes = {
        b"": _StatusPage(adminKey, _loadPage()),
        b"static": StaticFiles(loadAssets(), notFound),
        b"settings": _SettingsResource(adminKey, settings),
        b"accounts": _AccountsResource(
            adminKey, accountsView, clearAccount, recentFailovers, clock, tokenActions
        ),
    }
    if registry is not None:
        routes[b"metrics"] = GuardedMetrics(adminKey, registry)
    if usage is not None:
        routes[b"usage"] = _UsageResource(adminKey, usage, clock)
    if history is not None:
        routes[b"history"] = _HistoryResource(adminKey, history)
    if reload is not None:
        routes[b"reload"] = _ReloadResource(adminKey, reload)
    return _AdminRoot(adminKey, routes)


def metricsResource(registry: CollectorRegistry) -> Resource:
    """
    The bare Prometheus exposition of C{registry}, without the admin key.
    relay itself does not mount it: its C{/metrics} (like C{/admin/metrics})
    requires C{Authorization: Bearer <admin key>} and answers 404 when no
    admin key is configured (L{GuardedMetrics}); this one is for embedding
    and tests.

    @param registry: e.g. L{relay.console.metrics.RelayMetrics.registry}.
    @rtype: L{Resource}
    """
    return _MetricsResource(registry)
