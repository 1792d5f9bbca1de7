"""
Tests for L{relay.entry.responsesapi}, L{relay.entry.models} and
L{relay.entry.annotate} (issue 20; behaviour.md R87-R92): the routing of
C{/v1/responses/...} and C{/v1/models} onto the engine, with a recording
runner, through L{treq.testing.StubTreq}.
"""

from __future__ import annotations

import json

from treq.testing import StubTreq
from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.entry.annotate import annotateTurn
from relay.entry.http import KeyRing
from relay.entry.root import buildRoot
from relay.base.records import Account, ClientKey, Turn
from relay.scheduling.scheduler import affinityKey

ALICE = ClientKey(name="alice", key="sk-alice", concurrency=0)
BOB = ClientKey(name="bob", key="sk-bob", concurrency=0)


class FakeScheduler:
    def __init__(self, owners, accounts):
        self.owners = owners
        self.accounts = {a.id: a for a in accounts}
        self.lookups = []

    def lookupResponse(self, responseId):
        self.lookups.append(responseId)
        return succeed(self.owners.get(responseId))

    def accountById(self, accountId):
        return self.accounts.get(accountId)


class RecordingRunner:
    """
    A runner that records the turns it is given and answers 200 JSON.
    """

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.clock = Clock()
        self.turns = []

    def run(self, turn, sink):
        self.turns.append(turn)
        sink.writeBody(200, {}, b'{"ok": true}')
        return succeed("completed")


def account(id, type="apikey"):
    return Account(id=id, type=type, base_url="http://u/v1", credential="c")


class RoutingTests(SynchronousTestCase):
    def setUp(self):
        self.scheduler = FakeScheduler(
            {"resp_a": ("a1", "alice"), "resp_o": ("o1", "alice")},
            [account("a1"), account("o1", "oauth")])
        self.runner = RecordingRunner(self.scheduler)
        accounts = [account("a1"), account("o1", "oauth")]
        root = buildRoot(self.runner, KeyRing([ALICE, BOB]), accounts)
        self.treq = StubTreq(root)

    def call(self, method, path, body=None, key="sk-alice", headers=None):
        hdrs = {"Content-Type": "application/json"}
        if key:
            hdrs["Authorization"] = "Bearer " + key
        hdrs.update(headers or {})
        d = self.treq.request(method, "http://relay" + path,
                              data=json.dumps(body).encode() if body is not None else None,
                              headers=hdrs)
        self.treq.flush()
        response = self.successResultOf(d)
        content = response.content()
        self.treq.flush()
        data = self.successResultOf(content)
        return response.code, (json.loads(data) if data else None)

    def test_keyFirst(self):
        """
        A sub-route without a valid key is 401 and looks nothing up.
        """
        self.assertEqual(self.call("GET", "/v1/responses/resp_a", key=None)[0], 401)
        self.assertEqual(self.call("POST", "/v1/responses/compact", {}, key="sk-x")[0], 401)
        self.assertEqual((self.scheduler.lookups, self.runner.turns), ([], []))

    def test_unknownPathsAndMethods(self):
        """
        R87: unknown sub-paths are JSON 404, known ones with another method
        JSON 405; none reaches the engine.
        """
        for method, path, code in (("POST", "/v1/responses/nope", 404),
                                   ("POST", "/v1/responses/resp_a/nope", 404),
                                   ("GET", "/v1/responses/compact", 405),
                                   ("PATCH", "/v1/responses/resp_a", 405),
                                   ("GET", "/v1/responses/resp_a/cancel", 405)):
            status, body = self.call(method, path, {})
            self.assertEqual(status, code, (method, path))
            self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertEqual(self.runner.turns, [])

    def test_ownerChecks(self):
        """
        R87, R104: another key's id, an unknown id and an OAuth-owned id are
        404 without reaching the engine; the owner's key gets a retrieve
        bound to the owning account.
        """
        self.assertEqual(self.call("GET", "/v1/responses/resp_a", key="sk-bob")[0], 404)
        self.assertEqual(self.call("GET", "/v1/responses/resp_none")[0], 404)
        self.assertEqual(self.call("DELETE", "/v1/responses/resp_o")[0], 404)
        self.assertEqual(self.runner.turns, [])
        self.assertEqual(self.call("GET", "/v1/responses/resp_a")[0], 200)
        (turn,) = self.runner.turns
        kind = turn.request
        self.assertEqual((kind.name, kind.method, kind.path, kind.ownerAccountId, kind.usesSlot),
                         ("retrieve", b"GET", "/responses/resp_a", "a1", False))

    def test_subRouteKinds(self):
        """
        Each sub-route becomes its request kind, on every alias of
        C{/v1/responses}.
        """
        self.call("GET", "/v1/responses/resp_a?stream=true&starting_after=3")
        self.call("GET", "/responses/resp_a/input_items?limit=2")
        self.call("POST", "/backend-api/codex/responses/resp_a/cancel", {"any": "body"})
        self.call("DELETE", "/v1/responses/resp_a")
        self.call("POST", "/v1/responses/compact", {"model": "gpt-5.5", "input": "x",
                                                    "stream": True})
        self.call("POST", "/v1/responses/input_tokens", {"model": "gpt-5.5", "input": "x"})
        kinds = [(t.request.name, t.request.method, t.request.path) for t in self.runner.turns]
        self.assertEqual(kinds, [
            ("stream", b"GET", "/responses/resp_a?stream=true&starting_after=3"),
            ("input_items", b"GET", "/responses/resp_a/input_items?limit=2"),
            ("cancel", b"POST", "/responses/resp_a/cancel"),
            ("delete", b"DELETE", "/responses/resp_a"),
            ("compact", b"POST", "/responses/compact"),
            ("input_tokens", b"POST", "/responses/input_tokens"),
        ])
        stream, compact = self.runner.turns[0], self.runner.turns[4]
        self.assertTrue(stream.stream and stream.request.usesSlot)
        self.assertNotIn("stream", compact.body)
        self.assertEqual(compact.compactionItems, [])
        self.assertIsNotNone(compact.sessionHash)

    def test_compactOfAChain(self):
        """
        A compaction of a chain carries its C{previous_response_id} into
        selection (it goes where the chain lives, R40-R42); a bad one is 400.
        """
        self.call("POST", "/v1/responses/compact",
                  {"model": "gpt-5.5", "previous_response_id": "resp_a"})
        self.assertEqual(self.runner.turns[-1].previousResponseId, "resp_a")
        for bad in ("", 7):
            status, _ = self.call("POST", "/v1/responses/compact",
                                  {"model": "gpt-5.5", "previous_response_id": bad})
            self.assertEqual(status, 400)

    def test_compactNeedsAModel(self):
        status, body = self.call("POST", "/v1/responses/compact", {"input": "x"})
        self.assertEqual((status, body["error"]["param"]), (400, "model"))

    def test_turnsStillTurns(self):
        """
        C{POST /v1/responses} itself is a turn, noted for R88-R90.
        """
        self.call("POST", "/v1/responses", {"model": "gpt-5.5", "input": "x",
                                            "background": True})
        (turn,) = self.runner.turns
        self.assertIsNone(turn.request)
        self.assertTrue(turn.background)


class AnnotateTests(SynchronousTestCase):
    def test_affinity(self):
        item = {"type": "compaction", "encrypted_content": "E"}
        body = {"input": [item]}
        turn = Turn(entrypoint="http", endpoint="responses", client=ALICE, model="m", body=body,
                    stream=False, headers={"x-codex-turn-state": "ts_1"})
        annotateTurn(turn)
        self.assertEqual(turn.affinity, (
            ("compaction", affinityKey("compaction", "E")),
            ("turn_state", affinityKey("turn_state", "ts_1"))))
        plain = Turn(entrypoint="ws", endpoint="responses", client=ALICE, model="m",
                     body={"input": [], "background": True}, stream=True)
        annotateTurn(plain)
        self.assertEqual((plain.affinity, plain.background), ((), False))


    def test_usedTriggersDropped(self):
        """
        R89: a trigger passes upstream only as the last input item; one the
        client replayed earlier in the input is dropped, the last one kept.
        """
        trigger = {"type": "compaction_trigger"}
        user = {"type": "message", "role": "user", "content": "x"}
        for given, kept in (([user, trigger, user], [user, user]),
                            ([user, trigger, user, trigger], [user, user, trigger]),
                            ([user, trigger], [user, trigger])):
            body = {"input": given}
            turn = Turn(entrypoint="http", endpoint="responses", client=ALICE, model="m",
                        body=body, stream=False)
            annotateTurn(turn)
            self.assertEqual(turn.body["input"], kept)
            self.assertEqual(body["input"], given)  # the client's body is not changed


class ModelsTests(SynchronousTestCase):
    def test_keyAndETag(self):
        """
        R92: both shapes need a key; the answer carries relay's ETag and a
        matching If-None-Match is a 304.
        """
        from relay.entry.models import ModelsResource

        class Catalog:
            async def manifest(self, key, version, requestId):
                return {"models": [{"slug": "gpt-5.5"}], "version": version}

            async def listing(self, key, requestId):
                return {"object": "list", "data": []}

        treq = StubTreq(ModelsResource(KeyRing([ALICE]), Catalog()))

        def get(path, **headers):
            d = treq.get("http://relay" + path, headers=headers)
            treq.flush()
            response = self.successResultOf(d)
            content = response.content()
            treq.flush()
            return response, self.successResultOf(content)

        self.assertEqual(get("/models")[0].code, 401)
        response, data = get("/models?client_version=0.171.0", Authorization="Bearer sk-alice")
        self.assertEqual(json.loads(data)["version"], "0.171.0")
        etag = response.headers.getRawHeaders(b"etag")[0].decode()
        response, data = get("/models?client_version=0.171.0", Authorization="Bearer sk-alice",
                             **{"If-None-Match": etag})
        self.assertEqual((response.code, data), (304, b""))
        response, data = get("/models", Authorization="Bearer sk-alice")
        self.assertEqual(json.loads(data)["object"], "list")
