"""
Unit tests for L{relay.emulator.chaos}: the emulator's seeded random faults and its per-turn
generation ledger (issue 14's soak), through L{treq.testing.StubTreq} on a L{Clock}.
"""

from __future__ import annotations

import json

from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.emulator import Emulator, EmulatorConfigError
from relay.emulator.chaos import ChaosPlan, TurnLedger, turnKey
from relay.emulator.state import parseFault

EVERY_KIND = [
    {"weight": 1, "kind": "status", "preset": "unavailable"},
    {"weight": 1, "kind": "reset_before_headers"},
    {"weight": 1, "kind": "cut_after_events", "events": 3},
    {"weight": 1, "kind": "ws_handshake_status", "code": 503},
    {"weight": 1, "kind": "stream_error", "transport": "ws", "code": "server_error"},
]


class ChaosPlanTests(SynchronousTestCase):
    """
    Parsing and drawing of L{ChaosPlan}.
    """

    def test_parseRefusesBadConfigurations(self) -> None:
        """
        Unknown keys, C{times}, a rate outside [0, 1], a bad weight and a malformed fault are
        refused with a message naming the key.
        """
        cases = [
            ({"sed": 1}, "unknown keys"),
            ({"rate": 1.5}, "chaos.rate"),
            ({"seed": "x"}, "chaos.seed"),
            ({"faults": [{"kind": "status", "code": 503, "times": 2}]}, "times"),
            ({"faults": [{"kind": "status", "code": 503, "weight": 0}]}, "weight"),
            ({"faults": [{"kind": "nonsense"}]}, "chaos.faults[0]"),
            ({"accounts": "a1"}, "chaos.accounts"),
        ]
        for spec, words in cases:
            with self.assertRaises(ValueError) as caught:
                ChaosPlan.parse(spec)
            self.assertIn(words, str(caught.exception))
        self.assertIsNone(ChaosPlan.parse(None))

    def test_drawIsAFunctionOfSeedKeyAndAttempt(self) -> None:
        """
        The same seed, key and attempt give the same fault whatever was drawn before (arrival
        order does not matter); another seed gives another sequence.
        """
        plan = ChaosPlan.parse({"seed": 3, "rate": 0.5, "faults": EVERY_KIND})
        keys = [(f"turn-{i}", attempt) for i in range(40) for attempt in range(3)]

        def kinds(p, order):
            out = {}
            for key, attempt in order:
                fault = p.pick("a1", key, attempt, "http", False, 0.0)
                out[(key, attempt)] = fault.kind if fault is not None else None
            return out

        forward = kinds(plan, keys)
        self.assertEqual(forward, kinds(plan, list(reversed(keys))))
        other = kinds(ChaosPlan.parse({"seed": 4, "rate": 0.5, "faults": EVERY_KIND}), keys)
        self.assertNotEqual(forward, other)
        drawn = [k for k in forward.values() if k is not None]
        self.assertTrue(0.3 * len(keys) < len(drawn) < 0.7 * len(keys), len(drawn))
        self.assertEqual(set(drawn), {"status", "reset_before_headers", "cut_after_events"})

    def test_stageAndTransportFilter(self) -> None:
        """
        Handshakes draw only C{ws_handshake_*} kinds (with C{handshake_rate}); a fault
        limited to C{transport: ws} is never drawn for HTTP; C{accounts} limits chaos to the
        named accounts.
        """
        plan = ChaosPlan.parse({"seed": 1, "rate": 1, "handshake_rate": 1, "faults": EVERY_KIND,
                                "accounts": ["a1"]})
        for i in range(50):
            shake = plan.pick("a1", f"k{i}", 0, "ws", True, 0.0)
            self.assertEqual(shake.kind, "ws_handshake_status")
            self.assertNotEqual(plan.pick("a1", f"k{i}", 0, "http", False, 0.0).kind,
                                "stream_error")
            self.assertIsNone(plan.pick("a2", f"k{i}", 0, "http", False, 0.0))
        quiet = ChaosPlan.parse({"seed": 1, "rate": 0, "faults": EVERY_KIND})
        self.assertIsNone(quiet.pick("a1", "k", 0, "http", False, 0.0))

    def test_usageLimitResetsIn(self) -> None:
        """
        The C{usage_limit} preset takes C{resets_in_seconds}, so a rehearsal can park an
        account for seconds rather than the default two hours.
        """
        fault = parseFault({"preset": "usage_limit", "resets_in_seconds": 5}, 1000.0)
        self.assertEqual(fault.get("body")["error"]["resets_at"], 1005)
        self.assertEqual(fault.get("body")["error"]["resets_in_seconds"], 5)
        self.assertEqual(fault.get("headers")["x-codex-primary-reset-at"], "1005")
        self.assertNotIn("resets_in_seconds", fault.params)
        default = parseFault({"preset": "usage_limit"}, 1000.0)
        self.assertEqual(default.get("body")["error"]["resets_at"], 8200)


class TurnKeyTests(SynchronousTestCase):
    """
    L{turnKey} and L{TurnLedger}.
    """

    def test_turnKey(self) -> None:
        """
        C{client_metadata.turn_id} wins, else the C{x-client-request-id} header; a WebSocket
        frame (no headers) without metadata has no key.
        """
        headers = {"x-client-request-id": "req-1"}
        self.assertEqual(turnKey({"client_metadata": {"turn_id": "t-1"}}, headers), "t-1")
        self.assertEqual(turnKey({"client_metadata": {"turn_id": ""}}, headers), "req-1")
        self.assertEqual(turnKey({}, headers), "req-1")
        self.assertIsNone(turnKey({"input": "x"}, None))
        self.assertIsNone(turnKey(None, {}))

    def test_ledgerCountsAttempts(self) -> None:
        """
        Each request of a key is the next attempt; requests without a key get sequence keys
        and are not recorded; a generation without a key is ignored.
        """
        ledger = TurnLedger()
        first = ledger.arrived("t", "a1", "http", 1.0)
        second = ledger.arrived("t", "a2", "http", 2.0)
        self.assertEqual((first.attempt, second.attempt), (0, 1))
        self.assertEqual(ledger.handshake("t").attempt, 2)
        anonymous = ledger.arrived(None, "a1", "ws", 3.0)
        self.assertEqual(anonymous.key, None)
        self.assertNotEqual(anonymous.drawKey, ledger.arrived(None, "a1", "ws", 3.0).drawKey)
        ledger.generated(second, "a2", 2.5)
        ledger.generated(anonymous, "a1", 3.5)
        self.assertEqual(ledger.toJSON(), {"t": {
            "requests": [[1.0, "a1", "http"], [2.0, "a2", "http"]],
            "generations": [[2.5, "a2"]]}})


class ChaosResourceTests(SynchronousTestCase):
    """
    Chaos and the ledger through the emulator's HTTP resource.
    """

    def setUp(self) -> None:
        """
        An emulator with one account and a stub client.
        """
        self.clock = Clock()
        self.clock.advance(1_800_000_000)
        self.emulator = Emulator(reactor=self.clock, config={
            "accept_any": False, "accounts": [{"name": "a1", "credential": "sk-a1"}]})
        self.treq = StubTreq(self.emulator.site.resource)

    def _request(self, method: str, path: str, body=None, turn: str | None = None,
                 cut: bool = False):
        """
        Send a request and return C{(response, body bytes)} (with C{cut}, the failure the
        body ends with instead of the bytes).
        """
        headers = {"Authorization": "Bearer sk-a1", "Content-Type": "application/json"}
        if turn is not None:
            headers["X-Client-Request-Id"] = turn
        data = json.dumps(body).encode() if body is not None else b""
        d = self.treq.request(method, "http://emulator" + path, data=data, headers=headers)
        self.treq.flush()
        response = self.successResultOf(d)
        content = response.content()
        self.treq.flush()
        if cut:
            return response, self.failureResultOf(content)
        return response, self.successResultOf(content)

    def test_generationsCounted(self) -> None:
        """
        A stream and a non-stream answer delivered whole are one generation each under the
        turn's key; a stream cut after output, a C{response.failed} and a prewarm are none.
        """
        self._request("POST", "/v1/responses", {"input": "hi", "stream": True}, "t-stream")
        self._request("POST", "/v1/responses", {"input": "hi"}, "t-json")
        self.emulator.setFault("a1", {"kind": "cut_after_events", "events": 3, "times": 1})
        self._request("POST", "/v1/responses", {"input": "hi", "stream": True}, "t-cut",
                      cut=True)
        self.emulator.setFault("a1", {"kind": "stream_error", "times": 1})
        self._request("POST", "/v1/responses", {"input": "hi", "stream": True}, "t-failed")
        self._request("POST", "/v1/responses",
                      {"input": "hi", "stream": True, "generate": False}, "t-prewarm")
        self._request("POST", "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "hi"}], "stream": True},
                      "t-chat")
        _, data = self._request("GET", "/_emulator/turns")
        turns = json.loads(data)
        generations = {key: len(entry["generations"]) for key, entry in turns.items()}
        self.assertEqual(generations, {"t-stream": 1, "t-json": 1, "t-cut": 0, "t-failed": 0,
                                       "t-prewarm": 0, "t-chat": 1})
        self.assertEqual(turns["t-json"]["requests"], [[1_800_000_000, "a1", "http"]])

    def test_chaosControlAndDraw(self) -> None:
        """
        C{PUT /_emulator/chaos} turns chaos on (rate 1: every request gets a fault), C{GET}
        shows it, a bad body is a 400 that changes nothing, C{DELETE} turns it off; a
        scripted fault still wins over chaos.
        """
        spec = {"seed": 5, "rate": 1, "faults": [{"kind": "status", "code": 502}]}
        response, _ = self._request("PUT", "/_emulator/chaos", spec)
        self.assertEqual(response.code, 200)
        _, shown = self._request("GET", "/_emulator/chaos")
        self.assertEqual(json.loads(shown)["faults"], [{"kind": "status", "code": 502,
                                                         "weight": 1.0}])
        bad, _ = self._request("PUT", "/_emulator/chaos", {"rate": 2})
        self.assertEqual(bad.code, 400)
        self.assertEqual(self._request("POST", "/v1/responses", {"input": "x"}, "t1")[0].code,
                         502)
        self.emulator.setFault("a1", {"kind": "status", "code": 418, "times": 1})
        self.assertEqual(self._request("POST", "/v1/responses", {"input": "x"}, "t1")[0].code,
                         418)
        self._request("DELETE", "/_emulator/chaos")
        self.assertEqual(self._request("POST", "/v1/responses", {"input": "x"}, "t1")[0].code,
                         200)
        self._request("DELETE", "/_emulator/turns")
        self.assertEqual(json.loads(self._request("GET", "/_emulator/turns")[1]), {})

    def test_configKey(self) -> None:
        """
        C{chaos:} in the configuration is validated at start-up and put in force.
        """
        with self.assertRaises(EmulatorConfigError):
            Emulator(reactor=self.clock, config={"chaos": {"rate": -1}})
        emulator = Emulator(reactor=self.clock, config={"chaos": {"seed": 2, "rate": 0.1}})
        self.assertEqual(emulator.chaos.seed, 2)
