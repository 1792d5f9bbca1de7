"""
Tests for L{relay.tap} (the C{twistd relay} options and service) and for
the discovery of the C{relay} and C{relay-emulator} twistd plugins
(style.md 9(f)).
"""

from __future__ import annotations

import errno
import io
import json
import os

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import IServiceMaker, MultiService
from twisted.internet.defer import fail
from twisted.internet.error import CannotListenError
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import capturedLogs, formatEvent
from twisted.plugin import getPlugins
from twisted.python.reflect import namedAny
from twisted.python.usage import UsageError
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.configuration import check as configcheck
from relay.configuration.parse import checkDatabase, settingsFromString
from relay.base.logs import jsonStdout, textStdout
from relay.base.records import ConfigError
from relay.tap import Options, exitWithConfigError, makeService

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, os.pardir, "etc", "demo.yaml")
"""etc/demo.yaml, relative to this file so trial's C{_trial_temp} does not matter (trap T3)."""

MINIMAL = """\
listen: "tcp:0:interface=127.0.0.1"
keys: [{name: t, key: sk-relay-tap-test}]
accounts:
  - {id: a1, type: apikey, api_key: sk-tap-account, base_url: "http://127.0.0.1:9/v1"}
"""


def patchStderr(case: SynchronousTestCase) -> io.StringIO:
    """
    Point the configuration error line's standard error
    (L{relay.configuration.check}) at a fresh L{io.StringIO} for the duration of
    C{case}.
    """
    stream = io.StringIO()
    case.patch(configcheck, "_stderr", lambda: stream)
    return stream


class ExitWithConfigErrorTests(SynchronousTestCase):
    """
    L{exitWithConfigError} writes one line and exits with status 2.
    """

    def test_oneLine(self) -> None:
        """
        The message, whitespace collapsed, follows C{relay: config error: }
        on exactly one line; the exit status is 2.
        """
        stderr = patchStderr(self)
        e = self.assertRaises(SystemExit, exitWithConfigError, "a.b:\n  bad  value")
        self.assertEqual(e.code, 2)
        self.assertEqual(stderr.getvalue(), "relay: config error: a.b: bad value\n")


class OptionsTests(SynchronousTestCase):
    """
    L{Options} parses the configuration once; every configuration problem
    is one line on standard error and C{SystemExit(2)} (no usage text), and
    L{Options.configure} raises it as a L{ConfigError}.
    """

    def setUp(self) -> None:
        self.stderr = patchStderr(self)

    def writeConfig(self, text: str) -> str:
        """
        Write C{text} to a fresh file and return its path.
        """
        path = self.mktemp()
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def assertOneLineConfigError(self, argv, *fragments: str) -> str:
        """
        Parsing C{argv} writes exactly one line, C{relay: config error:
        ...} containing every fragment, to standard error and raises
        C{SystemExit(2)}; L{Options.configure} raises the same message as
        a L{ConfigError}.

        @return: the message (without the prefix).
        """
        e = self.assertRaises(SystemExit, Options().parseOptions, argv)
        self.assertEqual(e.code, 2)
        lines = self.stderr.getvalue().splitlines()
        self.assertEqual(len(lines), 1, self.stderr.getvalue())
        self.assertTrue(lines[0].startswith("relay: config error: "), lines[0])
        message = lines[0][len("relay: config error: "):]
        for fragment in fragments:
            self.assertIn(fragment, message)
        self.assertEqual(self.configureError(argv), message)
        return message

    def configureError(self, argv) -> str:
        """
        The programmatic layer: L{Options.configure} for C{argv}'s options
        raises L{ConfigError}; nothing is written to standard error.

        @return: the error's message.
        """
        before = self.stderr.getvalue()
        options = Options()
        postOptions = options.postOptions
        options.postOptions = lambda: None
        options.parseOptions(argv)
        e = self.assertRaises(ConfigError, options.configure)
        self.assertEqual(self.stderr.getvalue(), before)
        options.postOptions = postOptions
        return str(e)

    def test_demoConfig(self) -> None:
        """
        C{--config etc/demo.yaml} parses into C{options.config}: its listen,
        three accounts and one client key.
        """
        options = Options()
        options.parseOptions(["--config", DEMO])
        config = options.config
        self.assertEqual(config.listen, "tcp:8080:interface=127.0.0.1")
        self.assertEqual([a.id for a in config.accounts], ["a1", "a2", "a3"])
        self.assertEqual([k.name for k in config.keys], ["demo"])
        self.assertEqual(config.log_format, "text")

    def test_unknownKey(self) -> None:
        """
        An unknown key is a one-line config error naming the key path.
        """
        path = self.writeConfig(MINIMAL + "gateway: {foo: 1}\n")
        self.assertOneLineConfigError(["--config", path], "gateway.foo")

    def test_badValue(self) -> None:
        """
        A value of the wrong type names the key and what was expected.
        """
        path = self.writeConfig(MINIMAL + "gateway: {max_account_switches: ten}\n")
        self.assertOneLineConfigError(
            ["--config", path], "gateway.max_account_switches", "expected an integer"
        )

    def test_missingCredential(self) -> None:
        """
        An account without a credential names the account.
        """
        path = self.writeConfig(
            'listen: "tcp:0"\naccounts: [{id: a1, type: apikey, base_url: "http://x/v1"}]\n'
        )
        self.assertOneLineConfigError(["--config", path], "accounts[0] (a1)", "api_key")

    def test_yamlSyntaxError(self) -> None:
        """
        A YAML syntax error is one line with the file position.
        """
        path = self.writeConfig("keys: [unclosed\n")
        self.assertOneLineConfigError(["--config", path], "YAML syntax error")

    def test_missingFile(self) -> None:
        """
        A file that does not exist is a one-line config error naming it.
        """
        path = self.mktemp()
        self.assertOneLineConfigError(["--config", path], path)

    def test_secretNotInMessage(self) -> None:
        """
        A bad secret value's error message names the key but not the value.
        """
        path = self.writeConfig(
            MINIMAL.replace("sk-relay-tap-test", "sk-relay-tap-test, concurrency: many")
        )
        message = self.assertOneLineConfigError(["--config", path], "keys[0].concurrency")
        self.assertNotIn("sk-relay-tap-test", message)

    def test_listenOverride(self) -> None:
        """
        C{--listen} replaces the configuration's listen endpoint.
        """
        options = Options()
        options.parseOptions(["--config", DEMO, "--listen", "tcp:0:interface=127.0.0.1"])
        self.assertEqual(options.config.listen, "tcp:0:interface=127.0.0.1")

    def test_logFormatJSON(self) -> None:
        """
        C{--log-format json} is accepted and recorded.
        """
        options = Options()
        options.parseOptions(["--config", DEMO, "--log-format", "json"])
        self.assertEqual(options["log-format"], "json")

    def test_logFormatBad(self) -> None:
        """
        An unknown C{--log-format} is a bad flag, not a bad file: a one-line
        L{UsageError} (the runner adds its usage text), nothing on stderr.
        """
        e = self.assertRaises(
            UsageError, Options().parseOptions, ["--config", DEMO, "--log-format", "xml"]
        )
        self.assertEqual(str(e), "--log-format: expected text or json, got 'xml'")
        self.assertEqual(self.stderr.getvalue(), "")

    def test_exactLine(self) -> None:
        """
        The whole standard error output for a bad value is the one line.
        """
        path = self.writeConfig(MINIMAL.replace("type: apikey", "type: x"))
        self.assertRaises(SystemExit, Options().parseOptions, ["--config", path])
        self.assertEqual(
            self.stderr.getvalue(),
            "relay: config error: accounts[0].type: expected apikey or oauth, got 'x'\n",
        )

    def test_databaseDirectoryMissing(self) -> None:
        """
        With the memory backend, a C{database} in a directory that does not
        exist is a one-line error naming C{database}.
        """
        missing = os.path.abspath(self.mktemp())
        path = self.writeConfig(MINIMAL + f"database: {missing}/settings.sqlite\n")
        self.assertOneLineConfigError(
            ["--config", path], f"database: directory {missing} does not exist"
        )

    def test_databaseDirectoryUnwritable(self) -> None:
        """
        A C{database} whose directory is not writable is a one-line error
        naming C{database} (C{os.access} is faked: root may write anywhere).
        """
        directory = os.path.abspath(self.mktemp())
        os.mkdir(directory)
        realAccess = os.access

        def access(path, mode, *a, **kw):
            if os.path.abspath(path) == directory and mode & os.W_OK:
                return False
            return realAccess(path, mode, *a, **kw)

        self.patch(os, "access", access)
        path = self.writeConfig(MINIMAL + f"database: {directory}/settings.sqlite\n")
        self.assertOneLineConfigError(
            ["--config", path], f"database: directory {directory} is not writable"
        )


    def test_componentCannotImport(self) -> None:
        """
        A C{components:} dotted name that cannot be imported is a one-line
        config error at option-parsing time (twistd prints a traceback for
        exceptions in C{makeService}).
        """
        path = self.writeConfig(MINIMAL + "components: {classifier: nosuchpkg.Classifier}\n")
        self.assertOneLineConfigError(
            ["--config", path], "components.classifier", "nosuchpkg.Classifier"
        )

    def test_componentWrongInterface(self) -> None:
        """
        A class that does not implement its interface is a one-line
        config error naming the key and the interface.
        """
        path = self.writeConfig(
            MINIMAL + "components: {dialer: relay.policy.classify.DefaultClassifier}\n"
        )
        self.assertOneLineConfigError(
            ["--config", path], "components.dialer", "IUpstreamDialer"
        )

    def test_componentNotCallable(self) -> None:
        """
        A dotted name naming something that is not callable is refused.
        """
        path = self.writeConfig(MINIMAL + "components: {admission: relay.tap.__doc__}\n")
        self.assertOneLineConfigError(["--config", path], "components.admission", "not callable")

    def test_componentGood(self) -> None:
        """
        The built-in classes, named explicitly, are accepted.
        """
        path = self.writeConfig(
            MINIMAL + "components: {classifier: relay.policy.classify.DefaultClassifier}\n"
        )
        options = Options()
        options.parseOptions(["--config", path])
        self.assertEqual(
            options.config.components.classifier, "relay.policy.classify.DefaultClassifier"
        )


class CheckDatabaseTests(SynchronousTestCase):
    """
    L{checkDatabase} checks the SQLite settings path of the memory backend.
    """

    def config(self, extra: str):
        """
        A parsed configuration: L{MINIMAL} plus C{extra}.
        """
        return settingsFromString(MINIMAL + extra)

    def assertDatabaseError(self, extra: str, expected: str) -> None:
        """
        L{checkDatabase} raises L{ConfigError} with exactly C{expected}.
        """
        e = self.assertRaises(ConfigError, checkDatabase, self.config(extra))
        self.assertEqual(str(e), expected)

    def test_good(self) -> None:
        """
        A file to be created in a writable directory, an existing writable
        file and C{:memory:} are accepted.
        """
        directory = os.path.abspath(self.mktemp())
        os.mkdir(directory)
        checkDatabase(self.config(f"database: {directory}/new.sqlite\n"))
        with open(os.path.join(directory, "old.sqlite"), "w"):
            pass
        checkDatabase(self.config(f"database: {directory}/old.sqlite\n"))
        checkDatabase(self.config('database: ":memory:"\n'))

    def test_relativeDefault(self) -> None:
        """
        A bare file name is checked against the current directory.
        """
        checkDatabase(self.config(""))

    def test_missingDirectory(self) -> None:
        """
        A directory that does not exist names C{database}.
        """
        missing = os.path.abspath(self.mktemp())
        self.assertDatabaseError(
            f"database: {missing}/x.sqlite\n", f"database: directory {missing} does not exist"
        )

    def test_directoryIsAFile(self) -> None:
        """
        A "directory" that is a regular file is refused.
        """
        notDir = os.path.abspath(self.mktemp())
        with open(notDir, "w"):
            pass
        self.assertDatabaseError(
            f"database: {notDir}/x.sqlite\n", f"database: {notDir} is not a directory"
        )

    def test_databaseIsADirectory(self) -> None:
        """
        A C{database} that is a directory is refused.
        """
        directory = os.path.abspath(self.mktemp())
        os.mkdir(directory)
        self.assertDatabaseError(
            f"database: {directory}\n", f"database: {directory} is a directory"
        )

    def test_unwritableFile(self) -> None:
        """
        An existing file that cannot be written is refused.
        """
        directory = os.path.abspath(self.mktemp())
        os.mkdir(directory)
        target = os.path.join(directory, "x.sqlite")
        with open(target, "w"):
            pass
        realAccess = os.access
        self.patch(
            os, "access",
            lambda p, mode, *a, **kw: False if p == target else realAccess(p, mode, *a, **kw),
        )
        self.assertDatabaseError(
            f"database: {target}\n", f"database: {target} is not writable"
        )

    def test_redisBackendNotChecked(self) -> None:
        """
        With the Redis backend the settings live in Redis: C{database} is
        not looked at.
        """
        checkDatabase(self.config(
            "state: {backend: redis, redis_url: 'redis://127.0.0.1:6379/0'}\n"
            "database: /nonexistent-relay-dir/x.sqlite\n"
        ))

    def test_twistdLogger(self) -> None:
        """
        Under twistd (a parent with a C{logger} option), the options name a
        redacting observer factory in the requested format. It must be a
        dotted name: twistd's C{postOptions} runs after ours and resolves
        C{--logger} with C{namedAny}.
        """
        options = Options()
        options.parent = {"logger": None}
        options.parseOptions(["--config", DEMO, "--log-format", "json"])
        self.assertEqual(options.parent["logger"], "relay.base.logs.jsonStdout")
        self.assertIs(namedAny(options.parent["logger"]), jsonStdout)

        options = Options()
        options.parent = {"logger": None}
        options.parseOptions(["--config", DEMO])
        self.assertIs(namedAny(options.parent["logger"]), textStdout)

    def test_ownPidfile(self) -> None:
        """
        Issue 15: under twistd, relay's default pid file is C{relay.pid} and
        the emulator's C{relay-emulator.pid}, not the shared C{twistd.pid};
        a chosen one (or none, C{--pidfile=}) is kept; under twist (no
        C{pidfile} option) nothing changes.
        """
        from twisted.scripts.twistd import ServerOptions

        from relay.emulator.tap import Options as EmulatorOptions

        for argv, expected in (
            (["-n", "relay", "--config", DEMO], "relay.pid"),
            (["-n", "--pidfile=mine.pid", "relay", "--config", DEMO], "mine.pid"),
            (["-n", "--pidfile=", "relay", "--config", DEMO], ""),
            (["-n", "relay-emulator", "--port", "0"], "relay-emulator.pid"),
        ):
            server = ServerOptions()
            server.parseOptions(argv)
            self.assertEqual(
                server["pidfile"], os.path.abspath(expected) if expected else "", argv
            )
        options = Options()
        options.parent = {"logger": None}
        options.parseOptions(["--config", DEMO])
        self.assertNotIn("pidfile", options.parent)
        emulator = EmulatorOptions()
        emulator.parent = {"pidfile": "twistd.pid"}
        emulator.parseOptions([])
        self.assertEqual(emulator.parent["pidfile"], "relay-emulator.pid")

    def test_twistdLoggerGiven(self) -> None:
        """
        A C{--logger} the operator gave twistd is left alone.
        """
        options = Options()
        options.parent = {"logger": "my.own.observer"}
        options.parseOptions(["--config", DEMO])
        self.assertEqual(options.parent["logger"], "my.own.observer")

    def test_twistLogger(self) -> None:
        """
        Under twist (C{python -m twisted relay}, a parent with a
        C{fileLogObserverFactory}), the factory is replaced by one that
        writes redacted JSON lines when asked.
        """
        options = Options()
        options.parent = {"fileLogObserverFactory": None, "logFile": None}
        options.parseOptions(["--config", DEMO, "--log-format", "json"])
        stream = io.StringIO()
        observer = options.parent["fileLogObserverFactory"](stream)
        observer({"log_format": "key {key}", "key": "sk-relay-demo", "log_time": 0.0})
        line = stream.getvalue().strip()
        self.assertNotIn("sk-relay-demo", line)
        self.assertIsInstance(json.loads(line), dict)


class MakeServiceTests(SynchronousTestCase):
    """
    L{makeService} builds the relay's service tree without touching the
    global reactor when one is passed.
    """

    def options(self, *extra: str) -> Options:
        """
        Options for etc/demo.yaml with its settings database moved to a
        fresh temporary path (nothing is written next to the tests).
        """
        with open(DEMO, encoding="utf-8") as f:
            text = f.read()
        self.database = os.path.abspath(self.mktemp())
        text = text.replace("database: relay-demo.sqlite", f"database: {self.database}")
        path = self.mktemp()
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        options = Options()
        options.parseOptions(["--config", path, *extra])
        self.assertEqual(options.config.database, self.database)
        return options

    def test_children(self) -> None:
        """
        With the memory backend the service is a L{MultiService}; its last
        child is the one listening L{StreamServerEndpointService}, serving
        the relay's site; there is no Redis client; nothing listens until it
        starts.
        """
        reactor = MemoryReactorClock()
        service = makeService(self.options(), reactor=reactor)
        self.assertIsInstance(service, MultiService)
        children = list(service)
        listeners = [c for c in children if isinstance(c, StreamServerEndpointService)]
        self.assertEqual(len(listeners), 1)
        self.assertIs(children[-1], listeners[0])
        self.assertIs(listeners[0].factory, service.relayApplication.site)
        self.assertFalse(
            [c for c in children if type(c).__name__ == "RedisService"],
            "no Redis client with state.backend memory",
        )
        self.assertEqual(reactor.tcpServers, [])

    def failingListen(self, service) -> None:
        """
        Make C{service}'s listener fail as if its port were in use.
        """

        class InUse:
            def listen(self, factory):
                return fail(CannotListenError(
                    "127.0.0.1", 18080, OSError(errno.EADDRINUSE, "Address already in use")
                ))

        service.relayListener.endpoint = InUse()

    def test_portInUse(self) -> None:
        """
        A port in use is one line naming C{listen} on standard error and
        C{SystemExit(2)} (twistd -n and twist), not a CannotListenError
        traceback.
        """
        stderr = patchStderr(self)
        options = self.options("--listen", "tcp:18080:interface=127.0.0.1")
        options.parent = {"nodaemon": True}
        service = makeService(options, reactor=MemoryReactorClock())
        self.failingListen(service)
        e = self.assertRaises(SystemExit, service.privilegedStartService)
        self.assertEqual(e.code, 2)
        self.assertEqual(
            stderr.getvalue(),
            "relay: config error: listen: cannot listen on"
            " tcp:18080:interface=127.0.0.1: Address already in use\n",
        )

    def test_portInUseOnceNoStalePidfile(self) -> None:
        """
        Under C{twistd -n} a port in use is said once (standard error, not
        also the log, which is stdout there too), and the pid file twistd
        wrote for this process is removed: twistd removes it only for an
        L{Exception}, not for the L{SystemExit}.
        """
        stderr = patchStderr(self)
        pidfile = os.path.abspath(self.mktemp())
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
        options = self.options()
        options.parent = {"nodaemon": True, "pidfile": pidfile}
        service = makeService(options, reactor=MemoryReactorClock())
        self.failingListen(service)
        with capturedLogs() as events:
            e = self.assertRaises(SystemExit, service.privilegedStartService)
        self.assertEqual(e.code, 2)
        self.assertEqual(len(stderr.getvalue().splitlines()), 1)
        self.assertEqual([ev for ev in events if ev.get("log_namespace") == "relay.process.app._Listener"],
                         [])
        self.assertFalse(os.path.exists(pidfile))

    def test_portInUseOtherPidfileKept(self) -> None:
        """
        A pid file that is not this process's (another relay's) is left.
        """
        patchStderr(self)
        pidfile = os.path.abspath(self.mktemp())
        with open(pidfile, "w") as f:
            f.write(str(os.getpid() + 1))
        options = self.options()
        options.parent = {"nodaemon": True, "pidfile": pidfile}
        service = makeService(options, reactor=MemoryReactorClock())
        self.failingListen(service)
        self.assertRaises(SystemExit, service.privilegedStartService)
        self.assertTrue(os.path.exists(pidfile))

    def test_portInUseDaemonLogs(self) -> None:
        """
        A daemonising twistd's only record is its log: the line is logged
        there, and twistd removes its own pid file for the exception.
        """
        patchStderr(self)
        options = self.options()
        options.parent = {"nodaemon": False, "pidfile": os.path.abspath(self.mktemp())}
        service = makeService(options, reactor=MemoryReactorClock())
        self.failingListen(service)
        with capturedLogs() as events:
            self.assertRaises(CannotListenError, service.privilegedStartService)
        (logged,) = [ev for ev in events if ev.get("log_namespace") == "relay.process.app._Listener"]
        self.assertEqual(formatEvent(logged), "listen: cannot listen on"
                         " tcp:8080:interface=127.0.0.1: Address already in use")

    def test_portInUseStartService(self) -> None:
        """
        twist starts the service with C{startService} only: the same line.
        """
        stderr = patchStderr(self)
        service = makeService(self.options(), reactor=MemoryReactorClock())
        self.failingListen(service)
        e = self.assertRaises(SystemExit, service.startService)
        self.assertEqual(e.code, 2)
        self.assertEqual(len(stderr.getvalue().splitlines()), 1)
        self.assertIn("listen: cannot listen on", stderr.getvalue())

    def test_portInUseDaemon(self) -> None:
        """
        Under a daemonising twistd the L{CannotListenError} propagates (its
        parent process reports it through a status pipe that a SystemExit
        would leave unwritten); nothing goes to standard error.
        """
        stderr = patchStderr(self)
        options = self.options()
        options.parent = {"nodaemon": False}
        service = makeService(options, reactor=MemoryReactorClock())
        self.failingListen(service)
        self.assertRaises(CannotListenError, service.privilegedStartService)
        self.assertEqual(stderr.getvalue(), "")

    def test_startListens(self) -> None:
        """
        Starting the service listens on the configured port and interface;
        C{--listen} overrides it.
        """
        reactor = MemoryReactorClock()
        service = makeService(
            self.options("--listen", "tcp:18080:interface=127.0.0.1"), reactor=reactor
        )
        service.startService()
        self.addCleanup(service.stopService)
        [(port, factory, _backlog, interface)] = reactor.tcpServers
        self.assertEqual((port, interface), (18080, "127.0.0.1"))
        self.assertIs(factory, service.relayApplication.site)


class PluginTests(SynchronousTestCase):
    """
    The twistd plugins are discoverable from the repository root.
    """

    def plugin(self, tapname: str):
        """
        The L{IServiceMaker} plugin called C{tapname}.
        """
        found = [p for p in getPlugins(IServiceMaker) if p.tapname == tapname]
        self.assertEqual(len(found), 1, f"plugin {tapname!r} not found exactly once")
        return found[0]

    def test_relay(self) -> None:
        """
        The C{relay} plugin provides L{IServiceMaker} and uses L{relay.tap}.
        """
        plugin = self.plugin("relay")
        self.assertTrue(verifyObject(IServiceMaker, plugin))
        self.assertIs(plugin.options, Options)

    def test_emulator(self) -> None:
        """
        The C{relay-emulator} plugin provides L{IServiceMaker}.
        """
        from relay.emulator import tap as emulatorTap

        plugin = self.plugin("relay-emulator")
        self.assertTrue(verifyObject(IServiceMaker, plugin))
        self.assertIs(plugin.options, emulatorTap.Options)


class UnmigratedTokensTests(SynchronousTestCase):
    """
    L{relay.process.app._warnUnmigratedTokens}: with the Redis backend, an existing
    SQLite C{database} may hold the newest OAuth tokens; relay says so.
    """

    def warnings(self, database, accounts):
        from types import SimpleNamespace

        from twisted.logger import globalLogPublisher

        from relay.process.app import _warnUnmigratedTokens

        seen = []

        def observe(event):
            if event.get("event") == "relay.oauth_store_not_migrated":
                seen.append(event)

        globalLogPublisher.addObserver(observe)
        try:
            _warnUnmigratedTokens(SimpleNamespace(database=database, accounts=accounts))
        finally:
            globalLogPublisher.removeObserver(observe)
        return seen

    def test_warnsOnlyWhenTokensMayBeThere(self):
        """
        One warning naming the refreshable OAuth accounts when the file
        exists; none without the file, without a database key, or without
        refreshable OAuth accounts.
        """
        from types import SimpleNamespace

        path = self.mktemp()
        with open(path, "w"):
            pass
        oauth = SimpleNamespace(id="o1", type="oauth", refresh_token="rt")
        apikey = SimpleNamespace(id="a1", type="apikey", refresh_token=None)
        [event] = self.warnings(path, [oauth, apikey])
        self.assertEqual(event["accounts"], "o1")
        self.assertEqual(self.warnings(path + ".missing", [oauth]), [])
        self.assertEqual(self.warnings(None, [oauth]), [])
        self.assertEqual(self.warnings(path, [apikey]), [])


class SettleMemoryTests(SynchronousTestCase):
    """
    L{relay.tap.SettleMemory}: the heap is tidied once, a while after the
    service starts (issue 24, RSS at c=128).
    """

    def test_settlesOnceAfterTheDelay(self) -> None:
        """
        Nothing runs at start; the settle runs once after the delay, and
        not again.
        """
        from twisted.internet.task import Clock

        from relay.tap import SETTLE_AFTER_SECONDS, SettleMemory

        clock = Clock()
        runs = []
        service = SettleMemory(clock, settle=lambda: runs.append(clock.seconds()))
        service.startService()
        clock.advance(SETTLE_AFTER_SECONDS - 0.5)
        self.assertEqual(runs, [])
        clock.advance(1)
        self.assertEqual(runs, [SETTLE_AFTER_SECONDS + 0.5])
        clock.advance(100)
        self.assertEqual(len(runs), 1)
        service.stopService()

    def test_stopBeforeTheDelayCancels(self) -> None:
        """
        A service stopped before the delay leaves no call behind.
        """
        from twisted.internet.task import Clock

        from relay.tap import SettleMemory

        clock = Clock()
        runs = []
        service = SettleMemory(clock, settle=lambda: runs.append(1))
        service.startService()
        service.stopService()
        self.assertEqual(clock.getDelayedCalls(), [])
        clock.advance(100)
        self.assertEqual(runs, [])

    def test_settleMemoryCollectsAndClearsLinecache(self) -> None:
        """
        L{relay.tap.settleMemory} frees unreachable cycles and drops the
        cached source lines (attrs' generated methods among them).
        """
        import gc
        import linecache

        from relay.tap import settleMemory

        class Cycle:
            pass

        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        del a, b
        linecache.cache["<relay-test-settle>"] = (1, None, ["x\n"], "<relay-test-settle>")
        gc.disable()
        try:
            result = settleMemory()
        finally:
            gc.enable()
        self.assertGreaterEqual(result["collected"], 2)
        self.assertNotIn("<relay-test-settle>", linecache.cache)

    def test_settleProcessFreezesAndRaisesTheYoungThreshold(self) -> None:
        """
        L{relay.tap.settleProcess} settles the heap, moves what is alive to
        the collector's permanent generation, and raises the first
        threshold to L{relay.tap.YOUNG_GC_THRESHOLD} (the others kept).
        """
        import gc

        from relay.tap import YOUNG_GC_THRESHOLD, settleProcess

        before = gc.get_threshold()
        self.addCleanup(gc.set_threshold, *before)
        self.addCleanup(gc.unfreeze)
        gc.unfreeze()
        self.assertEqual(gc.get_freeze_count(), 0)
        result = settleProcess()
        self.assertGreater(result["frozen"], 1000)
        self.assertEqual(gc.get_freeze_count(), result["frozen"])
        self.assertIn("collected", result)
        self.assertEqual(gc.get_threshold(), (YOUNG_GC_THRESHOLD,) + before[1:])
        self.assertGreater(YOUNG_GC_THRESHOLD, before[0])

    def test_theServiceRunsSettleProcess(self) -> None:
        """
        L{SettleMemory}'s default settle is L{relay.tap.settleProcess}.
        """
        from twisted.internet.task import Clock

        from relay.tap import SettleMemory, settleProcess

        self.assertIs(SettleMemory(Clock())._settle, settleProcess)

    def test_makeServiceRunsIt(self) -> None:
        """
        The relay service built by L{makeService} includes a
        L{SettleMemory}.
        """
        from relay.tap import SettleMemory

        options = MakeServiceTests.options(self)
        service = makeService(options, reactor=MemoryReactorClock())
        self.assertIn(SettleMemory, [type(s) for s in service])


_LAZY_PROBE = """
import json, sys
from twisted.internet.testing import MemoryReactorClock
from relay.tap import Options, makeService
options = Options()
options.parseOptions(["--config", sys.argv[1]])
makeService(options, reactor=MemoryReactorClock())
print(json.dumps([m for m in ("treq", "jwt", "zstandard", "autobahn") if m in sys.modules]))
"""


class LazyImportTests(SynchronousTestCase):
    """
    Issue 24 (RSS at c=128): treq, PyJWT and zstandard are imported where
    they are first used, unless the configuration uses them, in which case
    they are imported at start (L{relay.process.app.checkImports}); a fresh
    interpreter shows which are loaded once the service is built.
    """

    def loaded(self, accounts: str) -> list:
        import subprocess
        import sys

        path = self.mktemp()
        database = os.path.abspath(self.mktemp())
        with open(path, "w", encoding="utf-8") as f:
            f.write('listen: "tcp:0:interface=127.0.0.1"\n'
                    "keys: [{name: k, key: sk-relay-test-lazy}]\n"
                    f"accounts: [{accounts}]\n"
                    f"database: {database}\n")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run([sys.executable, "-c", _LAZY_PROBE, path], capture_output=True,
                             check=False, text=True, env=dict(os.environ, PYTHONPATH=root),
                             timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def test_apiKeyAccountLoadsNone(self) -> None:
        """
        One direct API-key account: none of the three is imported (the
        WebSocket stack, autobahn, is: the Responses WebSocket is served).
        """
        direct = '{id: a1, type: apikey, base_url: "http://127.0.0.1:9/v1", api_key: sk-up}'
        self.assertEqual(self.loaded(direct), ["autobahn"])

    def test_proxiedAccountLoadsTreq(self) -> None:
        """
        An account behind an egress proxy: treq is imported at start.
        """
        loaded = self.loaded('{id: a1, type: apikey, base_url: "http://127.0.0.1:9/v1", '
                             'api_key: sk-up, proxy: "http://127.0.0.1:3128"}')
        self.assertIn("treq", loaded)
        self.assertNotIn("jwt", loaded)

    def test_checkImportsNamesTheLibrary(self) -> None:
        """
        A library the configuration uses that cannot be imported is a
        L{ConfigError} naming C{accounts} and the library.
        """
        import sys

        from relay.process.app import checkImports
        from relay.configuration.parse import loadConfig

        path = self.mktemp()
        with open(path, "w", encoding="utf-8") as f:
            f.write('listen: "tcp:0:interface=127.0.0.1"\n'
                    "keys: [{name: k, key: sk-relay-test-lazy}]\n"
                    'accounts: [{id: a1, type: apikey, base_url: "http://127.0.0.1:9/v1", '
                    'api_key: sk-up, proxy: "http://127.0.0.1:3128"}]\n')
        config = loadConfig(path)
        self.patch(sys, "modules", dict(sys.modules, **{"treq.client": None}))
        with self.assertRaises(ConfigError) as e:
            checkImports(config)
        self.assertIn("accounts: treq", str(e.exception))
