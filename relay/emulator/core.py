# -*- test-case-name: tests.test_emulator -*-
"""
L{Emulator}: the in-process handle on the upstream emulator (site, listening port, control
methods) used by the twistd plugin and by relay's tests.
"""

from __future__ import annotations

from typing import Any

from attrs import define, field
from autobahn.twisted.resource import WebSocketResource
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.web.server import Site

from relay.emulator.chaos import ChaosPlan, TurnDraw, TurnLedger, turnKey
from relay.emulator.http import EmulatorResource
from relay.emulator.login import LoginFlows
from relay.emulator.oauth import DEFAULT_ACCESS_TTL, OAuthAuthority, UsageModel, canonicalKey
from relay.emulator.state import (
    DEFAULT_MODELS,
    EmulatorState,
    Fault,
    RecordedRequest,
    parseFaults,
    parseScript,
)
from relay.emulator.stored import ResponseStore
from relay.emulator.ws import buildFactory

CONFIG_KEYS = frozenset(
    {"listen", "accept_any", "ws_max_age", "models", "default_script", "default_fault",
     "accounts", "oauth", "chaos", "ws_max_frame_bytes"}
)
"""The keys an emulator configuration may have."""

ACCOUNT_KEYS = frozenset(
    {"name", "credential", "script", "fault", "type", "refresh_token", "chatgpt_account_id",
     "plan_type", "usage"}
)

OAUTH_KEYS = frozenset({"access_token_ttl", "secret", "device_interval"})
"""The keys of the C{oauth:} section (L{relay.emulator.oauth})."""
"""The keys an account entry may have."""


class EmulatorConfigError(ValueError):
    """
    The emulator configuration is malformed; the message names the offending key.
    """


def validateConfig(config: dict) -> dict:
    """
    Check an emulator configuration against the key whitelist and parse its scripts and
    faults once, so errors surface at start-up.

    @param config: the configuration (the YAML document as a dict).
    @type config: L{dict}
    @return: C{config}, unchanged.
    @rtype: L{dict}
    @raise EmulatorConfigError: naming the bad key or value.
    """
    if not isinstance(config, dict):
        raise EmulatorConfigError("the emulator configuration must be a mapping")
    unknown = set(config) - CONFIG_KEYS
    if unknown:
        raise EmulatorConfigError(f"unknown emulator configuration keys: {sorted(unknown)}")
    accounts = config.get("accounts") or []
    if not isinstance(accounts, list):
        raise EmulatorConfigError("accounts must be a list")
    try:
        parseScript(config.get("default_script"))
        parseFaults(config.get("default_fault"))
        for index, account in enumerate(accounts):
            if not isinstance(account, dict):
                raise EmulatorConfigError(f"accounts[{index}] must be a mapping")
            bad = set(account) - ACCOUNT_KEYS
            if bad:
                raise EmulatorConfigError(f"accounts[{index}]: unknown keys {sorted(bad)}")
            kind = account.get("type", "apikey")
            if kind not in ("apikey", "oauth"):
                raise EmulatorConfigError(f"accounts[{index}]: type must be apikey or oauth")
            required = ("name",) if kind == "oauth" else ("name", "credential")
            for key in required:
                if not isinstance(account.get(key), str) or not account[key]:
                    raise EmulatorConfigError(f"accounts[{index}]: missing entry {key!r}")
            if kind == "oauth" and "credential" in account:
                raise EmulatorConfigError(
                    f"accounts[{index}]: an oauth account has no credential (its key is"
                    " oauth:<name>)")
            if kind != "oauth" and "refresh_token" in account:
                raise EmulatorConfigError(f"accounts[{index}]: refresh_token needs type oauth")
            if account.get("usage") is not None:
                UsageModel.parse(account["usage"], 0.0)
            parseScript(account.get("script"))
            parseFaults(account.get("fault"))
        oauth = config.get("oauth") or {}
        if not isinstance(oauth, dict) or set(oauth) - OAUTH_KEYS:
            raise EmulatorConfigError(f"oauth: expected a mapping with keys {sorted(OAUTH_KEYS)}")
        interval = oauth.get("device_interval", 5)
        if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= 60:
            raise EmulatorConfigError("oauth.device_interval must be an integer from 1 to 60")
        ttl = oauth.get("access_token_ttl", 1)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0:
            raise EmulatorConfigError("oauth.access_token_ttl must be a positive number")
        ChaosPlan.parse(config.get("chaos"))
    except EmulatorConfigError:
        raise
    except ValueError as e:
        raise EmulatorConfigError(str(e)) from e
    age = config.get("ws_max_age", 3600)
    if not isinstance(age, (int, float)) or age <= 0:
        raise EmulatorConfigError("ws_max_age must be a positive number of seconds")
    frame = config.get("ws_max_frame_bytes", 64 * 2**20)
    if isinstance(frame, bool) or not isinstance(frame, int) or frame <= 0:
        raise EmulatorConfigError("ws_max_frame_bytes must be a positive integer")
    return config


@define(eq=False)
class Emulator:
    """
    The OpenAI upstream emulator: a twisted.web L{Site} serving the Responses API (HTTP and
    WebSocket), Chat Completions, the model list and the C{/_emulator/} control API.

    @ivar reactor: the reactor (or, for unit tests that never listen, a
        L{twisted.internet.task.Clock}); used for time, delays and listening.
    @ivar config: the configuration dict (the YAML format of C{etc/emulator.yaml}).
    @ivar state: the scripts, faults, recordings and counters.
    @ivar site: the site to listen with; C{site.wsFactory} is the WebSocket factory.
    @ivar wsResource: the autobahn resource upgrades are handed to.
    @ivar listeningPort: the port after L{listen}, else L{None}.
    @ivar wsMaxAge: the WebSocket connection age limit in seconds.
    @ivar models: the model ids C{GET /v1/models} lists.
    @ivar oauth: the token issuer and usage meter (L{relay.emulator.oauth}).
    @ivar chaos: the seeded random faults in force (L{relay.emulator.chaos}), or L{None}.
    @ivar ledger: requests and generations per client turn (L{relay.emulator.chaos}).
    @ivar responses: the stored and background responses (L{relay.emulator.stored}).
    @ivar wsMaxFrameBytes: the largest client WebSocket frame; a bigger one is closed 1009
        (C{ws_max_frame_bytes}, default 64 MiB), as upstream closes a frame too big.
    """

    _log = Logger()

    reactor: IReactorTime
    config: dict = field(factory=dict)
    state: EmulatorState = field(init=False)
    site: Site = field(init=False)
    wsResource: WebSocketResource = field(init=False)
    listeningPort: IListeningPort | None = field(init=False, default=None)
    wsMaxAge: float = field(init=False, default=3600.0)
    models: tuple = field(init=False, default=DEFAULT_MODELS)
    oauth: OAuthAuthority = field(init=False)
    chaos: ChaosPlan | None = field(init=False, default=None)
    ledger: TurnLedger = field(init=False, factory=TurnLedger)
    responses: ResponseStore = field(init=False, factory=ResponseStore)
    wsMaxFrameBytes: int = field(init=False, default=64 * 2**20)
    _secure: bool = field(init=False, default=False)
    _held: set = field(init=False, factory=set)
    _connections: set = field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        """
        Apply the configuration and build the site.

        @raise EmulatorConfigError: for a malformed configuration.
        """
        config = validateConfig(self.config or {})
        self.state = EmulatorState(clock=self.reactor,
                                   acceptAny=bool(config.get("accept_any", True)))
        self.wsMaxAge = float(config.get("ws_max_age", 3600))
        self.wsMaxFrameBytes = int(config.get("ws_max_frame_bytes", 64 * 2**20))
        self.models = tuple(config.get("models") or DEFAULT_MODELS)
        oauth = config.get("oauth") or {}
        self.oauth = OAuthAuthority(
            clock=self.reactor, accessTtl=float(oauth.get("access_token_ttl", DEFAULT_ACCESS_TTL))
        )
        if oauth.get("secret"):
            self.oauth.secret = str(oauth["secret"]).encode("utf-8")
        self.oauth.login = LoginFlows(authority=self.oauth,
                                      interval=int(oauth.get("device_interval", 5)))
        for account in config.get("accounts") or []:
            name = account["name"]
            if account.get("type") == "oauth":
                key = canonicalKey(name)
                self.oauth.addAccount(
                    name, account.get("refresh_token"),
                    account.get("chatgpt_account_id") or f"acct-{name}",
                    account.get("plan_type") or "plus",
                )
            else:
                key = account["credential"]
            self.state.addAccount(name, key)
            if account.get("script") is not None:
                self.state.setScript(key, account["script"])
            if account.get("fault") is not None:
                self.state.setFault(key, account["fault"])
            if account.get("usage") is not None:
                self.oauth.setUsage(key, account["usage"])
        if config.get("default_script") is not None:
            self.state.setScript("*", config["default_script"])
        if config.get("default_fault") is not None:
            self.state.setFault("*", config["default_fault"])
        self.chaos = ChaosPlan.parse(config.get("chaos"))
        factory = buildFactory(self)
        self.wsResource = WebSocketResource(factory)
        self.site = Site(EmulatorResource(self), reactor=self.reactor)
        self.site.wsFactory = factory
        self.site.displayTracebacks = False

    @property
    def clock(self) -> IReactorTime:
        """
        The time source (the reactor).

        @rtype: L{IReactorTime}
        """
        return self.reactor

    @property
    def port(self) -> int | None:
        """
        The listening port number, or L{None} before L{listen}.

        @rtype: L{int} or L{None}
        """
        if self.listeningPort is None:
            return None
        return getattr(self.listeningPort.getHost(), "port", None)

    async def listen(self, reactor: Any = None,
                     endpoint_string: str = "tcp:0:interface=127.0.0.1") -> IListeningPort:  # noqa: N803
        """
        Listen on a server endpoint string (C{tcp:…}, C{ssl:…}, C{unix:…}).

        @param reactor: the reactor to listen with; defaults to C{self.reactor}.
        @param endpoint_string: the endpoint description.
        @type endpoint_string: L{str}
        @return: the listening port.
        @rtype: L{IListeningPort}
        """
        reactor = reactor if reactor is not None else self.reactor
        self._secure = endpoint_string.split(":", 1)[0] in ("ssl", "tls")
        self.listeningPort = await serverFromString(reactor, endpoint_string).listen(self.site)
        self._log.info("emulator listening on {port}", event="emulator.listening",
                       port=self.port)
        return self.listeningPort

    def baseURL(self, kind: str = "apikey", host: str | None = None) -> str:
        """
        The base URL a client (or relay account) should use.

        @param kind: C{"apikey"} (C{http://h:p/v1}), C{"oauth"}
            (C{http://h:p/backend-api/codex}), C{"ws"} / C{"ws-apikey"} (C{ws://h:p/v1}),
            C{"ws-oauth"} (C{ws://h:p/backend-api/codex}) or C{"root"} (C{http://h:p}).
            The schemes become C{https}/C{wss} when listening with TLS.
        @type kind: L{str}
        @param host: the host to put in the URL; defaults to the listening address
            (C{127.0.0.1} for a wildcard address).
        @type host: L{str} or L{None}
        @rtype: L{str}
        @raise ValueError: for an unknown kind.
        """
        address = self.listeningPort.getHost() if self.listeningPort is not None else None
        if host is None:
            host = getattr(address, "host", None) or "127.0.0.1"
            if host in ("0.0.0.0", "::", ""):
                host = "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        authority = f"{host}:{self.port}"
        paths = {"apikey": "/v1", "http": "/v1", "oauth": "/backend-api/codex", "ws": "/v1",
                 "ws-apikey": "/v1", "ws-oauth": "/backend-api/codex", "root": ""}
        if kind not in paths:
            raise ValueError(f"unknown base URL kind {kind!r}")
        scheme = ("wss" if self._secure else "ws") if kind.startswith("ws") else (
            "https" if self._secure else "http")
        return f"{scheme}://{authority}{paths[kind]}"

    # -- control ----------------------------------------------------------------------------

    def authenticate(self, token: str | None) -> tuple:
        """
        Map a bearer to its credential key (see
        L{relay.emulator.oauth.OAuthAuthority.authenticate}).

        @return: C{(key, None)} or C{(None, 401 body)}.
        """
        return self.oauth.authenticate(token)

    def mintAccessToken(self, name: str, ttl: float | None = None) -> str:
        """
        A signed access token for OAuth account C{name} (tests, rehearsals).

        @param ttl: seconds it is valid (default the configured lifetime).
        """
        return self.oauth.mintAccessToken(name, ttl)

    def setUsage(self, credentialOrName: str, spec: dict | None) -> None:
        """
        Configure the usage windows of an account (by name or credential).

        @raise ValueError: for a malformed spec.
        """
        self.oauth.setUsage(self.state.resolve(credentialOrName), spec)

    def setFault(self, credential: str, fault: Any) -> None:
        """
        Replace the faults of an account (by credential or name; C{"*"} for every account
        without its own); L{None} clears them.

        @param credential: a credential, an account name, or C{"*"}.
        @type credential: L{str}
        @param fault: a fault object, a list of them, or L{None}.
        @raise ValueError: for a malformed fault.
        """
        self.state.setFault(credential, fault)

    def clearFaults(self) -> None:
        """
        Remove every fault, including the C{"*"} default.
        """
        self.state.clearFaults()

    def setChaos(self, spec: Any) -> None:
        """
        Put a chaos configuration in force (L{relay.emulator.chaos}); L{None} turns chaos off.

        @raise ValueError: for a malformed configuration (nothing changes).
        """
        self.chaos = ChaosPlan.parse(spec)

    def arrive(self, credential: str | None, transport: str, body: Any,
               headers: dict | None) -> TurnDraw:
        """
        Note a request (HTTP) or a turn (a WebSocket C{response.create}) in the turn ledger.

        @param credential: the bearer's key.
        @param transport: C{"http"} or C{"ws"}.
        @param body: the parsed body or frame.
        @param headers: the request's lower-cased headers (L{None} for a WebSocket frame).
        @return: the request's L{TurnDraw}, for L{takeFault} and L{generated}.
        """
        return self.ledger.arrived(turnKey(body, headers), self.state.nameOf(credential),
                                   transport, self.reactor.seconds())

    def takeFault(self, credential: str | None, transport: str, draw: TurnDraw,
                  handshake: bool = False, body: Any = None,
                  endpoint: str = "responses") -> Fault | None:
        """
        The fault of one request: a scripted one first (its C{times} counts down), else the
        chaos draw.

        @param draw: the request's L{TurnDraw} (L{arrive}, or L{TurnLedger.handshake}).
        @param body: the request body or frame (a fault's C{model} filter, a C{refuse}
            fault's fit: L{EmulatorState.takeFault}).
        @param endpoint: C{responses} or C{chat}.
        @return: the fault, or L{None}.
        """
        fault = self.state.takeFault(credential, transport, handshake, body, endpoint)
        if fault is None and self.chaos is not None:
            fault = self.chaos.pick(self.state.nameOf(credential), draw.drawKey, draw.attempt,
                                    transport, handshake, self.reactor.seconds())
        return fault

    def generated(self, draw: TurnDraw | None, credential: str | None,
                  final: dict | None = None) -> None:
        """
        Note that a request's answer was delivered whole (a generation).

        @param final: the response or completion object delivered, whose usage
            C{GET /_emulator/generations} lists; L{None} lists zero counts.
        """
        self.ledger.generated(draw, self.state.nameOf(credential), self.reactor.seconds(),
                              final)

    def generationCount(self, credentialOrName: str | None = None) -> int:
        """
        How many generations the emulator delivered (with or without a turn key): in all, or
        of one account. Sub-routes (compact, retrieve, cancel, ...) never add to it.

        @param credentialOrName: a credential or account name, or L{None} for all.
        """
        if credentialOrName is None:
            return self.ledger.total
        return self.ledger.byAccount.get(self.state.nameOf(self.state.resolve(credentialOrName)), 0)

    def setScript(self, credential: str, script: dict | None) -> None:
        """
        Set the script of an account (by credential or name; C{"*"} sets the default);
        L{None} resets it.

        @param credential: a credential, an account name, or C{"*"}.
        @type credential: L{str}
        @param script: the script object.
        @raise ValueError: for a malformed script.
        """
        self.state.setScript(credential, script)

    @property
    def requests(self) -> list[RecordedRequest]:
        """
        Every recorded request, oldest first.

        @rtype: L{list} of L{RecordedRequest}
        """
        return self.state.requests

    def requestsFor(self, credential: str, kind: str | None = None) -> list[RecordedRequest]:
        """
        The recorded requests of one account.

        @param credential: a credential or an account name.
        @type credential: L{str}
        @param kind: only records of this kind (C{"request"}, C{"handshake"}, C{"frame"}).
        @type kind: L{str} or L{None}
        @rtype: L{list} of L{RecordedRequest}
        """
        key = self.state.resolve(credential)
        return [r for r in self.state.requests
                if r.credential == key and (kind is None or r.kind == kind)]

    def clearRequests(self) -> None:
        """
        Forget every recorded request.
        """
        del self.state.requests[:]

    def peak(self, credential: str) -> int:
        """
        The peak number of concurrent in-flight turns of an account.

        @param credential: a credential or an account name.
        @type credential: L{str}
        @rtype: L{int}
        """
        return self.state.peak(credential)

    def inflight(self, credential: str) -> int:
        """
        The number of in-flight turns of an account now.

        @param credential: a credential or an account name.
        @type credential: L{str}
        @rtype: L{int}
        """
        return self.state.inflight(credential)

    def resetPeaks(self) -> None:
        """
        Reset every peak to the current in-flight count.
        """
        self.state.resetPeaks()

    def connectionCount(self) -> int:
        """
        The number of open WebSocket connections.

        @rtype: L{int}
        """
        return self.site.wsFactory.getConnectionCount()

    def dropConnections(self) -> None:
        """
        Abort every open WebSocket connection and every hanging HTTP request.
        """
        for proto in list(self._connections):
            proto.dropConnection(abort=True)
        for request in list(self._held):
            transport = request.channel.transport if request.channel is not None else None
            if transport is not None:
                transport.abortConnection()
        self._held.clear()

    async def stop(self, timeout: float = 5.0) -> None:
        """
        Drop every connection, wait (up to C{timeout}) for WebSocket connections to drain,
        then stop listening.

        @param timeout: seconds to wait for the drain.
        @type timeout: L{float}
        """
        self.dropConnections()
        waited = 0.0
        while self.connectionCount() > 0 and waited < timeout:
            await deferLater(self.reactor, 0.01, lambda: None)
            waited += 0.01
        if self.listeningPort is not None:
            port, self.listeningPort = self.listeningPort, None
            result = port.stopListening()
            if isinstance(result, Deferred):
                await result
