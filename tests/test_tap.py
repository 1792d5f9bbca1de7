"""
Tests for L{relay.tap} (the C{twistd relay} options and service) and for
the discovery of the C{relay} and C{relay-emulator} twistd plugins
(style.md 9(f)).
"""

from __future__ import annotations

import io
import json
import os

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import IServiceMaker, MultiService
from twisted.internet.testing import MemoryReactorClock
from twisted.plugin import getPlugins
from twisted.python.reflect import namedAny
from twisted.python.usage import UsageError
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.logs import jsonStdout, textStdout
from relay.tap import Options, makeService

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, os.pardir, "etc", "demo.yaml")
"""etc/demo.yaml, relative to this file so trial's C{_trial_temp} does not matter (trap T3)."""

MINIMAL = """\
listen: "tcp:0:interface=127.0.0.1"
keys: [{name: t, key: sk-relay-tap-test}]
accounts:
  - {id: a1, type: apikey, api_key: sk-tap-account, base_url: "http://127.0.0.1:9/v1"}
"""


class OptionsTests(SynchronousTestCase):
    """
    L{Options} parses the configuration once and turns every problem into a
    one-line L{UsageError}.
    """

    def writeConfig(self, text: str) -> str:
        """
        Write C{text} to a fresh file and return its path.
        """
        path = self.mktemp()
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def assertOneLineUsageError(self, argv, *fragments: str) -> str:
        """
        Parsing C{argv} raises L{UsageError} with a one-line message that
        contains every fragment.
        """
        e = self.assertRaises(UsageError, Options().parseOptions, argv)
        message = str(e)
        self.assertNotIn("\n", message)
        for fragment in fragments:
            self.assertIn(fragment, message)
        return message

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
        An unknown key is a one-line L{UsageError} naming the key path.
        """
        path = self.writeConfig(MINIMAL + "gateway: {foo: 1}\n")
        self.assertOneLineUsageError(["--config", path], "gateway.foo")

    def test_badValue(self) -> None:
        """
        A value of the wrong type names the key and what was expected.
        """
        path = self.writeConfig(MINIMAL + "gateway: {max_account_switches: ten}\n")
        self.assertOneLineUsageError(
            ["--config", path], "gateway.max_account_switches", "expected an integer"
        )

    def test_missingCredential(self) -> None:
        """
        An account without a credential names the account.
        """
        path = self.writeConfig(
            'listen: "tcp:0"\naccounts: [{id: a1, type: apikey, base_url: "http://x/v1"}]\n'
        )
        self.assertOneLineUsageError(["--config", path], "accounts[0] (a1)", "api_key")

    def test_yamlSyntaxError(self) -> None:
        """
        A YAML syntax error is one line with the file position.
        """
        path = self.writeConfig("keys: [unclosed\n")
        self.assertOneLineUsageError(["--config", path], "YAML syntax error")

    def test_missingFile(self) -> None:
        """
        A file that does not exist is a L{UsageError} naming it.
        """
        path = self.mktemp()
        self.assertOneLineUsageError(["--config", path], path)

    def test_secretNotInMessage(self) -> None:
        """
        A bad secret value's error message names the key but not the value.
        """
        path = self.writeConfig(
            MINIMAL.replace("sk-relay-tap-test", "sk-relay-tap-test, concurrency: many")
        )
        message = self.assertOneLineUsageError(["--config", path], "keys[0].concurrency")
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
        An unknown C{--log-format} is a L{UsageError}.
        """
        self.assertOneLineUsageError(
            ["--config", DEMO, "--log-format", "xml"], "--log-format", "xml"
        )

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
        self.assertEqual(options.parent["logger"], "relay.logs.jsonStdout")
        self.assertIs(namedAny(options.parent["logger"]), jsonStdout)

        options = Options()
        options.parent = {"logger": None}
        options.parseOptions(["--config", DEMO])
        self.assertIs(namedAny(options.parent["logger"]), textStdout)

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

    def test_componentCannotImport(self) -> None:
        """
        A C{components:} dotted name that cannot be imported is a one-line
        L{UsageError} at option-parsing time (twistd prints a traceback for
        exceptions in C{makeService}).
        """
        path = self.writeConfig(MINIMAL + "components: {classifier: nosuchpkg.Classifier}\n")
        self.assertOneLineUsageError(
            ["--config", path], "components.classifier", "nosuchpkg.Classifier"
        )

    def test_componentWrongInterface(self) -> None:
        """
        A class that does not implement its interface is a one-line
        L{UsageError} naming the key and the interface.
        """
        path = self.writeConfig(
            MINIMAL + "components: {dialer: relay.classify.DefaultClassifier}\n"
        )
        self.assertOneLineUsageError(
            ["--config", path], "components.dialer", "IUpstreamDialer"
        )

    def test_componentNotCallable(self) -> None:
        """
        A dotted name naming something that is not callable is refused.
        """
        path = self.writeConfig(MINIMAL + "components: {admission: relay.tap.__doc__}\n")
        self.assertOneLineUsageError(["--config", path], "components.admission", "not callable")

    def test_componentGood(self) -> None:
        """
        The built-in classes, named explicitly, are accepted.
        """
        path = self.writeConfig(
            MINIMAL + "components: {classifier: relay.classify.DefaultClassifier}\n"
        )
        options = Options()
        options.parseOptions(["--config", path])
        self.assertEqual(
            options.config.components.classifier, "relay.classify.DefaultClassifier"
        )


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
