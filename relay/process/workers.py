# -*- test-case-name: tests.test_workers -*-
"""
Worker processes across cores (config.md C{workers}).

With C{workers: N} (N > 1) the process started by C{twistd relay} /
C{python -m twisted relay} becomes a supervisor: it reserves the listening
address, then runs N workers -- each a whole relay (C{python -m twisted
relay} with the same configuration file and C{RELAY_WORKER} set in its
environment) listening on that one address with C{SO_REUSEPORT}, so the
kernel spreads new connections across them. Every slot, wait, binding,
cooldown, token and setting is shared through Redis (C{state.backend:
redis} is required; L{relay.configuration.parse.checkWorkers}).

The supervisor restarts a worker that exits while it runs (after a delay
that grows while workers keep dying young), and on stop sends each worker
C{SIGTERM}, waits for all of them (up to L{STOP_GRACE_SECONDS}, then
C{SIGKILL}), and exits. Workers inherit its standard output and error, so
their log lines go where its own go. A worker whose supervisor dies gets
C{SIGTERM} from the kernel (Linux C{PR_SET_PDEATHSIG}).

C{SIGHUP} to the supervisor (L{WorkerSupervisor.reloadWorkers}, installed
by L{relay.tap}) is forwarded to every running worker, and each reloads the
configuration file (L{relay.process.reload}); the supervisor itself
stays up. A worker waiting to be restarted gets nothing: it starts with the
file as it then is.

Metrics across workers: the supervisor runs its workers with
prometheus_client's multiprocess directory, C{PROMETHEUS_MULTIPROC_DIR}
(L{MetricsDirectory}): its own temporary directory, removed when it stops,
or the operator's (emptied of old files when the supervisor starts). A
scrape answered by any worker reports the whole group
(L{relay.console.metrics}); a worker that exits is marked dead there.

Each worker also has a channel to its supervisor: a pipe on the worker's
file descriptor L{CHANNEL_FD}, named in its environment by
L{SUPERVISOR_FD_ENV} (L{SupervisorChannel} is the worker's end). A worker
says C{ready} once its own C{SIGHUP} handler is installed -- until then
the signal's default action would kill it, so a C{SIGHUP} meant for a
worker still starting is held and sent when it is ready -- and
C{reloaded} after a reload asked of it through C{POST /admin/reload}
applied, so that the supervisor has the other workers reload the same
file (a failed reload is not forwarded). Nothing is ever signalled to a
worker's parent: a process started without the channel is not
supervised.
"""

from __future__ import annotations

import os
import socket
import stat
import sys

from attrs import define, field
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IStreamServerEndpoint
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from zope.interface import implementer

from relay.base.logs import WORKER_ENV, workerIndex

SUPERVISOR_FD_ENV = "RELAY_SUPERVISOR_FD"
"""Set in a worker's environment by the supervisor: the file descriptor of
the worker's end of its channel to the supervisor (L{CHANNEL_FD})."""

CHANNEL_FD = 3
"""The worker's file descriptor of the pipe its supervisor reads."""

SUPERVISOR_PID_ENV = "RELAY_SUPERVISOR_PID"
"""Set in a worker's environment by the supervisor: the supervisor's pid, so
that L{dieWithParent} can tell "my supervisor died" from "my supervisor is
pid 1" (the entrypoint of a container)."""

MESSAGE_READY = b"ready"
"""A worker's message: its C{SIGHUP} handler is installed."""

MESSAGE_RELOADED = b"reloaded"
"""A worker's message: a C{POST /admin/reload} applied; reload the others."""

_MAX_MESSAGE = 256
"""Longer unterminated channel input is dropped (not our protocol)."""

STOP_GRACE_SECONDS = 30.0
"""How long a stopping supervisor waits for its workers before SIGKILL."""

RESTART_DELAY_SECONDS = 0.5
"""The first restart delay; it doubles (up to L{MAX_RESTART_DELAY_SECONDS})
while workers die within L{HEALTHY_SECONDS} of their start."""

MAX_RESTART_DELAY_SECONDS = 30.0

HEALTHY_SECONDS = 10.0
"""A worker that ran this long resets the restart delay."""


@define(eq=False)
class MetricsDirectory:
    """
    The workers' prometheus_client multiprocess directory.

    @ivar path: the directory, once L{prepare}d.
    @ivar owned: whether the supervisor made it (and removes it).
    """

    path: str | None = None
    owned: bool = False

    def prepare(self, environ: dict) -> str:
        """
        Use C{environ}'s C{PROMETHEUS_MULTIPROC_DIR} (its old C{*.db} files
        removed: prometheus_client wants it empty at start) or make a
        temporary directory, and put it in C{environ} for the workers.

        @return: the directory.
        """
        from relay.console.metrics import MULTIPROCESS_ENV

        given = environ.get(MULTIPROCESS_ENV)
        if given:
            os.makedirs(given, exist_ok=True)
            for name in os.listdir(given):
                if name.endswith(".db"):
                    try:
                        os.unlink(os.path.join(given, name))
                    except OSError:
                        pass
            self.path, self.owned = given, False
        else:
            import tempfile

            self.path, self.owned = tempfile.mkdtemp(prefix="relay-metrics-"), True
        environ[MULTIPROCESS_ENV] = self.path
        return self.path

    def processDead(self, pid: int) -> None:
        """
        A worker exited: its live gauges go (prometheus_client's
        C{mark_process_dead}); its counters stay in the sums.
        """
        if self.path is None:
            return
        try:
            from prometheus_client.multiprocess import mark_process_dead

            mark_process_dead(pid, self.path)
        except Exception:  # noqa: BLE001 - best effort
            pass

    def remove(self) -> None:
        """
        Remove the directory if the supervisor made it.
        """
        if self.owned and self.path is not None:
            import shutil

            shutil.rmtree(self.path, ignore_errors=True)
        self.path = None


def supervisorChannel(environ=os.environ) -> int | None:
    """
    This worker's end of its channel to the supervisor, when the
    supervisor started it: L{WORKER_ENV} and L{SUPERVISOR_FD_ENV} are set
    and the descriptor named is a pipe.

    @return: the file descriptor, or L{None} (not supervised).
    """
    if workerIndex(environ) is None:
        return None
    value = environ.get(SUPERVISOR_FD_ENV)
    if value is None or not value.isdigit():
        return None
    fd = int(value)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
    except OSError:
        return None
    return fd


@define(eq=False)
class SupervisorChannel(Service):
    """
    A worker's end of its channel to the supervisor (see the module
    docstring): C{ready} when started (the edge services before it have
    installed the C{SIGHUP} handler), C{reloaded} after every reload asked
    through C{POST /admin/reload} that applied.

    @ivar fd: the channel's file descriptor (L{supervisorChannel}).
    @ivar reloader: the worker's L{relay.process.reload.ConfigReloader}.
    """

    fd: int
    reloader: object
    running: int = field(default=0, init=False)
    name: str | None = field(default=None, init=False)
    parent: object = field(default=None, init=False)

    _log = Logger()

    def startService(self) -> None:
        """
        Follow the reloads; tell the supervisor this worker is ready.
        """
        Service.startService(self)
        self.reloader.onApplied.append(self._applied)
        self._send(MESSAGE_READY)

    def stopService(self) -> None:
        """
        Stop following the reloads.
        """
        Service.stopService(self)
        if self._applied in self.reloader.onApplied:
            self.reloader.onApplied.remove(self._applied)

    def _applied(self, result, config) -> None:
        """
        An C{onApplied} hook: a reload an operator asked of this worker
        (C{admin}) is forwarded to the others; a C{SIGHUP} one is not
        (the supervisor sent it, or the operator signalled this worker
        alone).
        """
        if result.source == "admin":
            self._send(MESSAGE_RELOADED)

    def _send(self, message: bytes) -> None:
        """
        Write one message line; a supervisor that is gone is logged.
        """
        try:
            os.write(self.fd, message + b"\n")
        except OSError as e:
            self._log.warn(
                "cannot tell the supervisor {what}: {error}",
                event="relay.worker_channel_failed", what=message.decode(), error=str(e),
            )


def tcpAddress(listen: str) -> tuple:
    """
    The address of a C{tcp:} / C{tcp6:} server endpoint string.

    @param listen: e.g. C{tcp:8080:interface=127.0.0.1:backlog=100}.
    @return: C{(family, interface, port, backlog)}.
    @raise ValueError: for another endpoint type.
    """
    from twisted.internet.endpoints import (
        TCP4ServerEndpoint,
        TCP6ServerEndpoint,
        serverFromString,
    )

    endpoint = serverFromString(None, listen)
    if isinstance(endpoint, TCP6ServerEndpoint):
        family = socket.AF_INET6
    elif isinstance(endpoint, TCP4ServerEndpoint):
        family = socket.AF_INET
    else:
        raise ValueError(f"not a tcp: endpoint: {listen}")  # noqa: TRY004 - a bad value
    interface = endpoint._interface or ("::" if family == socket.AF_INET6 else "0.0.0.0")
    return family, interface, endpoint._port, endpoint._backlog


def _reusePortSocket(family, interface: str, port: int) -> socket.socket:
    """
    A TCP socket bound to C{(interface, port)} with C{SO_REUSEADDR} and
    C{SO_REUSEPORT} set; not listening.

    @raise CannotListenError: when the address cannot be bound.
    """
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((interface, port))
    except OSError as e:
        sock.close()
        raise CannotListenError(interface, port, e)
    return sock


def reserveAddress(listen: str) -> tuple:
    """
    Bind (without listening) the supervisor's C{listen} address with
    C{SO_REUSEPORT}: the port is held for the workers (a port of 0 becomes
    a real one) and a port in use is found before any worker starts. A
    bound socket that does not listen receives no connections.

    @return: C{(socket, listen string naming the bound port)}.
    @raise CannotListenError: when the address cannot be bound.
    """
    family, interface, port, backlog = tcpAddress(listen)
    sock = _reusePortSocket(family, interface, port)
    bound = sock.getsockname()[1]
    kind = "tcp6" if family == socket.AF_INET6 else "tcp"
    escaped = interface.replace(":", "\\:")
    return sock, f"{kind}:{bound}:interface={escaped}:backlog={backlog}"


@implementer(IStreamServerEndpoint)
@define
class ReusePortEndpoint:
    """
    A worker's server endpoint: the C{tcp:} address of C{listen}, bound
    with C{SO_REUSEPORT} and adopted by the reactor
    (C{IReactorSocket.adoptStreamPort}).

    @ivar reactor: an L{IReactorSocket}.
    @ivar address: the C{tcp:} / C{tcp6:} endpoint string.
    """

    reactor: object
    address: str

    def listen(self, factory) -> Deferred:
        """
        See L{IStreamServerEndpoint.listen}.

        @return: a Deferred firing with the L{IListeningPort}; failing with
            L{CannotListenError}.
        """
        from twisted.internet.defer import fail

        try:
            family, interface, port, backlog = tcpAddress(self.address)
            sock = _reusePortSocket(family, interface, port)
            try:
                sock.listen(backlog)
                sock.setblocking(False)
                listening = self.reactor.adoptStreamPort(sock.fileno(), family, factory)
            finally:
                sock.close()  # the reactor holds its own duplicate
        except CannotListenError:
            return fail()
        except OSError as e:
            return fail(CannotListenError(self.address, 0, e))
        return succeed(listening)


def dieWithParent(environ=None, getppid=os.getppid, kill=os.kill, prctl=None) -> None:
    """
    Ask Linux to send this process C{SIGTERM} when its parent (the
    supervisor) dies, so no worker outlives a killed supervisor. Does
    nothing elsewhere.

    A supervisor that died before the request leaves the worker with
    another parent (init, or a subreaper): then the worker sends itself
    C{SIGTERM} at once. The supervisor's pid comes from
    L{SUPERVISOR_PID_ENV}: a supervisor that I{is} pid 1 -- the entrypoint
    of a container -- is alive, not dead (without the variable,
    a parent of pid 1 means the supervisor is gone).

    @param environ: the environment (default C{os.environ}).
    @param getppid: returns the parent's pid.
    @param kill: C{os.kill}.
    @param prctl: C{prctl(option, arg2, ...)}; default libc's.
    """
    if not sys.platform.startswith("linux"):
        return
    import signal

    environ = os.environ if environ is None else environ
    try:
        if prctl is None:
            import ctypes

            prctl = ctypes.CDLL(None, use_errno=True).prctl
        PR_SET_PDEATHSIG = 1
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except Exception:  # noqa: BLE001 - best effort
        return
    expected = environ.get(SUPERVISOR_PID_ENV, "")
    parent = getppid()
    gone = parent != int(expected) if expected.isdigit() else parent == 1
    if gone:
        # The supervisor died before prctl: nobody will signal us.
        kill(os.getpid(), signal.SIGTERM)


class _WorkerProtocol(ProcessProtocol):
    """
    Watches one worker process for L{WorkerSupervisor}.
    """

    def __init__(self, supervisor: WorkerSupervisor, index: int, startedAt: float):
        """
        @param supervisor: told of the worker's messages and end.
        @param index: the worker's index.
        @param startedAt: when it was spawned.
        """
        self.supervisor = supervisor
        self.index = index
        self.startedAt = startedAt
        self.ended = Deferred()
        self.ready = False
        self.hangupHeld = False
        self.pid = None
        self._pending = b""

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        """
        Lines from the worker's channel (L{CHANNEL_FD}) go to the
        supervisor.
        """
        if childFD != CHANNEL_FD:
            return
        *lines, self._pending = (self._pending + data).split(b"\n")
        if len(self._pending) > _MAX_MESSAGE:
            self._pending = b""
        for line in lines:
            self.supervisor._message(self, line.strip())

    def processEnded(self, reason) -> None:
        self.supervisor._ended(self, reason)
        self.ended.callback(None)


@define(eq=False)
class WorkerSupervisor(Service):
    """
    Runs and watches the worker processes (see the module docstring).

    @ivar reactor: an L{IReactorProcess} and L{IReactorTime}.
    @ivar count: how many workers.
    @ivar argv: the worker command line (C{sys.executable} first).
    @ivar environ: the workers' environment (L{WORKER_ENV} is added).
    @ivar reserved: the supervisor's bound, non-listening socket holding
        the port (closed on stop), or L{None}.
    @ivar grace: seconds to wait for workers after C{SIGTERM}.
    """

    reactor: object
    count: int
    argv: list
    environ: dict = field(factory=lambda: dict(os.environ))
    reserved: socket.socket | None = None
    grace: float = STOP_GRACE_SECONDS
    workers: dict = field(factory=dict, init=False)
    _delay: float = field(default=RESTART_DELAY_SECONDS, init=False)
    _pendingRestarts: dict = field(factory=dict, init=False)
    metrics: MetricsDirectory = field(factory=MetricsDirectory)
    running: int = field(default=0, init=False)
    name: str | None = field(default=None, init=False)
    parent: object = field(default=None, init=False)

    _log = Logger()

    def startService(self) -> None:
        """
        Start every worker (with the metrics directory in their
        environment).
        """
        Service.startService(self)
        self.metrics.prepare(self.environ)
        for index in range(self.count):
            self._spawn(index)

    def _spawn(self, index: int) -> None:
        self._pendingRestarts.pop(index, None)
        if not self.running:
            return
        protocol = _WorkerProtocol(self, index, self.reactor.seconds())
        env = dict(self.environ)
        env[WORKER_ENV] = str(index)
        env[SUPERVISOR_FD_ENV] = str(CHANNEL_FD)
        env[SUPERVISOR_PID_ENV] = str(os.getpid())
        process = self.reactor.spawnProcess(
            protocol, self.argv[0], self.argv, env=env,
            childFDs={0: 0, 1: 1, 2: 2, CHANNEL_FD: "r"},
        )
        protocol.pid = process.pid
        self.workers[index] = (protocol, process)
        self._log.info(
            "worker {index} started (pid {pid})",
            event="relay.worker_started", index=index, pid=process.pid,
        )

    def reloadWorkers(self, source: str = "sighup", sender: _WorkerProtocol | None = None) -> int:
        """
        Forward C{SIGHUP} to every running worker (but C{sender}): each
        reloads the configuration file. A worker still starting (not
        C{ready}) gets it once ready; a worker waiting to be restarted is
        skipped (it will read the file when it starts). Logs one line,
        C{relay.workers_reload_forwarded}, with how many were signalled.

        @param source: who asked (C{sighup}, C{admin}), for the log.
        @param sender: the worker whose own reload is being forwarded.
        @return: how many workers were signalled now.
        """
        signalled = held = 0
        for protocol, process in list(self.workers.values()):
            if protocol is sender:
                continue
            if not protocol.ready:
                protocol.hangupHeld = True
                held += 1
            elif _signal(process, "HUP"):
                signalled += 1
        self._log.info(
            "reload ({source}{by}): sent SIGHUP to {signalled} worker(s){later}",
            event="relay.workers_reload_forwarded", source=source, signalled=signalled,
            starting=held, count=self.count,
            from_worker=None if sender is None else sender.index,
            by="" if sender is None else f" on worker {sender.index}",
            later=f", {held} more once started" if held else "",
        )
        return signalled

    def _message(self, protocol: _WorkerProtocol, message: bytes) -> None:
        """
        A line from a worker's channel (see the module docstring).
        """
        current = self.workers.get(protocol.index, (None, None))
        if current[0] is not protocol or not self.running:
            return
        if message == MESSAGE_READY:
            protocol.ready = True
            if protocol.hangupHeld:
                protocol.hangupHeld = False
                _signal(current[1], "HUP")
        elif message == MESSAGE_RELOADED:
            self.reloadWorkers("admin", sender=protocol)

    def _ended(self, protocol: _WorkerProtocol, reason) -> None:
        index = protocol.index
        if self.workers.get(index, (None,))[0] is protocol:
            del self.workers[index]
        status = getattr(reason.value, "exitCode", None)
        signal = getattr(reason.value, "signal", None)
        if protocol.pid is not None:
            self.metrics.processDead(protocol.pid)
        if not self.running:
            self._log.info(
                "worker {index} stopped (exit status {status}, signal {signal})",
                event="relay.worker_stopped", index=index, status=status, signal=signal,
            )
            return
        lived = self.reactor.seconds() - protocol.startedAt
        if lived >= HEALTHY_SECONDS:
            self._delay = RESTART_DELAY_SECONDS
        delay = self._delay
        self._delay = min(self._delay * 2, MAX_RESTART_DELAY_SECONDS)
        self._log.warn(
            "worker {index} exited (exit status {status}, signal {signal}) after "
            "{lived:.1f}s; restarting it in {delay}s",
            event="relay.worker_exited", index=index, status=status, signal=signal,
            lived=lived, delay=delay,
        )
        self._pendingRestarts[index] = self.reactor.callLater(delay, self._spawn, index)

    def stopService(self) -> Deferred:
        """
        C{SIGTERM} every worker; fire once all have exited (C{SIGKILL}
        after L{grace} seconds).
        """
        Service.stopService(self)
        for call in self._pendingRestarts.values():
            if call.active():
                call.cancel()
        self._pendingRestarts.clear()
        if self.reserved is not None:
            self.reserved.close()
            self.reserved = None
        waiting = []
        for protocol, process in list(self.workers.values()):
            waiting.append(protocol.ended)
            _signal(process, "TERM")
        if not waiting:
            self.metrics.remove()
            return succeed(None)
        done = DeferredList(waiting)

        def kill():
            for _, process in list(self.workers.values()):
                self._log.warn(
                    "worker (pid {pid}) did not stop within {grace}s; killing it",
                    event="relay.worker_killed", pid=process.pid, grace=self.grace,
                )
                _signal(process, "KILL")

        timer = self.reactor.callLater(self.grace, kill)

        def stopped(result):
            if timer.active():
                timer.cancel()
            self.metrics.remove()

        return done.addCallback(stopped)


def _signal(process, name: str) -> bool:
    """
    Signal a process that may have exited already.

    @return: whether the signal was sent.
    """
    from twisted.internet.error import ProcessExitedAlready

    try:
        process.signalProcess(name)
    except (ProcessExitedAlready, OSError):
        return False
    return True


def workerArgv(configPath: str, listen: str, logFormat: str | None) -> list:
    """
    The command line of one worker.

    @param configPath: the configuration file (made absolute).
    @param listen: the address the workers share.
    @param logFormat: C{--log-format} when given on the supervisor's
        command line.
    """
    argv = [sys.executable, "-m", "twisted", "relay", "--config", os.path.abspath(configPath),
            "--listen", listen]
    if logFormat:
        argv += ["--log-format", logFormat]
    return argv
