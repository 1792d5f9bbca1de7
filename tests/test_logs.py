"""
Tests for L{relay.base.logs}: the observers and the secret redactor.
"""

from __future__ import annotations

import io
import itertools
import json
import os

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.logger import ILogObserver, Logger, LogLevel, eventsFromJSONLogFile
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.base import logs
from relay.configuration.parse import loadConfig, secretsOf
from relay.base.logs import SecretRedactor, SecretSet, observerFor

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


class ContainerRedactionTests(SynchronousTestCase):
    """
    Secrets held by a field's containers in any place a JSON line writes
    them -- a dict's keys, a set's members, a container nested deeper than
    the redactor walks -- are redacted in both formats, on the fused and
    the general way (style.md section 6).
    """

    def _lines(self, **fields):
        """
        @return: the lines C{fields} give in each format, fused and general.
        """
        secrets = SecretSet(["ACCTKEY0123456789"])
        out = []
        for fmt in ("json", "text"):
            for fused in (True, False):
                stream = io.StringIO()
                observer = observerFor(fmt, stream, secrets, worker=None)
                if not fused:
                    observer._hold = None
                _emit(observer, "seen {h}", event="relay.test", **fields)
                out.append(stream.getvalue())
        return out

    def test_dictKeys(self):
        """
        A dict field's keys are redacted like its values.
        """
        for line in self._lines(h={"ACCTKEY0123456789": 1, "Bearer abcdefgh": 2}):
            self.assertNotIn("ACCTKEY0123456789", line)
            self.assertNotIn("abcdefgh", line)

    def test_setMembers(self):
        """
        A set field's members are redacted.
        """
        for line in self._lines(h={"ACCTKEY0123456789", "sk-proj-abcdef123456"}):
            self.assertNotIn("ACCTKEY0123456789", line)
            self.assertNotIn("abcdef123456", line)

    def test_deepNesting(self):
        """
        A secret nested deeper than the redactor's walk is still redacted
        (the deep part is written as its redacted text).
        """
        deep = "ACCTKEY0123456789"
        for _ in range(12):
            deep = [deep]
        lines = self._lines(h=1, deep={"a": deep})
        for line in lines:
            self.assertNotIn("ACCTKEY0123456789", line)
        self.assertIn("***", lines[0])

    def test_secretKeysKeptApart(self):
        """
        Two dict keys that both redact to C{***} keep both values (the
        second is C{***#2}), in a JSON line.
        """
        from relay.base.redact import SecretRedactor

        redactor = SecretRedactor(lambda e: None,
                                  SecretSet(["ACCTKEY0123456789", "OTHERKEY987654321"]))
        out = redactor.redactEvent({"h": {"ACCTKEY0123456789": 1, "OTHERKEY987654321": 2}})["h"]
        self.assertEqual(out, {"***": 1, "***#2": 2})

    def test_deepUnprintable(self):
        """
        A container deeper than the walk whose text cannot be made (an
        element's C{__repr__} raises) is left as it was: the redactor does
        not raise (the line is not lost); a deep one too long to vouch for
        is written as its first part, redacted.
        """
        from relay.base.redact import _DEEP_TEXT, SecretRedactor

        class Broken:
            def __repr__(self):
                raise RuntimeError("no")

        deep = [Broken()]
        for _ in range(12):
            deep = [deep]
        redactor = SecretRedactor(lambda e: None, SecretSet(["ACCTKEY0123456789"]))
        self.assertIs(redactor.redactEvent({"h": {"a": deep}})["h"]["a"], deep)
        long = ["x" * (_DEEP_TEXT * 2) + "ACCTKEY0123456789"]
        for _ in range(12):
            long = [long]
        written = redactor.redactEvent({"h": long})["h"]
        text = repr(written)
        self.assertNotIn("ACCTKEY", text)
        self.assertLess(len(text), _DEEP_TEXT * 2)

    def test_objectTextCut(self):
        """
        An object's text is redacted before the JSON line cuts it to its
        first 2,000 characters: a secret across the cut leaves no prefix.
        """

        class Holder:
            def __str__(self):
                return "x" * 1990 + "ACCTKEY0123456789"

        for line in self._lines(h=Holder()):
            self.assertNotIn("ACCTKEY012", line)


class ControlCharacterTests(SynchronousTestCase):
    """
    A text line never carries a control character from a field (log
    injection): a carriage return, an escape sequence, a C1 control or a
    Unicode line separator in a client's text (a model name) is written
    as its escape, on the fused and the general way; a newline still
    continues the line with a tab, and a JSON line escapes them all.
    """

    HOSTILE = ("gpt\r2026-01-01T00:00:00.000Z [relay.turn_finished#info] FORGED\x1b[2J\u2028\x85\x00\x7f"
               "\u061c\xad\U000e0001\u202e")

    def _lines(self, fmt, fused, **fields):
        stream = io.StringIO()
        observer = observerFor(fmt, stream, SecretSet(), worker=None)
        if not fused:
            observer._hold = None
        for _ in range(2):  # the second event finds its format clean (fused)
            _emit(observer, "no account available for model {model}", event="relay.test",
                  **fields)
        return stream.getvalue().split("\n")[:-1]

    def test_textEscaped(self):
        """
        The model's control characters are escaped: one physical line per
        event, whatever splits lines (C{str.splitlines} too).
        """
        for fused in (True, False):
            lines = self._lines("text", fused, model=self.HOSTILE)
            self.assertEqual(len(lines), 2)
            for line in lines:
                self.assertEqual(line.splitlines(), [line])
                self.assertTrue(line.isprintable(), repr(line))
                self.assertIn("gpt\\r2026-01-01", line)
                self.assertIn("FORGED\\x1b[2J\\u2028\\x85\\x00\\x7f\\u061c\\xad\\U000e0001\\u202e",
                              line)

    def test_newlineContinues(self):
        """
        A newline (a traceback's, a multi-line message's) still continues
        the line with a tab, and a tab stays as it is.
        """
        lines = self._lines("text", True, model="a\nb\tc")
        self.assertEqual([line.split("] ", 1)[-1] for line in lines],
                         ["no account available for model a", "\tb\tc"] * 2)

    def test_jsonEscapes(self):
        """
        The JSON line holds the same text, escaped by JSON.
        """
        for fused in (True, False):
            for line in self._lines("json", fused, model=self.HOSTILE):
                self.assertEqual(json.loads(line)["model"], self.HOSTILE)
                self.assertEqual(line.splitlines(), [line])


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


class LineFormatTests(SynchronousTestCase):
    """
    Issue 15: what each text and JSON line holds (L{logs.formatTextLine},
    L{logs.formatJSONLine}).
    """

    def setUp(self):
        self.text = io.StringIO()
        self.json = io.StringIO()
        textObserver = observerFor("text", self.text, ["sk-secret-abcdef"])
        jsonObserver = observerFor("json", self.json, ["sk-secret-abcdef"])

        def both(event):
            textObserver(event)
            jsonObserver(event)

        self.observer = both
        self.log = Logger(namespace="relay.test.Thing", observer=both)

    def records(self):
        return [json.loads(line) for line in self.json.getvalue().splitlines()]

    def test_textLine(self):
        """
        A text line: ISO-8601 UTC time with milliseconds, then the event's
        name, level and request id in brackets, then the message.
        """
        self.log.warn(
            "switching from {account_id}", event="openai.upstream_failover_switching",
            account_id="a2", request_id="req_1",
        )
        self.log.info("no name here")
        first, second = self.text.getvalue().splitlines()
        self.assertRegex(
            first,
            r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "
            r"\[openai\.upstream_failover_switching#warn req=req_1\] switching from a2$",
        )
        self.assertRegex(second, r"Z \[relay\.test\.Thing#info\] no name here$")

    def test_timesInMessagesAreISO(self):
        """
        C{until}, C{*_until} and C{*_at} placeholders holding a Unix time
        render as ISO-8601 UTC in the message; the JSON field keeps the
        number; durations, formatted fields and other names are untouched.
        """
        self.log.warn(
            "marked until {until}, rate limited until {rate_limited_until}, reset at"
            " {reset_at}; {seconds} s; {until_short:.0f}; at {at}",
            event="relay.account_cooldown_set", until=1796069325.8038597,
            rate_limited_until=1796069385, reset_at=1796069400.5, seconds=10.0,
            until_short=1796069325.8, at=12.5,
        )
        message = (
            "marked until 2026-11-30T20:08:45.803Z, rate limited until"
            " 2026-11-30T20:09:45.000Z, reset at 2026-11-30T20:10:00.500Z; 10.0 s;"
            " 1796069326; at 12.5"
        )
        self.assertTrue(self.text.getvalue().rstrip("\n").endswith(message))
        (record,) = self.records()
        self.assertEqual(record["message"], message)
        self.assertEqual(record["until"], 1796069325.8038597)

    def test_jsonFieldSet(self):
        """
        A JSON line is one flat object: the fixed keys first, then the
        event's own fields; nothing of Twisted's (C{log_*}); own fields
        named like a fixed key are renamed; values JSON cannot hold become
        text.
        """
        class Thing:
            def __str__(self):
                return "a thing"

        self.log.info(
            "attempt on {account_id} failed", event="openai.ops_event", account_id="a1",
            message="upstream said no", time=3, thing=Thing(), raw=b"bytes",
            tags={"b", "a"}, request_id="req_2",
        )
        (record,) = self.records()
        self.assertEqual(list(record)[:5], list(logs.JSON_FIXED_KEYS))
        self.assertEqual(record["level"], "info")
        self.assertEqual(record["event"], "openai.ops_event")
        self.assertEqual(record["message"], "attempt on a1 failed")
        self.assertEqual(record["request_id"], "req_2")
        self.assertEqual(
            {k: record[k] for k in list(record)[5:]},
            {"account_id": "a1", "event_message": "upstream said no", "event_time": 3,
             "thing": "a thing", "raw": "bytes", "tags": ["a", "b"]},
        )

    def test_jsonFailure(self):
        """
        A logged failure adds C{failure} and C{traceback}, as text; the
        text format indents the traceback under its line.
        """
        try:
            raise ZeroDivisionError("division by zero")
        except ZeroDivisionError:
            self.log.failure("while {doing}", doing="dividing", event="relay.test_bug")
        (record,) = self.records()
        self.assertEqual(record["level"], "critical")
        self.assertEqual(record["message"], "while dividing")
        self.assertEqual(record["failure"], "ZeroDivisionError: division by zero")
        self.assertIn("Traceback", record["traceback"])
        lines = self.text.getvalue().splitlines()
        self.assertIn("[relay.test_bug#critical] while dividing", lines[0])
        self.assertTrue(all(line.startswith("\t") for line in lines[1:]))

    def test_legacyEvent(self):
        """
        A C{twisted.python.log} event (e.g. twisted.web's "starting on")
        keeps only its text; its legacy keys are not written.
        """
        from twisted.logger._legacy import publishToNewObserver
        from twisted.python.log import textFromEventDict

        publishToNewObserver(
            self.observer,
            {"message": ("Site starting on 8080",), "isError": 0, "system": "-",
             "time": 1796069325.0},
            textFromEventDict,
        )
        (record,) = self.records()
        self.assertEqual(
            record,
            {"time": "2026-11-30T20:08:45.000Z", "level": "info", "event": "log_legacy",
             "message": "Site starting on 8080", "request_id": None},
        )

    def test_redactedEverywhere(self):
        """
        A secret is redacted in fields, in the message, and in the text of
        an object that JSON could not hold.
        """
        class Leaky:
            def __str__(self):
                return "holding sk-secret-abcdef and Bearer abc.def"

        self.log.info("object {obj}", obj=Leaky(), key="sk-secret-abcdef", event="relay.leak")
        output = self.text.getvalue() + self.json.getvalue()
        self.assertNotIn("sk-secret-abcdef", output)
        self.assertNotIn("abc.def", output)
        (record,) = self.records()
        self.assertEqual(record["key"], "***")
        self.assertEqual(record["message"], "object holding *** and Bearer ***")

    def test_reportReadsIt(self):
        """
        L{relay.console.report.readEvents} reads the JSON lines (and the older
        record-separated form).
        """
        from relay.console.report import buildReport, readEvents

        self.log.info("done", event="relay.turn_finished", entrypoint="http",
                      outcome="completed", status=200, attempts=1, duration_ms=5)
        report = buildReport(readEvents(io.StringIO(self.json.getvalue())))
        self.assertEqual(report["events"], {"relay.turn_finished": 1})
        older = "\x1e" + self.json.getvalue()
        self.assertEqual(len(list(readEvents(io.BytesIO(older.encode())))), 1)


class WorkerFieldTests(SynchronousTestCase):
    """
    Issue 16: the lines of a worker (C{workers: N}) name its index; those
    of a process no supervisor started do not.
    """

    def lines(self, fmt: str, index, **fields) -> str:
        """
        One event written through L{observerFor} with the worker C{index}.
        """
        stream = io.StringIO()
        observer = observerFor(fmt, stream, (), worker=index)
        _emit(observer, "hello {who}", who="op", event="relay.hello", **fields)
        return stream.getvalue()

    def test_json(self):
        """
        A worker's JSON line has C{worker} (its index) right after the
        fixed keys; an own C{worker} field is kept as C{event_worker}.
        """
        record = json.loads(self.lines("json", 1))
        self.assertEqual(list(record)[:6], [*logs.JSON_FIXED_KEYS, "worker"])
        self.assertEqual(record["worker"], 1)
        record = json.loads(self.lines("json", 0, worker="w-own"))
        self.assertEqual((record["worker"], record["event_worker"]), (0, "w-own"))

    def test_text(self):
        """
        A worker's text line ends its brackets with C{worker=N}.
        """
        self.assertRegex(self.lines("text", 2), r"Z \[relay\.hello#info worker=2\] hello op$")

    def test_absentUnlessSupervised(self):
        """
        Without a worker index neither format names one.
        """
        self.assertNotIn("worker", json.loads(self.lines("json", None)))
        self.assertNotIn("worker", self.lines("text", None))

    def test_fromEnvironment(self):
        """
        By default the index is this process's, from C{RELAY_WORKER} (set
        by the supervisor), read when the observer is built.
        """
        from relay.base.logs import WORKER_ENV

        self.addCleanup(os.environ.pop, WORKER_ENV, None)
        os.environ.pop(WORKER_ENV, None)
        plain = io.StringIO()
        plainObserver = observerFor("json", plain, ())
        os.environ[WORKER_ENV] = "3"
        stream = io.StringIO()
        observer = observerFor("json", stream, ())
        text = io.StringIO()
        textObserver = observerFor("text", text, ())
        del os.environ[WORKER_ENV]
        for each in (plainObserver, observer, textObserver):
            _emit(each, "hello", event="relay.hello")
        self.assertEqual(json.loads(stream.getvalue())["worker"], 3)
        self.assertIn(" worker=3]", text.getvalue())
        self.assertNotIn("worker", json.loads(plain.getvalue()))


class AccessLogQueryTests(SynchronousTestCase):
    """
    The access line (C{relay.http_access}) never carries a secret-looking
    query parameter's value.
    """

    def test_redactQuery(self):
        """
        Values of parameters named like a key, token, secret, password or
        auth (any case, also percent-encoded) become C{***}; other
        parameters, the path and the order stay as sent.
        """
        self.assertEqual(
            logs.redactQuery("/v1/responses?api_key=sk-live-1&stream=true&Access_Token=abc"
                             "&x%2DAuth=q&PASSWORD=p&client_secret=s&model=gpt-5"),
            "/v1/responses?api_key=***&stream=true&Access_Token=***&x%2DAuth=***"
            "&PASSWORD=***&client_secret=***&model=gpt-5",
        )
        self.assertEqual(logs.redactQuery("/v1/models"), "/v1/models")
        self.assertEqual(logs.redactQuery("/x?key&token=&a=1"), "/x?key&token=&a=1")

    def test_accessLineRedacted(self):
        """
        C{POST /v1/responses?api_key=...}: the access event's C{path} keeps
        the path and the harmless parameters, and the key is gone.
        """
        from twisted.internet.task import Clock
        from twisted.internet.testing import EventLoggingObserver
        from twisted.logger import globalLogPublisher
        from twisted.web.resource import Resource
        from twisted.web.test.requesthelper import DummyRequest

        from relay.process.app import _Site

        site = _Site(Resource())
        site.clock = Clock()
        request = DummyRequest([b"v1", b"responses"])
        request.method = b"POST"
        request.uri = b"/v1/responses?api_key=sk-query-secret-1&stream=true"
        request.code = 200
        request.sentLength = 12
        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        site.log(request)
        [event] = [e for e in events if e.get("event") == "relay.http_access"]
        self.assertEqual(event["event"], "relay.http_access")
        self.assertEqual(event["path"], "/v1/responses?api_key=***&stream=true")
        self.assertNotIn("sk-query-secret-1", json.dumps(event, default=repr))

    def test_longTextRedactedBeforeCut(self):
        """
        A target or User-Agent longer than the access line keeps is
        redacted before it is cut: a registered secret across the cut
        leaves no prefix in the event (which the observer could no longer
        recognise). Shorter ones are logged as before.
        """
        from twisted.internet.task import Clock
        from twisted.internet.testing import EventLoggingObserver
        from twisted.logger import globalLogPublisher
        from twisted.web.resource import Resource
        from twisted.web.test.requesthelper import DummyRequest

        from relay.process.app import _Site

        self.patch(logs, "_registered", SecretSet())
        secret = "tenant0secret0value0abcdefghij"
        logs.registerSecrets([secret])
        site = _Site(Resource())
        site.clock = Clock()
        request = DummyRequest([b"v1"])
        request.method = b"GET"
        request.uri = b"/v1/" + b"p" * 500 + b"/" + secret.encode()
        request.requestHeaders.setRawHeaders(b"user-agent", [b"a" * 190 + b" " + secret.encode()])
        request.code = 404
        request.sentLength = 1
        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        site.log(request)
        [event] = [e for e in events if e.get("event") == "relay.http_access"]
        self.assertNotIn(secret[:6], event["path"])
        self.assertNotIn(secret[:6], event["user_agent"])
        self.assertEqual(event["path"], ("/v1/" + "p" * 500 + "/***")[:512])
        self.assertEqual(logs.cutRedacted("short " + secret, 100), "short " + secret)

    def test_requestLogAgentRedactedBeforeCut(self):
        """
        The User-Agent a turn keeps for the request log (cut at 200) is
        redacted before the cut too.
        """
        from types import SimpleNamespace

        from twisted.web.test.requesthelper import DummyRequest

        from relay.entry.http import _noteClient

        self.patch(logs, "_registered", SecretSet())
        secret = "tenant0secret0value0abcdefghij"
        logs.registerSecrets([secret])
        request = DummyRequest([b"v1"])
        request.requestHeaders.setRawHeaders(b"user-agent", [b"a" * 190 + b" " + secret.encode()])
        turn = SimpleNamespace()
        _noteClient(turn, request)
        self.assertEqual(turn.userAgent, "a" * 190 + " ***")
        # a short one too: no observer redacts the request log's text
        request.requestHeaders.setRawHeaders(b"user-agent", [b"codex " + secret.encode()])
        _noteClient(turn, request)
        self.assertEqual(turn.userAgent, "codex ***")
        self.assertEqual(logs.cutRedacted("sdk " + secret, 200, always=True), "sdk ***")
        self.assertEqual(logs.cutRedacted("sdk " + secret, 200), "sdk " + secret)

    def test_consolePollingIsDebug(self):
        """
        The console's polling (a C{GET} under C{/admin} that succeeded) is
        logged at debug; admin changes, failed admin reads and client
        traffic stay at info (an open admin tab must not fill the log).
        """
        from twisted.internet.task import Clock
        from twisted.internet.testing import EventLoggingObserver
        from twisted.logger import LogLevel, globalLogPublisher
        from twisted.web.resource import Resource
        from twisted.web.test.requesthelper import DummyRequest

        from relay.process.app import _Site

        site = _Site(Resource())
        site.clock = Clock()
        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)

        def level(method, uri, code=200):
            request = DummyRequest([])
            request.method = method
            request.uri = uri
            request.code = code
            request.sentLength = 1
            site.log(request)
            return [e for e in events if e.get("event") == "relay.http_access"][-1]["log_level"]

        self.assertEqual(level(b"GET", b"/admin/accounts"), LogLevel.debug)
        self.assertEqual(level(b"GET", b"/admin/requests?limit=50"), LogLevel.debug)
        self.assertEqual(level(b"GET", b"/admin/"), LogLevel.debug)
        self.assertEqual(level(b"POST", b"/admin/accounts/a/clear"), LogLevel.info)
        self.assertEqual(level(b"GET", b"/admin/accounts", 401), LogLevel.info)
        self.assertEqual(level(b"GET", b"/v1/models"), LogLevel.info)
        self.assertEqual(level(b"GET", b"/administrator"), LogLevel.info)


class _CountingStream(io.StringIO):
    """
    A text stream that counts its writes.
    """

    writes = 0

    def __init__(self):
        super().__init__()
        self.chunks = []

    def write(self, text):
        self.writes += 1
        self.chunks.append(text)
        return super().write(text)


class BatchedObserverTests(SynchronousTestCase):
    """
    Issue 24 item 1: with C{schedule}, the info lines of one reactor
    iteration leave in one write (L{logs.BatchedFileLogObserver}).
    """

    def setUp(self):
        from twisted.internet.task import Clock

        self.clock = Clock()
        self.stream = _CountingStream()
        self.observer = observerFor(
            "text", self.stream, secrets=["sk-hidden-secret"], worker=None,
            schedule=lambda f: self.clock.callLater(0, f),
        )
        self.log = Logger(observer=self.observer, namespace="relay.test")

    def test_infoLinesShareOneWrite(self):
        for n in range(3):
            self.log.info("line {n} sk-hidden-secret", n=n, event="relay.test_line")
        self.assertEqual((self.stream.getvalue(), self.stream.writes), ("", 0))
        self.clock.advance(0)
        lines = self.stream.getvalue().splitlines()
        self.assertEqual(self.stream.writes, 1)
        self.assertEqual([line.split("] ", 1)[1] for line in lines],
                         ["line 0 ***", "line 1 ***", "line 2 ***"])

    def test_warningWritesAtOnce(self):
        """
        A warning is written at once, after the lines held before it.
        """
        self.log.info("first", event="relay.test_line")
        self.log.warn("second", event="relay.test_warning")
        text = self.stream.getvalue()
        self.assertIn("first", text.splitlines()[0])
        self.assertIn("[relay.test_warning#warn] second", text.splitlines()[1])
        self.clock.advance(0)
        self.assertEqual(self.stream.writes, 1)

    def test_flushLines(self):
        self.log.info("held", event="relay.test_line")
        self.observer.flushLines()
        self.assertIn("held", self.stream.getvalue())

    def test_immediateWithoutSchedule(self):
        stream = _CountingStream()
        log = Logger(observer=observerFor("json", stream, worker=None), namespace="relay.test")
        log.info("now", event="relay.test_line")
        self.assertEqual(json.loads(stream.getvalue())["message"], "now")

    def test_writesStayWithinPipeBuffer(self):
        """
        No write holds more than 4,000 characters (a pipe's atomic write
        is 4,096 bytes): the lines of workers sharing one never interleave.
        """
        for n in range(30):
            self.log.info("{pad}", pad="x" * 300, event="relay.test_line")
        self.clock.advance(0)
        self.assertEqual(len(self.stream.getvalue().splitlines()), 30)
        self.assertGreater(self.stream.writes, 1)
        self.assertTrue(all(len(w) <= 4000 for w in self.stream.chunks))

    def test_nonASCIILineAlone(self):
        self.log.info("plain", event="relay.test_line")
        self.log.info("caf\u00e9", event="relay.test_line")
        self.assertEqual(self.stream.writes, 2)
        self.assertTrue(self.stream.chunks[1].endswith("caf\u00e9\n"))


class ClassLoggerTests(SynchronousTestCase):
    """
    Issue 24: L{logs.ClassLogger} publishes what L{Logger} does, bound once
    per class.
    """

    def _pair(self):
        events = []

        class Plain:
            _log = Logger(observer=events.append)

        class Lean:
            _log = logs.ClassLogger(observer=events.append)

        return events, Plain, Lean

    def test_sameEvent(self):
        """
        An C{info}, C{warn} or C{error} line has the keys, level, format
        and namespace (C{module.Class}) L{Logger} gives it.
        """
        events, Plain, Lean = self._pair()
        for method in ("info", "warn", "error", "debug"):
            del events[:]
            for owner in (Plain(), Lean()):
                getattr(owner._log, method)("a {x}", event="relay.test", x=1)
            plain, lean = events
            self.assertEqual(list(plain), list(lean))
            for key in ("log_level", "log_format", "event", "x"):
                self.assertEqual(plain[key], lean[key])
            self.assertEqual(lean["log_namespace"], f"{__name__}.Lean")
            self.assertEqual(plain["log_namespace"], f"{__name__}.Plain")
            self.assertEqual(lean["log_source"], Lean)

    def test_oncePerClass(self):
        """
        Every read of the attribute, on any instance, is the same logger; a
        subclass has its own namespace.
        """
        events, _, Lean = self._pair()

        class Sub(Lean):
            pass

        self.assertIs(Lean()._log, Lean()._log)
        self.assertIs(Lean()._log, Lean._log)
        self.assertEqual(Sub()._log.namespace, f"{__name__}.Sub")

    def test_badLevel(self):
        """
        An unknown level is reported as L{Logger.emit} reports it.
        """
        events, _, Lean = self._pair()
        Lean()._log.emit("loud", "x")
        self.assertEqual(len(events), 1)
        self.assertIn("invalid log level", events[0]["log_format"])

    def test_textLineMatchesLogger(self):
        """
        The text and JSON lines of both loggers are the same, redacted.
        """
        for fmt in ("text", "json"):
            lines = []
            for kind in (Logger, logs.ClassLogger):
                stream = io.StringIO()
                observer = observerFor(fmt, stream, secrets=["sk-class-secret"], worker=None)
                owner = type("Owner", (), {"_log": kind(observer=observer)})()
                owner._log.info("turn {request_id} on {account_id}", event="relay.test",
                                request_id="req_1", account_id="sk-class-secret")
                lines.append(stream.getvalue())
            plain, lean = lines
            self.assertNotIn("sk-class-secret", lean)
            self.assertEqual(plain.split(" ", 1)[1] if fmt == "text" else
                             json.loads(plain)["message"],
                             lean.split(" ", 1)[1] if fmt == "text" else
                             json.loads(lean)["message"])


class RedactionMemoryTests(SynchronousTestCase):
    """
    Issue 24: a value the redactor found clean is skipped without a check,
    until the secrets change.
    """

    def test_cleanUntilSecretsChange(self):
        """
        A field value seen clean is redacted once it becomes a secret, in
        both formats, in the format's fields and in the others.
        """
        for fmt in ("text", "json"):
            secrets = SecretSet()
            stream = io.StringIO()
            observer = observerFor(fmt, stream, secrets=secrets, worker=None)
            for _ in range(2):
                _emit(observer, "on {account_id}", event="relay.test",
                      account_id="acct-value-1", other="acct-value-1")
            self.assertIn("acct-value-1", stream.getvalue())
            secrets.add(["acct-value-1"])
            stream.seek(0)
            stream.truncate()
            _emit(observer, "on {account_id}", event="relay.test",
                  account_id="acct-value-1", other="acct-value-1")
            self.assertNotIn("acct-value-1", stream.getvalue())
            self.assertIn("***", stream.getvalue())


class LevelFilterTests(SynchronousTestCase):
    """
    Issue 24: L{logs.LevelFilter} passes what twist's level filter passes,
    and L{logs.leanLevelFilter} puts it in that filter's place.
    """

    def test_sameVerdicts(self):
        """
        For every level of the filter and of the event, with and without a
        namespace, the same events pass as through a
        L{FilteringLogObserver} with a L{LogLevelFilterPredicate}.
        """
        from twisted.logger import FilteringLogObserver, LogLevel, LogLevelFilterPredicate

        levels = list(LogLevel.iterconstants())
        for floor in levels:
            twisted, lean = [], []
            reference = FilteringLogObserver(twisted.append, [LogLevelFilterPredicate(floor)])
            ours = logs.LevelFilter(lean.append, floor)
            events = [{"log_level": level, "log_namespace": namespace, "n": i}
                      for i, (level, namespace) in enumerate(
                          (level, namespace) for level in levels + [None]
                          for namespace in ("relay.engine.runner.TurnRunner", "x", "", None))]
            for event in events:
                reference(dict(event))
                ours(dict(event))
            self.assertEqual(lean, twisted)
            self.assertTrue(lean)

    def test_replacesTwistFilter(self):
        """
        The runner's filter around the observer is replaced by a
        L{LevelFilter} of the same level; a filter around another observer,
        or one with namespace levels, is left alone.
        """
        from twisted.logger import (FilteringLogObserver, LogLevel, LogLevelFilterPredicate,
                                    LogPublisher)

        lines, other = [], []
        observer = lines.append
        publisher = LogPublisher()
        runnerFilter = FilteringLogObserver(observer,
                                            [LogLevelFilterPredicate(LogLevel.warn)])
        otherFilter = FilteringLogObserver(other.append, [LogLevelFilterPredicate()])
        publisher.addObserver(otherFilter)
        publisher.addObserver(runnerFilter)
        self.assertTrue(logs.leanLevelFilter(publisher, observer, LogLevel.warn))
        self.assertNotIn(runnerFilter, publisher._observers)
        self.assertIn(otherFilter, publisher._observers)
        Logger(namespace="relay.x", observer=publisher).info("dropped")
        Logger(namespace="relay.x", observer=publisher).warn("kept")
        self.assertEqual([e["log_format"] for e in lines], ["kept"])
        self.assertEqual(len(other), 2)

        predicate = LogLevelFilterPredicate(LogLevel.info)
        predicate.setLogLevelForNamespace("relay", LogLevel.debug)
        observer = other.append
        custom = FilteringLogObserver(observer, [predicate])
        publisher = LogPublisher(custom)
        self.assertFalse(logs.leanLevelFilter(publisher, observer, LogLevel.info))
        self.assertIn(custom, publisher._observers)


class FusedLineTests(SynchronousTestCase):
    """
    The observers write the common line themselves
    (L{logs._TextRedactor.fuse}, L{logs._JSONRedactor.fuse}); every line
    is the one the redactor and L{logs.formatTextLine} or
    L{logs.formatJSONLine} write separately.
    """

    def events(self):
        """
        Events of every shape the fused way takes or declines.
        """
        class Text(str):
            pass

        class Thing:
            def __str__(self):
                return "thing sk-secret-abcdef"

        def event(fmt, **fields):
            base = {"log_namespace": "relay.test.Thing", "log_level": LogLevel.info,
                    "log_format": fmt, "log_time": 1796069325.8038597, "log_source": None}
            base.update(fields)
            return base

        yield event("turn {request_id} {outcome} with status {status} on {account_id}",
                    event="relay.turn_finished", request_id="req_1", outcome="completed",
                    status=200, account_id="a1", other=Thing())
        yield event("{client} \"{method} {path}\" {status} {bytes} in {duration_ms}ms",
                    event="relay.http_access", request_id="req_2", client="127.0.0.1",
                    method="POST", path="/v1/x?api_key=***", status=200, bytes=3,
                    duration_ms=1.5)
        yield event("plain", event="relay.test", request_id=None)
        yield event("100% {x} %s %(x)s {{lit}} {x}", x="a%sb", event="relay.x")
        yield event("only {x}", x=3, event="relay.x")
        yield event("no event or id")
        yield event("number name", event=7, request_id=12)
        yield event("{a} {b} {c} {d}", a=None, b=True, c=1.25, d=-3, event="relay.x")
        yield event("two\nlines {x}", x="and\nmore", event="relay.x", request_id="req_3")
        yield event("{missing} field", event="relay.x")
        yield event("{x!r} {y:>5}", x="a", y="b", event="relay.x")
        yield event("{x.real} {y[0]}", x=1, y=[1], event="relay.x")
        yield event("{} {0}", event="relay.x")
        yield event("until {until}", until=1796069325.5, event="relay.x")
        yield event("secret {x}", x="key sk-secret-abcdef here", event="relay.x")
        yield event("secret in {x}", x=Text("sk-secret-abcdef"), event="relay.x")
        yield event("object {x}", x=Thing(), event="relay.x")
        yield event("list {x}", x=["Bearer abc.def"], event="relay.x")
        yield event("named", event="relay.sk-secret-abcdef", request_id="sk-secret-abcdef")
        yield event("format sk-secret-abcdef {x}", x=1, event="relay.x")
        yield event("warn {x}", x="a", event="relay.x", log_level=LogLevel.warn)
        yield event("no level {x}", x="a", event="relay.x", log_level=None)
        yield event("no time", event="relay.x", log_time=None)
        yield {"log_format": None, "log_level": LogLevel.info, "log_namespace": "n",
               "log_time": 5.0, "event": "relay.none_format"}
        try:
            1 / 0
        except ZeroDivisionError:
            from twisted.python.failure import Failure

            yield event("failed {x}", x="a", event="relay.x", log_failure=Failure())

    def reference(self, fmt, stream, worker):
        """
        The unfused observer of C{fmt}: the redactor, then
        L{logs.formatTextLine} or L{logs.formatJSONLine}.
        """

        def redact(text):
            return reference.redactText(text)

        if fmt == "text":
            kind = logs._TextRedactor

            def format(event):
                return logs.formatTextLine(event, redact, worker)
        else:
            kind = SecretRedactor
            encoder = logs._encoder(redact)

            def format(event):
                return logs.formatJSONLine(event, redact, encoder, worker)

        reference = kind(logs.FileLogObserver(stream, format), ["sk-secret-abcdef"])
        return reference

    def test_sameLines(self):
        """
        For each event, with and without a worker, batched and written at
        once, twice (the second time its values are known clean), the
        fused observer writes the unfused one's bytes, in both formats.
        """
        from relay.base.requestid import currentRequestId

        token = currentRequestId.set("req_context")
        self.addCleanup(currentRequestId.reset, token)
        for fmt, worker, schedule in itertools.product(
            ("text", "json"), (None, 3), (None, lambda f: f())
        ):
            fused, plain = io.StringIO(), io.StringIO()
            observer = observerFor(fmt, fused, ["sk-secret-abcdef"], worker=worker,
                                   schedule=schedule)
            reference = self.reference(fmt, plain, worker)
            for _ in range(2):
                for event in self.events():
                    observer(event)
                    reference(event)
            observer.flushLines()
            self.assertEqual(fused.getvalue(), plain.getvalue())
            self.assertNotIn("sk-secret-abcdef", fused.getvalue())
            self.assertIn("req_context", fused.getvalue())

    def test_bytesStream(self):
        """
        Written at once to a binary stream, a line is UTF-8, as
        L{FileLogObserver} writes it.
        """
        stream = io.BytesIO()
        _emit(observerFor("text", stream, (), worker=None), "caf\u00e9 {x}", x="ok",
              event="relay.x")
        self.assertTrue(stream.getvalue().endswith("caf\u00e9 ok\n".encode()))


class LiteralPrefilterTests(SynchronousTestCase):
    """
    The redactor's literal check (L{SecretRedactor._literalClean})
    answers as the combined pattern's search does.
    """

    def test_sameAnswers(self):
        """
        For texts with and without each pattern's literal, in other cases,
        with non-ASCII look-alikes (C{\u017f} matches C{s} ignoring case)
        and with registered secrets, the literal check and the search agree;
        the texts that need redaction are still redacted.
        """
        import itertools

        redactor = SecretRedactor(lambda e: None, ["oauth-emu-a3", "Zq9-known"])
        redactor._refresh()
        pieces = ["", "req_0123abcdef", "sk-", "sk-proj-abcdef123", "xsk-abcdefgh",
                  "eyJ", "eyJabcdefghij.abc.def", "://", "http://u:p@h", "Bearer",
                  "bEaReR tok", "BASIC x", "ba\u017fic tok", "be\u0430rer tok", "basic",
                  "oauth-emu-a3", "OAUTH-EMU-A3", "zq9-known", "Zq9-known", " ", "\t", "caf\u00e9"]
        texts = {"".join(p) for p in itertools.product(pieces, repeat=2)}
        texts |= {" ".join(p) for p in itertools.product(pieces, repeat=2)}
        for text in sorted(texts):
            self.assertEqual(redactor._literalClean(text),
                             redactor._anyPattern.search(text) is None, text)
        self.assertEqual(redactor.redactText("ba\u017fic tok"), "ba\u017fic ***")
        self.assertEqual(redactor.redactText("x bEaReR tok"), "x bEaReR ***")
        self.assertEqual(redactor.redactText("id Zq9-known"), "id ***")


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(),
    st.text(alphabet="a\x7f\x00\x1f\"\\/\u00e9"), st.lists(st.integers(), max_size=2),
)
"""Values of a JSON line's fields, plain and odd."""


class QuickJSONTests(SynchronousTestCase):
    """
    A JSON line of plain values is written by orjson
    (L{logs._quickJSON}) with the standard library encoder's bytes.
    """

    @settings(max_examples=500, deadline=None)
    @given(st.dictionaries(st.text(max_size=8), _VALUES, max_size=6))
    def test_sameBytes(self, record):
        """
        Whatever a record holds, the quick line is the standard library's
        line or there is none.
        """
        line = logs._quickJSON(record)
        if line is not None:
            self.assertEqual(line, logs._plainEncoder.encode(record) + "\n")

    def test_turnLines(self):
        """
        The lines of a turn (strings, booleans, L{None}, counts,
        milliseconds) take the quick way, through L{observerFor} too.
        """
        self.assertTrue(logs._QUICK_JSON)
        record = {"time": "2026-11-30T00:53:20.123Z", "level": "info", "event": "relay.x",
                  "message": "m \"q\"", "request_id": None, "n": 3, "ok": False,
                  "latency_ms": 0.0123, "skew": 0.0, "big": 2 ** 63 - 1}
        self.assertEqual(logs._quickJSON(record), logs._plainEncoder.encode(record) + "\n")
        for odd in (1e-5, 1e16, float("nan"), 2 ** 63, "caf\u00e9", "del\x7f", [1], b"x"):
            self.assertIsNone(logs._quickJSON(dict(record, odd=odd)))
        stream = io.StringIO()
        _emit(observerFor("json", stream, ["sk-secret-abcdef"], worker=None), "v {v}",
              v="sk-secret-abcdef", n=1.5, event="relay.x")
        self.assertEqual(json.loads(stream.getvalue())["message"], "v ***")


_LITERALS = st.text(alphabet="ab %s()\n{}", max_size=6).map(
    lambda t: t.replace("{", "{{").replace("}", "}}"))
_NAMES = st.sampled_from(["a", "b", "until", "c_at", "x"])
_PLAIN_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                          st.text(max_size=5))


class PlainTemplateTests(SynchronousTestCase):
    """
    A plain format's %-template (L{logs._plainFormatOf}) writes
    what C{str.format_map} writes.
    """

    @settings(max_examples=400, deadline=None)
    @given(st.lists(st.tuples(_LITERALS, _NAMES), max_size=4), _LITERALS,
           st.dictionaries(_NAMES, _PLAIN_VALUES))
    def test_sameText(self, parts, tail, values):
        """
        For formats of literals (with C{%} and braces) and plain
        placeholders, the template renders plain values as C{format_map};
        a missing value is a L{KeyError}; a time field is not plain.
        """
        fmt = "".join(literal + "{" + name + "}" for literal, name in parts) + tail
        plan = logs._plainFormatOf(fmt)
        if any(name in ("until", "c_at") for _, name in parts):
            self.assertIs(plan, False)
            return
        getter, template = plan
        try:
            expected = fmt.format_map(values)
        except KeyError:
            self.assertRaises(KeyError, getter, values)
            return
        self.assertEqual(template % getter(values), expected)
        event = dict(values, log_format=fmt)
        self.assertEqual(logs._message(event, logs._identity), expected)
