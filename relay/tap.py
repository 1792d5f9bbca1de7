# -*- test-case-name: tests.test_tap -*-
"""
The twistd plugin's C{Options} and C{makeService}: C{twistd -n relay
--config FILE}. The only module in relay that imports the global reactor
(lazily, in L{makeService}).

House rule: a bad configuration is one line on standard error, naming the
key, and exit status 2 -- no usage text, no traceback, under both
C{twistd -n relay} and C{python -m twisted relay}. Both runners print
their whole usage text for a L{usage.UsageError} (and twistd a traceback for
anything L{makeService} raises), so configuration problems never travel as
L{usage.UsageError}: L{Options.configure} raises L{ConfigError} (the
programmatic layer), and L{Options.postOptions} turns it into
L{exitWithConfigError}. A bad command-line flag (an unknown option, a bad
C{--log-format}) stays a L{usage.UsageError} with the usage text.
"""

from __future__ import annotations

import os
import signal

from twisted.application.service import Service
from twisted.logger import Logger
from twisted.python import usage

from relay.configuration.check import (  # noqa: F401 - their home is relay.configuration.check
    CONFIG_ERROR_EXIT,
    CONFIG_ERROR_PREFIX,
    checkComponents,
    exitWithConfigError,
)
from relay.base.records import ConfigError

_LOG_FORMATS = ("text", "json")

TWISTD_DEFAULT_PIDFILE = "twistd.pid"
"""twistd's own default C{--pidfile}."""


def ownPidfile(options: usage.Options, name: str) -> None:
    """
    Give a twistd plugin its own default pid file, C{<name>.pid}, instead
    of twistd's C{twistd.pid}, so C{twistd -n relay} and C{twistd -n
    relay-emulator} started side by side from one directory do not refuse
    each other ("Another twistd server is running"). A
    C{--pidfile} given on the command line (other than C{twistd.pid}
    itself) is kept, and C{--pidfile=} still means none. Runs in the
    plugin's C{postOptions}, before twistd resolves the path; does nothing
    under C{twist} (C{python -m twisted}), which writes no pid file.

    @param options: the plugin's options (its C{parent} is twistd's).
    @param name: the plugin's name, e.g. C{relay}.
    """
    parent = getattr(options, "parent", None)
    if parent is not None and parent.get("pidfile") == TWISTD_DEFAULT_PIDFILE:
        parent["pidfile"] = name + ".pid"


def removeOwnPidfile(path) -> None:
    """
    Remove the pid file twistd wrote for this process, when relay exits
    before the reactor runs (a C{listen} port in use): twistd removes it
    only for an L{Exception}, and the one-line exit is a L{SystemExit}. A
    file holding another process's pid (or none) is left alone.

    @param path: the pid file's path (twistd's C{--pidfile}), or L{None}.
    """
    if not path:
        return
    try:
        with open(path) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return
    if pid == os.getpid():
        try:
            os.unlink(path)
        except OSError:
            pass


class Options(usage.Options):
    """
    C{twistd relay} options.

    @ivar config: the parsed L{relay.base.records.RelayConfig}, after parsing.
    """

    optParameters = [
        ["config", "c", "/etc/relay/relay.yaml", "The relay configuration file (YAML)."],
        ["listen", "l", None, "A Twisted endpoint string overriding the config's listen."],
        ["log-format", None, None, "text or json (one JSON object per line); overrides log.format."],
        ["workers", "w", None, "Worker processes sharing the listen port; overrides workers:."],
    ]

    def postOptions(self) -> None:
        """
        Parse the configuration once, into C{self.config}. A bad
        configuration is one line on standard error and exit status 2
        (L{exitWithConfigError}); a bad C{--log-format} is a
        L{usage.UsageError}.

        @raise SystemExit: for a configuration problem.
        """
        fmt = self["log-format"]
        if fmt is not None and fmt not in _LOG_FORMATS:
            raise usage.UsageError(f"--log-format: expected text or json, got {fmt!r}")
        ownPidfile(self, "relay")
        try:
            self.configure()
        except ConfigError as e:
            exitWithConfigError(str(e))

    def configure(self) -> None:
        """
        The programmatic layer of L{postOptions}: load and check the
        configuration named by C{self["config"]} into C{self.config},
        register its secrets for redaction and hand the runner a redacting
        log observer.

        @raise ConfigError: with a one-line message naming the key.
        """
        from attrs import evolve

        from relay.configuration.parse import checkDatabase, loadConfig, secretsOf
        from relay.base.logs import registerSecrets

        try:
            config = loadConfig(self["config"])
        except OSError as e:
            raise ConfigError(f"cannot read config {self['config']}: {e.strerror or e}")
        if self["listen"]:
            config = evolve(config, listen=self["listen"])
        if self["workers"] is not None:
            try:
                workers = int(self["workers"])
            except ValueError:
                workers = 0
            if not 1 <= workers <= 64:
                raise ConfigError(f"workers: --workers must be between 1 and 64, got {self['workers']!r}")
            config = evolve(config, workers=workers)
        from relay.configuration.parse import checkWorkers
        from relay.process.workers import workerIndex

        checkWorkers(config)
        self.worker = workerIndex()
        if self.worker is not None:
            # A worker started by the supervisor serves; it does
            # not supervise.
            config = evolve(config, workers=1)
        fmt = self["log-format"] or config.log_format
        checkComponents(config)
        checkDatabase(config)
        self.config = config
        registerSecrets(secretsOf(config))
        parent = getattr(self, "parent", None)
        if parent is not None and "fileLogObserverFactory" in parent:
            # twist (python -m twisted relay ...) builds its observer with
            # this factory on its --log-file (stdout by default).
            parent["fileLogObserverFactory"] = lambda stream: _batchedObserver(
                fmt, stream, parent.get("logLevel"))
        elif parent is not None and not parent.get("logger"):
            # twistd builds its logger after parsing options; hand it ours so
            # every line is redacted, and JSON when asked. twistd's own
            # postOptions runs after ours and resolves --logger with namedAny,
            # so this must be a dotted name, not a callable.
            parent["logger"] = f"relay.base.logs.{fmt}Stdout"


def _batchedObserver(fmt: str, stream, level=None):
    """
    The observer for twist, writing the lines of one reactor iteration
    together (L{relay.base.logs.BatchedFileLogObserver}); what is held is
    written at shutdown and at exit. Called once twist installed the
    reactor. With twist's C{level} (its C{--log-level}), the level filter
    twist puts in front of it is replaced, once the reactor runs, by the
    equivalent L{relay.base.logs.LevelFilter}, which checks a line's level
    without parsing its namespace.
    """
    import atexit

    from twisted.internet import reactor
    from twisted.logger import globalLogPublisher

    from relay.base.logs import leanLevelFilter, observerFor

    observer = observerFor(fmt, stream, schedule=lambda f: reactor.callLater(0, f))
    reactor.addSystemEventTrigger("after", "shutdown", observer.flushLines)
    atexit.register(observer.flushLines)
    if level is not None:
        reactor.callWhenRunning(leanLevelFilter, globalLogPublisher, observer, level)
    return observer


SUPERVISOR_GRACE_MARGIN_SECONDS = 10.0
"""How much longer than a worker's C{gateway.shutdown_grace_seconds} the
supervisor waits for it after C{SIGTERM} before it sends C{SIGKILL}."""


def _supervisor(options: Options, reactor):
    """
    The service of a C{workers: N} supervisor
    (L{relay.process.workers}): the listen address reserved now (a port in use is
    a one-line error naming C{listen}), N workers started with the
    service, C{SIGHUP} forwarded to them
    (L{relay.process.workers.WorkerSupervisor.reloadWorkers}).
    """
    from twisted.application.service import MultiService
    from twisted.internet.error import CannotListenError

    from relay.process.workers import WorkerSupervisor, reserveAddress, workerArgv

    config = options.config
    try:
        reserved, listen = reserveAddress(config.listen)
    except CannotListenError as e:
        reason = getattr(e.socketError, "strerror", None) or str(e.socketError)
        exitWithConfigError(f"listen: cannot listen on {config.listen}: {reason}")
    top = MultiService()
    supervisor = WorkerSupervisor(
        reactor=reactor,
        count=config.workers,
        argv=workerArgv(options["config"], listen, options["log-format"]),
        reserved=reserved,
        # Each worker drains for up to its grace; the supervisor
        # waits that long (and a little more) before it kills one.
        grace=config.gateway.shutdown_grace_seconds + SUPERVISOR_GRACE_MARGIN_SECONDS,
    )
    # SIGHUP (kill -HUP <supervisor pid>) reloads every worker; without a
    # handler its default action would kill the supervisor and so the
    # service. Installed before the workers start.
    ReloadOnHangup(supervisor.reloadWorkers, reactor).setServiceParent(top)
    supervisor.setServiceParent(top)
    CleanExitOnTerm(reactor).setServiceParent(top)
    top.relaySupervisor = supervisor
    return top


def globalReactor():
    """
    The global reactor, for the twistd C{makeService} functions only (the
    relay's and the emulator's): the one place in relay that imports it
    (architecture.md invariant 2).
    """
    from twisted.internet import reactor

    return reactor


class ReloadOnHangup(Service):
    """
    C{SIGHUP} reloads the configuration
    (L{relay.process.reload}). Signal handling lives here, at the edge
    where the service starts: the handler is installed when the service
    starts and the previous one restored when it stops. The handler only
    schedules the reload on the reactor thread (C{callFromThread}, as
    Twisted's own signal handlers do); the reload runs there.

    @ivar reload: C{reload(source)}, e.g. L{relay.process.reload.ConfigReloader.reload},
        or a supervisor's L{relay.process.workers.WorkerSupervisor.reloadWorkers}.
    """

    _log = Logger()

    def __init__(self, reload, reactor):
        """
        @param reload: called with C{"sighup"} on the reactor thread.
        @param reactor: the reactor to schedule it on.
        """
        self.reload = reload
        self._reactor = reactor
        self._previous = None

    def startService(self) -> None:
        """
        Install the C{SIGHUP} handler (where the platform has one).
        """
        super().startService()
        if hasattr(signal, "SIGHUP"):
            self._previous = signal.signal(signal.SIGHUP, self._onSignal)

    def stopService(self):
        """
        Stop reloading: from here to the process's exit (the drain, up to
        C{shutdown_grace_seconds}) a C{SIGHUP} is logged and ignored. The
        previous handler is not restored: the default action would kill
        the process (and a supervisor's workers) in the middle of the drain.
        """
        super().stopService()
        if self._previous is not None:
            signal.signal(signal.SIGHUP, self._onSignalWhileStopping)
            self._previous = None

    def _onSignal(self, signum, frame) -> None:
        """
        The signal handler: hand the reload to the reactor thread.
        """
        self._reactor.callFromThread(self._reloadNow)

    def _onSignalWhileStopping(self, signum, frame) -> None:
        """
        The signal handler once stopping: say so on the reactor thread.
        """
        self._reactor.callFromThread(self._logIgnored)

    def _logIgnored(self) -> None:
        self._log.info(
            "SIGHUP ignored: relay is stopping",
            event="relay.config_reload_ignored",
            source="sighup",
        )

    def _reloadNow(self) -> None:
        """
        Run the reload; its outcome is logged by the reloader.
        """
        try:
            self.reload("sighup")
        except Exception:  # noqa: BLE001 - logged; the process stays up
            self._log.failure("reload on SIGHUP failed", event="relay.config_reload_failed")


class CleanExitOnTerm(Service):
    """
    C{SIGTERM} is relay's normal stop: once the service has
    drained, the process exits with status 0. Since Twisted 22 twistd and
    twist re-raise the signal that stopped the reactor after it stops (the
    reactor's private C{_exitSignal}), so the exit status would say
    "killed by SIGTERM"; this service, stopped after the drain, forgets a
    C{SIGTERM} there. Any other signal (e.g. C{SIGINT}) keeps twistd's
    behaviour.
    """

    def __init__(self, reactor):
        """
        @param reactor: the reactor twistd runs.
        """
        self._reactor = reactor

    def stopService(self):
        """
        The drain is over: a C{SIGTERM} stop exits 0.
        """
        super().stopService()
        if getattr(self._reactor, "_exitSignal", None) == getattr(signal, "SIGTERM", None):
            self._reactor._exitSignal = None


SETTLE_AFTER_SECONDS = 2.0
"""How long after the service starts L{SettleMemory} tidies the heap: the
start-up gate (keys, control plane) has read by then on a healthy host;
a later read only leaves a little garbage behind."""


def settleMemory() -> dict:
    """
    Give back what start-up left behind (RSS at c=128 <= 64 MiB):
    a full collection; the source lines attrs keeps in C{linecache} for
    the methods it generated (a traceback through one reads the file
    again, or shows no line); then glibc's C{malloc_trim(0)}, which returns
    the free pages of the heap to the system (no-op where libc is not
    glibc).

    @return: C{{"collected": objects freed}}, for tests and logs.
    """
    import ctypes
    import ctypes.util
    import gc
    import linecache

    collected = gc.collect()
    linecache.clearcache()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        pass
    else:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)
    return {"collected": collected}


YOUNG_GC_THRESHOLD = 10_000
"""The collector's first threshold after start-up (CPython's default is
700): how many more container objects may be allocated than freed since
the last young collection before the next one runs. Thirty-two turns in flight
keep more than 700 young objects alive at once, so with the default a
young collection ran every few hundred allocations and re-scanned them,
and the survivors it promoted set off full collections: 8 % of relay's
CPU at c=32 JSON (bench/results/2026-12-02-issue24-gc.md). Objects not in
a cycle are freed by reference counting whatever the threshold (a relayed
turn leaves none in a cycle); what is left in cycles (a failure's
traceback, a replaced connection's objects) waits longer for its
collection: on a quiet process, until this many more objects have been
allocated than freed."""


def settleProcess() -> dict:
    """
    What L{SettleMemory} runs once start-up is over: L{settleMemory}, then
    C{gc.freeze()} -- the objects start-up left alive (modules, classes,
    the config, the resource tree) move to the collector's permanent
    generation, so a full collection no longer walks ~90,000 objects that
    live as long as the process -- and the first threshold raised to
    L{YOUNG_GC_THRESHOLD}, the later ones kept (CPU per turn at
    load). The process-wide tuning is here, where the plugin owns the
    process, not in relay's modules.

    @return: L{settleMemory}'s C{{"collected": n}} plus C{"frozen"}, the
        objects now in the permanent generation.
    """
    import gc

    result = settleMemory()
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])
    result["frozen"] = gc.get_freeze_count()
    return result


class SettleMemory(Service):
    """
    Runs L{settleProcess} once, L{SETTLE_AFTER_SECONDS} after the service
    starts (the place that builds the process tidies it, as the plugin
    owns the process; relay's modules hold no global reactor).
    """

    def __init__(self, reactor, settle=settleProcess, delay=SETTLE_AFTER_SECONDS):
        self._reactor = reactor
        self._settle = settle
        self._delay = delay
        self._call = None

    def startService(self) -> None:
        super().startService()
        self._call = self._reactor.callLater(self._delay, self._run)

    def _run(self) -> None:
        self._call = None
        self._settle()

    def stopService(self):
        super().stopService()
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None


def makeService(options: Options, reactor=None):
    """
    Build the relay service.

    @param options: parsed L{Options}.
    @param reactor: the reactor; the global one when L{None}
        (coding-standard idiom).
    @return: a L{twisted.application.service.MultiService}.
    @raise SystemExit: when a component named in C{components:} cannot be
        built (one line on standard error, L{exitWithConfigError}). The
        service exits the same way when C{listen} cannot be listened on,
        except under a daemonising twistd.
    """
    if reactor is None:
        reactor = globalReactor()
    if options.config.workers > 1:
        return _supervisor(options, reactor)
    from relay.process.app import buildService

    worker = getattr(options, "worker", None)
    edgeServices = [
        lambda app: ReloadOnHangup(app.reloader.reload, reactor),
        lambda app: CleanExitOnTerm(reactor),
        lambda app: SettleMemory(reactor),
    ]
    if worker is not None:
        from relay.process.workers import SupervisorChannel, supervisorChannel

        channel = supervisorChannel()
        if channel is not None:
            # After the SIGHUP handler: "ready" means a SIGHUP is safe.
            edgeServices.append(lambda app: SupervisorChannel(fd=channel, reloader=app.reloader))
    try:
        service = buildService(
            options.config, reactor,
            configPath=options["config"], listenOverride=options["listen"],
            edgeServices=edgeServices,
            reusePort=worker is not None,
        )
    except ConfigError as e:
        exitWithConfigError(str(e))
    if worker is not None:
        from relay.process.workers import dieWithParent

        dieWithParent()
    parent = getattr(options, "parent", None)
    if parent is not None and "nodaemon" in parent and not parent["nodaemon"]:
        # A daemonising twistd: its parent process waits on a status pipe
        # that only an exception from startApplication writes (a SystemExit
        # would leave it waiting forever), and the daemon's stderr is
        # /dev/null. Let a CannotListenError propagate there.
        service.relayListener.exitOnError = False
    elif parent is not None and parent.get("pidfile"):
        # twistd -n writes its pid file before it starts the service.
        pidfile = parent["pidfile"]
        service.relayListener.beforeExit = lambda: removeOwnPidfile(pidfile)
    return service
