# -*- test-case-name: tests.test_intake -*-
"""
Request intake: nothing before the key (behaviour.md R103).

Every HTTP request passes through L{IntakePolicy} as soon as its headers
are read, before a byte of its body is stored, on every route (those of
today and those added later): the route class of its path decides which
credential it needs, and a request without it is answered at once (401,
or 404 for admin routes when no admin key is configured, R99) with
C{Connection: close}; its body is never read, decoded, spooled or parsed.

  - B{client routes} (C{/v1/...}, the prefixless aliases,
    C{/backend-api/...}): a client key (C{Authorization: Bearer} or
    C{x-api-key}, L{relay.entry.http.KeyRing}: one digest, one lookup)
    that is neither disabled nor expired (401 C{api_key_disabled} /
    C{api_key_expired}, the key policy's key-only refusals, R102); while
    the ring cannot tell yet (the control store's first read at start,
    R105) the request waits at its headers, its body unread (bounded,
    L{KEYS_WAIT_SECONDS});
  - B{admin routes} (C{/admin/<anything>}): the admin key, or a console
    operator's session cookie (L{IntakePolicy.consoleGate}); the status page
    shell C{GET /admin/} and its files C{GET /admin/static/...} need none
    (R99);
  - B{C{/metrics}}: the admin key or the read-only C{metrics_key};
  - B{sign-in routes} (C{/auth/...}, the console's sign-in): none yet;
    their body is read, bounded by L{SIGNIN_BODY_LIMIT}; the route checks
    the password (throttled per address, L{relay.operators.signin});
  - B{a key holder's page} (C{/me}) is open; its data (C{/me/api/...}) is
    a client route;
  - B{open routes} (C{/healthz}, C{/readyz}, unknown paths): none; their
    body, if any, is discarded unread.

A client request's body is then held raw (not decoded) while it arrives,
counted against C{gateway.max_request_body_bytes} and against the bytes in
flight of its key (C{gateway.limits.body_bytes_in_flight_per_key}) and of
the whole process (C{gateway.limits.body_bytes_in_flight}): over either,
a 429 naming the limit, at once. Once the raw body is in, the key's slot
(R26) is admitted by the front door (L{relay.frontdoor.door.FrontDoor.admitSlot}:
the wait plan and its answers are the engine's; this module only
sequences the transport); only then is the body decoded (bounded by the
limit and by C{gateway.limits.max_decompression_ratio}) and handed to the
resource. Form bodies are never parsed by twisted.web; the one
C{multipart/form-data} body relay reads (C{POST /v1/images/edits}, R115) is
parsed by its resource from the held, decoded body like JSON
(L{relay.entry.media}, L{relay.wire.multipart}).

B{For resources} (every route of every engineer): a request that reached
C{render} on a client route carries

  - C{request.admission}: its L{relay.frontdoor.record.Admission}: the
    authenticated L{relay.base.records.ClientKey} and the key's admitted slot (none
    when the key is unlimited or the request had no body); a resource that
    starts a turn hands the slot over (C{Admission.handOver}: C{keyLease},
    with C{keyAdmitted=True}) and the engine releases it; otherwise it is
    released when the request finishes;
  - C{request.relayJSON()}: the decoded body parsed as JSON
    (L{relay.frontdoor.parse.readJSON}: deep nesting and bad surrogates are
    400s), raising L{RequestRefused} (its C{.error} a 400
    L{relay.base.records.ClientError}) for a body that is not JSON; parsed once.
    L{relay.entry.http.requestJSON} does the same for requests built
    without the intake.

Transport sequencing only; no failover or admission policy (architecture.md
invariant 1).
"""

from __future__ import annotations

import hmac
import re
from urllib.parse import unquote_to_bytes as unquote
from typing import Callable, Optional

from attrs import define, field
from twisted.logger import Logger

from relay.frontdoor.budgets import BodyBudget, tooManyBytes  # noqa: F401 - re-exported
from relay.frontdoor.keyring import (  # noqa: F401 - bearerOrKey, UNAUTHORIZED re-exported
    UNAUTHORIZED,
    authenticateClient,
    bearerOrKey,
)
from relay.frontdoor.parse import RequestRefused  # noqa: F401 - re-exported
from relay.frontdoor.reuse import HistoryReuse
from relay.base.records import ClientError
from relay.base.requestnotes import notesOf

ROUTE_CLIENT = "client"
ROUTE_ADMIN = "admin"
ROUTE_METRICS = "metrics"
ROUTE_SIGNIN = "signin"

SIGNIN_BODY_LIMIT = 16 * 1024
"""The largest body of a console sign-in route (C{/auth/...}), bytes."""
ROUTE_OPEN = "open"

CLIENT_PREFIXES = (b"v1", b"backend-api", b"responses", b"chat", b"models", b"embeddings",
                   b"images")
"""First path segments of the client API (protocol.md 1)."""

OPEN_PATHS = frozenset({b"healthz", b"readyz"})

KEYS_WAIT_SECONDS = 10.0
"""R105: how long a client request waits at its headers for the key ring
(the control store's first read) before it is authenticated with what is
known (the control plane gives up waiting after as long,
L{relay.control.plane.LOADING_GRACE_SECONDS})."""

ADMIN_BODY_LIMIT = 64 * 1024
"""The largest admin request body (settings, tokens), bytes."""

BODY_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})
"""Methods whose body a route may read; any other request's body is
discarded unread."""


TURN_PATHS = frozenset({
    (b"v1", b"responses"), (b"responses",), (b"backend-api", b"codex", b"responses"),
    (b"v1", b"chat", b"completions"), (b"chat", b"completions"),
    (b"v1", b"messages"),
})
"""The request targets whose C{POST} is a turn (protocol.md 1)."""

STREAM_SCAN_CANDIDATES = 64
"""How many C{"stream"} strings L{bodyStreams} looks at, from the end, before
it gives up (a body of many of them costs no more than this)."""

_STREAM_MEMBER = re.compile(rb'"stream"[ \t\r\n]{0,64}:[ \t\r\n]{0,64}(true|false)')
_KEY_START = re.compile(rb'[{,][ \t\r\n]{0,64}\Z')


def isTurnPath(path: bytes) -> bool:
    """
    Whether a request target is a turn route (C{POST /v1/responses} and
    its aliases, C{POST /v1/chat/completions}, C{POST /v1/messages}).

    @param path: the request target as sent (may carry a query).
    """
    return _segments(path) in TURN_PATHS


def isHealthPath(path: bytes) -> bool:
    """
    Whether a request target is C{/healthz} or C{/readyz} (the routes a
    connection over the connection caps may still ask,
    L{relay.entry.site.OVER_CAP_ALLOWANCE}).

    @param path: the request target as sent (may carry a query).
    """
    segments = _segments(path)
    return len(segments) == 1 and segments[0] in OPEN_PATHS


_segmentsSeen: dict = {}
_SEGMENTS_SEEN_SIZE = 512


def _segments(path: bytes) -> tuple:
    """
    The non-empty path segments of a request target, percent-decoded as
    twisted.web decodes them to find the resource (C{/%61dmin/settings}
    is C{/admin/settings}), so a route is sorted by the resource that will
    answer it. Remembered per target without a query (every
    request sorts its route twice, and a gateway's targets repeat).
    """
    found = _segmentsSeen.get(path)
    if found is not None:
        return found
    target, mark, _ = path.partition(b"?")
    found = tuple(s for s in (unquote(s) for s in target.split(b"/")) if s)
    if not mark and len(path) <= 256:
        if len(_segmentsSeen) >= _SEGMENTS_SEEN_SIZE:
            _segmentsSeen.clear()
        _segmentsSeen[path] = found
    return found


def bodyStreams(raw: bytes) -> Optional[bool]:
    """
    The C{stream} flag of a JSON request body, read from its raw bytes
    without parsing them (behaviour.md R85 while the key's slot is
    awaited, before R103 lets relay parse the body; protocol.md 2.1: the
    body's flag decides, never C{Accept}).

    The last C{"stream": true|false} in member position (after C{{} or
    C{,}) wins, as in a parse (the last duplicate wins). The bytes are
    searched from the end with C{bytes.rfind} (Codex and the SDK put
    C{stream} after C{input}), at most L{STREAM_SCAN_CANDIDATES} C{"stream"}
    strings are looked at, nothing is allocated but match objects, and
    nesting is not checked: a C{"stream": true} member of a nested object
    counts. In valid JSON an unescaped C{"stream"} after C{{} or C{,} and
    before C{:} is always a member name, so the answer is the parse's for
    every body relay receives from Codex and the SDK. The parse after
    admission stays authoritative (L{relay.entry.body}).

    @param raw: the body as received (not C{Content-Encoding}-decoded).
    @return: C{True} or C{False} for the flag (C{False} when the body has
        no C{stream} member), L{None} when it could not tell (too many
        candidates).
    """
    end = len(raw)
    for _ in range(STREAM_SCAN_CANDIDATES):
        at = raw.rfind(b'"stream"', 0, end)
        if at < 0:
            return False
        end = at
        member = _STREAM_MEMBER.match(raw, at)
        if member is not None and _KEY_START.search(raw, max(0, at - 65), at):
            return member.group(1) == b"true"
    return None


def routeClass(path: bytes, method: bytes) -> str:
    """
    The route class of a request target (see the module docstring).

    @param path: the request target as sent (may carry a query).
    @param method: the request method.
    @return: one of L{ROUTE_CLIENT}, L{ROUTE_ADMIN}, L{ROUTE_METRICS},
        L{ROUTE_OPEN}.
    """
    segments = _segments(path)
    if not segments:
        return ROUTE_OPEN
    head = segments[0]
    if head == b"admin":
        if method in (b"GET", b"HEAD") and (
            len(segments) == 1 or (segments[1] == b"static" and len(segments) > 2
                                   and b".." not in segments and b"." not in segments)
        ):
            # The status page shell, its redirect and its static files
            # (styles, scripts, the charting library: no data) (R99).
            return ROUTE_OPEN
        return ROUTE_ADMIN
    if head == b"metrics":
        return ROUTE_METRICS
    if head == b"auth":
        return ROUTE_SIGNIN  # console sign-in: no credential yet, a small body
    if head == b"me":
        # A key holder's page (open) and its data (the key, like any client route).
        return ROUTE_CLIENT if len(segments) > 1 and segments[1] == b"api" else ROUTE_OPEN
    if head in CLIENT_PREFIXES:
        return ROUTE_CLIENT
    return ROUTE_OPEN


def sameSecret(given: Optional[bytes], expected: Optional[str]) -> bool:
    """
    Constant-time comparison of a presented secret with a configured one.
    """
    if not given or not expected:
        return False
    return hmac.compare_digest(given, expected.encode("utf-8"))


UNAUTHORIZED_ADMIN = ClientError(
    401, "authentication_error", "Missing or invalid admin key", code="invalid_admin_key",
    headers=(("WWW-Authenticate", 'Bearer realm="relay-admin"'),),
)

ADMIN_DISABLED = ClientError(404, "invalid_request_error", "Not found", code="not_found")

TOO_MANY_CONNECTIONS = ClientError(
    503, "api_error", "Too many open connections, please retry later.",
    code="too_many_connections", headers=(("Retry-After", "1"),),
)
"""A connection over C{gateway.limits.max_connections} /
C{max_connections_per_address} (L{relay.entry.site.RelaySite}), or a
request other than C{/healthz} / C{/readyz} on one of the over-cap
allowance (L{relay.entry.site.OVER_CAP_ALLOWANCE})."""


@define(eq=False)
class IntakePolicy:
    """
    What the site checks when a request's headers are in (see the module
    docstring). Set as C{site.intake}.

    @ivar keys: the L{relay.entry.http.KeyRing}.
    @ivar adminKey: a no-argument callable returning the admin key in force
        or L{None}.
    @ivar metricsKey: a no-argument callable returning the read-only
        metrics key or L{None}.
    @ivar limits: a no-argument callable returning the
        L{relay.base.records.LimitSettings} in force.
    @ivar admitKey: C{(key, cancel, requestId) -> Deferred[lease or None]}
        (the front door's R26 admission, L{relay.frontdoor.door.FrontDoor.admitSlot}), failing with an exception carrying
        C{.error} (a L{ClientError}); L{None} admits nothing.
    @ivar takesSlot: C{(key) -> bool}: whether C{admitKey} has a slot to
        admit for the key (L{relay.frontdoor.door.FrontDoor.takesSlot});
        L{False}: the request is admitted at once, with no lease, without
        asking C{admitKey}; L{None}: C{admitKey} is always asked.
    @ivar budget: the L{BodyBudget}.
    @ivar histories: the large bodies each key sent last, parsed
        (L{HistoryReuse}): a Codex turn's body is read as the extension of
        the one before.
    @ivar draining: a no-argument callable, true while relay drains:
        a request that arrives then takes no slot; the drain gate
        answers it 503.
    @ivar keyRefusal: C{(key) -> ClientError or None}: the refusals that
        need only the key (behaviour.md R102, R103: disabled 401
        C{api_key_disabled}, expired 401 C{api_key_expired};
        L{relay.tenants.keypolicy.KeyPolicy.keyRefusal}), answered from the
        headers like an unknown key; L{None}: none.
    @ivar keysReady: a no-argument callable: L{None} when the key ring can
        tell every key now, else a Deferred firing once it can (the start-up
        gate's C{control} flag while the control store's first read is
        pending, R105); a client request then waits at its headers, its
        body unread, for at most L{KEYS_WAIT_SECONDS}.
    @ivar adminGuard: the L{relay.entry.adminguard.AdminGuard} that backs
        off an address guessing the admin (or metrics) key, or L{None}.
    @ivar consoleGate: checks an admin request that carries a console
        session cookie and no C{Authorization} (its session, CSRF token and
        role: L{relay.operators.gate.ConsoleGate}), or L{None}: the admin
        key only.
    """

    keys: object
    adminKey: Callable[[], Optional[str]] = lambda: None
    metricsKey: Callable[[], Optional[str]] = lambda: None
    limits: Callable[[], object] = None
    admitKey: Optional[Callable] = None
    takesSlot: Optional[Callable] = None
    budget: BodyBudget = field(factory=BodyBudget)
    histories: HistoryReuse = field(factory=HistoryReuse)
    draining: Callable[[], bool] = lambda: False
    keyRefusal: Optional[Callable] = None
    keysReady: Callable[[], object] = lambda: None
    adminGuard: Optional[object] = None
    consoleGate: Optional[object] = None
    _log = Logger()

    def authenticate(self, route: str, request):
        """
        Check the request's credentials for its route class.

        @return: C{(clientKey or None, error or None)}.
        """
        if route in (ROUTE_OPEN, ROUTE_SIGNIN):
            return None, None
        secret = bearerOrKey(request)
        if route == ROUTE_CLIENT:
            return authenticateClient(self.keys, secret, self.keyRefusal)
        admin = self.adminKey()
        metrics = self.metricsKey() if route == ROUTE_METRICS else None
        if admin is None and metrics is None:
            return None, ADMIN_DISABLED
        gate = self.consoleGate
        if (route == ROUTE_ADMIN and gate is not None and _bearer(request) is None
                and gate.present(request)):
            # A console operator's session cookie (its CSRF token, its role).
            return None, gate.authenticate(request)
        return None, self._operatorKey(request, admin, metrics)

    def _operatorKey(self, request, admin, metrics) -> Optional[ClientError]:
        """
        The admin (or, on C{/metrics}, the metrics) key check, behind the
        guessing back-off of L{adminGuard}: an address that waits is
        answered 429 without its key being compared; a wrong key (one that
        is none of relay's keys) is counted, a right one resets the
        address. Those answers are logged by the guard (throttled), not
        one line per request.

        @return: L{None} when the key is right, else the error.
        """
        guard = self.adminGuard
        address = getattr(request.getClientAddress(), "host", None)
        if guard is not None:
            refusal = guard.refusal(address)
            if refusal is not None:
                notesOf(request).quietRefusal = True
                return refusal
        given = _bearer(request)
        if sameSecret(given, admin) or sameSecret(given, metrics):
            if guard is not None:
                guard.succeeded(address)
            return None
        if guard is not None and given and not self._known(given):
            guard.failed(address)
            notesOf(request).quietRefusal = True
        return UNAUTHORIZED_ADMIN

    def _known(self, secret: bytes) -> bool:
        """
        Whether C{secret} is one of relay's keys (the metrics key, a client
        key) presented on a route it does not open: a wrong door, not a
        guess.
        """
        if sameSecret(secret, self.metricsKey()):
            return True
        authenticate = getattr(self.keys, "authenticateSecret", None)
        return authenticate is not None and authenticate(secret) is not None

    def bodyLimit(self, route: str, siteLimit: int) -> int:
        """
        The largest body the route class takes, bytes.
        """
        if route == ROUTE_CLIENT:
            return siteLimit
        if route == ROUTE_SIGNIN:
            return SIGNIN_BODY_LIMIT
        return ADMIN_BODY_LIMIT

    def logRefused(self, request, route: str, error: ClientError) -> None:
        """
        Say that a request was answered from its headers alone (not a
        guessed admin key: L{adminGuard} logs those, throttled).
        """
        if notesOf(request).quietRefusal:
            return
        address = request.getClientAddress()
        self._log.info(
            "{route} request refused before its body: {status} {code}",
            event="relay.intake_refused", route=route, status=error.status, code=error.code,
            client=getattr(address, "host", "-"),
        )


def _bearer(request) -> Optional[bytes]:
    """
    The C{Authorization: Bearer} secret only (admin routes, R99).
    """
    auth = request.requestHeaders.getRawHeaders(b"authorization", [None])[0]
    if auth and auth[:7].lower() == b"bearer ":
        return auth[7:].strip() or None
    return None
