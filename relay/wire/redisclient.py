# -*- test-case-name: tests.integration.test_redis_state -*-
"""
The one place relay talks to txredisapi (style.md pattern d).

L{RedisService} owns a txredisapi connection pool -- a C{lazyConnectionPool}
built from C{state.redis_url} (C{redis://}, C{rediss://} with TLS, or a
C{unix://} socket: L{parseRedisUrl}), or with C{state.redis_sentinels} the pool
txredisapi's C{Sentinel.master_for} keeps on the current master -- and runs
every command through L{RedisService.execute}, which puts a timeout on the
injected clock on each call (trap T16) and counts commands (for the
benchmark and tests).

Reachability (behaviour.md R101). The service knows, without any
ping of its own on a turn's path, whether Redis answers: every reply marks
it I{reachable}; a command that times out or loses its connection with no
reply from Redis since it was sent marks it I{unreachable}. While
unreachable, L{RedisService.execute} fails at once with L{RedisUnavailable}
(a silent Redis would otherwise cost every command its whole timeout, one
after another, in every turn) and a background probe (C{PING}, or C{ROLE}
with Sentinel) runs every L{RedisService.probeInterval} seconds until Redis
answers again; an idle connection is probed every
L{RedisService.idleProbeSeconds}. L{RedisService.reachable} is what
C{/readyz} reads.

Never a write to a demoted master: with Sentinel every new connection checks
C{ROLE} (txredisapi's C{SentinelRedisProtocol}) and the probe does too; a
C{READONLY} reply (the master was demoted while relay held a connection)
drops every connection, so the next one asks the Sentinels again.

txredisapi imports the global reactor at import time (trap T5), so it is
imported lazily in L{RedisService.startService}; this module is safe to
import anywhere.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import Any, Optional
from urllib.parse import parse_qsl, unquote, urlsplit

from attrs import define, field
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from relay.base.records import RelayError
from relay.wire.sendnow import sendNow

_SCRIPT_SHAS: dict = {}
"""Script text -> its SHA1 hex (L{RedisService._eval})."""


def _scriptSha(script: str) -> str:
    """
    @return: the SHA1 hex of a script's text, computed once per text.
    """
    sha = _SCRIPT_SHAS.get(script)
    if sha is None:
        if len(_SCRIPT_SHAS) > 256:
            _SCRIPT_SHAS.clear()
        sha = _SCRIPT_SHAS[script] = hashlib.sha1(script.encode("utf-8")).hexdigest()
    return sha


class RedisUnavailable(RelayError):
    """
    A Redis command failed: connection error, timeout, refused connection
    or a server error reply. Carries the operation name.

    @ivar operation: what relay was doing, e.g. C{slot_acquire}.
    """

    def __init__(self, operation: str, detail: str = ""):
        super().__init__(f"{operation}: {detail}" if detail else operation)
        self.operation = operation


REDIS_URL_SCHEMES = ("redis", "rediss", "unix")
"""The schemes of C{state.redis_url}: plain TCP, TLS, a unix socket."""

TLS_PARAMETERS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
"""The query parameters of a C{rediss://} URL (the names redis-py uses)."""


@define(frozen=True)
class RedisTarget:
    """
    Where and how to reach Redis, from C{state.redis_url} (L{parseRedisUrl}).

    @ivar scheme: C{redis}, C{rediss} (TLS) or C{unix}.
    @ivar host: the host name or address (TCP), else L{None}.
    @ivar port: the TCP port, else L{None}.
    @ivar path: the unix socket's path, else L{None}.
    @ivar dbid: the database, L{None} for 0 (no C{SELECT} on reconnect).
    @ivar password: or L{None}. @ivar username: or L{None} (ACL user).
    @ivar caCerts: C{rediss}: a PEM file of the certificate authorities to
        trust instead of the system's, or L{None}.
    @ivar certFile: C{rediss}: the client certificate (PEM), or L{None}.
    @ivar keyFile: C{rediss}: its private key (PEM; default: in
        C{certFile}).
    """

    scheme: str
    host: Optional[str] = None
    port: Optional[int] = None
    path: Optional[str] = None
    dbid: Optional[int] = None
    password: Optional[str] = field(default=None, repr=False)
    username: Optional[str] = None
    caCerts: Optional[str] = None
    certFile: Optional[str] = None
    keyFile: Optional[str] = None

    @property
    def tls(self) -> bool:
        """
        Whether the connection is TLS (C{rediss://}).
        """
        return self.scheme == "rediss"

    def tlsOptions(self):
        """
        The client TLS options of a C{rediss://} target: the server's
        certificate verified against L{caCerts} (or the system's trust
        store) for L{host}, and L{certFile}/L{keyFile} presented when given.

        @return: an C{IOpenSSLClientConnectionCreator}, as txredisapi's
            C{ssl_context_factory} takes it.
        @raise ValueError: for a file that cannot be read or parsed, or a
            key that is not the certificate's (the message names the
            parameter, never a password).
        """
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from twisted.internet import ssl

        trustRoot = None
        if self.caCerts:
            data = _readFile("ssl_ca_certs", self.caCerts)
            try:
                certificates = x509.load_pem_x509_certificates(data)
            except ValueError:
                raise ValueError(f"ssl_ca_certs: no PEM certificate in {self.caCerts}")
            trustRoot = ssl.trustRootFromCertificates(
                [ssl.Certificate.loadPEM(c.public_bytes(serialization.Encoding.PEM))
                 for c in certificates])
        extra = {}
        if self.certFile:
            # cryptography objects, not pyOpenSSL's (deprecated by pyOpenSSL).
            try:
                certificate = x509.load_pem_x509_certificate(
                    _readFile("ssl_certfile", self.certFile))
            except ValueError:
                raise ValueError(f"ssl_certfile: no PEM certificate in {self.certFile}")
            keyPath = self.keyFile or self.certFile
            try:
                key = serialization.load_pem_private_key(
                    _readFile("ssl_keyfile", keyPath), password=None)
            except (ValueError, TypeError):
                raise ValueError(f"ssl_keyfile: no unencrypted PEM private key in {keyPath}")
            spki = (serialization.Encoding.DER,
                    serialization.PublicFormat.SubjectPublicKeyInfo)
            if key.public_key().public_bytes(*spki) != certificate.public_key().public_bytes(*spki):
                raise ValueError(f"ssl_keyfile: the key in {keyPath} is not ssl_certfile's")
            extra = {"privateKey": key, "certificate": certificate}
        return ssl.optionsForClientTLS(self.host, trustRoot=trustRoot,
                                       extraCertificateOptions=extra)


def _readFile(parameter: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{parameter}: cannot read {path}: {e.strerror}")


def parseRedisUrl(url: str) -> RedisTarget:
    """
    Parse C{state.redis_url} (the forms redis-py takes):

      - C{redis://[[user]:password@]host[:port][/db]}
      - C{rediss://[[user]:password@]host[:port][/db][?ssl_ca_certs=PEM]
        [&ssl_certfile=PEM][&ssl_keyfile=PEM]}: TLS, the server's
        certificate verified for C{host}
      - C{unix://[[user]:password@]/path/to/redis.sock[?db=N]}

    @param url: the C{state.redis_url} value.
    @return: a L{RedisTarget}.
    @raise ValueError: for another scheme, a bad database or port, an
        unknown or repeated query parameter, or a unix URL without a path
        (messages never include the URL: it may carry a password).
    """
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme not in REDIS_URL_SCHEMES:
        raise ValueError(f"unsupported scheme {scheme!r}: expected redis://host:port/db,"
                         " rediss://host:port/db or unix:///path/to/redis.sock")
    known = {"unix": ("db",), "rediss": TLS_PARAMETERS}.get(scheme, ())
    query = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in known:
            allowed = f" (known: {', '.join(known)})" if known else ""
            raise ValueError(f"unknown parameter {name!r} in a {scheme}:// URL{allowed}")
        if name in query:
            raise ValueError(f"parameter {name!r} given twice")
        query[name] = value
    password = unquote(parts.password) if parts.password else None
    username = unquote(parts.username) if parts.username else None
    if scheme == "unix":
        if not parts.path or parts.path == "/":
            raise ValueError("a unix:// URL needs the socket's path: unix:///path/to/redis.sock")
        db = query.get("db", "0")
        return RedisTarget(scheme=scheme, path=unquote(parts.path), dbid=_database(db),
                           password=password, username=username)
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError("bad port")
    tls = {}
    if scheme == "rediss":
        tls = {"caCerts": query.get("ssl_ca_certs") or None,
               "certFile": query.get("ssl_certfile") or None,
               "keyFile": query.get("ssl_keyfile") or None}
        if tls["keyFile"] and not tls["certFile"]:
            raise ValueError("ssl_keyfile needs ssl_certfile")
    return RedisTarget(scheme=scheme, host=parts.hostname or "127.0.0.1", port=port,
                       dbid=_database(parts.path.strip("/") or "0"), password=password,
                       username=username, **tls)


def _database(text: str) -> Optional[int]:
    """
    The database number of a URL, L{None} for 0 (C{SELECT} is skipped).
    """
    if not text.isdigit():
        raise ValueError(f"bad database {text!r}: expected a number")
    return int(text) or None


def parseHostPort(address: str, defaultPort: int = 26379) -> tuple:
    """
    Parse one C{state.redis_sentinels} entry.

    @param address: C{host:port}, C{host} (port C{defaultPort}) or
        C{[v6 address]:port}.
    @return: C{(host, port)}.
    @raise ValueError: for an empty host or a bad port.
    """
    address = address.strip()
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise ValueError(f"expected host:port, got {address!r}")
    else:
        host, _, port = address.rpartition(":") if ":" in address else (address, "", "")
    if not host:
        raise ValueError(f"expected host:port, got {address!r}")
    if not port:
        return host, defaultPort
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad port in {address!r}")
    return host, int(port)


#: Error replies that mean "this server cannot serve relay's writes now":
#: a demoted master (C{READONLY}), a replica cut off from its master
#: (C{MASTERDOWN}), a server still loading its data set (C{LOADING}), a
#: master without enough in-sync replicas (C{NOREPLICAS}, min-replicas-to-write).
UNSERVING_REPLIES = ("READONLY", "MASTERDOWN", "LOADING", "NOREPLICAS")


def isRedisFailure(reason: Any) -> bool:
    """
    Whether an exception or L{Failure} is one of the Redis errors R35 maps
    to C{on_redis_error}: txredisapi's C{ConnectionError} (and its
    C{TimeoutError}), C{ResponseError} (and C{ScriptDoesNotExist}),
    C{ValueError} from a refused non-lazy connection (trap T18),
    L{defer.TimeoutError} from C{addTimeout}, L{RedisUnavailable}, and
    L{defer.CancelledError}.

    @param reason: an exception or a L{Failure}.
    """
    value = reason.value if isinstance(reason, Failure) else reason
    if isinstance(value, (RedisUnavailable, defer.TimeoutError, defer.CancelledError, ValueError)):
        return True
    import sys

    txredisapi = sys.modules.get("txredisapi")
    return txredisapi is not None and isinstance(value, txredisapi.RedisError)


def logFailure(log: Logger, reason: Failure, message: str, **fields: Any) -> None:
    """
    Log a background job's failure: a Redis failure (L{isRedisFailure}) is
    one warning line naming it -- Redis being away is an operating
    condition, already announced by C{relay.redis_unreachable}, not a bug
    (behaviour.md R101: "never an unhandled error") -- anything else is
    logged with its traceback, as L{Logger.failure} does.

    @param log: the L{Logger}.
    @param reason: the L{Failure}.
    @param message: the log format string.
    @param fields: log fields (C{event=...}).
    """
    if isRedisFailure(reason):
        log.warn(message + " ({error})", error=describe(reason), **fields)
    else:
        log.failure(message, reason, **fields)


def describe(reason: Any) -> str:
    """
    @param reason: an exception or a L{Failure}.
    @return: short text for logs, e.g. C{TimeoutError: ...}.
    """
    value = reason.value if isinstance(reason, Failure) else reason
    return f"{type(value).__name__}: {value}"


@define(eq=False)
class RedisService(Service):
    """
    Owns the txredisapi connection pool and knows whether Redis answers.

    @ivar url: C{state.redis_url} (L{parseRedisUrl}); with C{sentinels}
        a C{redis://} URL of which only the database, user and password
        are used.
    @ivar _clock: the clock for per-call timeouts and the probe.
    @ivar poolsize: connections in the pool.
    @ivar connectTimeout: TCP connect timeout, seconds.
    @ivar replyTimeout: txredisapi's reply timeout on a live connection,
        seconds (the per-call timeout of L{execute} bounds the rest); a
        connection without a reply for this long is dropped and redialled.
    @ivar reconnectMaxDelay: cap of the reconnect back-off, seconds, so
        relay notices a restarted (or newly promoted) Redis quickly.
    @ivar sentinels: C{((host, port), ...)} of the Sentinels, or
        empty for a plain C{url}.
    @ivar masterName: the Sentinel service name (C{state.redis_master_name}).
    @ivar durableReplicas: replicas a L{executeDurable} write waits for
        (C{WAIT}); 1 with Sentinel, else 0 (nothing to wait for).
    @ivar durableTimeout: seconds a durable write waits for them.
    @ivar probeInterval: seconds between probes while unreachable.
    @ivar idleProbeSeconds: a reachable Redis with no reply for this long is
        probed (so an idle relay still notices a Redis that went silent).
    @ivar pool: the pool while running, else L{None}.
    @ivar commandCount: commands sent through L{execute} so far.
    @ivar lastReplyAt: clock seconds of the last reply from Redis, or
        L{None}.
    """

    url: str
    _clock: IReactorTime
    poolsize: int = 4
    connectTimeout: float = 2.0
    replyTimeout: float = 5.0
    reconnectMaxDelay: float = 1.0
    sentinels: tuple = ()
    masterName: Optional[str] = None
    durableReplicas: Optional[int] = None
    durableTimeout: float = 1.0
    probeInterval: float = 0.5
    idleProbeSeconds: float = 5.0
    pool: Optional[Any] = field(default=None, init=False)
    commandCount: int = field(default=0, init=False)
    lastReplyAt: Optional[float] = field(default=None, init=False)
    _state: Optional[bool] = field(default=None, init=False)
    _downSince: Optional[float] = field(default=None, init=False)
    _prober: Optional[LoopingCall] = field(default=None, init=False)
    _probing: bool = field(default=False, init=False)
    _sentinel: Optional[Any] = field(default=None, init=False)
    _watchers: list = field(factory=list, init=False)
    _switchedTo: Optional[tuple] = field(default=None, init=False)
    switchListeners: list = field(factory=list, init=False)
    """Callables run (no arguments) when the Sentinels promote a new master,
    after the connections were dropped (e.g. the slot admission re-releasing
    what the old master may not have passed on)."""
    _directPath: Optional[_DirectPath] = field(default=None, init=False)
    """The direct path of L{execute} (L{_DirectPath})."""
    unreachableListeners: list = field(factory=list, init=False)
    """Callables run (no arguments) each time Redis is found unreachable
    (e.g. the control plane ending the start-up wait for its first read,
    R101: a silent Redis fails fast, the read in flight included)."""

    _log = Logger()

    def __attrs_post_init__(self) -> None:
        """
        Initialise L{Service}'s own attributes.
        """
        self.running = 0
        self.name = None
        self.parent = None
        self._directPath = _DirectPath(self, self._clock)
        if self.durableReplicas is None:
            self.durableReplicas = 1 if self.sentinels else 0

    # -- reachability ----------------------------------------------------------

    @property
    def reachable(self) -> bool:
        """
        Whether Redis answered the last time relay heard from it (R101): a
        reply since the last command that timed out or lost its
        connection. L{False} before the first reply. Costs nothing: no
        round trip.
        """
        return self._state is True

    def _replied(self) -> None:
        """
        Redis answered: it is reachable.
        """
        now = self._clock.seconds()
        self.lastReplyAt = now
        if self._state is not True:
            if self._state is False:
                self._log.info(
                    "redis answers again after {outage:.1f}s",
                    event="relay.redis_reachable",
                    outage=now - (self._downSince or now),
                )
            self._state = True
            self._downSince = None

    def _silent(self, sentAt: float, why: str) -> None:
        """
        A command sent at C{sentAt} got no reply (timeout, lost or refused
        connection): unless Redis answered anything since, it is
        unreachable.
        """
        if self.lastReplyAt is not None and self.lastReplyAt > sentAt:
            return
        self._unreachable(why)

    def _unreachable(self, why: str) -> None:
        if self._state is False:
            return
        self._state = False
        self._downSince = self._clock.seconds()
        self._log.warn(
            "redis does not answer ({why}); failing fast and probing every {interval}s",
            event="relay.redis_unreachable",
            why=why,
            interval=self.probeInterval,
        )
        for listener in list(self.unreachableListeners):
            try:
                listener()
            except Exception:  # noqa: BLE001 - logged; the others still run
                self._log.failure("a redis unreachable listener failed")

    def _probeTick(self) -> None:
        """
        The probe loop: while unreachable, or when no reply came for
        L{idleProbeSeconds}, send one probe (never two at once).
        """
        if self._probing or self.pool is None:
            return
        now = self._clock.seconds()
        idle = self.lastReplyAt is None or now - self.lastReplyAt >= self.idleProbeSeconds
        if self._state is True and not idle:
            return
        self.probe()

    def probe(self) -> Deferred:
        """
        One probe round trip: C{PING}, or with Sentinel C{ROLE} (a server
        that is no longer the master has its connections dropped, so the
        next connection asks the Sentinels). Bypasses the fail-fast of
        L{execute}.

        @return: a Deferred firing with L{True} when Redis answered as a
            usable master, else L{False}; it never fails.
        """
        if self.pool is None:
            return defer.succeed(False)
        self._probing = True
        sentAt = self._clock.seconds()
        try:
            d = self.pool.role() if self.sentinels else self.pool.ping()
        except Exception as e:  # noqa: BLE001 - the pool refused at once
            d = defer.fail(e)
        d.addTimeout(max(self.probeInterval * 2, 1.0), self._clock)

        def _cb(reply) -> bool:
            if self.sentinels:
                role = reply[0] if isinstance(reply, (list, tuple)) and reply else reply
                if isinstance(role, bytes):
                    role = role.decode("ascii", "replace")
                if role != "master":
                    self.lastReplyAt = self._clock.seconds()
                    self._unreachable(f"connected to a {role}, not the master")
                    self._dropConnections()
                    return False
            self._replied()
            return True

        def _eb(f: Failure) -> bool:
            self._classify(f, sentAt)
            return False

        def _done(result):
            self._probing = False
            return result

        return d.addCallbacks(_cb, _eb).addBoth(_done)

    def _classify(self, f: Failure, sentAt: float) -> None:
        """
        Learn from a failed command: an error reply is an answer (a
        demoted master's C{READONLY} also drops the connections); a timeout
        or connection error is silence.
        """
        import txredisapi

        if f.check(defer.CancelledError):
            return
        if f.check(txredisapi.ResponseError):
            text = str(f.value)
            self.lastReplyAt = self._clock.seconds()
            if text.startswith(UNSERVING_REPLIES):
                self._unreachable(text.split("\n")[0][:120])
                if text.startswith("READONLY"):
                    self._dropConnections()
            else:
                self._replied()
            return
        if f.check(defer.TimeoutError, txredisapi.ConnectionError, ValueError):
            self._silent(sentAt, describe(f)[:120])

    def _dropConnections(self) -> None:
        """
        Close every pooled connection; txredisapi reconnects by itself
        (with Sentinel, to the master the Sentinels name now).
        """
        factory = getattr(self.pool, "_factory", None)
        for conn in list(getattr(factory, "pool", ())):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.loseConnection()

    # -- the service -----------------------------------------------------------

    def startService(self) -> None:
        """
        Create the pool (it connects in the background and reconnects by
        itself) and start the probe loop, which probes at once.
        """
        Service.startService(self)
        self.pool = self._makePool()
        self._fastCodec()
        factory = getattr(self.pool, "_factory", None)
        if factory is not None:
            factory.initialDelay = min(factory.initialDelay, 0.1)
            factory.maxDelay = self.reconnectMaxDelay
        self._prober = LoopingCall(self._probeTick)
        self._prober.clock = self._clock
        self._prober.start(self.probeInterval, now=True)

    def _fastCodec(self) -> None:
        """
        Give the pool's connections L{_fastProtocol}: set on
        the factory before any connection is built (connections are made
        in later reactor turns).
        """
        factory = getattr(self.pool, "_factory", None)
        base = getattr(factory, "protocol", None)
        if isinstance(base, type):
            factory.protocol = _fastProtocol(base)

    def _makePool(self):
        """
        @return: the txredisapi connection handler: a lazy pool on the URL's
            host (over TLS for C{rediss://}) or unix socket, or with
            C{sentinels} one kept on the current master.
        """
        import txredisapi

        target = parseRedisUrl(self.url)
        params = {"dbid": target.dbid, "password": target.password,
                  "username": target.username}
        if not self.sentinels:
            common = dict(
                poolsize=self.poolsize,
                connectTimeout=self.connectTimeout,
                replyTimeout=self.replyTimeout,
                convertNumbers=False,
                **params,
            )
            if target.path is not None:
                return txredisapi.lazyUnixConnectionPool(path=target.path, **common)
            return txredisapi.lazyConnectionPool(
                host=target.host, port=target.port,
                ssl_context_factory=target.tlsOptions() if target.tls else False,
                **common,
            )
        self._sentinel = txredisapi.Sentinel(
            [tuple(a) for a in self.sentinels],
            connectTimeout=self.connectTimeout,
            replyTimeout=self.replyTimeout,
        )
        self._watchSwitches()
        # txredisapi waits this long for a usable answer about the master
        # before the connection attempt fails and is retried; while the
        # Sentinels report it down (before the promotion) that is the
        # delay before relay asks again.
        self._sentinel.discovery_timeout = max(self.reconnectMaxDelay, 0.5)
        return self._sentinel.master_for(
            self.masterName,
            dbid=params["dbid"],
            poolsize=self.poolsize,
            isLazy=True,
            password=params["password"],
            username=params["username"],
            replyTimeout=self.replyTimeout,
            convertNumbers=False,
        )

    def endpoint(self):
        """
        A client endpoint to the Redis relay writes to now, for a
        connection of its own outside the pool (a pub/sub subscriber such
        as the control plane's change feed, L{relay.control.store.redis}):
        the URL's host (over TLS for C{rediss://}) or unix socket, or with
        C{sentinels} the master the Sentinels name at each connect (so a
        reconnect after a promotion reaches the new master).

        @return: an L{twisted.internet.interfaces.IStreamClientEndpoint}.
        @raise ValueError: for a URL L{parseRedisUrl} refuses.
        """
        from twisted.internet.endpoints import HostnameEndpoint, UNIXClientEndpoint, wrapClientTLS

        if self.sentinels:
            return _MasterEndpoint(self)
        target = parseRedisUrl(self.url)
        if target.path is not None:
            return UNIXClientEndpoint(self._clock, target.path, timeout=self.connectTimeout)
        endpoint = HostnameEndpoint(self._clock, target.host, target.port,
                                    timeout=self.connectTimeout)
        if target.tls:
            return wrapClientTLS(target.tlsOptions(), endpoint)
        return endpoint

    def _watchSwitches(self) -> None:
        """
        Subscribe to every Sentinel's C{+switch-master} channel: when the
        Sentinels promote a new master of L{masterName}, every pooled
        connection is dropped at once, so relay stops writing to the old
        master before it is demoted (or while it is cut off), and the next
        connection asks the Sentinels for the new one.
        """
        import txredisapi
        from twisted.internet.endpoints import HostnameEndpoint

        service = self

        class _SwitchWatch(txredisapi.SubscriberProtocol):
            def connectionMade(self):
                d = txredisapi.SubscriberProtocol.connectionMade(self)
                d.addCallback(lambda _: self.subscribe("+switch-master"))
                d.addErrback(lambda f: None)
                return d

            def messageReceived(self, pattern, channel, message):
                service._masterSwitched(message)

        for host, port in self.sentinels:
            factory = txredisapi.SubscriberFactory(isLazy=True)
            factory.protocol = _SwitchWatch
            factory.initialDelay = 0.1
            factory.maxDelay = self.reconnectMaxDelay
            factory.startConnecting(
                # The injected clock is the reactor in a running relay.
                HostnameEndpoint(self._clock, host, port, timeout=self.connectTimeout)
            )
            self._watchers.append(factory)

    def _masterSwitched(self, message) -> None:
        """
        A C{+switch-master} message: C{<name> <old ip> <old port> <new ip>
        <new port>}; the first message about a new master of ours drops
        the connections (the other Sentinels repeat it).
        """
        if isinstance(message, bytes):
            message = message.decode("utf-8", "replace")
        parts = str(message).split()
        if len(parts) != 5 or parts[0] != self.masterName:
            return
        new = (parts[3], parts[4])
        if new == self._switchedTo:
            return
        self._switchedTo = new
        self._log.warn(
            "sentinel promoted {new} (was {old}); moving relay's connections",
            event="relay.redis_master_switched",
            old=f"{parts[1]}:{parts[2]}",
            new=f"{parts[3]}:{parts[4]}",
        )
        self._dropConnections()
        for listener in list(self.switchListeners):
            try:
                listener()
            except Exception:  # noqa: BLE001 - logged; the others still run
                self._log.failure("a master switch listener failed")

    def stopService(self) -> Deferred:
        """
        Stop probing and disconnect the pool (and the Sentinel connections).

        @return: a L{Deferred} that fires when the connections are closed.
        """
        Service.stopService(self)
        if self._prober is not None and self._prober.running:
            self._prober.stop()
        # The pool's disconnection fails every command still waiting.
        self._directPath.stop()
        self._prober = None
        pool, self.pool = self.pool, None
        sentinel, self._sentinel = self._sentinel, None
        waits = []
        if pool is not None:
            waits.append(pool.disconnect().addErrback(lambda f: None))
        if sentinel is not None:
            waits.append(sentinel.disconnect().addErrback(lambda f: None))
        watchers, self._watchers = self._watchers, []
        for factory in watchers:
            waits.append(factory.disconnect().addErrback(lambda f: None))
        return defer.gatherResults(waits).addCallback(lambda _: None)

    # -- commands --------------------------------------------------------------

    def execute(self, timeout: float, method: str, *args: Any, **kwargs: Any) -> Deferred:
        """
        Run one pool command with a timeout on the injected clock (T16).

        @param timeout: seconds.
        @param method: a txredisapi method name, e.g. C{eval} or
            C{execute_command}.
        @return: a L{Deferred} with the reply; it fails with
            L{RedisUnavailable} on any Redis error (see L{isRedisFailure}),
            when the service is not running, and at once while Redis is
            unreachable (R101; see the module docstring).
        """
        self.commandCount += 1
        if self.pool is None:
            return defer.fail(RedisUnavailable(method, "redis service not running"))
        if self._state is False:
            return defer.fail(RedisUnavailable(method, "redis unreachable"))
        sentAt = self._clock.seconds()
        if not kwargs and (method == "execute_command" or (
                method == "eval" and args and isinstance(args[0], str))):
            conn = self._directPath.connection()
            if conn is not None:
                if method == "eval":
                    script, keys, scriptArgs = (tuple(args) + ((), ()))[:3]
                    command = ("EVALSHA", _scriptSha(script), len(keys), *keys, *scriptArgs)
                    return self._directPath.send(conn, timeout, method, sentAt, command,
                                                 (script, keys, scriptArgs))
                return self._directPath.send(conn, timeout, method, sentAt, args, None)
        try:
            if method == "eval" and args and isinstance(args[0], str):
                d = self._eval(*args, **kwargs)
            else:
                d = getattr(self.pool, method)(*args, **kwargs)
        except Exception as e:
            return defer.fail(RedisUnavailable(method, describe(e)))
        d.addTimeout(timeout, self._clock)
        return d.addCallbacks(self._cbReply, self._ebMap, errbackArgs=(method, sentAt))

    def _eval(self, script: str, keys=(), args=()) -> Deferred:
        """
        C{EVALSHA} with the script's SHA1 computed once per script text
        (txredisapi's C{eval} encodes and hashes the whole script
        on every call -- 11 KB for the shared batch script); a Redis that
        does not know the script (C{NOSCRIPT}: restarted, failed over,
        flushed) gets it with C{EVAL}, as txredisapi's C{eval} does.
        """
        sha = _scriptSha(script)
        pool = self.pool

        def noScript(f: Failure):
            from txredisapi import ScriptDoesNotExist

            f.trap(ScriptDoesNotExist)
            return pool.eval(script, keys, args)

        return pool.evalsha(sha, keys, args).addErrback(noScript)

    def _cbReply(self, reply):
        self._replied()
        return reply

    def _ebMap(self, f: Failure, method: str, sentAt: float) -> Failure:
        self._classify(f, sentAt)
        if isRedisFailure(f) and not f.check(RedisUnavailable):
            raise RedisUnavailable(method, describe(f))
        return f

    def executeDurable(self, timeout: float, command: tuple) -> Deferred:
        """
        Run one write command and, with L{durableReplicas}, C{WAIT} on the
        same connection (a pipeline) until that many replicas have it, for
        up to L{durableTimeout} seconds: a write acknowledged this way
        survives the master's death and a Sentinel promotion
        (used for OAuth token records, whose loss would mean reusing a
        rotated refresh token). Fewer replicas than asked is logged
        (C{relay.redis_write_not_replicated}), not an error: the write is on
        the master.

        @param timeout: seconds for the whole round trip (the C{WAIT}
            included).
        @param command: the raw command, e.g. C{("EVAL", script, 1, key,
            ...)}; scripts go as C{EVAL} (no C{EVALSHA} fallback inside a
            pipeline).
        @return: a L{Deferred} with the command's reply; failures as
            L{execute}.
        """
        if not self.durableReplicas:
            return self.execute(timeout, "execute_command", *command)
        self.commandCount += 1
        if self.pool is None:
            return defer.fail(RedisUnavailable(command[0], "redis service not running"))
        if self._state is False:
            return defer.fail(RedisUnavailable(command[0], "redis unreachable"))
        sentAt = self._clock.seconds()
        waitMs = max(1, int(self.durableTimeout * 1000))
        replicas = self.durableReplicas

        async def run():
            pipe = await self.pool.pipeline()
            # Each reply is taken before txredisapi's execute_pipeline sees
            # it: its DeferredList consumes errors, so an error reply
            # (READONLY from a demoted master, a script error) or the
            # connection's loss would otherwise reach us as the value None
            # -- a write that never happened reported as done.
            reply = _ownOutcome(pipe.execute_command(*command))
            acked = _ownOutcome(pipe.execute_command("WAIT", replicas, waitMs))
            pipe.execute_pipeline().addErrback(lambda f: None)
            try:
                value = await reply
            except BaseException:
                acked.addErrback(lambda f: None)
                raise
            count = await acked
            if int(count or 0) < replicas:
                self._log.warn(
                    "a durable write reached {acked} of {replicas} replica(s) within {ms} ms",
                    event="relay.redis_write_not_replicated",
                    acked=int(count or 0), replicas=replicas, ms=waitMs,
                )
            return value

        d = Deferred.fromCoroutine(run())
        d.addTimeout(timeout + self.durableTimeout, self._clock)
        return d.addCallbacks(self._cbReply, self._ebMap, errbackArgs=(command[0], sentAt))


@define(eq=False, repr=False)
class _DirectPath:
    """
    The direct path of L{RedisService.execute}: a command written
    straight on a ready pooled connection, its reply taken from the
    connection's reply queue, under one deadline watch for all commands.

    @ivar _service: the L{RedisService}: its pool and what it learns from
        replies and failures (R101 reachability).
    @ivar _clock: the injected clock (seconds).
    @ivar _turn: the index of the ready connection used last.
    @ivar _watched: L{send}'s commands waiting for a reply: timeout
        (seconds) -> a deque of C{(deadline, result, connection, ...)} in
        sending order.
    @ivar _watch: the delayed call of L{_watchTick}, or L{None}.
    """

    _service: RedisService
    _clock: IReactorTime
    _turn: int = field(default=0, init=False)
    _watched: dict = field(factory=dict, init=False)
    _watch: Optional[Any] = field(default=None, init=False)

    def stop(self) -> None:
        """
        Forget the commands waiting (the pool's disconnection fails them).
        """
        if self._watch is not None and self._watch.active():
            self._watch.cancel()
        self._watch = None
        self._watched = {}

    def send(self, conn, timeout: float, method: str, sentAt: float, command: tuple,
             script: Optional[tuple]) -> Deferred:
        """
        One command written on C{conn} (a ready pooled connection,
        L{connection}) and its reply taken from the connection's reply
        queue, as txredisapi's C{execute_command} does, with one timer for
        both timeouts (txredisapi's path costs about six
        L{Deferred}s and two delayed calls per command). Same outcomes as
        the pool path of L{RedisService.execute}:

          - a reply marks Redis reachable and fires the result; an error
            reply (or the connection's loss) fails it with
            L{RedisUnavailable} after L{RedisService._classify};
          - C{NOSCRIPT} to an C{EVALSHA} (C{script} is C{(text, keys,
            args)}) runs the script with C{EVAL} through the pool;
          - no reply within C{timeout} seconds fails it with a
            L{defer.TimeoutError}'s L{RedisUnavailable}; when the
            connection's own reply timeout (txredisapi's C{replyTimeout})
            is not longer than C{timeout}, it comes first, as with
            txredisapi: the commands waiting on that connection fail and
            the connection is dropped (and redialled);
          - cancelling the result fails it with L{RedisUnavailable}.
        """
        try:
            payload = conn._build_command(*command)
        except Exception as e:  # noqa: BLE001 - as the pool path: a RedisUnavailable
            return defer.fail(RedisUnavailable(method, describe(e)))

        def cancel(d: Deferred) -> None:
            d.errback(RedisUnavailable(method, describe(defer.CancelledError())))

        d = Deferred(cancel)
        waiter = conn.replyQueue.get()
        # Sent at once when nothing is queued on the connection (a
        # FileDescriptor.write costs two epoll_ctl calls and a reactor
        # iteration per command; the bytes' order stays the connection's).
        sendNow(conn.transport, payload)
        limit = conn.replyTimeout
        silent = bool(limit) and limit <= timeout
        delay = limit if silent else timeout
        queue = self._watched.get(delay)
        if queue is None:
            queue = self._watched[delay] = deque()
        queue.append((sentAt + delay, d, conn, timeout, method, sentAt, silent))
        watch = self._watch
        if watch is None:
            self._watch = self._clock.callLater(delay, self._watchTick)
        elif sentAt + delay < watch.getTime():
            watch.reset(delay)
        waiter.addCallback(self._directReply, d, queue, timeout, method, sentAt, script)
        return d

    def _watchTick(self) -> None:
        """
        The deadline watch of L{send}'s commands (one delayed
        call for all of them, not one each). Each queue holds the commands
        of one timeout in the order they were sent, so in deadline order:
        answered ones are dropped from its head, expired ones fail
        (L{_directTimeout}), and the watch is set again for the earliest
        deadline left.
        """
        self._watch = None
        now = self._clock.seconds()
        earliest = None
        for delay, queue in list(self._watched.items()):
            while queue:
                entry = queue[0]
                if entry[1].called:
                    queue.popleft()
                elif entry[0] <= now:
                    queue.popleft()
                    self._directTimeout(*entry[1:])
                else:
                    break
            if queue:
                if earliest is None or queue[0][0] < earliest:
                    earliest = queue[0][0]
            elif self._watched.get(delay) is queue:
                del self._watched[delay]
        if earliest is not None:
            if self._watch is None:
                self._watch = self._clock.callLater(max(earliest - now, 0), self._watchTick)
            elif earliest < self._watch.getTime():
                self._watch.reset(max(earliest - now, 0))

    def _directReply(self, reply, d: Deferred, queue: deque, timeout: float, method: str,
                     sentAt: float, script: Optional[tuple]) -> None:
        """
        L{send}'s reply (or the exception txredisapi queued for it).
        """
        if not d.called:
            self._directAnswer(reply, d, timeout, method, sentAt, script)
        # Answered commands leave the head of their watch queue (replies
        # come in the order of the commands, mostly).
        while queue and queue[0][1].called:
            queue.popleft()

    def _directAnswer(self, reply, d: Deferred, timeout: float, method: str,
                      sentAt: float, script: Optional[tuple]) -> None:
        """
        Fire L{send}'s result with its reply.
        """
        if not isinstance(reply, Exception):
            self._service._replied()
            d.callback(reply)
            return
        import txredisapi

        if (script is not None and isinstance(reply, txredisapi.ResponseError)
                and str(reply).startswith("NOSCRIPT")):
            remaining = max(sentAt + timeout - self._clock.seconds(), 0.001)
            retry = self._service.pool.eval(*script)
            retry.addTimeout(remaining, self._clock)
            retry.addCallbacks(self._service._cbReply, self._service._ebMap,
                               errbackArgs=(method, sentAt))

            def _pass(result) -> None:
                if not d.called:
                    if isinstance(result, Failure):
                        d.errback(result)
                    else:
                        d.callback(result)

            retry.addBoth(_pass)
            return
        f = Failure(reply)
        self._service._classify(f, sentAt)
        d.errback(RedisUnavailable(method, describe(f)) if isRedisFailure(f) else f)

    def _directTimeout(self, d: Deferred, conn, timeout: float, method: str, sentAt: float,
                       silent: bool) -> None:
        """
        No reply in time to a command of L{send}.
        """
        if d.called:
            return
        if silent:
            import txredisapi

            text = f"Not received Redis response in {conn.replyTimeout} seconds"
            error = txredisapi.TimeoutError(text)
            f = Failure(error)
            self._service._classify(f, sentAt)
            d.errback(RedisUnavailable(method, describe(f)))
            while conn.replyQueue.waiting:
                conn.replyQueue.put(txredisapi.TimeoutError(text))
            if conn.transport is not None:
                conn.transport.abortConnection()
            return
        f = Failure(defer.TimeoutError(timeout, "Deferred"))
        self._service._classify(f, sentAt)
        d.errback(RedisUnavailable(method, describe(f)))

    def connection(self):
        """
        A ready pooled connection for a non-blocking command, taken
        directly (txredisapi's pool handler builds a closure and
        runs C{getConnection}, an C{inlineCallbacks} generator, for every
        command), or L{None} when none is ready: the caller goes through
        the pool handler, which waits for one (or fails) as before. Like
        the handler's C{peek}, the connection stays in the pool; they are
        taken in turn instead of at random.
        """
        queue = getattr(getattr(self._service.pool, "_factory", None), "connectionQueue", None)
        ready = getattr(queue, "pending", None)
        if not ready:
            return None
        self._turn = turn = (self._turn + 1) % len(ready)
        conn = ready[turn]
        return conn if conn.connected else None


def _ownOutcome(d: Deferred) -> Deferred:
    """
    A L{Deferred} with C{d}'s outcome (its value or its failure), while
    C{d} itself goes on with C{None}: for a pipelined command's reply,
    which txredisapi's C{execute_pipeline} also waits on with a
    C{DeferredList(consumeErrors=True)} that turns any later failure into
    C{None} (see L{RedisService.executeDurable}).
    """
    mine = Deferred()

    def take(result):
        mine.callback(result)  # a Failure runs mine's errbacks
        return None

    d.addBoth(take)
    return mine


_FAST_PROTOCOLS: dict = {}


def _fastProtocol(base: type) -> type:
    """
    C{base} (a txredisapi protocol class) with L{_buildCommand} and
    L{_convertReply} in place of txredisapi's C{_build_command} and
    C{tryConvertData} (those run Python code per argument and
    per reply element -- an C{isinstance} chain, a C{bytearray} extended
    three times per argument -- for every command of a turn). The same
    bytes go out and the same values come back: both fall back to
    txredisapi's own for anything but its default codec (UTF-8, strict,
    C{convertNumbers=False}, which L{RedisService} uses). A Sentinel
    protocol also gets L{_sentinelConnectionMade} (its role check with its
    failures handled).
    """
    fast = _FAST_PROTOCOLS.get(base)
    if fast is None:
        from txredisapi import SentinelRedisProtocol

        methods = {"_build_command": _buildCommand, "tryConvertData": _convertReply,
                   "__module__": __name__}
        if issubclass(base, SentinelRedisProtocol):
            methods["connectionMade"] = _sentinelConnectionMade
        fast = _FAST_PROTOCOLS[base] = type("Fast" + base.__name__, (base,), methods)
    return fast


def _sentinelConnectionMade(self) -> Deferred:
    """
    txredisapi's C{SentinelRedisProtocol.connectionMade} -- C{ROLE} on
    every new connection to the master the Sentinels named, and the
    connection dropped unless it answers C{master} -- with its failures
    handled: txredisapi leaves the C{ROLE} (and C{AUTH}) L{Deferred}s
    without an errback, so a connection lost before the reply (the master
    killed or cut off during a failover) logged an "Unhandled error in
    Deferred" traceback. A failed check drops the connection, which the
    factory redials (asking the Sentinels again); it never becomes ready,
    so no command is written to it.
    """
    from txredisapi import RedisProtocol

    def checkRole(role):
        if self.factory.is_master and (not role or role[0] != "master"):
            self.transport.loseConnection()
            return None
        return RedisProtocol.connectionMade(self)

    def failed(f: Failure) -> None:
        transport = self.transport
        if transport is not None:
            transport.loseConnection()

    if self.password is not None:
        # RedisProtocol.connectionMade sends AUTH again and acts on its reply.
        self.auth(self.password, self.username).addErrback(lambda f: None)
    return self.role().addCallback(checkRole).addErrback(failed)


def _buildCommand(self, *args, **kwargs) -> bytes:
    """
    txredisapi's C{_build_command}: one RESP array of bulk strings.
    """
    if self.charset != "utf-8" or self.errors != "strict":
        return _txredisapi().BaseRedisProtocol._build_command(self, *args, **kwargs)
    out = [b"*%d\r\n" % len(args)]
    append = out.append
    try:
        for value in args:
            kind = type(value)
            if kind is str:
                value = value.encode()
            elif kind is int:
                value = b"%d" % value
            elif kind is not bytes:
                value = self._encode_value(value)
            append(b"$%d\r\n%s\r\n" % (len(value), value))
    except UnicodeEncodeError:
        # txredisapi's InvalidData, with its message
        return _txredisapi().BaseRedisProtocol._build_command(self, *args, **kwargs)
    return b"".join(out)


def _convertReply(self, data):
    """
    txredisapi's C{tryConvertData} without number conversion: bytes
    decoded as UTF-8 (kept as bytes when they are not UTF-8), lists
    converted element by element, anything else as it is.
    """
    if self.convertNumbers or self.charset != "utf-8":
        return _txredisapi().BaseRedisProtocol.tryConvertData(self, data)
    return _decode(data)


def _txredisapi():
    import txredisapi

    return txredisapi


def _decode(data):
    kind = type(data)
    if kind is bytes:
        try:
            return data.decode()
        except UnicodeDecodeError:
            return data
    if kind is list:
        try:
            return [x.decode() if type(x) is bytes else _decode(x) if type(x) is list else x
                    for x in data]
        except UnicodeDecodeError:
            return [_decode(x) for x in data]
    return data


class _MasterEndpoint:
    """
    A client endpoint that asks the Sentinels of a L{RedisService} for the
    current master's address at every connect (L{RedisService.endpoint}).
    """

    def __init__(self, service: RedisService):
        self._service = service

    def connect(self, factory):
        """
        @return: a Deferred firing with the connected protocol, or failing
            when no Sentinel names a master (the caller retries).
        """
        from twisted.internet.endpoints import HostnameEndpoint

        service = self._service
        sentinel = service._sentinel
        if sentinel is None:
            return defer.fail(RedisUnavailable("connect", "the Redis client is not running"))
        d = sentinel.discover_master(service.masterName)
        d.addCallback(lambda address: HostnameEndpoint(
            service._clock, address[0], int(address[1]), timeout=service.connectTimeout,
        ).connect(factory))
        return d
