"""
Tests for L{relay.logs}: the observers and the secret redactor.
"""

from __future__ import annotations

import io
import json
import os

from twisted.logger import ILogObserver, Logger, eventsFromJSONLogFile
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay import logs
from relay.config import loadConfig, secretsOf
from relay.logs import SecretRedactor, SecretSet, observerFor

_ETC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "etc")


def _emit(observer, fmt, **kw):
    """
    Emit one event through a L{Logger} bound to C{observer}.
    """
    Logger(namespace="relay.test", observer=observer).info(fmt, **kw)


class SecretRedactorTests(SynchronousTestCase):
    """
    L{SecretRedactor} replaces secrets with C{***} in a copy of each event.
    """

    def setUp(self):
        self.events = []
        self.redactor = SecretRedactor(self.events.append, ["admin-demo", "oauth-emu-a3"])

    def test_provides(self):
        """
        The redactor is an L{ILogObserver}.
        """
        self.assertTrue(verifyObject(ILogObserver, self.redactor))

    def test_knownSecret(self):
        """
        A registered secret is replaced anywhere in a string value, in
        nested containers and in the format string.
        """
        _emit(
            self.redactor,
            "token oauth-emu-a3 seen {detail}",
            detail="admin key admin-demo",
            nested={"list": ["x", "oauth-emu-a3"], "n": 3},
            event="relay.test",
        )
        (event,) = self.events
        self.assertEqual(event["detail"], "admin key ***")
        self.assertEqual(event["nested"], {"list": ["x", "***"], "n": 3})
        self.assertEqual(event["log_format"], "token *** seen {detail}")
        self.assertEqual(event["event"], "relay.test")

    def test_originalUntouched(self):
        """
        The original event (seen by other observers) is not modified.
        """
        original = {"detail": "admin-demo", "nested": ["admin-demo"], "log_format": "{detail}"}
        self.redactor(original)
        self.assertEqual(
            original, {"detail": "admin-demo", "nested": ["admin-demo"], "log_format": "{detail}"}
        )
        self.assertEqual(self.events[0]["detail"], "***")
        self.assertEqual(self.events[0]["nested"], ["***"])

    def test_patterns(self):
        """
        C{sk-...} keys, bearer tokens, JWTs and URL passwords are redacted
        even when not registered.
        """
        self.redactor(
            {
                "a": "key sk-proj-abcdef123456 rejected",
                "b": "Authorization: Bearer tok.en-value, next",
                "c": "jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl end",
                "d": "proxy socks5://user:hunter22@10.0.0.1:1080 down",
                "e": "task-force and mask-on stay",
            }
        )
        (event,) = self.events
        self.assertEqual(event["a"], "key *** rejected")
        self.assertEqual(event["b"], "Authorization: Bearer ***, next")
        self.assertEqual(event["c"], "jwt *** end")
        self.assertEqual(event["d"], "proxy socks5://***@10.0.0.1:1080 down")
        self.assertEqual(event["e"], "task-force and mask-on stay")

    def test_bytes(self):
        """
        Secrets inside byte strings are redacted too.
        """
        self.redactor({"body": b'{"token": "oauth-emu-a3"}'})
        self.assertEqual(self.events[0]["body"], b'{"token": "***"}')

    def test_sharedSetGrows(self):
        """
        Secrets added to a shared L{SecretSet} after construction apply.
        """
        shared = SecretSet()
        events = []
        redactor = SecretRedactor(events.append, shared)
        redactor({"x": "late-secret-1"})
        shared.add(["late-secret-1", "ab"])
        redactor({"x": "late-secret-1 ab"})
        self.assertEqual([e["x"] for e in events], ["late-secret-1", "*** ab"])

    def test_jsonOutputHasNoSecrets(self):
        """
        Through L{observerFor}, JSON output of events carrying every secret
        of the example configuration contains none of them.
        """
        env = {
            "RELAY_ADMIN_KEY": "admin-example-secret",
            "RELAY_KEY_ALICE": "relay-alice-secret",
            "RELAY_PROXY_EGRESS_1": "http://pu:proxy-pass-secret@proxy.example:3128",
            "OPENAI_API_KEY_A1": "upstream-a1-secret",
            "OPENAI_ACCESS_TOKEN_O1": "oauth-token-o1-secret",
            "OPENAI_REFRESH_TOKEN_O1": "oauth-refresh-o1-secret",
        }
        config = loadConfig(os.path.join(_ETC, "relay.example.yaml"), environ=env)
        secrets = secretsOf(config)
        stream = io.StringIO()
        observer = observerFor("json", stream, secrets)
        for secret in sorted(secrets):
            _emit(
                observer, "leaked {value}", value=secret, event="relay.test_leak", account_id="a1"
            )
        output = stream.getvalue()
        for secret in secrets:
            self.assertNotIn(secret, output)
        stream.seek(0)
        events = list(eventsFromJSONLogFile(stream))
        self.assertEqual(len(events), len(secrets))
        self.assertEqual({e["value"] for e in events}, {"***"})
        self.assertEqual({e["account_id"] for e in events}, {"a1"})


class ObserverTests(SynchronousTestCase):
    """
    L{observerFor}, L{logs.jsonStdout} and L{logs.textStdout}.
    """

    def test_text(self):
        """
        The text observer writes rendered, redacted lines.
        """
        stream = io.StringIO()
        _emit(observerFor("text", stream, ["s3cr3t-value"]), "hello {who} s3cr3t-value", who="op")
        self.assertIn("hello op ***", stream.getvalue())

    def test_json(self):
        """
        The JSON observer writes one plain JSON object per line (no record
        separator), so C{json.loads} reads each line.
        """
        stream = io.StringIO()
        _emit(observerFor("json", stream, ()), "hello {who}", who="op", event="relay.hello")
        _emit(observerFor("json", stream, ()), "bye", event="relay.bye")
        lines = stream.getvalue().splitlines()
        self.assertEqual(len(lines), 2)
        record = json.loads(lines[0])
        self.assertEqual((record["who"], record["event"]), ("op", "relay.hello"))

    def test_unknownFormat(self):
        """
        An unknown format is a L{ValueError}.
        """
        self.assertRaises(ValueError, observerFor, "xml", io.StringIO())

    def test_stdoutObservers(self):
        """
        L{logs.jsonStdout} and L{logs.textStdout} are usable as twistd
        C{--logger} factories: called without arguments, they return
        observers that write to stdout and use the registered secrets.
        """
        self.patch(logs, "_registered", SecretSet())
        logs.registerSecrets(["registered-secret-xyz"])
        outputs = []
        for factory in (logs.jsonStdout, logs.textStdout):
            stdout = io.StringIO()
            self.patch(logs.sys, "stdout", stdout)
            observer = factory()
            self.assertTrue(verifyObject(ILogObserver, observer))
            _emit(observer, "value {v}", v="registered-secret-xyz")
            outputs.append(stdout.getvalue())
        jsonOutput, textOutput = outputs
        self.assertEqual(json.loads(jsonOutput.strip("\x1e\n"))["v"], "***")
        self.assertIn("value ***", textOutput)
        self.assertNotIn("registered-secret-xyz", jsonOutput + textOutput)
