"""
behaviour.md R106: client-controlled text never marks an account. Upstream
echoes the request in its errors (field names, values, the model name);
relay decides from what upstream asserts about the account (status, code,
type, and phrases only in text the client did not supply). An unknown or
unsupported parameter is R7's rejected field (dropped, retried once on the
same account, R112); a model refusal is R8 row 5's model block for that
model on that account.

The refusals come from the emulator's own templates
(L{relay.emulator.refusals}); the engine runs on a L{Clock} with the
in-memory fakes of L{tests.test_runner}, so the property tests stay cheap.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.emulator.refusals import Refusal, refusalFor
from relay.emulator.ws import wsError
from relay.engine.payload import withoutField
from relay.base.records import Account, ClientKey, GatewaySettings, Turn
from relay.policy import classify as C
from relay.policy import ends as E
from relay.policy import failures as F
from relay.policy.bookkeeping import AccountBookkeeping
from relay.policy.classify import DefaultClassifier, clientStrings, scrubMessage
from relay.policy.health import AccountHealth
from relay.policy.judgement import judge
from relay.state.settings import RuntimeSettings
from relay.state.memory import MemoryStateStore
from tests.test_runner import CREATED, FakeDialer, FakeSink, Rig, account, frame, ok, sse, status

T0 = 1_700_000_000.0

APIKEY = Account(id="a1", type="apikey", base_url="http://u/v1", credential="sk-a1")
OAUTH = Account(
    id="o1", type="oauth", base_url="http://u/backend-api/codex", credential="tok",
    refresh_token="rt",
)

#: Every phrase the R8/R11/R23/R49 rules match in a message, and the issue's own.
PHRASES = tuple(
    dict.fromkeys(
        C.R8_CONTEXT_SUBSTRINGS + C.R8_CONTEXT_PAIR[0] + C.R8_CONTEXT_PAIR[1]
        + C.R8_CONTEXT_ALL + C.R8_MODEL_NOT_FOUND_MESSAGES + C.R8_MODEL_REFUSAL_MESSAGES
        + C.R8_OVERLOAD_MESSAGES + C.R8_PROCESSING_MESSAGES + C.R8_PROCESSING_ALL
        + C.R11_400_DISABLE_MESSAGES + C.R23_ERROR_RETRY_WORDS + C.R23_POLICY_MARKERS
        + C.R106_LIMIT_WORDS + C.R3_MARKERS
        + (
            "Your organization has been disabled.",
            "Identity verification is required",
            "usage limit has been reached",
            "rate limit exceeded",
            "You can retry your request, or contact us through help.openai.com "
            "if the error persists. (Please include the request ID abc)",
            "organization_deactivated",
            "server_is_overloaded",
            "Unknown parameter: 'x'.",
        )
    )
)


def turnFor(body, model=None, entrypoint="http"):
    return Turn(
        entrypoint=entrypoint, endpoint="responses",
        client=ClientKey(name="t", key="k", concurrency=0),
        model=model if model is not None else body.get("model"), body=body,
        stream=True, requestId="req", phase="request" if entrypoint == "http" else "first_turn",
    )


def httpEnd(refusal: Refusal) -> E.StatusRefused:
    return E.StatusRefused(
        refusal.status, {"content-type": "application/json"},
        json.dumps(refusal.body).encode(),
    )


def wsErrorEnd(refusal: Refusal) -> E.InBandFailure:
    return E.InBandFailure(wsError(refusal.status, refusal.error()), E.WIRE_WS)


def failedEnd(refusal: Refusal, wire=E.WIRE_WS) -> E.InBandFailure:
    event = {"type": "response.failed",
             "response": {"id": "resp_1", "status": "failed", "error": refusal.error()}}
    return E.InBandFailure(event, wire)


WIRES = {"http": httpEnd, "ws_error": wsErrorEnd, "ws_failed": failedEnd,
         "sse_failed": lambda r: failedEnd(r, E.WIRE_SSE)}


class Book:
    """
    The real health and bookkeeping on a memory store and a L{Clock}.
    """

    def __init__(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.store = MemoryStateStore(clock=self.clock)
        self.health = AccountHealth(
            store=self.store, clock=self.clock,
            settings=RuntimeSettings(current=GatewaySettings()),
        )
        self.book = AccountBookkeeping(health=self.health, clock=self.clock)

    def record(self, account, end, verdict, model):
        d = self.book.record(account, end, verdict, model)
        self.clock.advance(0)
        return d

    def state(self, account):
        out = []
        self.store.getAccountStates([account.id]).addCallback(out.append)
        return out[0][account.id]


def accountWide(state) -> list:
    """
    What marks an account as a whole (cooled, rate-limited, disabled, a
    streak), as opposed to one model on it.
    """
    found = []
    if state.disabled:
        found.append("disabled: " + state.disabledReason)
    if state.blockedUntil:
        found.append("blocked: " + state.blockReason)
    if state.rateLimitedUntil:
        found.append("rate_limited")
    if state.overloadedUntil:
        found.append("overloaded")
    if state.streaks:
        found.append(f"streaks {state.streaks}")
    return found


class IssueInputTests(SynchronousTestCase):
    """
    R106: the failing inputs found by a hostile tenant, each judged and recorded.
    """

    def setUp(self):
        self.classifier = DefaultClassifier()
        self.book = Book()

    def judgeAndRecord(self, account, end, body, model=None):
        turn = turnFor(body, model)
        verdict = judge(self.classifier, end, account, turn, T0)
        self.book.record(account, end, verdict, turn.model)
        return verdict, self.book.state(account)

    def assertUnmarked(self, state):
        self.assertEqual(accountWide(state), [])
        self.assertEqual(state.modelBlocks, {})
        self.assertIsNone(self.book.health.localBlock(APIKEY.id))
        self.assertIsNone(self.book.health.localBlock(OAUTH.id))

    def test_unknown_parameter_echo_disables_nothing(self):
        """
        The API's C{Unknown parameter} echo of R11's disable phrase: no
        disable, no failover, the field is R7's rejected field.
        """
        name = "identity verification is required"
        body = {"model": "gpt-5.5", "input": "hi", name: 1}
        refusal = refusalFor({"template": "unknown_parameter"}, body)
        for wire, end in WIRES.items():
            verdict, state = self.judgeAndRecord(APIKEY, end(refusal), body)
            self.assertFalse(verdict.failover, wire)
            self.assertEqual(verdict.markings, (), wire)
            self.assertEqual(verdict.rejectedField, name, wire)
            self.assertUnmarked(state)

    def test_backend_unsupported_parameter_echo(self):
        """
        The ChatGPT backend's C{{"detail": "Unsupported parameter: X"}} on
        an OAuth account: the same.
        """
        for name in ("identity verification is required", "Your organization has been disabled",
                     "model not found", "servers are overloaded"):
            body = {"model": "gpt-5.5", "input": "hi", name: 1}
            refusal = refusalFor({"template": "unsupported_parameter"}, body)
            self.assertEqual(refusal.body, {"detail": f"Unsupported parameter: {name}"})
            for wire, end in WIRES.items():
                verdict, state = self.judgeAndRecord(OAUTH, end(refusal), body)
                self.assertFalse(verdict.failover, (name, wire))
                self.assertFalse(verdict.sameAccount, (name, wire))
                self.assertEqual(verdict.markings, (), (name, wire))
                self.assertEqual(verdict.rejectedField, name, (name, wire))
                self.assertUnmarked(state)

    def test_model_not_found_field_blocks_no_model(self):
        """
        A field named "model not found" blocks no model.
        """
        body = {"model": "gpt-5.5", "input": "hi", "model not found": 1}
        refusal = refusalFor({"template": "unknown_parameter"}, body)
        verdict, state = self.judgeAndRecord(APIKEY, httpEnd(refusal), body)
        self.assertNotEqual(verdict.reason, C.REASON_MODEL_NOT_FOUND)
        self.assertUnmarked(state)

    def test_overloaded_field_is_not_retried(self):
        """
        A field named "servers are overloaded" is no capacity shed: no
        same-account backoff retries (the issue saw 4 upstream calls).
        """
        body = {"model": "gpt-5.5", "input": "hi", "servers are overloaded": 1}
        refusal = refusalFor({"template": "unknown_parameter"}, body)
        verdict, _ = self.judgeAndRecord(APIKEY, httpEnd(refusal), body)
        self.assertFalse(verdict.failover)
        self.assertFalse(verdict.sameAccount)
        self.assertFalse(verdict.backoff)

    def test_invalid_value_echo(self):
        """
        C{Invalid value: '<value>'} quoting a phrase marks nothing and is
        not a rejected field.
        """
        for value in PHRASES:
            body = {"model": "gpt-5.5", "input": "hi", "service_tier": value}
            refusal = refusalFor({"template": "invalid_value"}, body)
            self.assertIn(value, refusal.body["error"]["message"])
            verdict, state = self.judgeAndRecord(APIKEY, httpEnd(refusal), body)
            self.assertFalse(verdict.failover, value)
            self.assertIsNone(verdict.rejectedField, value)
            self.assertUnmarked(state)

    def test_project_model_refusal_is_a_model_block(self):
        """
        A project's 403 C{model_not_found} ("does not have access to model")
        is R8 row 5's model block for that model on that account, never the
        account-wide 403 counter: three in parallel leave the account
        schedulable for every other model. The same for 400 and 404, on
        either account type.
        """
        for account in (APIKEY, OAUTH):
            for code in (403, 400, 404):
                book = self.book = Book()
                body = {"model": "o1-pro", "input": "hi"}
                refusal = refusalFor({"template": "model_not_found", "code": code}, body,
                                     credential=account.credential)
                for wire, end in WIRES.items():
                    for _ in range(3):
                        verdict, state = self.judgeAndRecord(account, end(refusal), body)
                        self.assertTrue(verdict.failover, (account.type, code, wire))
                        self.assertFalse(verdict.sameAccount)
                        self.assertEqual(verdict.reason, C.REASON_MODEL_NOT_FOUND)
                        self.assertEqual([m.kind for m in verdict.markings],
                                         [F.MARK_MODEL_BLOCK])
                    self.assertEqual(accountWide(state), [], (account.type, code, wire))
                    self.assertEqual(list(state.modelBlocks), ["o1-pro"])
                    self.assertIsNone(book.health.localBlock(account.id))
                    self.assertIsNone(state.unschedulable(T0, "gpt-5.5"))

    def test_project_refusal_message_without_code(self):
        """
        "does not have access to model" without a code is a model refusal too.
        """
        body = {"model": "o1-pro", "input": "hi"}
        end = E.StatusRefused(403, {}, json.dumps({"error": {
            "message": "Project `proj_x` does not have access to model `o1-pro`",
            "type": "invalid_request_error", "code": None, "param": None}}).encode())
        verdict, state = self.judgeAndRecord(APIKEY, end, body)
        self.assertEqual(verdict.reason, C.REASON_MODEL_NOT_FOUND)
        self.assertEqual(accountWide(state), [])
        self.assertEqual(list(state.modelBlocks), ["o1-pro"])

    def test_model_block_needs_a_model(self):
        """
        A model refusal for a turn without a model blocks nothing (never the
        account).
        """
        body = {"input": "hi"}
        end = E.StatusRefused(404, {}, json.dumps({"error": {
            "message": "The model `x` does not exist", "code": "model_not_found"}}).encode())
        verdict, state = self.judgeAndRecord(APIKEY, end, body, model=None)
        self.assertTrue(verdict.failover)
        self.assertUnmarked(state)

    def test_real_account_messages_still_mark(self):
        """
        R11: real account-level messages the client did not supply still
        disable, even when the request carries unrelated strings.
        """
        body = {"model": "gpt-5.5", "input": [{"role": "user", "content": "organization"}],
                "tools": [{"type": "function", "name": "f", "parameters": {
                    "type": "object", "required": ["model"]}}]}
        for message in ("Your organization has been disabled.",
                        "Identity verification is required to use this model."):
            book = self.book = Book()
            end = E.StatusRefused(400, {}, json.dumps({"error": {
                "message": message, "type": "invalid_request_error", "param": None,
                "code": None}}).encode())
            verdict, state = self.judgeAndRecord(APIKEY, end, body)
            self.assertEqual([m.kind for m in verdict.markings], [F.MARK_DISABLED], message)
            self.assertTrue(state.disabled)
            self.assertIsNotNone(book.health.localBlock(APIKEY.id))
        end = E.StatusRefused(503, {}, json.dumps({"error": {
            "message": "Our servers are currently overloaded.", "code": None}}).encode())
        verdict = judge(self.classifier, end, APIKEY, turnFor(body), T0)
        self.assertEqual(verdict.reason, C.REASON_OVERLOAD)

    def test_upload_names_are_client_text(self):
        """
        An image edit's file name and content type are the client's: an
        upstream message quoting them (without a C{param}) marks nothing.
        They travel beside the form fields (C{turn.upload}), not in the
        body, so they were not taken out before.
        """
        from relay.wire.multipart import Upload

        phrase = "Your organization has been disabled"
        for upload in (Upload(field="image", filename=phrase + ".png",
                              contentType="image/png", data=b"x"),
                       Upload(field="image", filename="a.png",
                              contentType="image/" + phrase, data=b"x")):
            self.book = Book()
            turn = Turn(entrypoint="http", endpoint="image_edits",
                        client=ClientKey(name="t", key="k", concurrency=0),
                        model="gpt-image-1", body={"prompt": "p", "model": "gpt-image-1"},
                        stream=False, requestId="req", upload=(upload,))
            end = E.StatusRefused(400, {}, json.dumps({"error": {
                "message": f"Could not read {upload.filename} ({upload.contentType}).",
                "type": "invalid_request_error", "param": None, "code": None}}).encode())
            verdict = judge(self.classifier, end, APIKEY, turn, T0)
            self.book.record(APIKEY, end, verdict, turn.model)
            self.assertEqual(verdict.markings, ())
            self.assertUnmarked(self.book.state(APIKEY))

    def test_param_is_never_account_level(self):
        """
        An error naming a C{param} never marks the account, whatever its
        status (no 403 counter).
        """
        body = {"model": "gpt-5.5", "input": "hi"}
        end = E.StatusRefused(403, {}, json.dumps({"error": {
            "message": "Invalid 'input': forbidden content", "type": "invalid_request_error",
            "param": "input", "code": None}}).encode())
        verdict, state = self.judgeAndRecord(APIKEY, end, body)
        self.assertEqual(verdict.markings, ())
        self.assertEqual(accountWide(state), [])

    def test_echoed_rate_limit_event_is_not_a_429(self):
        """
        R49's limit words echoed in a status-less stream error are no 429.
        """
        body = {"model": "gpt-5.5", "input": "hi", "usage limit reached": 1}
        event = {"type": "error", "error": {
            "message": "Unsupported parameter: usage limit reached", "type": None}}
        verdict, state = self.judgeAndRecord(APIKEY, E.InBandFailure(event, E.WIRE_WS), body)
        self.assertEqual(verdict.markings, ())
        self.assertEqual(verdict.rejectedField, "usage limit reached")
        self.assertEqual(accountWide(state), [])


class ScrubTests(SynchronousTestCase):
    """
    R106's scrub and the field path of R7's rejected field.
    """

    def test_scrub(self):
        strings = clientStrings({"Servers  ARE overloaded": ["x", {"k": "Model not found!"}]})
        self.assertIn("servers are overloaded", strings)
        self.assertIn("model not found!", strings)
        self.assertEqual(
            scrubMessage("Echo: 'servers are overloaded'", strings), "echo: '\x00'")
        self.assertEqual(scrubMessage("Unknown parameter: 'model not found'.", frozenset()),
                         "unknown parameter")
        # A client string without phrase text is kept: real messages still match.
        self.assertEqual(scrubMessage("The model x is at capacity", clientStrings("model")),
                         "the model x is at capacity")

    def test_withoutField(self):
        body = {"a.b": 1, "a": {"b": 2, "c": 3}, "input": [{"x": 1, "y": 2}]}
        self.assertEqual(withoutField(body, "a.b"), {"a": {"b": 2, "c": 3},
                                                     "input": [{"x": 1, "y": 2}]})
        self.assertEqual(withoutField({"a": {"b": 2, "c": 3}}, "a.b"), {"a": {"c": 3}})
        self.assertEqual(withoutField(body, "input[0].y")["input"], [{"x": 1}])
        self.assertIsNone(withoutField(body, "input[3].y"))
        self.assertIsNone(withoutField(body, "nope"))
        self.assertIsNone(withoutField(body, "input[0]"))
        self.assertEqual(body["a"], {"b": 2, "c": 3})  # never mutated


# -- the engine ---------------------------------------------------------------


class EchoDialer(FakeDialer):
    """
    An upstream that refuses with an emulator template (C{refusal}) and
    serves what it does not refuse; C{wire} C{http} answers the status,
    C{sse_failed} a 200 stream with C{response.failed}.
    """

    refusal: dict = {}
    wire = "http"

    def request(self, account, method, path, body, headers, timeouts):
        self.calls.append((account.id, self.clock.seconds()))
        self.bodies.append(body)
        parsed = json.loads(body)
        refusal = refusalFor(self.refusal, parsed, "responses", account.credential)
        if refusal is None:
            return ok()(self.clock)
        if self.wire == "http":
            return status(refusal.status, refusal.body)(self.clock)
        failed = frame("response.failed", response={
            "id": "resp_1", "status": "failed", "error": refusal.error()})
        return sse(CREATED, failed)(self.clock)


def echoRig(accounts, refusal, wire="http"):
    rig = Rig(accounts)
    rig.dialer = EchoDialer(rig.clock)
    rig.dialer.bodies = []
    rig.dialer.refusal = refusal
    rig.dialer.wire = wire
    rig.runner.dialer = rig.dialer
    return rig


def runTurn(rig, body, model):
    turn = Turn(entrypoint="http", endpoint="responses",
                client=ClientKey(name="t", key="k", concurrency=0), model=model,
                body=body, stream=True, requestId="req")
    sink = FakeSink()
    outcome = []
    rig.runner.run(turn, sink).addCallback(outcome.append)
    rig.clock.advance(0)
    for _ in range(40):
        if outcome:
            break
        rig.clock.advance(1)
    return sink, outcome


class RejectedFieldEngineTests(SynchronousTestCase):
    """
    R7 / R106 / R112: the engine drops a refused field and retries once on
    the same account; a second refusal reaches the client.
    """

    def test_dropped_and_retried_on_the_same_account(self):
        for template in ("unknown_parameter", "unsupported_parameter"):
            for wire in ("http", "sse_failed"):
                rig = echoRig([account("a", priority=1), account("b", priority=2)],
                              {"template": template}, wire)
                name = "identity verification is required"
                sink, outcome = runTurn(
                    rig, {"model": "gpt-5.5", "input": "hi", name: 1}, "gpt-5.5")
                self.assertEqual(outcome, ["completed"], (template, wire))
                self.assertEqual(rig.dialer.ids(), ["a", "a"], (template, wire))
                self.assertNotIn(name.encode(), rig.dialer.bodies[1])
                for id in ("a", "b"):
                    self.assertEqual(accountWide(rig.state(id)), [])

    def test_second_refusal_reaches_the_client(self):
        """
        Two unknown fields: one is dropped, the second refusal is answered
        with upstream's own message, and nothing is marked.
        """
        rig = echoRig([account("a", priority=1), account("b", priority=2)],
                      {"template": "unknown_parameter"})
        body = {"model": "gpt-5.5", "input": "hi", "servers are overloaded": 1,
                "model not found": 2}
        sink, outcome = runTurn(rig, body, "gpt-5.5")
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(rig.dialer.ids(), ["a", "a"])
        self.assertEqual(sink.errors[0].status, 400)
        self.assertEqual(sink.errors[0].message, "Unknown parameter: 'model not found'.")
        self.assertEqual(sink.errors[0].param, "model not found")
        for id in ("a", "b"):
            state = rig.state(id)
            self.assertEqual(accountWide(state), [])
            self.assertEqual(state.modelBlocks, {})

    def test_model_refusal_fails_over_with_a_model_block(self):
        rig = echoRig([account("a", priority=1), account("b", priority=2)],
                      {"template": "model_not_found", "code": 403})
        sink, outcome = runTurn(rig, {"model": "o1-pro", "input": "hi"}, "o1-pro")
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(rig.dialer.ids(), ["a", "b"])
        for id in ("a", "b"):
            state = rig.state(id)
            self.assertEqual(accountWide(state), [])
            self.assertEqual(list(state.modelBlocks), ["o1-pro"])
        # The account serves another model at once.
        rig.dialer.refusal = {"template": "unknown_parameter"}
        sink, outcome = runTurn(rig, {"model": "gpt-5.5", "input": "hi"}, "gpt-5.5")
        self.assertEqual(outcome, ["completed"])


# -- the property -------------------------------------------------------------

_text = st.text(max_size=40)
_phrase = st.sampled_from(PHRASES)
#: A hypothesis-chosen client string: a phrase, a phrase inside other text,
#: or any text.
clientString = st.one_of(
    _phrase,
    st.builds(lambda a, p, b: a + p + b, _text, _phrase, _text),
    st.builds(lambda p: p.upper(), _phrase),
    _text,
)
RESERVED = ("model", "input", "stream", "store", "instructions", "type", "generate",
            "stream_id", "service_tier", "text")
fieldName = clientString.filter(lambda s: s not in RESERVED)
templates = st.sampled_from([
    {"template": "unknown_parameter"},
    {"template": "unsupported_parameter"},
    {"template": "invalid_value"},
    {"template": "invalid_value", "param": "service_tier"},
    {"template": "model_not_found", "code": 400},
    {"template": "model_not_found", "code": 403},
    {"template": "model_not_found", "code": 404},
    {"template": "model_not_supported"},
])
MODEL_REFUSALS = ("model_not_found", "model_not_supported")
PROPERTY = settings(max_examples=2000, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def requestBody(name, value, model, nested, tier):
    return {"model": model, "input": [{"role": "user", "content": nested}],
            "service_tier": tier, name: value}


class ClientTextProperty(SynchronousTestCase):
    """
    R106's class: hypothesis-chosen strings (every R8/R11 phrase among
    them) as field names, values and model names, echoed through every
    error template on every wire, mark no account, block no model but the
    refused one, and cost no more upstream calls than R8 allows.
    """

    @PROPERTY
    @given(templates, st.sampled_from(sorted(WIRES)), st.booleans(), fieldName, clientString,
           clientString, clientString, clientString)
    def test_judged(self, refuse, wire, oauth, name, value, model, nested, tier):
        """
        Every wire (HTTP status, WebSocket C{error} event, WebSocket and SSE
        C{response.failed}), both account types: the judgement and what
        bookkeeping writes.
        """
        acct = OAUTH if oauth else APIKEY
        model = model or "m"
        body = requestBody(name, value, model, nested, tier)
        refusal = refusalFor(refuse, body, credential=acct.credential)
        if refusal is None:
            return
        book = Book()
        end = WIRES[wire](refusal)
        turn = turnFor(body, model, "http" if wire == "http" else "ws")
        verdict = judge(DefaultClassifier(), end, acct, turn, T0)
        if verdict is not None:
            book.record(acct, end, verdict, model)
            self.assertFalse(verdict.sameAccount)
            self.assertFalse(verdict.backoff)
            self.assertFalse(verdict.oauth429)
            kinds = [m.kind for m in verdict.markings]
            if refuse["template"] == "model_not_found":
                self.assertTrue(verdict.failover)  # the code decides
            if verdict.failover:
                # Only a model refusal fails over (a message-only one the
                # client also wrote passes through unjudged: never a mark).
                self.assertIn(refuse["template"], MODEL_REFUSALS)
                self.assertIn(kinds, ([], [F.MARK_MODEL_BLOCK]))
            else:
                self.assertEqual(kinds, [])
        state = book.state(acct)
        self.assertEqual(accountWide(state), [])
        self.assertIn(list(state.modelBlocks),
                      ([], [model]) if refuse["template"] in MODEL_REFUSALS else ([],))
        self.assertIsNone(book.health.localBlock(acct.id))

    @PROPERTY
    @given(templates, st.sampled_from(["http", "sse_failed"]), st.booleans(), fieldName,
           clientString, clientString, clientString, clientString)
    def test_engine(self, refuse, wire, oauth, name, value, model, nested, tier):
        """
        The whole engine on HTTP (status and in-band C{response.failed}),
        three accounts: no account ends cooled, blocked or disabled; a
        refused field costs one same-account retry at most; a model refusal
        tries each account once.
        """
        kind = "oauth" if oauth else "apikey"
        accounts = [account(id, type=kind, priority=i) for i, id in enumerate("abc")]
        rig = echoRig(accounts, refuse, wire)
        model = model or "m"
        sink, outcome = runTurn(rig, requestBody(name, value, model, nested, tier), model)
        self.assertEqual(len(outcome), 1)
        ids = rig.dialer.ids()
        if refuse["template"] in MODEL_REFUSALS:
            self.assertEqual(len(ids), len(set(ids)), ids)  # failover only, never a retry
        else:
            self.assertLessEqual(len(ids), 2, ids)
            self.assertEqual(set(ids), {"a"}, ids)
        for id in "abc":
            state = rig.state(id)
            self.assertEqual(accountWide(state), [], id)
            self.assertIn(list(state.modelBlocks),
                          ([], [model]) if refuse["template"] in MODEL_REFUSALS else ([],))
            self.assertIsNone(rig.health.localBlock(id))


class EmulatorRefusalTests(SynchronousTestCase):
    """
    The emulator's C{refuse} fault and its templates (L{relay.emulator.refusals}).
    """

    def test_parse(self):
        from relay.emulator.chaos import ChaosPlan
        from relay.emulator.state import parseFault

        fault = parseFault({"kind": "refuse", "template": "model_not_found", "code": 403,
                            "wire": "response.failed", "times": 1})
        self.assertEqual((fault.kind, fault.get("code"), fault.times), ("refuse", 403, 1))
        for bad in ({"template": "nope"}, {"template": "model_not_found", "code": 500},
                    {"template": "unknown_parameter", "wire": "close"},
                    {"template": "unknown_parameter", "param": 3}):
            self.assertRaises(ValueError, parseFault, dict(bad, kind="refuse"))
        ChaosPlan.parse({"rate": 1, "faults": [{"kind": "refuse",
                                                "template": "unknown_parameter"}]})

    def test_templates(self):
        body = {"model": "o1-pro", "input": "hi", "service_tier": "v", "zz": 1}
        self.assertEqual(refusalFor({"template": "unknown_parameter"}, body).body, {"error": {
            "message": "Unknown parameter: 'zz'.", "type": "invalid_request_error",
            "param": "zz", "code": "unknown_parameter"}})
        self.assertEqual(refusalFor({"template": "unsupported_parameter"}, body).body,
                         {"detail": "Unsupported parameter: zz"})
        self.assertIsNone(refusalFor({"template": "unknown_parameter"}, {"model": "m"}))
        self.assertIsNone(refusalFor({"template": "unknown_parameter", "param": "x"}, body))
        invalid = refusalFor({"template": "invalid_value"}, body)
        self.assertEqual((invalid.status, invalid.body["error"]["param"]), (400, "service_tier"))
        self.assertTrue(invalid.body["error"]["message"].startswith("Invalid value: 'v'."))
        project = refusalFor({"template": "model_not_found", "code": 403}, body,
                             credential="sk-secret")
        message = project.body["error"]["message"]
        self.assertRegex(message, r"^Project `proj_[0-9a-f]{24}` does not have access to "
                                  r"model `o1-pro`$")
        self.assertNotIn("sk-secret", message)
        self.assertEqual(refusalFor({"template": "model_not_found"}, body).status, 404)
        self.assertEqual(refusalFor({"template": "model_not_found", "code": 400}, body)
                         .body["error"]["param"], "model")
        backend = refusalFor({"template": "model_not_supported"}, body)
        self.assertEqual(backend.error(), {
            "type": "invalid_request_error", "code": None, "param": None,
            "message": "The 'o1-pro' model is not supported when using Codex with a "
                       "ChatGPT account."})
