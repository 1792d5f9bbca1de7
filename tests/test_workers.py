"""
Tests for L{relay.workers} (issue 16): the supervisor on a fake process
reactor and a L{Clock}; the C{workers} configuration key and flag.
"""

from __future__ import annotations

import signal
import socket

from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.interfaces import IStreamServerEndpoint
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.config import checkWorkers, settingsFromString
from relay.model import ConfigError
from relay.workers import (
    HEALTHY_SECONDS,
    RESTART_DELAY_SECONDS,
    WORKER_ENV,
    ReusePortEndpoint,
    WorkerSupervisor,
    reserveAddress,
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
        L{WORKER_ENV}, sharing the supervisor's stdout and stderr.
        """
        self.supervisor.startService()
        self.assertEqual(len(self.reactor.spawned), 2)
        envs = [entry[3] for entry in self.reactor.spawned]
        self.assertEqual([env[WORKER_ENV] for env in envs], ["0", "1"])
        self.assertEqual(envs[0]["PATH"], "/bin")
        self.assertEqual(self.reactor.spawned[0][4], {0: 0, 1: 1, 2: 2})
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
        _end(self.reactor.spawned[0], signal=9)
        with capturedLogs() as logs:
            self.assertEqual(self.supervisor.reloadWorkers("sighup"), 1)
        self.assertEqual(self.reactor.spawned[1][5].signals, ["HUP"])
        self.assertEqual(self.reactor.spawned[0][5].signals, [])
        [line] = [e for e in logs if e.get("event") == "relay.workers_reload_forwarded"]
        self.assertEqual((line["signalled"], line["count"], line["source"]), (1, 2, "sighup"))
        self.reactor.advance(RESTART_DELAY_SECONDS)
        self.assertEqual(self.reactor.spawned[2][5].signals, [])
        self.assertTrue(self.supervisor.running)


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
        service.startService()
        try:
            handler = signal.getsignal(signal.SIGHUP)
            self.assertNotIn(handler, (previous, signal.SIG_DFL))
            handler(signal.SIGHUP, None)
            self.assertEqual([e[5].signals for e in reactor.spawned], [["HUP"], ["HUP"]])
        finally:
            d = service.stopService()
            for entry in reactor.spawned:
                _end(entry)
            self.successResultOf(d)
        self.assertEqual(signal.getsignal(signal.SIGHUP), previous)


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
