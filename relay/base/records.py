# -*- test-case-name: tests.test_config -*-
"""
Value objects shared by every part of relay: accounts, client keys, the
gateway settings, wait plans, turns and the errors the turn engine raises.

Durations are seconds unless a name ends in C{_ms} (config.md).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from attrs import define, field, frozen
from twisted.internet.defer import Deferred

from relay.base.alertsettings import AlertSettings
from relay.base.modelname import listed, mapped


# ---------------------------------------------------------------------------
# Configuration values
# ---------------------------------------------------------------------------


@frozen
class ClientKey:
    """
    A client API key issued by relay (config.md C{keys:}).

    @ivar name: the key's display name, used in logs (never the secret).
    @ivar key: the secret value the client sends as C{Authorization: Bearer}.
    @ivar concurrency: per-key slots (behaviour.md R26); 0 means unlimited.
    @ivar daily_tokens: optional token budget (input + output) per UTC day;
        L{None} means none.
    @ivar monthly_tokens: optional token budget per UTC month.
    """

    name: str
    key: str = field(repr=False)
    concurrency: int = 5
    daily_tokens: int | None = None
    monthly_tokens: int | None = None
    # The key's policy (behaviour.md R102). Every field defaults to
    # "no limit", so a key without them behaves as before; keys made
    # through the admin API later carry the same fields.
    models: Optional[tuple] = None
    """Allow-list of client model names (before mapping), or L{None}: any;
    matched as R110 says (L{relay.base.modelname.listed}: any case, trimmed, a
    dated snapshot of a listed family)."""
    deny_models: Optional[tuple] = None
    """Model names the key may never use, checked after C{models}, matched
    as C{models} are, against the client's name and the name an account
    maps it to (R110)."""
    expires_at: Optional[float] = None
    """Unix seconds after which the key is refused (401), or L{None}."""
    rpm: Optional[int] = None
    """Requests per sliding 60-second window, or L{None}."""
    tpm: Optional[int] = None
    """Tokens (input + output) per sliding 60-second window, or L{None}."""
    accounts: Optional[tuple] = None
    """The account ids the key may reach, or L{None} (see C{group})."""
    group: Optional[str] = None
    """The name of a C{groups:} entry whose accounts the key may reach."""
    daily_usd: Optional[float] = None
    """Money budget per UTC day (priced turns, L{relay.tenants.prices})."""
    monthly_usd: Optional[float] = None
    """Money budget per UTC month."""
    max_turn_output_tokens: Optional[int] = 32000
    """R108: the output tokens a budget reservation assumes for a turn that
    gives no C{max_output_tokens}; L{None} (C{null}) is the default, 32000."""
    disabled: bool = False
    """A disabled key is refused like a revoked one (401, close 1008)."""
    digest: Optional[bytes] = field(default=None, repr=False)
    """The SHA-256 digest of the secret (L{relay.tenants.keydigest}): the
    only form a key issued through the admin API is kept in (its C{key} is
    then empty); L{relay.entry.http.KeyRing} fills it in for file keys."""
    issuance: Optional[str] = None
    """Which issuance of the name this key is, for a key issued through the
    admin API (a random id kept in its record, L{relay.control.keys}); a
    key issued again under a revoked key's name has another. L{None} for
    file keys."""

    @property
    def ownerId(self) -> str:
        """
        The identity that owns what this key creates (behaviour.md R104:
        response owner records, pooled upstream WebSockets, session scopes):
        a file key's name (an operator rotating its secret keeps its
        conversations), or an admin key's name with its issuance (a key
        issued again under a revoked key's name never continues the old
        key's conversations).
        """
        return f"{self.name}#{self.issuance}" if self.issuance else self.name


@frozen
class ProxySpec:
    """
    An egress proxy an account dials through.

    @ivar id: a stable identifier used in logs and health state.
    @ivar scheme: C{socks5}, C{socks5h} or C{http}.
    @ivar host: proxy host name or address.
    @ivar port: proxy TCP port.
    @ivar username: optional user name (never logged).
    @ivar password: optional password (never logged).
    """

    id: str
    scheme: str
    host: str
    port: int
    username: Optional[str] = field(default=None, repr=False)
    password: Optional[str] = field(default=None, repr=False)


ENDPOINTS = ("responses", "chat", "messages", "embeddings", "images", "image_edits")
"""The client surfaces a L{Turn} comes from (R115): C{POST /v1/responses},
C{/v1/chat/completions}, C{/v1/messages}, C{/v1/embeddings}, C{/v1/images/generations} and
C{/v1/images/edits}."""

_EVERY_ACCOUNT = frozenset({"responses", "chat", "messages", "images", "image_edits"})
"""The endpoints both account types serve (L{Account.servesEndpoint})."""


@frozen
class Account:
    """
    One upstream credential (behaviour.md §0).

    @ivar id: unique account id.
    @ivar type: C{apikey} or C{oauth}.
    @ivar base_url: upstream base URL without trailing slash, e.g.
        C{https://api.openai.com/v1} or C{https://chatgpt.com/backend-api/codex}.
    @ivar credential: the API key or OAuth access token (never logged).
    @ivar chatgpt_account_id: OAuth only: sent as C{chatgpt-account-id}.
    @ivar concurrency: account slots (R27); 0 means unlimited.
    @ivar priority: lower number is preferred (R43).
    @ivar models: optional allow-list of upstream model names (after
        mapping), matched as R110 says (L{servesModel}); L{None}: any name.
    @ivar model_mapping: requested model name -> upstream model name.
    @ivar ws_mode: C{ctx_pool}, C{passthrough}, C{http_bridge}, C{off} or
        L{None} for the gateway default (R48).
    @ivar proxy: optional egress proxy.
    @ivar pool_mode: API-key pool mode (R14).
    @ivar pool_mode_retry_count: same-account retry limit (R14), default 3.
    @ivar pool_mode_retry_status_codes: statuses that allow a same-account
        retry in pool mode (R14).
    @ivar refresh_token: OAuth only: the configured refresh token,
        or, on the account the engine dials, the current one; L{None} for a
        static access token. Never logged.
    @ivar id_token: OAuth only: the configured ID token (a JWT), if any.
    @ivar auth_base_url: OAuth only: where C{POST /oauth/token} is sent
        (protocol.md 7.4); L{None} means C{gateway.oauth.auth_base_url}.
    @ivar last_refresh: OAuth only: when the configured tokens were last
        refreshed (Unix seconds, e.g. Codex C{auth.json}'s C{last_refresh}),
        or L{None}.
    @ivar auto_redeem_resets: OAuth only: relay redeems one of the login's
        banked resets itself when its window is spent and no other account
        of its group can serve (L{relay.oauth.resets}; protocol.md 7.3a).
    @ivar token_source: where the configured tokens came from, for the
        admin view: C{config}, C{env} or C{auth_file:PATH} (no secrets).
    """

    id: str
    type: str
    base_url: str
    credential: str = field(repr=False)
    chatgpt_account_id: Optional[str] = None
    concurrency: int = 3
    priority: int = 50
    models: Optional[tuple] = None
    model_mapping: dict = field(factory=dict, hash=False)
    ws_mode: Optional[str] = None
    proxy: Optional[ProxySpec] = None
    pool_mode: bool = False
    pool_mode_retry_count: int = 3
    pool_mode_retry_status_codes: tuple = (401, 403, 429)
    refresh_token: Optional[str] = field(default=None, repr=False)
    id_token: Optional[str] = field(default=None, repr=False)
    auth_base_url: Optional[str] = None
    last_refresh: Optional[float] = None
    token_source: Optional[str] = None
    auto_redeem_resets: bool = False

    def upstreamModel(self, requested: str) -> str:
        """
        Map a requested model name to the upstream one: the mapping's key
        equal to it, or equal once both are trimmed and lower-cased
        (behaviour.md R110, L{relay.base.modelname.mapped}). The name is never
        otherwise altered: what goes upstream is the client's or the
        mapping's, byte for byte.

        @param requested: the model the client asked for.
        @return: the mapped name, or C{requested} when no mapping applies.
        """
        if not self.model_mapping:
            return requested
        found = self.model_mapping.get(requested)
        if found is None:
            found = mapped(requested, self.model_mapping)
        return requested if found is None else found

    def servesEndpoint(self, endpoint: str) -> bool:
        """
        Whether this account can serve C{endpoint} (a scheduling
        eligibility filter by capability, R115). Every account serves
        C{responses}, C{chat} and C{messages}: the ChatGPT (OAuth) backend
        has only C{/responses} (protocol.md 3, 7.2), and relay translates a
        chat or Messages turn for it (L{relay.translate}); likewise C{images} and
        C{image_edits}, served there through the Responses
        C{image_generation} tool (L{relay.translate.images}). Only API-key
        accounts serve C{embeddings}.

        @param endpoint: one of L{ENDPOINTS}.
        """
        if endpoint in _EVERY_ACCOUNT:
            return True
        return endpoint == "embeddings" and self.type != "oauth"

    def servesModel(self, requested: Optional[str]) -> bool:
        """
        Whether this account serves C{requested} after mapping: an account
        without a C{models} list serves any name; else the mapped name must
        be on it as R110 matches lists (L{relay.base.modelname.listed}: any
        case, trimmed, a dated snapshot of a listed family).

        @param requested: the client's model name, or L{None} (any).
        """
        if requested is None or self.models is None:
            return True
        upstream = self.upstreamModel(requested)
        if upstream in self.models:
            return True
        return listed(upstream, self.models)


@frozen
class BreakerSettings:
    """
    The consecutive-transport-failure breaker (behaviour.md R-B1).

    @ivar failures: transient failures that open the breaker.
    @ivar window_seconds: they must fall within this many seconds.
    @ivar open_seconds: first open period, doubled on each repeat.
    @ivar max_open_seconds: cap of the open period.
    @ivar enabled: switch the breaker off entirely.
    """

    failures: int = 3
    window_seconds: float = 60
    open_seconds: float = 120
    max_open_seconds: float = 600
    enabled: bool = True


@frozen
class SchedulingSettings:
    """
    Wait plans and sticky TTLs (behaviour.md R26, R28, R31, R38, R39).
    All values are seconds or counts.
    """

    sticky_session_wait_timeout: float = 120
    sticky_session_max_waiting: int = 3
    fallback_wait_timeout: float = 30
    fallback_max_waiting: int = 100
    user_wait_timeout: float = 30
    user_max_waiting: int = 20
    sticky_session_ttl_seconds: float = 3600
    previous_response_ttl_seconds: float = 3600
    response_owner_ttl_seconds: float = 30 * 86400
    """R104: how long relay remembers which key and account own
    a response id: as long as upstream keeps a stored response (30 days).
    A chain on an id with no owner record is refused
    (C{previous_response_not_found}); never shorter than
    C{previous_response_ttl_seconds}."""
    ping_interval: float = 10
    quota_aware: bool = True
    """Among accounts of equal priority, prefer the one with the
    most remaining usage window (L{relay.scheduling.quota})."""
    quota_threshold_percent: float = 95.0
    """An account whose primary or secondary window is at or above
    this used-percent is chosen only when no account of its priority below
    it can serve."""


@frozen
class OAuthSettings:
    """
    OAuth token refresh (protocol.md 7.4). Seconds.

    @ivar auth_base_url: where C{POST /oauth/token} goes unless an account
        names its own C{auth_base_url}.
    @ivar client_id: the OAuth client id sent with a refresh (Codex's).
    @ivar refresh_margin_seconds: refresh this long before the access
        token's C{exp} (a runtime setting); at most half the token's
        lifetime is used, so short-lived tokens do not refresh constantly.
    @ivar refresh_timeout_seconds: the token request's timeout; a request
        that was sent and timed out leaves the refresh token in doubt.
    """

    auth_base_url: str = "https://auth.openai.com"
    client_id: str = "app_EMoamEEZ73f0CkXaXp7hrann"
    refresh_margin_seconds: float = 86400
    refresh_timeout_seconds: float = 30
    usage_probe_interval_seconds: float = 300
    """How often an idle OAuth account's usage windows are read
    from C{/backend-api/wham/usage} (through its proxy); an account whose
    traffic reported its windows more recently is not probed. 0 = never."""
    usage_probe_after_cooldown: bool = True
    """Probe an OAuth account once when a cooldown of it ends (so
    a window that reset shows as such before the next turn)."""


@frozen
class WebSocketSettings:
    """
    Responses WebSocket settings (behaviour.md R47-R50, R69).
    """

    mode_default: str = "ctx_pool"
    pool_capacity_factor: float = 5.0
    client_first_message_timeout_seconds: float = 30
    inter_turn_idle_timeout_seconds: float = 300
    max_frame_bytes: int = 64 * 2**20
    client_max_age_seconds: float = 3600
    """protocol.md 4.5/4.6: a client connection older than this answers the
    next C{response.create} with C{websocket_connection_limit_reached}."""


@frozen
class UpstreamSettings:
    """
    Upstream timeouts (behaviour.md R24, R69). Seconds.

    @ivar connect_timeout_seconds: TCP (and proxy) connect timeout.
    @ivar header_timeout_seconds: wait for response headers after connect.
    @ivar stream_idle_timeout_seconds: max silence inside a stream (R24).
    """

    connect_timeout_seconds: float = 10
    header_timeout_seconds: float = 120
    stream_idle_timeout_seconds: float = 180


@frozen
class LimitSettings:
    """
    Intake limits (config.md C{gateway.limits}, behaviour.md R103).

    @ivar header_timeout_seconds: the whole header block of a request must
        arrive within this many seconds of its first byte (or of the
        connection opening); else 408 and close.
    @ivar min_body_bytes_per_second: a body must arrive at least this fast,
        measured over each C{body_rate_window_seconds} window; 0 = off.
    @ivar body_rate_window_seconds: that window, seconds.
    @ivar max_connections: open client connections per process; 0 = off.
    @ivar max_connections_per_address: open connections per client IP
        address; 0 = off.
    @ivar body_bytes_in_flight_per_key: bytes of request bodies and
        WebSocket frames one client key may hold at once (raw while they
        arrive, then the parsed-size estimate of L{relay.entry.body});
        0 = off.
    @ivar body_bytes_in_flight: the same for all keys together; 0 = off.
    @ivar max_decompression_ratio: a compressed body may decode to at most
        this many times its size (or 1 MiB, whichever is more); else 413.
    """

    header_timeout_seconds: float = 10
    min_body_bytes_per_second: int = 1024
    body_rate_window_seconds: float = 10.0
    max_connections: int = 10000
    max_connections_per_address: int = 256
    body_bytes_in_flight_per_key: int = 256 * 2**20
    body_bytes_in_flight: int = 4 * 2**30
    max_decompression_ratio: float = 100


BODY_RATE_WINDOW_SECONDS = 10.0
"""The default window over which C{min_body_bytes_per_second} is measured."""


@frozen
class GatewaySettings:
    """
    The runtime failover and admission settings (config.md C{gateway:}).

    Read on every attempt through L{relay.state.settings.RuntimeSettings}, so a live
    change applies to the next attempt (behaviour.md R74).
    """

    max_account_switches: int = 10
    max_request_body_bytes: int = 64 * 2**20
    """The largest request body, after decoding any C{Content-Encoding};
    larger ones are answered 413 at once. Read at startup and on
    a live reload."""
    first_output_timeout_seconds: float = 0
    retry_interval_ms: int = 0
    transport_retry_policy: str = "rotate"
    transport_error_cooldown_seconds: float = 600
    retry_budget_percent: float = 20
    stream_keepalive_interval: float = 10
    """Seconds of downstream silence before a keepalive (SSE comment or
    WebSocket ping) from turn start to terminal event; 0 = off
    (behaviour.md R24, R85)."""
    shutdown_grace_seconds: float = 30
    """How long running turns may finish after C{SIGTERM} before relay
    cancels them (L{relay.process.drain}). Read when the stop
    begins, so a reload changes it."""
    usage_drain_seconds: float = 60
    """How long relay keeps reading an upstream answer after its client left
    once output was produced, to learn the turn's real usage (behaviour.md
    R107); 0 = never (the usage is then estimated)."""
    usage_drain_bytes: int = 8 * 2**20
    """How many upstream bytes relay reads so after the client left, at most
    (R107); beyond it the usage is estimated."""
    breaker: BreakerSettings = BreakerSettings()
    scheduling: SchedulingSettings = SchedulingSettings()
    websocket: WebSocketSettings = WebSocketSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    oauth: OAuthSettings = OAuthSettings()
    limits: LimitSettings = LimitSettings()


@frozen
class StateSettings:
    """
    Where shared state lives (config.md C{state:}).

    @ivar backend: C{memory} or C{redis}.
    @ivar redis_url: C{redis://host:port/db}, C{rediss://} (TLS) or
        C{unix:///path/redis.sock?db=N} (L{relay.wire.redisclient.parseRedisUrl}).
    @ivar on_redis_error: C{fail_open} or C{fail_closed} (R35).
    @ivar concurrency_slot_ttl_minutes: slot lease TTL (R34).
    @ivar redis_sentinels: C{("host:port", ...)} of Redis Sentinels; when
        given, the master of C{redis_master_name} is asked of them and
        C{redis_url} gives only the database, user and password.
    @ivar redis_master_name: the Sentinel service name of the master.
    """

    backend: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    on_redis_error: str = "fail_open"
    concurrency_slot_ttl_minutes: float = 30
    redis_sentinels: tuple = ()
    redis_master_name: Optional[str] = None


@frozen
class UsageSettings:
    """
    Token accounting (config.md C{usage:}).

    @ivar flush_interval_seconds: how often hourly totals are written to
        the settings store (SQLite or Redis) and budgets re-read.
    @ivar retention_days: how long hourly totals are kept.
    """

    flush_interval_seconds: float = 10
    retention_days: int = 400


@frozen
class RequestLogSettings:
    """
    The request log (config.md C{request_log:}): one
    record per turn, bounded by count and by age.

    @ivar max_records: records kept at most (the oldest go first).
    @ivar retention_days: records older than this are deleted.
    @ivar flush_interval_seconds: how often buffered records are written.
    @ivar sample_rate: the fraction (0..1) of turns whose request body and
        output are kept for debugging; 0 (the default) keeps neither.
    @ivar sample_max_bytes: the most of each kept body or output, bytes.
    """

    max_records: int = 100000
    retention_days: float = 7
    flush_interval_seconds: float = 1.0
    sample_rate: float = 0.0
    sample_max_bytes: int = 16384


@frozen
class TracingSettings:
    """
    OpenTelemetry traces (off unless C{exporter} is set). Needs
    the C{otel} extra (C{pip install 'relay[otel]'}).

    @ivar exporter: C{none} (off: no tracer, nothing built per turn),
        C{otlp} (OTLP over HTTP/protobuf; the standard C{OTEL_EXPORTER_OTLP_*}
        variables apply) or C{console} (spans as JSON on standard output).
    @ivar endpoint: the OTLP traces URL, e.g.
        C{http://collector:4318/v1/traces}; L{None} leaves it to
        C{OTEL_EXPORTER_OTLP_TRACES_ENDPOINT} / C{OTEL_EXPORTER_OTLP_ENDPOINT}
        (default C{http://localhost:4318/v1/traces}).
    @ivar service_name: the C{service.name} resource attribute.
    @ivar sample_ratio: the share of new traces sampled, 0-1; a client's
        C{traceparent} decision is followed (parent-based).
    """

    exporter: str = "none"
    endpoint: Optional[str] = None
    service_name: str = "relay"
    sample_ratio: float = 1.0


@frozen
class ComponentSettings:
    """
    Dotted names of replacement components (config.md C{components:}).
    L{None} means the built-in one.
    """

    classifier: Optional[str] = None
    dialer: Optional[str] = None
    admission: Optional[str] = None


@frozen
class RelayConfig:
    """
    The whole parsed configuration file.
    """

    listen: str = "tcp:8080:interface=127.0.0.1"
    workers: int = 1
    admin_key: Optional[str] = field(default=None, repr=False)
    metrics_key: Optional[str] = field(default=None, repr=False)
    """A read-only key that opens C{/metrics} and nothing else (R99)."""
    log_format: str = "text"
    keys: tuple = ()
    accounts: tuple = ()
    gateway: GatewaySettings = GatewaySettings()
    components: ComponentSettings = ComponentSettings()
    state: StateSettings = StateSettings()
    database: str = "relay.sqlite"
    proxies: tuple = ()
    usage: UsageSettings = UsageSettings()
    alerts: AlertSettings = AlertSettings()
    """Webhook alerts (config.md C{alerts:}, L{relay.alerts})."""
    groups: dict = field(factory=dict, hash=False)
    """Account group name -> tuple of account ids (config.md C{groups:})."""
    prices: dict = field(factory=dict, hash=False)
    """Model -> L{relay.tenants.prices.Price} overriding the shipped table."""
    anthropic_models: dict = field(factory=dict, hash=False)
    """C{claude-*} family -> OpenAI model over the shipped defaults (config.md
    C{anthropic_models}, R115)."""
    request_log: RequestLogSettings = RequestLogSettings()
    """The request log's bounds and debug sampling."""
    tracing: TracingSettings = TracingSettings()
    demo: bool = False
    """The offline demo against the bundled emulator (config.md C{demo}):
    its published admin key is accepted. Never for real accounts."""
    operators: tuple = field(default=(), hash=False)
    """Console operators (config.md C{operators:}):
    L{relay.configuration.operators.OperatorSpec}s."""
    oidc: Optional[object] = field(default=None, hash=False)
    """The console's OpenID Connect sign-in
    (L{relay.configuration.operators.OIDCSettings}), or L{None}."""


# ---------------------------------------------------------------------------
# Admission
# ---------------------------------------------------------------------------


@frozen
class WaitPlan:
    """
    How to wait for a busy slot (behaviour.md R27, R28).

    @ivar kind: C{account} or C{user}.
    @ivar id: the account id or the client key name.
    @ivar max_concurrency: the slot limit (the account's real concurrency).
    @ivar timeout: seconds to wait at most.
    @ivar max_waiting: queue places; a full queue is refused at once.
    @ivar plan: C{sticky}, C{fallback} or C{user} (for logs).
    """

    kind: str
    id: str
    max_concurrency: int
    timeout: float
    max_waiting: int
    plan: str = "fallback"


# ---------------------------------------------------------------------------
# Turns
# ---------------------------------------------------------------------------


@define(eq=False)
class CancelSignal:
    """
    A client's cancellation (disconnect, deadline), observed by the engine.

    Entrypoints call L{cancel} when the client goes; the engine checks
    L{cancelled} before every decision and races its waits against
    L{whenCancelled} (behaviour.md R2).

    @ivar tell: the L{ClientError} relay owes a client whose turn relay
        cancelled itself, or L{None}.
    """

    cancelled: bool = False
    reason: str = ""
    tell: Optional["ClientError"] = None
    _waiters: list = field(factory=list)

    def cancel(self, reason: str = "client_gone", tell: Optional["ClientError"] = None) -> None:
        """
        Mark the turn cancelled and fire every waiter. Idempotent.

        @param reason: why, for logs.
        @param tell: when relay itself cancels a turn whose client is still
            there (the end of a graceful stop's grace), the
            terminal error the engine writes to that client once the turn
            has unwound; L{None} when the client left (nothing to tell).
            Either way the attempt ends as L{relay.policy.ends.Departed}:
            no account state is written (R2).
        """
        if self.cancelled:
            return
        self.cancelled = True
        self.reason = reason
        self.tell = tell
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            if isinstance(d, Deferred):
                d.callback(reason)
            else:
                d(reason)

    def onCancel(self, callback) -> None:
        """
        Call C{callback(reason)} once, when the turn is cancelled; a
        lighter L{whenCancelled} for the engine's hot path.
        Not called when already cancelled (check L{cancelled} first).

        @param callback: a one-argument callable.
        """
        self._waiters.append(callback)

    def removeOnCancel(self, callback) -> None:
        """
        Forget a callback added with L{onCancel}; a no-op when it was
        called or removed already.
        """
        try:
            self._waiters.remove(callback)
        except ValueError:
            pass

    def whenCancelled(self) -> Deferred:
        """
        @return: a L{Deferred} that fires with the reason once cancelled.
            Cancelling the returned Deferred detaches it.
        """
        if self.cancelled:
            d = Deferred()
            d.callback(self.reason)
            return d

        def _detach(d: Deferred) -> None:
            if d in self._waiters:
                self._waiters.remove(d)

        d = Deferred(_detach)
        self._waiters.append(d)
        return d


@define(eq=False)
class Turn:
    """
    One HTTP request or one WebSocket C{response.create} (DEVELOPERS.md).

    @ivar entrypoint: C{http} or C{ws}.
    @ivar endpoint: one of L{ENDPOINTS} (C{responses}, C{chat}, C{messages}
        (the Anthropic Messages API: C{body} is its Responses translation,
        R115), C{embeddings}, C{images}, C{image_edits}).
    @ivar client: the authenticated L{ClientKey}.
    @ivar model: the model the client asked for (before mapping).
    @ivar body: the JSON request body as a dict (relay-only fields removed).
    @ivar stream: whether the client wants SSE (from the body, protocol.md 2.1).
    @ivar headers: lower-cased client headers that may be copied upstream
        (never C{authorization}, cookies or hop-by-hop headers).
    @ivar sessionHash: the sticky session hash (R37), or L{None}.
    @ivar previousResponseId: the chain id (R41), or L{None}.
    @ivar historyComplete: whether relay may move the turn to another
        account (R62, R80).
    @ivar wsMode: the WebSocket mode for C{ws} turns.
    @ivar requestId: the turn's id, relay's own (L{relay.base.requestid}, R111):
        on every log line of the turn, in C{X-Request-Id}, the request
        log's key.
    @ivar clientRequestId: the id the client sent (C{X-Request-Id} or
        C{X-Client-Request-Id}, R111), or L{None}: logged, kept in the
        request log, sent upstream as C{X-Client-Request-Id}.
    @ivar cancel: the client's L{CancelSignal}.
    @ivar phase: C{first_turn}, C{later_turn} (WebSocket), or C{request}.
    @ivar preferredAccountId: an account to try first (WebSocket later
        turns stay on their account while it serves them).
    @ivar onResponseId: called with (response id, account) when a response
        completes, so the connection can track its chain.
    @ivar firstOutputAt: when the first output reached the client (clock
        seconds), set by the engine.
    @ivar wsContext: for C{ws} turns, the client connection's state (its
        history and dedicated upstream), read by the WebSocket attempt.
    @ivar usage: the turn's L{relay.usage.tokens.TokenCounts} once the
        engine read them, else L{None}.
    @ivar upstreamRequestId: the current attempt's upstream C{x-request-id}
        (L{None} before its headers or when it sent none), set by the
        engine and logged as C{upstream_request_id}.
    @ivar request: for a request that is not a turn (behaviour.md R87:
        compact, retrieve, delete, input items, cancel, input tokens,
        models), its L{relay.engine.requests.RequestKind}; L{None} for a
        turn.
    @ivar background: a C{background: true} create (R88): API-key accounts
        only, owner recorded at its first event, usage counted once.
    @ivar compactionItems: for a compaction turn (its last input item is
        C{compaction_trigger}, R89), the C{compaction} items it produced,
        filled by the engine; L{None} for other turns.
    @ivar messages: for a C{messages} turn, what the answer's translation
        needs of the client's request
        (L{relay.translate.anthropic.request.MessagesContext}); else L{None}.
    @ivar affinity: C{(layer, store key)} pairs whose recorded account the
        turn prefers (R89: the account that produced a C{compaction} item
        it carries; R90: the account that issued its C{x-codex-turn-state}).
    """

    entrypoint: str
    endpoint: str
    client: ClientKey
    model: Optional[str]
    body: dict
    stream: bool
    headers: dict = field(factory=dict)
    sessionHash: Optional[str] = None
    previousResponseId: Optional[str] = None
    historyComplete: bool = True
    wsMode: Optional[str] = None
    requestId: str = ""
    clientRequestId: Optional[str] = None
    cancel: CancelSignal = field(factory=CancelSignal)
    phase: str = "request"
    preferredAccountId: Optional[str] = None
    onResponseId: Optional[Callable[[str, Account], Any]] = None
    firstOutputAt: Optional[float] = None
    wsContext: Any = None
    messages: Any = None
    usage: Any = None
    upstreamRequestId: Optional[str] = None
    allowedAccounts: Optional[frozenset] = None
    """The account ids the key may reach (its group), or L{None}
    for every account; set by the key policy, narrowed at selection."""
    clientAddress: Optional[str] = None
    """The client's IP address, for the request log."""
    userAgent: Optional[str] = None
    """The client's C{User-Agent}, for the request log."""
    request: Any = None
    background: bool = False
    compactionItems: Optional[list] = None
    affinity: tuple = ()
    itemReferences: tuple = ()
    """R104: the ids of the stored items the input names
    (L{relay.scheduling.itemowners}); selection refuses the turn unless
    the key owns each."""
    outputItemIds: tuple = ()
    """R104: the output item ids of the response being recorded
    (L{relay.engine.runner.TurnRunner.ownResponse}); their owner records
    are written with the response's."""
    keyAdmitted: bool = False
    """R103: the entry already admitted the key's slot (before
    decoding the body); the engine does not admit it again."""
    keyLease: Any = None
    """The key's slot lease the entry admitted, released by the engine
    when the turn ends (L{None}: unlimited key)."""
    budgetHold: Any = None
    """R108: the L{relay.usage.ledger.Hold} of a key with a budget, from
    admission until the turn's usage settles it or its end releases it."""
    hostedCalls: Optional[dict] = None
    """R109: hosted tool -> calls seen in the answer's items, for a key with
    a money budget whose request offers one (L{relay.usage.reader.HostedCallWatch});
    else L{None}."""
    upload: Any = None
    """The files of an C{image_edits} turn
    (L{relay.wire.multipart.Upload}s, parsed after the key, R103),
    re-encoded for the upstream; their names, sizes and types are in
    C{body}. L{None} for every other turn."""
    rawBody: Any = None
    """A large client body's bytes (L{relay.wire.rawjson.RawObject}) the
    upstream body is spliced from (L{relay.engine.payload.encodeBody});
    L{None} for a small body, a WebSocket frame or a body relay built."""
    bodySize: int = 0
    """The client's body (or WebSocket frame) in bytes, once read; 0 when
    not known. Above L{relay.wire.jsoncodec.LARGE_BODY_BYTES} the upstream
    body is written by orjson (L{relay.engine.payload.encodeBody}) and the
    token estimate is read from it (L{relay.usage.estimate.inputTokens})."""
    keyLimits: Any = None
    """R114: the key's own windows (L{relay.tenants.keyusage.KeyLimits}) that
    replace an account's rate-limit headers and C{codex.rate_limits} events
    on this turn; L{None} until read (or without a reader)."""


# ---------------------------------------------------------------------------
# Errors the client sees
# ---------------------------------------------------------------------------


@frozen
class ClientError:
    """
    An error to give the client, in OpenAI's error envelope (protocol.md 2.6).

    @ivar status: HTTP status before commit.
    @ivar type: the error C{type} (e.g. C{rate_limit_error}).
    @ivar message: human text.
    @ivar code: optional machine code (e.g. C{relay_queue_full}).
    @ivar param: optional offending parameter.
    @ivar headers: extra response headers, e.g. C{Retry-After} (R16).
    @ivar rawBody: when set, the exact upstream body to pass through
        (C{cyber_policy}, R9) together with C{contentType}.
    @ivar contentType: content type for C{rawBody}.
    @ivar wsClose: (code, reason) to close a WebSocket with (R65, R70), or
        L{None} to send an C{error} event and keep the connection.
    @ivar wsInband: R113: a key's own limit (a model it may not use, a
        spent budget, its C{rpm}/C{tpm}): on an open WebSocket it is a
        status-bearing C{error} event and the socket stays open
        (C{wsClose} is then unused before output).
    @ivar resetsAt: Unix seconds when the refused limit frees up (a
        budget's period end, a rate window's slot), or L{None}.
    @ivar usageLimit: R113: a spent budget, told on every entrypoint in the
        shape Codex renders with its reset time (L{usageLimitFields}); HTTP
        bodies carry it too, not only the WebSocket event.
    """

    status: int
    type: str
    message: str
    code: Optional[str] = None
    param: Optional[str] = None
    headers: tuple = ()
    rawBody: Optional[bytes] = field(default=None, repr=False)
    contentType: Optional[str] = None
    wsClose: Optional[tuple] = None
    wsInband: bool = False
    resetsAt: Optional[float] = None
    usageLimit: bool = False

    def envelope(self) -> dict:
        """
        @return: C{{"error": {message, type, param, code}}}; for a
            C{usageLimit} error also Codex's usage-limit fields
            (L{usageLimitFields}: C{type} C{usage_limit_reached},
            C{resets_at}, C{resets_in_seconds}; OpenAI's envelope tolerates
            extra fields, and C{code} stays relay's).
        """
        envelope = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        if self.usageLimit and self.resetsAt is not None:
            envelope["error"].update(self.usageLimitFields())
        return envelope

    def usageLimitFields(self) -> dict:
        """
        R113: the fields that make Codex render this refusal as a usage
        limit with its reset time, as it does for a plan's usage limit
        (openai/codex C{core/src/api_bridge.rs} C{map_api_error}: a 429
        whose C{error.type} is C{usage_limit_reached}, the time from
        C{resets_at}; the WebSocket C{error} event and the HTTP body go
        through the same code). Needs C{resetsAt}.

        @return: C{{"type": "usage_limit_reached", "resets_at": <Unix
            seconds, rounded up>, "resets_in_seconds": <the
            C{Retry-After} header's seconds, 0 without one>}}.
        """
        retryAfter = dict((name.lower(), value) for name, value in self.headers)
        try:
            wait = max(0, int(retryAfter.get("retry-after", "0")))
        except ValueError:
            wait = 0
        return {
            "type": USAGE_LIMIT_TYPE,
            "resets_at": int(math.ceil(self.resetsAt)),
            "resets_in_seconds": wait,
        }


USAGE_LIMIT_TYPE = "usage_limit_reached"
"""The C{error.type} Codex renders as a usage limit with its reset time."""

PROMO_HEADER = "x-codex-promo-message"
"""The response header Codex prints a usage limit's text from ("You've hit
your usage limit. <text>, or try again at <time>."; openai/codex
C{codex-rs/codex-api/src/rate_limits.rs} C{parse_promo_message}), on HTTP
and in a WebSocket error event's C{headers}."""


def promoText(message: str) -> str:
    """
    C{message} as the L{PROMO_HEADER} value: visible ASCII (Codex drops a
    header value with anything else; other characters become C{?}) and no
    final full stop (Codex follows it with ", or try again at <time>.").
    """
    return message.encode("ascii", "replace").decode("ascii").rstrip(". ")


class RelayError(Exception):
    """
    Base of relay's own exceptions.
    """


class ConfigError(RelayError):
    """
    A configuration file problem; the message is one line naming the key.
    """


class AdmissionError(RelayError):
    """
    A slot could not be admitted.

    @ivar reason: C{queue_full}, C{timeout}, C{client_gone} or C{error}.
    @ivar plan: the L{WaitPlan} that was in force, or L{None}.
    """

    def __init__(self, reason: str, plan: Optional[WaitPlan] = None, detail: str = ""):
        super().__init__(reason if not detail else f"{reason}: {detail}")
        self.reason = reason
        self.plan = plan
