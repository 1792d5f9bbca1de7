"""
Tests for L{relay.process.workers} (issue 16): the supervisor on a fake process
reactor and a L{Clock}; the C{workers} configuration key and flag.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.interfaces import IStreamServerEndpoint
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.configuration.parse import checkWorkers, settingsFromString
from relay.base.records import ConfigError
from relay.process.workers import (
    CHANNEL_FD,
    HEALTHY_SECONDS,
    RESTART_DELAY_SECONDS,
    SUPERVISOR_FD_ENV,
    SUPERVISOR_PID_ENV,
    WORKER_ENV,
    ReusePortEndpoint,
    SupervisorChannel,
    WorkerSupervisor,
    dieWithParent,
    reserveAddress,
    supervisorChannel,
    tcpAddress,
    workerArgv,
    workerIndex,
)


class FakeProcess:
    """
    A spawned process: records signals.
    """

    def __init__(self, pid: int):
        self.pid = pid
        self.signals = []

    def signalProcess(self, name: str) -> None:
        """
        Record C{name}.
        """
        self.signals.append(name)


class FakeReactor(Clock):
    """
    A L{Clock} that records C{spawnProcess} calls.
    """

    def __init__(self):
        super().__init__()
        self.spawned = []

    def callFromThread(self, f, *args, **kw):
        """
        Run C{f} now (a signal handler's hand-off to the reactor thread).
        """
        f(*args, **kw)

    def spawnProcess(self, protocol, executable, args, env=None, childFDs=None, **kw):
        """
        Record the spawn; return a L{FakeProcess}.
        """
        process = FakeProcess(1000 + len(self.spawned))
        self.spawned.append((protocol, executable, args, env, childFDs, process))
        return process


def _end(entry, code=0, signal=None) -> None:
    """
    Make the spawned process C{entry} end.
    """
    protocol = entry[0]
    if signal is None and code == 0:
        protocol.processEnded(Failure(ProcessDone(0)))
    else:
        protocol.processEnded(Failure(ProcessTerminated(code, signal)))


def _say(entry, data: bytes) -> None:
    """
    Bytes from the spawned worker C{entry}'s channel to the supervisor.
    """
    entry[0].childDataReceived(CHANNEL_FD, data)


def _ready(reactor) -> None:
    """
    Every worker spawned so far says it is ready.
    """
    for entry in reactor.spawned:
        _say(entry, b"ready\n")


class SupervisorTests(SynchronousTestCase):
    """
    L{WorkerSupervisor} starts, restarts and stops its workers.
    """

    def setUp(self):
        self.reactor = FakeReactor()
        self.supervisor = WorkerSupervisor(
            reactor=self.reactor, count=2, argv=["python", "-m", "twisted", "relay"],
            environ={"PATH": "/bin"}, grace=5,
        )

    def test_startSpawnsEachWorker(self):
        """
        Starting runs C{count} workers, each with its index in
        L{WORKER_ENV}, sharing the supervisor's stdout and stderr, with a
        channel to the supervisor on L{CHANNEL_FD} named in
        L{SUPERVISOR_FD_ENV}.
        """
        self.supervisor.startService()
        self.assertEqual(len(self.reactor.spawned), 2)
        envs = [entry[3] for entry in self.reactor.spawned]
        self.assertEqual([env[WORKER_ENV] for env in envs], ["0", "1"])
        self.assertEqual(envs[0]["PATH"], "/bin")
        self.assertEqual(envs[0][SUPERVISOR_FD_ENV], str(CHANNEL_FD))
        self.assertEqual(envs[0][SUPERVISOR_PID_ENV], str(os.getpid()))
        self.assertEqual(self.reactor.spawned[0][4], {0: 0, 1: 1, 2: 2, CHANNEL_FD: "r"})
        self.assertEqual(self.reactor.spawned[0][1], "python")

    def test_crashedWorkerIsRestarted(self):
        """
        A worker that exits while the supervisor runs is started again
        after L{RESTART_DELAY_SECONDS}, with the same index.
        """
        self.supervisor.startService()
        _end(self.reactor.spawned[0], signal=9)
        self.assertEqual(len(self.reactor.spawned), 2)
        self.reactor.advance(RESTART_DELAY_SECONDS)
        self.assertEqual(len(self.reactor.spawned), 3)
        self.assertEqual(self.reactor.spawned[2][3][WORKER_ENV], "0")
        self.assertEqual(sorted(self.supervisor.workers), [0, 1])

    def test_restartDelayGrowsWhileWorkersDieYoung(self):
        """
        Workers that die young are restarted after a doubling delay; one
        that lived L{HEALTHY_SECONDS} resets it.
        """
        self.supervisor.startService()
        _end(self.reactor.spawned[0], code=1)
        self.reactor.advance(RESTART_DELAY_SECONDS)
        _end(self.reactor.spawned[2], code=1)
        self.reactor.advance(RESTART_DELAY_SECONDS)
        self.assertEqual(len(self.reactor.spawned), 3)
        self.reactor.advance(RESTART_DELAY_SECONDS)
        self.assertEqual(len(self.reactor.spawned), 4)
        self.reactor.advance(HEALTHY_SECONDS)
        _end(self.reactor.spawned[3], code=1)
        self.reactor.advance(RESTART_DELAY_SECONDS)
        self.assertEqual(len(self.reactor.spawned), 5)

    def test_stopSignalsEveryWorkerAndWaits(self):
        """
        Stopping sends SIGTERM to every worker and fires only once all of
        them have exited; none is restarted.
        """
        self.supervisor.startService()
        d = self.supervisor.stopService()
        processes = [entry[5] for entry in self.reactor.spawned]
        self.assertEqual([p.signals for p in processes], [["TERM"], ["TERM"]])
        self.assertNoResult(d)
        _end(self.reactor.spawned[0], signal=15)
        self.assertNoResult(d)
        _end(self.reactor.spawned[1])
        self.successResultOf(d)
        self.reactor.advance(60)
        self.assertEqual(len(self.reactor.spawned), 2)
        self.assertEqual([p.signals for p in processes], [["TERM"], ["TERM"]])

    def test_stopKillsWorkersAfterGrace(self):
        """
        A worker still running C{grace} seconds after SIGTERM gets SIGKILL.
        """
        self.supervisor.startService()
        d = self.supervisor.stopService()
        _end(self.reactor.spawned[0])
        self.reactor.advance(5)
        self.assertEqual(self.reactor.spawned[1][5].signals, ["TERM", "KILL"])
        self.assertEqual(self.reactor.spawned[0][5].signals, ["TERM"])
        _end(self.reactor.spawned[1], signal=9)
        self.successResultOf(d)

    def test_pendingRestartCancelledOnStop(self):
        """
        A restart scheduled before the stop does not happen.
        """
        self.supervisor.startService()
        _end(self.reactor.spawned[0], signal=9)
        d = self.supervisor.stopService()
        _end(self.reactor.spawned[1])
        self.successResultOf(d)
        self.reactor.advance(60)
        self.assertEqual(len(self.reactor.spawned), 2)


    def test_hangupForwardedToRunningWorkers(self):
        """
        L{WorkerSupervisor.reloadWorkers} sends C{SIGHUP} to every running
        worker and logs one line naming how many; a worker waiting to be
        restarted is skipped and starts (with the file as it then is)
        without one.
        """
        self.supervisor.startService()
        _ready(self.reactor)
        _end(self.reactor.spawned[0], signal=9)
        with capturedLogs() as logs:
            self.assertEqual(self.supervisor.reloadWorkers("sighup"), 1)
        self.assertEqual(self.reactor.spawned[1][5].signals, ["HUP"])
        self.assertEqual(self.reactor.spawned[0][5].signals, [])
        [line] = [e for e in logs if e.get("event") == "relay.workers_reload_forwarded"]
        self.assertEqual((line["signalled"], line["count"], line["source"]), (1, 2, "sighup"))
        self.reactor.advance(RESTART_DELAY_SECONDS)
        _ready(self.reactor)
        self.assertEqual(self.reactor.spawned[2][5].signals, [])
        self.assertTrue(self.supervisor.running)

    def test_hangupHeldUntilWorkerReady(self):
        """
        A worker that has not said C{ready} (its C{SIGHUP} handler is not
        installed yet: the signal would kill it) gets the C{SIGHUP} once
        it is ready, and only once.
        """
        self.supervisor.startService()
        _say(self.reactor.spawned[1], b"ready\n")
        self.assertEqual(self.supervisor.reloadWorkers("sighup"), 1)
        processes = [entry[5] for entry in self.reactor.spawned]
        self.assertEqual([p.signals for p in processes], [[], ["HUP"]])
        _say(self.reactor.spawned[0], b"rea")
        self.assertEqual(processes[0].signals, [])
        _say(self.reactor.spawned[0], b"dy\n")
        self.assertEqual(processes[0].signals, ["HUP"])
        _say(self.reactor.spawned[0], b"ready\n")
        self.assertEqual([p.signals for p in processes], [["HUP"], ["HUP"]])

    def test_adminReloadForwardedToTheOthers(self):
        """
        A worker's C{reloaded} (a C{POST /admin/reload} applied there) has
        the supervisor send C{SIGHUP} to every other worker, not back to
        the sender; one line names the sender and the count.
        """
        self.supervisor = WorkerSupervisor(
            reactor=self.reactor, count=3, argv=["python"], environ={}, grace=5,
        )
        self.supervisor.startService()
        _ready(self.reactor)
        with capturedLogs() as logs:
            _say(self.reactor.spawned[1], b"reloaded\n")
        processes = [entry[5] for entry in self.reactor.spawned]
        self.assertEqual([p.signals for p in processes], [["HUP"], [], ["HUP"]])
        [line] = [e for e in logs if e.get("event") == "relay.workers_reload_forwarded"]
        self.assertEqual((line["source"], line["from_worker"], line["signalled"]), ("admin", 1, 2))

    def test_channelNoiseIgnored(self):
        """
        Other descriptors, unknown lines and the messages of a worker that
        has been replaced change nothing.
        """
        self.supervisor.startService()
        _ready(self.reactor)
        old = self.reactor.spawned[0]
        self.reactor.spawned[1][0].childDataReceived(1, b"reloaded\n")
        _say(self.reactor.spawned[1], b"hello\n" + b"x" * 1000)
        _end(old, code=1)
        self.reactor.advance(RESTART_DELAY_SECONDS)
        _say(old, b"reloaded\n")
        self.assertEqual([e[5].signals for e in self.reactor.spawned], [[], [], []])


class DieWithParentTests(SynchronousTestCase):
    """
    L{dieWithParent}: a worker asks for C{SIGTERM} at its supervisor's
    death, and ends itself when the supervisor is already gone -- but a
    supervisor that is pid 1 (a container's entrypoint) is alive.
    """

    if not sys.platform.startswith("linux"):
        skip = "PR_SET_PDEATHSIG is Linux's"

    def run_(self, parent: int, environ: dict) -> list:
        calls = []
        dieWithParent(
            environ=environ, getppid=lambda: parent,
            kill=lambda pid, sig: calls.append(("kill", pid, sig)),
            prctl=lambda *args: calls.append(("prctl",) + args),
        )
        return calls

    def test_supervisorIsPidOne(self):
        """
        In a container the supervisor is pid 1: its workers keep running
        (issue 23: they used to end themselves at once, over and over).
        """
        calls = self.run_(1, {SUPERVISOR_PID_ENV: "1"})
        self.assertEqual(calls, [("prctl", 1, int(signal.SIGTERM), 0, 0, 0)])

    def test_supervisorAlive(self):
        self.assertEqual(len(self.run_(4242, {SUPERVISOR_PID_ENV: "4242"})), 1)

    def test_supervisorGoneBeforeTheRequest(self):
        """
        Re-parented (to init or a subreaper) before the request: the
        worker sends itself C{SIGTERM}.
        """
        calls = self.run_(1, {SUPERVISOR_PID_ENV: "4242"})
        self.assertEqual(calls[-1], ("kill", os.getpid(), signal.SIGTERM))
        calls = self.run_(77, {SUPERVISOR_PID_ENV: "4242"})
        self.assertEqual(calls[-1], ("kill", os.getpid(), signal.SIGTERM))

    def test_withoutThePid(self):
        """
        Without L{SUPERVISOR_PID_ENV}, a parent of pid 1 means the
        supervisor is gone.
        """
        self.assertEqual(self.run_(1, {})[-1][0], "kill")
        self.assertEqual(len(self.run_(4242, {})), 1)


class SupervisorServiceTests(SynchronousTestCase):
    """
    The C{workers: N} service tree L{relay.tap.makeService} builds.
    """

    def test_hangupReloadsWorkersSupervisorStays(self):
        """
        The supervisor installs a C{SIGHUP} handler while it runs (without
        one, the signal's default action kills it and the service goes
        down) that forwards C{SIGHUP} to every worker.
        """
        from relay.tap import Options, makeService

        path = self.mktemp()
        with open(path, "w") as f:
            f.write("workers: 2\nlisten: tcp:0:interface=127.0.0.1\nstate: {backend: redis}\n")
        options = Options()
        options.parseOptions(["--config", path])
        reactor = FakeReactor()
        service = makeService(options, reactor=reactor)
        previous = signal.getsignal(signal.SIGHUP)
        self.addCleanup(signal.signal, signal.SIGHUP, previous)
        service.startService()
        try:
            _ready(reactor)
            handler = signal.getsignal(signal.SIGHUP)
            self.assertNotIn(handler, (previous, signal.SIG_DFL))
            handler(signal.SIGHUP, None)
            self.assertEqual([e[5].signals for e in reactor.spawned], [["HUP"], ["HUP"]])
        finally:
            d = service.stopService()
            for entry in reactor.spawned:
                _end(entry)
            self.successResultOf(d)
        # Stopped: a SIGHUP is ignored (not the default action) until exit.
        self.assertNotIn(signal.getsignal(signal.SIGHUP), (previous, signal.SIG_DFL))


class _Reloads:
    """
    A L{relay.process.reload.ConfigReloader} over a configuration held
    in memory: L{good} switches between a valid and a broken file.
    """

    def __init__(self):
        from relay.process.live import LiveConfiguration
        from relay.process.reload import ConfigReloader
        from relay.state.settings import RuntimeSettings

        config = settingsFromString("{}\n")
        self.good = True

        def load(path, environ):
            if not self.good:
                raise ConfigError("gateway: broken")
            return config

        self.reloader = ConfigReloader(
            path="relay.yaml", live=LiveConfiguration.fromConfig(config),
            settings=RuntimeSettings(current=config.gateway), load=load, checks=lambda c: [],
        )


class ChannelTests(SynchronousTestCase):
    """
    The worker's end of its channel to the supervisor.
    """

    def pipe(self) -> tuple:
        """
        @return: a pipe's C{(read, write)} descriptors, closed on cleanup.
        """
        import os

        read, write = os.pipe()
        self.addCleanup(os.close, read)
        self.addCleanup(os.close, write)
        return read, write

    def test_onlyWhenSupervised(self):
        """
        The channel is the pipe named by L{SUPERVISOR_FD_ENV} in a worker
        (L{WORKER_ENV} set); a process without both, or whose descriptor is
        not a pipe, is not supervised.
        """
        _, write = self.pipe()
        self.assertEqual(supervisorChannel({WORKER_ENV: "0", SUPERVISOR_FD_ENV: str(write)}), write)
        self.assertIsNone(supervisorChannel({SUPERVISOR_FD_ENV: str(write)}))
        self.assertIsNone(supervisorChannel({WORKER_ENV: "0"}))
        self.assertIsNone(supervisorChannel({WORKER_ENV: "0", SUPERVISOR_FD_ENV: "x"}))
        with open(self.mktemp(), "w") as f:
            regular = {WORKER_ENV: "0", SUPERVISOR_FD_ENV: str(f.fileno())}
            self.assertIsNone(supervisorChannel(regular))
        self.assertIsNone(supervisorChannel({WORKER_ENV: "0", SUPERVISOR_FD_ENV: "987"}))

    def test_readyThenAdminReloadsOnly(self):
        """
        The started channel says C{ready}; a C{POST /admin/reload} that
        applied says C{reloaded}; a C{SIGHUP} reload (the supervisor's own
        forward) and a failed reload (a bad file) say nothing.
        """
        import os

        read, write = self.pipe()
        os.set_blocking(read, False)
        reloads = _Reloads()
        channel = SupervisorChannel(fd=write, reloader=reloads.reloader)
        channel.startService()
        self.assertEqual(os.read(read, 100), b"ready\n")
        self.assertTrue(reloads.reloader.reload("sighup").applied)
        reloads.good = False
        self.assertFalse(reloads.reloader.reload("admin").applied)
        self.assertRaises(BlockingIOError, os.read, read, 100)
        reloads.good = True
        self.assertTrue(reloads.reloader.reload("admin").applied)
        self.assertEqual(os.read(read, 100), b"reloaded\n")
        channel.stopService()
        self.assertEqual(reloads.reloader.onApplied, [])

    def test_supervisorGoneIsLogged(self):
        """
        A channel whose supervisor is gone logs the failed write; the
        worker goes on.
        """
        import os

        read, write = os.pipe()
        os.close(read)
        self.addCleanup(os.close, write)
        channel = SupervisorChannel(fd=write, reloader=_Reloads().reloader)
        with capturedLogs() as logs:
            channel.startService()
        self.assertEqual(
            [e["what"] for e in logs if e.get("event") == "relay.worker_channel_failed"],
            ["ready"],
        )


class AddressTests(SynchronousTestCase):
    """
    The shared address: parsing, the supervisor's reservation, a worker's
    endpoint.
    """

    def test_tcpAddress(self):
        """
        C{tcp:} and C{tcp6:} strings give family, interface, port, backlog;
        other endpoint types are refused.
        """
        self.assertEqual(tcpAddress("tcp:8080:interface=127.0.0.1:backlog=7"),
                         (socket.AF_INET, "127.0.0.1", 8080, 7))
        self.assertEqual(tcpAddress("tcp:8080")[1], "0.0.0.0")
        self.assertEqual(tcpAddress("tcp6:8080:interface=\\:\\:1")[:3],
                         (socket.AF_INET6, "::1", 8080))
        self.assertRaises(ValueError, tcpAddress, "unix:/tmp/relay.sock")

    def test_reserveNamesTheBoundPort(self):
        """
        Port 0 is bound to a real port, named in the returned endpoint
        string; a worker endpoint can listen on it beside the reservation.
        """
        sock, listen = reserveAddress("tcp:0:interface=127.0.0.1")
        try:
            port = sock.getsockname()[1]
            self.assertNotEqual(port, 0)
            self.assertEqual(tcpAddress(listen)[1:3], ("127.0.0.1", port))
            extra = socket.socket()
            extra.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            extra.bind(("127.0.0.1", port))
            extra.listen(1)
            extra.close()
        finally:
            sock.close()

    def test_endpointProvidesInterface(self):
        """
        L{ReusePortEndpoint} is an L{IStreamServerEndpoint}.
        """
        self.assertTrue(verifyObject(IStreamServerEndpoint, ReusePortEndpoint(Clock(), "tcp:0")))


class ConfigTests(SynchronousTestCase):
    """
    The C{workers} key (config.md) and the worker's identity.
    """

    def test_defaultOne(self):
        """
        Without the key there is one process.
        """
        self.assertEqual(settingsFromString("{}\n").workers, 1)

    def test_redisWorkers(self):
        """
        C{workers: 4} with Redis state is accepted.
        """
        config = settingsFromString("workers: 4\nstate: {backend: redis}\n")
        self.assertEqual(config.workers, 4)

    def test_memoryStateRefused(self):
        """
        N > 1 with memory state is an error naming C{workers}.
        """
        e = self.assertRaises(ConfigError, settingsFromString, "workers: 2\n")
        self.assertTrue(str(e).startswith("workers: "), str(e))
        self.assertIn("state.backend: redis", str(e))

    def test_notTCPRefused(self):
        """
        N > 1 needs a C{tcp:} listen endpoint.
        """
        e = self.assertRaises(
            ConfigError, settingsFromString,
            "workers: 2\nlisten: unix:/tmp/r.sock\nstate: {backend: redis}\n",
        )
        self.assertTrue(str(e).startswith("workers: "), str(e))

    def test_range(self):
        """
        0 and non-integers are refused.
        """
        self.assertRaises(ConfigError, settingsFromString, "workers: 0\n")
        self.assertRaises(ConfigError, settingsFromString, "workers: two\n")

    def test_checkAfterOverride(self):
        """
        L{checkWorkers} is what C{--workers} runs after overriding.
        """
        from attrs import evolve

        config = evolve(settingsFromString("{}\n"), workers=3)
        self.assertRaises(ConfigError, checkWorkers, config)

    def test_workerIndex(self):
        """
        The index comes from L{WORKER_ENV}; absent or malformed is L{None}.
        """
        self.assertEqual(workerIndex({WORKER_ENV: "3"}), 3)
        self.assertIsNone(workerIndex({}))
        self.assertIsNone(workerIndex({WORKER_ENV: "x"}))

    def test_workerArgv(self):
        """
        Workers run C{-m twisted relay} on the absolute config path, the
        shared address and the supervisor's C{--log-format}.
        """
        argv = workerArgv("relay.yaml", "tcp:8080", "json")
        self.assertEqual(argv[1:4], ["-m", "twisted", "relay"])
        self.assertTrue(argv[argv.index("--config") + 1].startswith("/"))
        self.assertEqual(argv[argv.index("--listen") + 1], "tcp:8080")
        self.assertEqual(argv[argv.index("--log-format") + 1], "json")
        self.assertNotIn("--log-format", workerArgv("relay.yaml", "tcp:8080", None))
