# -*- test-case-name: tests.test_tap -*-
"""
Builds a running relay from a L{RelayConfig}: state store, admission,
classifier, dialer, health, scheduler, the turn runner, and the twisted.web
L{Site} serving HTTP and the Responses WebSocket on one port.

The reactor is always passed in (only L{relay.tap.makeService} imports the
global one).
"""

from __future__ import annotations

import os
from http import HTTPStatus
from typing import Optional

from attrs import define, field
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.logger import Logger
from twisted.web.http import RESPONSES
from twisted.web.server import Site

from relay.policy.classify import DefaultClassifier
from relay.configuration.components import loadComponent
from relay.engine.runner import TurnRunner
from relay.entry.adminguard import AdminGuard
from relay.entry.body import LimitedBodyRequest
from relay.entry.http import KeyRing
from relay.entry.intake import IntakePolicy
from relay.entry.root import buildRoot
from relay.translate.anthropic.models import AnthropicModels
from relay.entry.site import JSONMethodErrors, RelaySite, writeFirst
from relay.process.listener import Listener
from relay.base.logs import ClassLogger, cutRedacted
from relay.base.redact import redactQuery
from relay.policy.health import AccountHealth
from relay.interfaces import IFailureClassifier, ISlotAdmission, IUpstreamDialer
from relay.base.records import RelayConfig
from relay.process.drain import DrainGate, GracefulDrain
from relay.process.live import LiveConfiguration
from relay.process.reload import ConfigReloader
from relay.policy.proxyhealth import ProxyHealth
from relay.wire.redisclient import logFailure
from relay.base.requestid import clientRequestIdOf, requestIdOf
from relay.scheduling.scheduler import AccountScheduler
from relay.state.settings import RuntimeSettings
from relay.upstream.http import HTTPDialer
from relay.base.requestnotes import notesOf


_log = Logger()


class _Request(LimitedBodyRequest):
    """
    A L{Request} that checks credentials from the headers, bounds, holds
    and decodes bodies (L{LimitedBodyRequest}) and never
    parses form submissions (relay reads JSON only, R103).
    """

    def process(self) -> None:
        """
        Give the request its id (and its C{X-Request-Id} response header)
        before any resource sees it, so every answer carries it,
        and note when it started for the access line (L{_Site.log}).
        """
        clock = getattr(self.channel.site, "clock", None)
        self.notes.startedAt = clock.seconds() if clock is not None else None
        requestIdOf(self)
        super().process()

    _relayChunks = False
    """The answer's head went out through L{relay.entry.site.RelayHTTPChannel}
    (L{write}): later chunks go to its C{write} directly."""

    def write(self, data: bytes) -> None:
        """
        The answer's first write sends its head and C{data} in
        one C{send} (L{relay.entry.site.RelayHTTPChannel.holdHead}); the
        chunks after it (a streamed answer) are framed here.
        """
        if self._relayChunks and self.chunked:
            if not (self.finished or self._disconnected or self._encoder or self._inFakeHead):
                # A chunk of a streamed answer (an SSE event), as
                # twisted.web's Request.write frames it (toChunk, joined by
                # RelayHTTPChannel.writeSequence), without its five calls.
                self.sentLength += len(data)
                if data:
                    self.channel.write(b"%x\r\n%b\r\n" % (len(data), data))
                return None
            return super().write(data)
        channel = getattr(self, "channel", None)
        if self.startedWriting or channel is None or not hasattr(channel, "holdHead"):
            return super().write(data)
        self._relayChunks = True
        if writeFirst(self, data):
            return None
        channel.holdHead()
        try:
            super().write(data)
        finally:
            channel.sendHead()

    def setResponseCode(self, code: int, message: Optional[bytes] = None) -> None:
        """
        Set the status; a status twisted.web has no reason phrase for (426
        Upgrade Required, 429 Too Many Requests, ...) gets the standard one
        (L{HTTPStatus}) instead of twisted.web's C{Unknown Status}.

        @param code: the HTTP status.
        @param message: the reason phrase, or L{None} for the standard one.
        """
        if message is None and code not in RESPONSES:
            try:
                message = HTTPStatus(code).phrase.encode("ascii")
            except ValueError:
                pass
        super().setResponseCode(code, message)

    def render(self, resrc) -> None:
        """
        Render C{resrc}; a method it has no handler for is a JSON 405
        (L{JSONMethodErrors}), never twisted.web's HTML page.
        """
        super().render(JSONMethodErrors(resrc))


_ACCESS = '{client} "{method} {path}" {status} {bytes}'
"""The access line's format (L{_Site.log}); L{_ACCESS_TIMED} with a duration."""
_ACCESS_TIMED = _ACCESS + " in {duration_ms}ms"


def _isPolling(request) -> bool:
    """
    @return: whether C{request} is an admin read that succeeded (the
        console's polling: C{GET}/C{HEAD} under C{/admin}, status below
        400), logged at debug by L{_Site.log}.
    """
    if request.method not in (b"GET", b"HEAD"):
        return False
    path = request.uri.split(b"?", 1)[0]
    return (path == b"/admin" or path.startswith(b"/admin/")) and (request.code or 200) < 400


class _Site(RelaySite):
    """
    The relay's L{Site}: its access line is a structured
    C{relay.http_access} event with the request's id, instead of
    twisted.web's Apache-style text line.

    @ivar clock: the L{IReactorTime} the request durations are measured on.
    """

    _log = ClassLogger()
    clock = None

    def log(self, request) -> None:
        """
        Log one finished request: client address, method, path, status,
        bytes sent, duration (ms) and user agent, with C{request_id} and
        the id the client sent, C{client_request_id} (R111). Query
        parameters whose names look secret (C{api_key=}, C{token=}, ...)
        are logged as C{***} (L{relay.base.logs.redactQuery}).

        @param request: the finished L{Request}.
        """
        address = request.getClientAddress()
        started = notesOf(request).startedAt
        duration = None
        if started is not None and self.clock is not None:
            duration = round((self.clock.seconds() - started) * 1000, 1)
        agent = request.getHeader(b"user-agent")
        uri = request.uri
        # A target without a query has nothing to redact.
        path = redactQuery(uri.decode("latin-1")) if 63 in uri else uri.decode("latin-1")  # b"?"
        # The console's own polling (admin reads that succeeded) is debug,
        # not info: an open admin tab must not fill the log.
        emit = self._log.debug if _isPolling(request) else self._log.info
        emit(
            _ACCESS if duration is None else _ACCESS_TIMED,
            event="relay.http_access",
            request_id=notesOf(request).requestId,
            client_request_id=clientRequestIdOf(request),
            client=getattr(address, "host", "-"),
            method=request.method.decode("latin-1"),
            path=cutRedacted(path, 512),  # redacted before a cut (a secret across it)
            status=request.code,
            bytes=request.sentLength,
            duration_ms=duration,
            user_agent=cutRedacted(agent.decode("latin-1"), 200) if agent else None,
        )


@define(eq=False)
class RelayApplication:
    """
    Everything a running relay holds, for the service and for tests.

    @ivar site: the L{Site} to listen with.
    @ivar services: child services to start (Redis, timers).
    @ivar live: the L{LiveConfiguration}: the accounts registry and key ring
        every consumer reads.
    @ivar reloader: the L{ConfigReloader} behind C{SIGHUP} and C{POST
        /admin/reload}.
    @ivar drain: the L{GracefulDrain} the service runs on stop.
    """

    config: RelayConfig
    reactor: object
    settings: RuntimeSettings
    store: object
    admission: object
    classifier: object
    dialer: object
    health: object
    scheduler: object
    runner: TurnRunner
    keys: KeyRing
    live: Optional[LiveConfiguration] = None
    reloader: Optional[ConfigReloader] = None
    drain: Optional[GracefulDrain] = None
    site: Optional[Site] = None
    services: list = field(factory=list)
    extras: dict = field(factory=dict)


def _memoryProviders(config: RelayConfig, reactor):
    from relay.admission.memory import MemorySlotAdmission
    from relay.state.memory import MemoryStateStore

    return MemoryStateStore(clock=reactor), (lambda **kw: MemorySlotAdmission(**kw)), {"clock": reactor}, []


def _redisProviders(config: RelayConfig, reactor):
    from relay.admission.redis import RedisSlotAdmission, sharedBatch
    from relay.wire.redisclient import RedisService
    from relay.state.redis import RedisStateStore

    service = RedisService(
        url=config.state.redis_url, clock=reactor, **_sentinelArguments(config.state)
    )
    # The built-in store and admission share one batcher, so a
    # turn's state reads, slot acquire and end-of-turn writes share round trips.
    batch = sharedBatch(service, reactor)
    store = RedisStateStore(
        redis=service, clock=reactor, onRedisError=config.state.on_redis_error, batch=batch
    )
    kwargs = {
        "redis": service,
        "clock": reactor,
        "slotTtl": config.state.concurrency_slot_ttl_minutes * 60,
        "onRedisError": config.state.on_redis_error,
        "prefix": os.urandom(4).hex(),
    }
    return store, (lambda **kw: RedisSlotAdmission(batch=batch, **kw)), kwargs, [service]


def answersAtOnce(config, store, admission) -> bool:
    """
    Whether the client's answers may be sent at once
    (L{relay.entry.site.RelaySite.answerAtOnce}): only when the state store,
    the slot admission and the control store all live in this process (the
    memory backend; the store and admission declare
    L{relay.interfaces.ISynchronousState} and
    L{relay.interfaces.ISynchronousAdmission}), so every write a turn makes before
    its answer -- the response's owner record and routing binding
    (R39/R40/R104), the slot releases -- is done when the answer is written.
    With Redis, or an operator's component (C{components:}, which may be
    remote), answers wait for the next poll, after the store's batched
    writes of the same reactor iteration have been sent.

    @param config: the L{RelayConfig}.
    @param store: the built L{IStateStore}.
    @param admission: the built L{ISlotAdmission}.
    @rtype: L{bool}
    """
    from relay.interfaces import ISynchronousAdmission, ISynchronousState

    return (
        config.state.backend == "memory"
        and ISynchronousState.providedBy(store)
        and ISynchronousAdmission.providedBy(admission)
    )


def _sentinelArguments(state) -> dict:
    """
    The L{relay.wire.redisclient.RedisService} arguments of
    C{state.redis_sentinels} / C{state.redis_master_name}, or none.
    """
    if not state.redis_sentinels:
        return {}
    from relay.wire.redisclient import parseHostPort

    return {
        "sentinels": tuple(parseHostPort(a) for a in state.redis_sentinels),
        "masterName": state.redis_master_name,
    }


def _processLiveness(admission) -> list:
    """
    R34 crash recovery: the heartbeat service of a Redis admission that has
    one (L{relay.admission.redis.RedisSlotAdmission.startHeartbeat}), so
    other processes free this process's slots soon after it is killed. It
    sits after the Redis client in the children: it starts after it, and
    stops before it but after the drain has released the slots.

    @param admission: the built L{ISlotAdmission} (possibly a component
        without a heartbeat, which gets none).
    @return: C{[ProcessLivenessService]}, or C{[]}.
    """
    from relay.admission.redis import ProcessLivenessService

    if not (hasattr(admission, "startHeartbeat") and hasattr(admission, "stopHeartbeat")):
        return []
    return [ProcessLivenessService(admission)]


def buildApplication(
    config: RelayConfig,
    reactor,
    dialer=None,
    trustRoot=None,
    configPath: Optional[str] = None,
    listenOverride: Optional[str] = None,
    spanExporter=None,
) -> RelayApplication:
    """
    Wire a relay.

    @param config: the parsed L{RelayConfig}.
    @param reactor: the reactor (also the clock).
    @param dialer: an L{IUpstreamDialer} to use instead of the configured
        one (tests).
    @param trustRoot: TLS trust root for upstreams (tests with a local CA).
    @param configPath: the file C{config} was read from, re-read by a live
        reload; L{None} leaves reload without a file until
        C{app.reloader.path} is set.
    @param listenOverride: the C{--listen} that overrode the file's.
    @param spanExporter: a span exporter for the turn traces, used instead
        of the configured one (tests; L{_tracer}).
    @return: a L{RelayApplication} whose C{site} is ready to listen.
    @raise relay.base.records.ConfigError: a component named in C{components:}
        cannot be built or does not provide its interface.
    """
    settings = RuntimeSettings(current=config.gateway)
    if config.state.backend == "redis":
        store, admissionFactory, admissionKwargs, services = _redisProviders(config, reactor)
    else:
        store, admissionFactory, admissionKwargs, services = _memoryProviders(config, reactor)
    admission = loadComponent(
        config.components.admission, ISlotAdmission, admissionFactory, "admission",
        **admissionKwargs,
    )
    if config.state.backend == "redis":
        services.extend(_processLiveness(admission))
    classifier = loadComponent(
        config.components.classifier,
        IFailureClassifier,
        DefaultClassifier,
        "classifier",
        transport_cooldown_seconds=config.gateway.transport_error_cooldown_seconds,
    )
    if dialer is None:
        dialer = loadComponent(
            config.components.dialer, IUpstreamDialer, HTTPDialer, "dialer",
            reactor=reactor, trustRoot=trustRoot,
        )
    health = AccountHealth(store=store, clock=reactor, settings=settings)
    proxyHealth = ProxyHealth(clock=reactor)
    # The accounts and keys have one live home; every consumer
    # below reads through it, so a reload changes them for all at once.
    live = LiveConfiguration.fromConfig(config)
    accounts = live.accounts
    credentials, quota = _oauthParts(config, reactor, settings, accounts, trustRoot)

    from relay.control.plane import ControlPlane

    # What operators change live (admin accounts, pauses); its
    # store is attached once the settings store exists (_controlSurface).
    control = ControlPlane(clock=reactor, live=live, configPath=configPath)

    def extraBlock(account, now, model):
        # A pause, R4/R-B1 in-memory blocks, then token state
        # (needs_login).
        return (control.blockReason(account, now) or health.localBlock(account.id, model)
                or credentials.blockReason(account, now))

    def flagged(now, pool):
        # The accounts extraBlock and the quarantine hook may
        # refuse now (a superset), so a selection checks only those.
        paused = control.flagged(now)
        if paused is None:
            return None
        out = set(paused)
        out.update(health.flagged(now))
        out.update(credentials.flagged(now))
        proxies = proxyHealth.quarantinedProxies(now)
        if proxies:
            out.update(pool.behindProxies(proxies))
        return out

    scheduler = AccountScheduler(
        accounts=accounts,
        admission=admission,
        store=store,
        clock=reactor,
        settings=settings,
        extraBlock=extraBlock,
        isQuarantined=proxyHealth.isQuarantined,
        quarantineEnd=proxyHealth.quarantinedUntil,
        quota=quota,
        flagged=flagged,
    )
    redis = services[0] if services else None
    parts = _engineParts(config, reactor, settings, live, redis, health, proxyHealth,
                         trustRoot, spanExporter)
    parts["keyUsage"] = _keyUsage(reactor, parts, quota, accounts)
    runner = TurnRunner(
        clock=reactor,
        scheduler=scheduler,
        admission=admission,
        dialer=dialer,
        classifier=classifier,
        settings=settings,
        credentials=credentials,
        quota=quota,
        **{name: parts.pop(name) for name in _RUNNER_PARTS},
    )
    keys = live.keys
    app = RelayApplication(
        config=config,
        reactor=reactor,
        settings=settings,
        store=store,
        admission=admission,
        classifier=classifier,
        dialer=dialer,
        health=health,
        scheduler=scheduler,
        runner=runner,
        keys=keys,
        live=live,
        services=services,
    )
    app.reloader = ConfigReloader(
        path=configPath, live=live, settings=settings, listenOverride=listenOverride
    )
    app.extras.update(proxyHealth=proxyHealth, credentials=credentials, quota=quota,
                      control=control, trustRoot=trustRoot, **parts)
    wsResource = _webSocket(app)
    door = wsResource.factory.door  # the one front door (relay.frontdoor)
    anthropicModels = AnthropicModels(config.anthropic_models)  # R115
    app.extras["anthropicModels"] = anthropicModels
    app.extras["control"].anthropicModels = anthropicModels  # the admin API's layer
    app.reloader.onApplied.append(
        lambda result, new: anthropicModels.setFile(new.anthropic_models))
    root = buildRoot(runner, keys, accounts, wsResource, door=door,
                     anthropicModels=anthropicModels)
    _readiness(app, root)
    _redisReadiness(app)
    _operatorSurface(app, root, accounts, proxyHealth)
    _consoleOperators(app, root, keys)
    _tracing(app)
    app.drain = GracefulDrain(
        clock=reactor, runner=runner, settings=settings, admission=admission,
        wsFactory=wsResource.factory,
    )
    site = _Site(DrainGate(root, app.drain), requestFactory=_Request, reactor=reactor)
    site.intake = IntakePolicy(
        keys=keys, adminKey=app.live.adminKey, metricsKey=app.live.metricsKey,
        limits=lambda: settings.current.limits, admitKey=door.admitSlot,
        takesSlot=door.takesSlot,
        draining=lambda: app.drain.draining,
        keyRefusal=_keyRefusal(app), keysReady=_keysReady(app),
        adminGuard=AdminGuard(clock=reactor),
        consoleGate=app.extras["operators"].gate,
    )
    site.limits = lambda: settings.current.limits
    wsResource.factory.budget = site.intake.budget
    site.clock = reactor
    site.answerAtOnce = answersAtOnce(config, store, admission)
    site.displayTracebacks = False
    site.maxRequestBodyBytes = config.gateway.max_request_body_bytes
    site.wsFactory = wsResource.factory
    app.services.append(app.extras["wsPoolService"])
    app.site = site
    app.reloader.onApplied.append(lambda result, new: _applyLimits(app, new))
    return app


_RUNNER_PARTS = ("bookkeeping", "metrics", "history", "wsAttempt", "usage", "observer",
                 "startupGate", "keyPolicy", "prices", "requestLog", "keyUsage")
"""The L{TurnRunner} collaborators L{_engineParts} builds."""


def _keyUsage(reactor, parts: dict, quota, accounts):
    """
    R114: a key's own windows (budgets, rpm/tpm, else the pool's headroom)
    for Codex's usage route and its turns' rate-limit headers and events.

    @return: a L{relay.tenants.keyusage.KeyUsage}.
    """
    from relay.tenants.keyusage import KeyUsage, poolWindows

    policy = parts["keyPolicy"]
    pool = poolWindows(reactor, quota, policy, accounts) if quota is not None else None
    return KeyUsage(clock=reactor, ledger=parts["usage"], policy=policy, pool=pool)


def _engineParts(config: RelayConfig, reactor, settings, live, redis, health, proxyHealth,
                 trustRoot, spanExporter=None) -> dict:
    """
    The turn engine's collaborators, built in one place and given to the
    L{TurnRunner} at construction (none is set on it afterwards): the
    metrics and the status page's history, the account bookkeeping (R86),
    the WebSocket upstream attempt, the usage ledger (R108), the tenants'
    price table, key policy and request log (R102, R109), the turn tracer
    and the start-up gate (R105). The settings store is set first: the
    ledger and the request log are kept where it keeps its data.

    @param settings: the L{RuntimeSettings}; its C{store} is set here.
    @param redis: the L{relay.wire.redisclient.RedisService} of the Redis
        backend, or L{None}.
    @param spanExporter: see L{buildApplication}.
    @return: a dict: the L{_RUNNER_PARTS}, plus C{wsPool}, C{rateLimiter}
        and, with tracing on, C{tracerProvider} for the application's extras.
    """
    from relay.console.history import AccountHistory
    from relay.console.metrics import RelayMetrics
    from relay.console.view import settingsStore
    from relay.policy.bookkeeping import AccountBookkeeping

    settings.store = settingsStore(config, reactor, redis)
    metrics = RelayMetrics(clock=reactor)
    pool, wsAttempt = _wsUpstream(reactor, settings, trustRoot)
    prices, limiter, policy, log = _tenantParts(config, reactor, live, settings.store, redis)
    observer, provider = _tracer(config, reactor, spanExporter)
    parts = dict(
        bookkeeping=AccountBookkeeping(health=health, clock=reactor, proxyHealth=proxyHealth,
                                       metrics=metrics),
        metrics=metrics,
        history=AccountHistory(clock=reactor),
        wsAttempt=wsAttempt,
        usage=_usageLedger(config, reactor, settings.store, metrics, redis),
        observer=observer,
        startupGate=_openGate(),
        keyPolicy=policy,
        prices=prices,
        requestLog=log,
        wsPool=pool,
        rateLimiter=limiter,
    )
    if provider is not None:
        parts["tracerProvider"] = provider
    return parts


def _openGate():
    """
    The start-up gate (R105), open: an application wired by hand (tests)
    has its stores loaded; L{_Startup} closes it until they are read.
    """
    from relay.process.readiness import StartupGate

    gate = StartupGate()
    gate.mark(gate.settings)()
    gate.mark(gate.tokens)()
    return gate


def _keyRefusal(app: RelayApplication):
    """
    The intake's key-only refusals (R102 with R103): the key policy's
    disabled / expired answers, given at the headers on every client route
    and the WebSocket upgrade (L{relay.entry.intake.IntakePolicy}).
    """

    def refusal(key):
        policy = app.extras.get("keyPolicy")
        if policy is None:
            return None
        return policy.keyRefusal(key, app.reactor.seconds())

    return refusal


def _keysReady(app: RelayApplication):
    """
    R105 at the headers: while the control store's first read is pending
    (the key ring does not know the admin keys and disables yet), the
    start-up gate's C{control} flag to wait for; else L{None}.
    """

    def ready():
        if not getattr(app.keys, "pending", False):
            return None
        gate = app.extras.get("startupGate")
        return gate.wait(["control"]) if gate is not None else None

    return ready


def _tracer(config: RelayConfig, reactor, exporter=None):
    """
    With C{tracing.exporter} set, OpenTelemetry spans for every
    turn and attempt (L{relay.tracing.otel.TurnTracer}, the runner's
    observer). Off (the default): nothing is built.

    @param exporter: a span exporter to use instead of the configured one
        (tests).
    @return: C{(TurnTracer, TracerProvider)}, or C{(None, None)}.
    @raise relay.base.records.ConfigError: the C{otel} extra is not installed.
    """
    settings = config.tracing
    if settings.exporter == "none" and exporter is None:
        return None, None
    from relay.tracing.otel import TurnTracer, buildTracerProvider

    provider = buildTracerProvider(settings, exporter)
    return TurnTracer(provider.get_tracer("relay"), reactor), provider


def _tracing(app: RelayApplication) -> None:
    """
    The tracer provider (L{_tracer}), if any, is flushed and shut down
    when relay stops.
    """
    provider = app.extras.get("tracerProvider")
    if provider is not None:
        app.services.append(_TracerShutdown(provider))


class _TracerShutdown(Service):
    """
    Flush and shut down the tracer provider when relay stops (after the
    drain: the last turns' spans are exported).
    """

    def __init__(self, provider):
        self.provider = provider

    def stopService(self):
        super().stopService()
        try:
            self.provider.shutdown()
        except Exception:  # noqa: BLE001 - logged; stopping goes on
            _log.failure("shutting down the tracer failed")


def _readiness(app: RelayApplication, root) -> None:
    """
    C{GET /readyz} (R101, R105,
    L{relay.process.readiness}): the L{Readiness} every part registers
    its check with, in C{app.extras["readiness"]} -- here C{settings} and
    C{tokens} (the stores were loaded; L{_Startup} sets them) and
    C{draining}; C{redis} (L{_redisReadiness}) and C{control}
    (L{relay.control.assemble}) add theirs -- and the one start-up gate
    turns wait on before the stores are in (C{app.extras["startupGate"]},
    the runner's C{startupGate}). Without L{_Startup} (an application wired
    by hand, as in tests) the stores count as loaded.
    """
    from relay.process.readiness import Readiness, ReadinessResource

    readiness = app.extras.setdefault("readiness", Readiness())
    gate = app.runner.startupGate
    readiness.addCheck("settings", gate.settings)
    readiness.addCheck("tokens", gate.tokens)
    readiness.addCheck("draining", lambda: app.drain is None or not app.drain.draining)
    app.extras.update(readiness=readiness, startupGate=gate)
    root.putChild(b"readyz", ReadinessResource(readiness))


def _redisReadiness(app: RelayApplication) -> None:
    """
    R101: C{/readyz} is not ready while Redis does not answer
    (L{relay.wire.redisclient.RedisService.reachable}: the last round trip's
    outcome, no ping per request).
    """
    from relay.wire.redisclient import RedisService

    if "readiness" not in app.extras:
        return
    for service in app.services:
        if isinstance(service, RedisService):
            app.extras["readiness"].addCheck("redis", lambda s=service: s.reachable)
            return


def _oauthParts(config: RelayConfig, reactor, settings, accounts, trustRoot):
    """
    The token side of OAuth accounts: the credential source
    (its store is set by L{_operatorSurface} once the settings store
    exists) and the usage-window recorder.

    @return: C{(OAuthCredentials, UsageWindows)}.
    """
    from twisted.web.client import BrowserLikePolicyForHTTPS

    from relay.oauth.credentials import OAuthCredentials
    from relay.oauth.endpoint import TokenEndpoint
    from relay.oauth.store import MemoryTokenStore
    from relay.scheduling.quota import UsageWindows

    policy = BrowserLikePolicyForHTTPS(trustRoot) if trustRoot is not None else None
    credentials = OAuthCredentials(
        clock=reactor,
        settings=settings,
        store=MemoryTokenStore(clock=reactor),
        endpoint=TokenEndpoint(reactor=reactor, settings=settings, tlsPolicy=policy),
        accounts=accounts,
    )
    return credentials, UsageWindows(clock=reactor)


def _warnUnmigratedTokens(config) -> None:
    """
    With the Redis backend the SQLite C{database} is ignored; OAuth tokens
    refreshed while it was the store stay there, and the configuration's
    refresh tokens were rotated since (reusing one can revoke the login,
    protocol.md 7.4). Say so once at start when such a file exists.
    """
    path = config.database
    refreshable = [a.id for a in config.accounts if a.type == "oauth" and a.refresh_token]
    if path and refreshable and os.path.exists(path):
        Logger().warn(
            "state.backend is redis: OAuth tokens refreshed into {path} are not carried over;"
            " give {accounts} a fresh login if they were refreshed there (docs/running.md, OAuth)",
            event="relay.oauth_store_not_migrated",
            path=path,
            accounts=", ".join(refreshable),
        )


def _tokenStore(app: RelayApplication, redis):
    """
    Where the newest tokens are persisted: Redis with the Redis backend,
    else the SQLite C{database} (through the settings store), else memory
    (nothing survives a restart; logged).
    """
    from relay.oauth.store import RedisTokenStore, SQLiteTokenStore
    from relay.state.settingsdb import SQLiteSettingsStore

    if app.config.state.backend == "redis" and redis is not None:
        _warnUnmigratedTokens(app.config)
        return RedisTokenStore(redis=redis)
    if isinstance(app.settings.store, SQLiteSettingsStore):
        return SQLiteTokenStore(settings=app.settings.store, clock=app.reactor)
    if any(a.type == "oauth" and a.refresh_token for a in app.config.accounts):
        Logger().warn(
            "no database: refreshed OAuth tokens live in memory only and are lost on restart",
            event="relay.oauth_store_memory",
        )
    return app.extras["credentials"].store


def _applyLimits(app: RelayApplication, config: RelayConfig) -> None:
    """
    A reload's gateway limits that live outside the runtime settings:
    the request body limit (read per request from the site) and the
    client WebSocket frame limit (read by each new connection).
    """
    app.site.maxRequestBodyBytes = config.gateway.max_request_body_bytes
    factory = app.extras.get("wsFactory")
    if factory is not None:
        factory.setProtocolOptions(maxMessagePayloadSize=config.gateway.websocket.max_frame_bytes)


def _wsUpstream(reactor, settings, trustRoot):
    """
    The upstream WebSocket pool and the engine's WebSocket attempt over it.

    @return: C{(UpstreamPool, WebSocketAttempt)}.
    """
    from twisted.web.client import BrowserLikePolicyForHTTPS

    from relay.engine.wsattempt import WebSocketAttempt
    from relay.upstream.ws import UpstreamPool

    policy = BrowserLikePolicyForHTTPS(trustRoot) if trustRoot is not None else None
    pool = UpstreamPool(reactor=reactor, settings=settings, tlsPolicy=policy)
    return pool, WebSocketAttempt(pool=pool, reactor=reactor, tlsPolicy=policy)


def _webSocket(app: RelayApplication):
    """
    The Responses WebSocket: the upgrade resource, and the
    upstream pool's (L{_wsUpstream}) service, which closes it on shutdown.
    """
    from relay.entry.ws import buildWebSocketResource
    from relay.upstream.ws import PoolService

    reactor = app.reactor
    pool = app.extras["wsPool"]
    app.extras["wsPoolService"] = PoolService(pool).asService()

    def retire(change) -> None:
        # A changed or removed account's pooled connections are
        # retired once idle; an unchanged account's stay.
        for accountId in change.changed | change.removed:
            pool.retire(accountId)

    app.live.accounts.subscribe(retire)
    app.live.accounts.subscribe(lambda change: _forgetRenewed(app, change))
    credentials = app.extras.get("credentials")
    if credentials is not None:
        # An OAuth account a reload adds gets managed tokens.
        app.live.accounts.subscribe(
            lambda change: credentials.accountsChanged(app.live.accounts, change)
        )
    resource = buildWebSocketResource(
        app.runner, app.keys, app.live.accounts, app.settings, reactor
    )
    app.extras["wsFactory"] = resource.factory
    return resource


def _forgetRenewed(app: RelayApplication, change) -> None:
    """
    An account whose credential, endpoint or proxy a reload
    changed starts afresh: its cooldowns, streaks and breaker (learnt about
    the old identity) are cleared, as an operator's clear would. Other
    accounts' state, changed or not, is kept.
    """
    for accountId in sorted(change.renewed):
        d = app.health.clear(accountId, "reload")
        d.addErrback(
            lambda f, i=accountId: _log.failure(
                "clearing renewed account {account_id} failed", f, account_id=i,
                event="relay.config_listener_failed",
            )
        )


def _operatorSurface(app: RelayApplication, root, accounts, proxyHealth) -> None:
    """
    Mount C{/admin} and C{/metrics} (behind C{admin_key}), wire
    metrics into the engine and the settings store into the settings.
    """
    from relay.console.admin import GuardedMetrics, buildAdminResource
    from relay.console.view import OperatorView, periodic
    from relay.usage.service import UsageFlushService

    reactor, config = app.reactor, app.config
    metrics, history = app.runner.metrics, app.runner.history
    credentials, quota = app.extras["credentials"], app.extras["quota"]
    view = OperatorView(
        accounts=accounts,
        store=app.store,
        admission=app.admission,
        health=app.health,
        runner=app.runner,
        clock=reactor,
        proxyHealth=proxyHealth,
        credentials=credentials,
        quota=quota,
    )
    metrics.setSlotsSource(lambda: view.slots)
    redis = app.services[0] if app.services else None
    _durableOwners(app)
    usage = app.extras["usage"] = app.runner.usage
    app.services.append(UsageFlushService(usage, config.usage.flush_interval_seconds, reactor))
    credentials.store = _tokenStore(app, redis)
    switchListeners = getattr(redis, "switchListeners", None)
    if config.state.backend == "redis" and switchListeners is not None:
        # Sentinel (behaviour.md R96): after a promotion the token records
        # are read again, so a write the old master lost is written back.
        switchListeners.append(credentials.storeSwitched)
    from relay.scheduling.quota import UsageCollector

    metrics.addCollector(UsageCollector(quota, credentials, accounts))
    # relay_oauth_refresh_failures_total: a counter, summed across workers.
    metrics.oauthAccounts([a.id for a in accounts if a.type == "oauth"])
    credentials.onRefreshFailure = metrics.oauthRefreshFailed
    admin = buildAdminResource(
        app.live.adminKey,
        app.settings,
        view.accountsView,
        view.clearAccount,
        metrics.exposed,
        recentFailovers=metrics.recentFailovers,
        clock=reactor,
        usage=usage,
        history=history.snapshot,
        tokenActions=view,
        reload=app.reloader.reload,
    )
    view.control = app.extras["control"]
    root.putChild(b"admin", _controlSurface(app, admin, view, redis))
    root.putChild(b"metrics", GuardedMetrics(
        app.live.adminKey, metrics.exposed, readKey=app.live.metricsKey
    ))
    app.extras.update(metrics=metrics, operator=view, history=history)
    _tenants(app, admin, usage, redis)
    _alerts(app)
    app.services.append(periodic(5, view.refreshSlots, reactor))
    prune = getattr(app.store, "prune", None)
    if prune is not None:
        # Expired bindings and owners leave memory.
        app.services.append(periodic(60, prune, reactor))
    if config.state.backend == "redis":
        app.services.append(periodic(5, app.settings.refresh, reactor))
    if any(a.type == "oauth" for a in accounts):
        # Adopt tokens another process refreshed; re-plan timers.
        app.services.append(periodic(15, credentials.sync, reactor))


def _consoleOperators(app: RelayApplication, root, keys) -> None:
    """
    The console's operators (C{/auth}, C{/admin/operators}, the intake's
    session gate: L{relay.operators.assemble}) and each key holder's page
    (C{/me}: L{relay.keypage}).
    """
    from relay.keypage.resource import KeyPage
    from relay.operators.assemble import assembleOperators

    parts = assembleOperators(app, root, app.extras["controlParts"])
    app.extras["operators"] = parts
    app.services.append(parts.service)
    runner = app.runner
    root.putChild(b"me", KeyPage(keys, getattr(runner, "keyUsage", None), runner.usage,
                                 getattr(runner, "requestLog", None), app.reactor))


def _controlSurface(app: RelayApplication, admin, view, redis):
    """
    The control plane's store, services and routes
    (L{relay.control.assemble}); a reload also checks that the file and
    the admin accounts agree.

    @return: the C{/admin} resource to mount (the operator's with the
        control routes in front, every change audited).
    """
    from relay.control.assemble import assembleControl

    parts = assembleControl(app, admin, view, redis)
    view.resets = parts.resets
    app.extras["controlParts"] = parts
    if redis is not None and hasattr(redis, "unreachableListeners"):
        # R101 with R105: a silent Redis ends the first read's wait at once.
        redis.unreachableListeners.append(parts.plane.storeUnreachable)
    app.services.append(parts.service)
    base = app.reloader.checks
    app.reloader.checks = lambda config: list(base(config)) + parts.plane.reloadProblems(config)
    return parts.resource


def _durableOwners(app: RelayApplication) -> None:
    """
    R104: with the embedded store, response owner records
    are persisted in the SQLite C{database}, so a restart does not forget
    which key owns a chain (Redis keeps them itself).
    """
    from relay.state.settingsdb import SQLiteSettingsStore
    from relay.state.durable import DurableFlushService, SQLiteValues

    if isinstance(app.settings.store, SQLiteSettingsStore) and hasattr(app.store, "durable"):
        # Written behind (one transaction per 0.25 s at most),
        # what waits is written at stop, before the database closes.
        app.store.durable = SQLiteValues(app.settings.store, clock=app.reactor)
        app.services.append(DurableFlushService(app.store.durable))


def _usageLedger(config: RelayConfig, reactor, settingsStore, metrics, redis):
    """
    Token accounting: the ledger the engine records into
    and its store (Redis with the Redis backend, else the settings SQLite
    file, else memory); its flush timer is started by L{_operatorSurface}.

    @param settingsStore: the settings store (C{RuntimeSettings.store}).
    @return: the L{relay.usage.ledger.UsageLedger}.
    """
    from relay.state.settingsdb import SQLiteSettingsStore
    from relay.usage.holds import MemoryBudgetHolds, RedisBudgetHolds
    from relay.usage.ledger import UsageLedger
    from relay.usage.store import MemoryUsageStore, RedisUsageStore, SQLiteUsageStore

    retention = config.usage.retention_days
    # R108: budget reservations, where the other processes see them.
    holds = MemoryBudgetHolds(clock=reactor)
    if config.state.backend == "redis" and redis is not None:
        store = RedisUsageStore(redis=redis, clock=reactor, retentionDays=retention)
        holds = RedisBudgetHolds(redis=redis)
    elif isinstance(settingsStore, SQLiteSettingsStore):
        store = SQLiteUsageStore(database=settingsStore, retentionDays=retention)
    else:
        store = MemoryUsageStore()
    budgets = {
        key.name: (key.daily_tokens, key.monthly_tokens)
        for key in config.keys
        if key.daily_tokens is not None or key.monthly_tokens is not None
    }
    ledger = UsageLedger(clock=reactor, store=store, metrics=metrics, budgets=budgets,
                         holds=holds, holdTtl=config.state.concurrency_slot_ttl_minutes * 60,
                         onHoldError=config.state.on_redis_error)
    return ledger


def _tenants(app: RelayApplication, admin, usage, redis) -> None:
    """
    Client keys as tenants: the price table and the key policy
    the engine checks before every turn (rate windows in Redis with the
    Redis backend, else in memory), the request log (Redis stream, else
    the settings SQLite file, else memory) and its flush timer, the
    C{/admin/requests} and C{/admin/explain} routes, and what a reload
    changes (prices, budgets; groups are read live). The parts the engine
    uses are built by L{_tenantParts}.
    """
    from relay.console.tenants import ExplainResource, RequestsResource
    from relay.console.explain import Explainer
    from relay.tenants.requestlog import RequestLogService

    reactor, config = app.reactor, app.config
    runner = app.runner
    prices, policy, log = runner.prices, runner.keyPolicy, runner.requestLog
    limiter, settings = app.extras["rateLimiter"], config.request_log
    if runner.metrics is not None:
        from relay.base.modelname import ModelCatalogue

        # R110: the model label is a known normalised name or "other".
        runner.metrics.models = ModelCatalogue(app.live.accounts.snapshot, prices)
    usage.setBudgets(config.keys)
    _keysFromTheControlPlane(app, prices, policy, usage)
    app.extras.update(prices=prices, keyPolicy=policy, rateLimiter=limiter, requestLog=log)
    app.services.append(RequestLogService(log, settings.flush_interval_seconds, reactor))
    explainer = Explainer(
        clock=reactor, scheduler=app.scheduler, keys=app.keys, accounts=app.live.accounts,
        policy=policy, admission=app.admission, ledger=usage, settings=app.settings,
        outcomes=getattr(runner.bookkeeping, "outcomes", None),
    )
    admin.putRoute(b"requests", RequestsResource(app.live.adminKey, log, reactor))
    admin.putRoute(b"explain", ExplainResource(app.live.adminKey, explainer))
    usageRoute = admin.route(b"usage")
    if usageRoute is not None:
        from relay.console.usageseries import renderSeries

        # GET /admin/usage/series: the usage store's and the log's totals.
        usageRoute.series = lambda request: renderSeries(request, usage, log, reactor)
    from relay.console.overview import OverviewResource

    admin.putRoute(b"overview", OverviewResource(
        app.live.adminKey, app.extras["operator"].accountsView,
        getattr(runner.bookkeeping, "outcomes", None), usage, reactor))

    def reloaded(result, new) -> None:
        prices.replace(new.prices)
        log.maxRecords = new.request_log.max_records
        log.retentionDays = new.request_log.retention_days
        log.sampleRate = new.request_log.sample_rate
        log.sampleMaxBytes = new.request_log.sample_max_bytes

    app.reloader.onApplied.append(reloaded)


def _alerts(app: RelayApplication) -> None:
    """
    Webhook alerts (config.md C{alerts:}, L{relay.alerts}), and the
    key budgets' gauge the shipped Prometheus rules read: the monitor
    reads the token status, the account states, a dry-run selection per
    model, the usage windows, the budgets and the turns' cost on a timer,
    off the turn path. With C{workers: N} every worker evaluates and only
    the first sends. A reload takes the new section's webhooks and
    thresholds; turning alerts on or off needs a restart.
    """
    settings = app.config.alerts
    runner = app.runner
    if runner.metrics is not None:
        from relay.alerts.budgetgauge import KeyBudgetCollector

        # relay_key_budget_used_ratio, for the shipped Prometheus rules.
        runner.metrics.addCollector(KeyBudgetCollector(runner.usage.budgetView, app.reactor))
    if not settings.enabled:
        def reloaded(result, new) -> None:
            if new.alerts.enabled:
                _log.warn("config reload: alerts.webhooks needs a restart to turn alerts on",
                          event="relay.config_reload_restart", key="alerts.webhooks")

        app.reloader.onApplied.append(reloaded)
        return
    from relay.alerts.delivery import TreqPoster, WebhookSender
    from relay.alerts.monitor import AlertMetrics, AlertMonitor
    from relay.base.logs import workerIndex
    from relay.base.modelname import ModelCatalogue
    from relay.base.records import ClientKey, Turn

    reactor = app.reactor
    probe = ClientKey(name="relay-alerts", key="", concurrency=0)

    async def canServe(model):
        turn = Turn(entrypoint="http", endpoint="responses", client=probe, model=model,
                    body={"model": model}, stream=True, requestId="alerts", phase="request")
        preview = await app.scheduler.preview(turn)
        return preview.error if preview.selection is None else None

    sender = WebhookSender(clock=reactor, poster=TreqPoster(reactor),
                           attempts=settings.delivery_attempts,
                           timeout=settings.delivery_timeout_seconds)
    quota = app.extras["quota"]
    monitor = AlertMonitor(
        clock=reactor, settings=settings, sender=sender, accounts=app.live.accounts.snapshot,
        credentials=app.extras["credentials"], store=app.store, canServe=canServe,
        windows=quota.get if quota is not None else None, budgets=runner.usage.budgetView,
        metrics=AlertMetrics(runner.metrics.registry) if runner.metrics is not None else None,
        sending=workerIndex() in (None, 0),
        modelName=ModelCatalogue(app.live.accounts.snapshot, runner.prices).canonical,
    )
    if runner.requestLog is not None:
        runner.requestLog.listeners.append(monitor.turnRecorded)
    app.services.append(monitor)
    app.extras["alerts"] = monitor
    app.reloader.onApplied.append(lambda result, new: monitor.reconfigure(new.alerts))


def _tenantParts(config: RelayConfig, reactor, live, settingsStore, redis):
    """
    The tenants' parts the engine uses: the price table, the
    key policy with its rate windows (Redis with the Redis backend, else
    memory) and the request log (Redis stream, else the settings SQLite
    file, else memory).

    @return: C{(PriceTable, rate limiter, KeyPolicy, request log)}.
    """
    from relay.state.settingsdb import SQLiteSettingsStore
    from relay.tenants.keypolicy import KeyPolicy
    from relay.tenants.prices import PriceTable
    from relay.tenants.ratelimit import MemoryRateLimiter, RedisRateLimiter
    from relay.tenants.requestlog import MemoryRequestLog, RedisRequestLog, SQLiteRequestLog

    prices = PriceTable(config.prices)
    if config.state.backend == "redis" and redis is not None:
        limiter = RedisRateLimiter(redis=redis, onRedisError=config.state.on_redis_error)
    else:
        limiter = MemoryRateLimiter(clock=reactor)
    policy = KeyPolicy(clock=reactor, live=live, limiter=limiter, prices=prices)
    settings = config.request_log
    bounds = dict(clock=reactor, maxRecords=settings.max_records,
                  retentionDays=settings.retention_days, sampleRate=settings.sample_rate,
                  sampleMaxBytes=settings.sample_max_bytes)
    if config.state.backend == "redis" and redis is not None:
        log = RedisRequestLog(redis=redis, **bounds)
    elif isinstance(settingsStore, SQLiteSettingsStore):
        log = SQLiteRequestLog(database=settingsStore, **bounds)
    else:
        log = MemoryRequestLog(**bounds)
    return prices, limiter, policy, log


def _keysFromTheControlPlane(app: RelayApplication, prices, policy, usage) -> None:
    """
    The control plane puts the admin API's groups and prices
    into the key policy and the price table; the budgets follow the key
    ring (file and admin keys, after every reload or admin change; a new
    budget reads the store's totals at once).
    """
    control = app.extras["control"]
    control.prices, control.keyPolicy = prices, policy

    def keysChanged() -> None:
        before = (usage.budgets, usage.moneyBudgets)
        usage.setBudgets(app.keys.keys)
        if (usage.budgets, usage.moneyBudgets) != before:
            usage.flush()

    app.keys.subscribe(keysChanged)
    keysChanged()


class _Startup(MultiService):
    """
    The relay service. Loads persisted runtime settings once the Redis
    client (if any) runs (R74 "at startup"); a failure is logged and the
    file's values stay.

    Stops in sequence, not concurrently as L{MultiService} would
    (L{relay.process.drain}): the listener first (no new connections),
    then the drain (running turns finish within the grace, the rest are
    cancelled, every slot is given back), then the other children in
    reverse order (pooled upstream connections, periodic jobs, and the
    Redis client last), then the settings store. twistd waits for the
    returned Deferred before the reactor stops, then exits 0.

    @ivar relayListener: the listening L{Listener}, when there is one.
    """

    relayListener = None

    _log = Logger()

    def __init__(self, app: RelayApplication):
        super().__init__()
        self._app = app

    def startService(self) -> None:
        # R105: not ready, and no turn, until the stores
        # are loaded -- one gate for every store a turn depends on: the
        # settings, the OAuth tokens, and the control plane's first read
        # (admin accounts, pauses, admin keys and disables),
        # each set once read or once its read failed (R35, R101). The
        # runner's gate (open for an application wired by hand) closes.
        gate = self._app.runner.startupGate
        gate.settings.clear()
        gate.tokens.clear()
        plane = None
        if "controlParts" in self._app.extras:
            plane = self._app.extras["controlParts"].plane
            plane.onSettled = gate.mark(gate.add("control"))
        self._app.extras["startupGate"] = gate
        super().startService()
        if plane is not None and not plane.running:
            # No control service among the children (an application wired
            # by hand): nothing will read the store, nobody waits for it.
            plane.onSettled()
        d = self._app.settings.start()
        d.addErrback(
            lambda f: logFailure(
                self._log, f, "loading persisted settings failed; using the file's",
                event="relay.settings_load_failed",
            )
        )
        d.addBoth(gate.mark(gate.settings))
        credentials = self._app.extras.get("credentials")
        if credentials is not None:
            # Stored tokens win over the file's; timers start once
            # the runtime settings (the refresh margin) are loaded.
            d.addBoth(lambda _: credentials.start())
            d.addErrback(lambda f: self._log.failure("loading OAuth tokens failed", f))
        d.addBoth(gate.mark(gate.tokens))

    def stopService(self):
        """
        Stop accepting, drain, stop the other children one by one, then
        close the settings store (the SQLite connection pool's thread), if
        it has a C{close}. Never fails; problems are logged.

        @return: a Deferred that fires when relay has stopped.
        """
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        Service.stopService(self)
        listener = self.relayListener
        if listener is not None and listener.running:
            await self._stopChild(listener)
        drain = self._app.drain
        if drain is not None:
            try:
                await drain.drain()
            except Exception:  # noqa: BLE001 - logged; stopping goes on
                self._log.failure("draining failed", event="relay.drain_failed")
        credentials = self._app.extras.get("credentials")
        if credentials is not None:
            # Token timers stop once no turn can need a refresh.
            credentials.stop()
        for service in reversed(list(self)):
            if service.running:
                await self._stopChild(service)
        self._closeStore(None)

    async def _stopChild(self, service) -> None:
        """
        Stop one child, logging (not raising) a failure.
        """
        try:
            await maybeDeferred(service.stopService)
        except Exception:  # noqa: BLE001 - logged; stopping goes on
            self._log.failure("stopping {service} failed", service=service)

    def _closeStore(self, result):
        """
        Close the settings store; pass C{result} through.
        """
        close = getattr(self._app.settings.store, "close", None)
        if close is not None:
            close()
        return result


LAZY_IMPORTS = {
    "treq.client": "treq (accounts behind an egress proxy, OAuth token refresh)",
    "jwt": "PyJWT (OAuth accounts' tokens)",
    "zstandard": "zstandard (zstd request bodies)",
}
"""Libraries relay imports where it first uses them, not at start (to
keep the RSS low at c=128). L{checkImports} imports at start those the
configuration uses, so a broken install still fails there."""


def checkImports(config: RelayConfig) -> list:
    """
    Import now the lazily imported libraries (L{LAZY_IMPORTS}) that
    C{config} uses: C{treq} when an account has a C{proxy} or is an OAuth
    account, C{jwt} for an OAuth account. Every library must at least be
    installed (C{importlib.util.find_spec}, which loads nothing): zstd
    bodies come from clients whatever the configuration says.

    @return: the module names imported.
    @raise ConfigError: naming the key (C{accounts}) or the library, when
        one cannot be imported or is not installed.
    """
    import importlib
    import importlib.util

    from relay.base.records import ConfigError

    wanted = []
    if any(a.proxy is not None or a.type == "oauth" for a in config.accounts):
        wanted.append("treq.client")
    if any(a.type == "oauth" for a in config.accounts):
        wanted.append("jwt")
    for name in wanted:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"accounts: {LAZY_IMPORTS[name]} cannot be imported: {e}")
    for name, what in LAZY_IMPORTS.items():
        try:
            # The top-level name: a submodule's find_spec imports its package.
            found = importlib.util.find_spec(name.split(".")[0])
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ConfigError(f"{what} is not installed (pip install relay's requirements)")
    return wanted


def buildService(
    config: RelayConfig,
    reactor,
    configPath: Optional[str] = None,
    listenOverride: Optional[str] = None,
    edgeServices=(),
    reusePort: bool = False,
) -> MultiService:
    """
    The twistd service: the Redis client (when configured), then the
    listening endpoint.

    @param configPath: the configuration file, for live reloads.
    @param listenOverride: the C{--listen} that overrode the file's.
    @param edgeServices: callables C{app -> IService} for services of the
        process edge (the C{SIGHUP} handler of L{relay.tap}), started
        before the listener.
    @param reusePort: listen with C{SO_REUSEPORT} beside the other workers
        of a supervisor (L{relay.process.workers}).
    """
    from twisted.internet.endpoints import serverFromString

    checkImports(config)
    app = buildApplication(config, reactor, configPath=configPath, listenOverride=listenOverride)
    top = _Startup(app)
    for service in app.services:
        service.setServiceParent(top)
    for build in edgeServices:
        build(app).setServiceParent(top)
    if reusePort:
        from relay.process.workers import ReusePortEndpoint

        endpoint = ReusePortEndpoint(reactor, config.listen)
    else:
        endpoint = serverFromString(reactor, config.listen)
    listener = Listener(endpoint, app.site, config.listen)
    listener.setServiceParent(top)
    top.relayApplication = app
    top.relayListener = listener
    return top
