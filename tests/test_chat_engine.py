"""
Chat Completions turns on OAuth accounts inside the turn engine (issue 13
item 1, behaviour.md R22, R23, R84, R86): the engine stages and classifies
the upstream Responses events exactly as for a C{/v1/responses} turn, so a
chat turn fails over like a responses turn, and the client sees one clean
chat stream from the account that served it.
"""

from __future__ import annotations

import json

from attrs import evolve
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from relay.interfaces import ITurnSink
from relay.base.records import ClientKey, Turn
from tests.test_runner import (
    CREATED,
    DELTA,
    IN_PROGRESS,
    ITEM_ADDED,
    FakeDialer,
    Rig,
    account,
    frame,
    ok,
    sse,
    status,
)


@implementer(ITurnSink)
class WireSink:
    """
    Records the bytes a client would get, the errors and the body.
    """

    def __init__(self, holdsOutput=False):
        self.committed = False
        self.holdsOutput = holdsOutput
        self.wire = []
        self.errors = []
        self.bodies = []
        self.finished = False

    def keepalive(self):
        pass

    def commit(self, headers):
        self.committed = True

    def writeEvent(self, event):
        self.wire.append(event.raw)

    def writeBody(self, status, headers, body):
        self.bodies.append((status, json.loads(body)))

    def fail(self, error):
        self.errors.append(error)

    def finish(self):
        self.finished = True

    def chunks(self):
        return [json.loads(raw[6:]) for raw in self.wire if raw != b"data: [DONE]\n\n"]


class PathDialer(FakeDialer):
    """
    A L{FakeDialer} that also records each request's path and JSON body.
    """

    def __init__(self, clock):
        super().__init__(clock)
        self.requests = []

    def request(self, account, method, path, body, headers, timeouts):
        self.requests.append((account.id, path, json.loads(body)))
        return super().request(account, method, path, body, headers, timeouts)


def rig(*accounts):
    r = Rig(list(accounts))
    r.dialer = PathDialer(r.clock)
    r.runner.dialer = r.dialer
    return r


def run(r, endpoint, stream=True, sink=None):
    """
    Run one turn of C{endpoint} (C{chat} or C{responses}).
    """
    if endpoint == "chat":
        body = {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}],
                "stream": stream}
    else:
        body = {"model": "gpt-5.5", "input": "hi", "stream": stream}
    turn = Turn(entrypoint="http", endpoint=endpoint,
                client=ClientKey(name="t", key="k", concurrency=0), model="gpt-5.5",
                body=body, stream=stream, requestId="req")
    sink = sink or WireSink(holdsOutput=not stream)
    outcome = []
    r.runner.run(turn, sink).addCallback(outcome.append)
    for _ in range(120):  # same-account backoffs and retry sleeps run on the clock
        if outcome:
            break
        r.clock.advance(1)
    return sink, outcome


OVERLOADED_FAILED = frame("response.failed", response={
    "id": "resp_x", "status": "failed",
    "error": {"code": "server_is_overloaded", "message": "Our servers are overloaded"}})
CONTEXT_FAILED = frame("response.failed", response={
    "id": "resp_x", "status": "failed",
    "error": {"code": "context_length_exceeded",
              "message": "Your input exceeds the context window"}})

SCENARIOS = {
    "5xx": [status(503)],
    "cut_before_output": [sse(CREATED, IN_PROGRESS, end="cut")],
    "ended_without_terminal": [sse(CREATED, IN_PROGRESS, end="done")],
    "in_band_overload_before_output": [sse(CREATED, OVERLOADED_FAILED)],
    "401": [status(401, {"error": {"message": "bad token", "code": "invalid_api_key"}})],
}


class ChatOnOAuthTests(SynchronousTestCase):
    """
    The engine runs chat turns on OAuth accounts (issue 13 item 1).
    """

    def test_sink_interface(self):
        """
        The recording sink provides L{ITurnSink}.
        """
        self.assertTrue(verifyObject(ITurnSink, WireSink()))

    def test_stream_served_by_oauth(self):
        """
        A streaming chat turn on an OAuth account goes to C{/responses} as
        a translated streaming request; the client gets chunks and
        C{[DONE]}.
        """
        r = rig(account("o", type="oauth"))
        sink, outcome = run(r, "chat")
        self.assertEqual(outcome, ["completed"])
        [(aid, path, body)] = r.dialer.requests
        self.assertEqual((aid, path), ("o", "/responses"))
        self.assertEqual(body["input"][0]["content"][0]["text"], "hi")
        self.assertTrue(body["stream"])
        self.assertEqual(sink.wire[-1], b"data: [DONE]\n\n")
        chunks = sink.chunks()
        self.assertEqual(chunks[0]["choices"][0]["delta"], {"role": "assistant", "content": ""})
        self.assertEqual(chunks[1]["choices"][0]["delta"], {"content": "Hi"})
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "stop")
        self.assertTrue(sink.finished)

    def test_json_served_by_oauth(self):
        """
        A non-streaming chat turn on an OAuth account streams upstream and
        answers one C{chat.completion}.
        """
        r = rig(account("o", type="oauth"))
        sink, outcome = run(r, "chat", stream=False)
        self.assertEqual(outcome, ["completed"])
        [(status_, body)] = sink.bodies
        self.assertEqual(status_, 200)
        self.assertEqual(body["object"], "chat.completion")
        self.assertEqual(body["choices"][0]["message"]["content"], "Hi")
        self.assertTrue(r.dialer.requests[0][2]["stream"])

    def test_apikey_chat_is_forwarded(self):
        """
        On an API-key account a chat turn still goes to
        C{/chat/completions} untranslated.
        """
        r = rig(account("k"))
        r.script("k", sse(b'data: {"object":"chat.completion.chunk","choices":[{"index":0,'
                          b'"delta":{"content":"x"}}]}\n\n', b"data: [DONE]\n\n"))
        sink, outcome = run(r, "chat")
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(r.dialer.requests[0][1], "/chat/completions")
        self.assertIn("messages", r.dialer.requests[0][2])

    def test_failover_gives_one_clean_stream(self):
        """
        R84: for each pre-output failure (5xx, a cut or a clean end before
        output, an in-band overload, a 401) the chat turn fails over to the
        next OAuth account and the client sees one stream, from the account
        that served it: one role chunk, no error.
        """
        for name, failure in SCENARIOS.items():
            r = rig(account("bad", type="oauth", priority=1), account("good", type="oauth",
                                                                       priority=2))
            r.script("bad", *failure)
            r.script("good", ok())
            sink, outcome = run(r, "chat")
            self.assertEqual(outcome, ["completed"], name)
            self.assertEqual((r.dialer.ids()[0], r.dialer.ids()[-1]), ("bad", "good"), name)
            chunks = sink.chunks()
            roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
            self.assertEqual(len(roles), 1, name)
            self.assertEqual(sink.errors, [], name)
            self.assertEqual(len({c["id"] for c in chunks}), 1, name)
            self.assertEqual(sink.wire.count(b"data: [DONE]\n\n"), 1, name)

    def test_chat_fails_over_like_responses(self):
        """
        R86 parity: for each scenario, a chat turn and a responses turn try
        the same accounts in the same order and end the same way, streaming
        and not.
        """
        for stream in (True, False):
            for name, failure in SCENARIOS.items():
                seen = {}
                for endpoint in ("responses", "chat"):
                    r = rig(account("bad", type="oauth", priority=1),
                            account("good", type="oauth", priority=2))
                    r.script("bad", *failure)
                    r.script("good", ok())
                    sink, outcome = run(r, endpoint, stream=stream)
                    seen[endpoint] = (outcome, r.dialer.ids())
                self.assertEqual(seen["chat"], seen["responses"], (name, stream))

    def test_policy_failure_is_not_failed_over(self):
        """
        R23, R10: a context window failure before output is the request's
        own: no failover; a chat client gets it as HTTP 400
        C{invalid_request_error}.
        """
        r = rig(account("a", type="oauth", priority=1), account("b", type="oauth", priority=2))
        r.script("a", sse(CREATED, CONTEXT_FAILED))
        sink, outcome = run(r, "chat")
        self.assertEqual(r.dialer.ids(), ["a"])
        [error] = sink.errors
        self.assertEqual((error.status, error.type, error.code),
                         (400, "invalid_request_error", "context_length_exceeded"))
        self.assertEqual(sink.wire, [])

    def test_break_after_output_is_one_error(self):
        """
        After chunks reached the client nothing fails over; the client gets
        relay's error once.
        """
        r = rig(account("a", type="oauth", priority=1), account("b", type="oauth", priority=2))
        r.script("a", sse(CREATED, ITEM_ADDED, DELTA, end="cut"))
        sink, outcome = run(r, "chat")
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(r.dialer.ids(), ["a"])
        self.assertEqual(len(sink.errors), 1)
        self.assertNotIn(b"data: [DONE]\n\n", sink.wire)

    def test_exhausted_chat_error(self):
        """
        When every account failed, the chat client gets R10's error: the
        real status of the last failure with C{api_error}.
        """
        r = rig(account("a", type="oauth"))
        r.script("a", status(500))
        r.runner.settings.current = evolve(r.runner.settings.current, max_account_switches=0)
        sink, outcome = run(r, "chat")
        self.assertEqual(outcome, ["failed"])
        [error] = sink.errors
        self.assertGreaterEqual(error.status, 500)
        self.assertEqual(sink.wire, [])

    def test_completed_terminal_used_for_json(self):
        """
        The JSON answer is built from the events, also when the terminal
        C{response.completed} has C{output: []}.
        """
        empty = frame("response.completed", response={
            "id": "resp_1", "status": "completed", "output": [],
            "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}})
        r = rig(account("o", type="oauth"))
        r.script("o", sse(CREATED, ITEM_ADDED, DELTA, empty))
        sink, _ = run(r, "chat", stream=False)
        [(_, body)] = sink.bodies
        self.assertEqual(body["choices"][0]["message"]["content"], "Hi")
        self.assertEqual(body["usage"]["total_tokens"], 2)
