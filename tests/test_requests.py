"""
Tests for the requests that are not turns (issue 20; behaviour.md R87-R92):
L{relay.engine.requests}, L{relay.engine.compaction}, L{relay.engine.catalog}
and the scheduler parts they use, on the real runner, scheduler, classifier,
memory store and admission with a scripted dialer on a L{Clock} (the rig of
L{tests.test_runner}).
"""

from __future__ import annotations

import json

from twisted.internet.defer import succeed
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from relay.engine import requests as R
from relay.engine.catalog import CaptureSink, ModelCatalog
from relay.engine.compaction import (
    CompactionWatch,
    compactionKeys,
    compactionTurnBody,
    compactShape,
    endsWithTrigger,
)
from relay.engine.payload import isEmptyCompleted
from relay.entry.conversation import ConnectionState
from relay.base.records import ClientKey, Turn
from relay.scheduling.scheduler import NO_SLOT, affinityKey
from relay.wire.sse import Event
from tests.test_runner import FakeResponse, FakeSink, Rig, account, frame, sse, status

KEY = ClientKey(name="t", key="k", concurrency=2)
TRIGGER = {"type": "compaction_trigger"}
USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}


def jsonAnswer(body: dict, code: int = 200, headers=None):
    raw = json.dumps(body).encode()
    return lambda clock: succeed(FakeResponse(
        clock, code=code, headers=headers or {"content-type": "application/json"},
        steps=[(0, raw)]))


class PathDialerRig(Rig):
    """
    The runner rig, its dialer also recording (method, path, body) per request.
    """

    def __init__(self, accounts, **settings):
        super().__init__(accounts, **settings)
        self.sent = []
        inner = self.dialer.request

        def request(account, method, path, body, headers, timeouts):
            self.sent.append((account.id, method, path, json.loads(body) if body else None,
                              dict(headers)))
            return inner(account, method, path, body, headers, timeouts)

        self.dialer.request = request

    def request(self, kind, body=None, model="gpt-5.5", stream=False, client=KEY):
        turn = Turn(entrypoint="http", endpoint="responses", client=client, model=model,
                    body=dict(body or {}), stream=stream, requestId="req", request=kind)
        if kind.name == "compact":
            turn.compactionItems = []
        sink = FakeSink()
        outcome = []
        self.runner.run(turn, sink).addCallback(outcome.append)
        return turn, sink, outcome


COMPACTED = {"id": "resp_c", "object": "response.compaction", "created_at": 1,
             "output": [USER, {"type": "compaction", "id": "cmp_1", "encrypted_content": "E1"}],
             "usage": {"input_tokens": 40, "output_tokens": 4, "total_tokens": 44}}


class CompactTests(SynchronousTestCase):
    def test_apiKeyCompactIsOneRequestToCompact(self) -> None:
        """
        R87: compact goes to the account's /responses/compact with the model
        mapped; the JSON answer reaches the client; its usage is counted; the
        compaction item's producer is remembered (R89).
        """
        rig = PathDialerRig([account("a", model_mapping={"alias": "gpt-5.5"})])
        rig.script("a", jsonAnswer(COMPACTED))
        turn, sink, outcome = rig.request(R.compactRequest(), {"model": "alias", "input": "x"},
                                          model="alias")
        self.assertEqual(outcome, ["completed"])
        (sent,) = rig.sent
        self.assertEqual(sent[1:3], (b"POST", "/responses/compact"))
        self.assertEqual(sent[3]["model"], "gpt-5.5")
        self.assertEqual(json.loads(sink.bodies[0][1])["object"], "response.compaction")
        self.assertEqual(turn.usage.input, 40)
        owner = self.successResultOf(
            rig.scheduler.affinityOwner(affinityKey("compaction", "E1")))
        self.assertEqual(owner, "a")

    def test_failoverAndDeterministic4xx(self) -> None:
        """
        R87, R8: a 503 switches to the next account; a 400 is answered with
        upstream's own status and body after one attempt and marks nothing.
        """
        rig = PathDialerRig([account("a", priority=1), account("b", priority=2)])
        rig.script("a", status(503))
        rig.script("b", jsonAnswer(COMPACTED))
        _, sink, outcome = rig.request(R.compactRequest(), {"model": "gpt-5.5", "input": "x"})
        self.assertEqual(outcome, ["completed"])
        self.assertEqual([s[0] for s in rig.sent], ["a", "b"])
        rig = PathDialerRig([account("a", priority=1), account("b", priority=2)])
        refusal = {"error": {"message": "bad input", "type": "invalid_request_error",
                             "code": "invalid_value", "param": "input"}}
        rig.script("a", status(400, refusal))
        _, sink, outcome = rig.request(R.compactRequest(), {"model": "gpt-5.5", "input": "x"})
        self.assertEqual(outcome, ["failed"])
        (error,) = sink.errors
        self.assertEqual((error.status, error.message), (400, "bad input"))
        self.assertEqual(json.loads(error.rawBody), refusal)
        self.assertEqual([s[0] for s in rig.sent], ["a"])
        state = rig.state("a")
        self.assertEqual((state.blockedUntil, state.rateLimitedUntil, state.disabled),
                         (0, 0, False))

    def test_oauthCompactIsACompactionTurn(self) -> None:
        """
        R87: on an OAuth account compact is the compaction turn on /responses
        (input + trailing trigger, stream, store false), answered in the
        compact shape from the output_item.done compaction item.
        """
        rig = PathDialerRig([account("o", type="oauth")])
        item = {"type": "compaction", "id": "cmp_9", "encrypted_content": "E9"}
        rig.script("o", sse(
            frame("response.created", response={"id": "resp_9", "status": "in_progress"}),
            frame("response.output_item.added", output_index=0, item=item),
            frame("response.output_item.done", output_index=0, item=item),
            frame("response.completed", response={
                "id": "resp_9", "status": "completed", "created_at": 5, "output": [],
                "usage": {"input_tokens": 7, "output_tokens": 1, "total_tokens": 8}}),
        ))
        turn, sink, outcome = rig.request(R.compactRequest(),
                                          {"model": "gpt-5.5", "input": [USER]})
        self.assertEqual(outcome, ["completed"])
        (sent,) = rig.sent
        self.assertEqual(sent[2], "/responses")
        self.assertEqual(sent[3]["input"], [USER, TRIGGER])
        self.assertEqual((sent[3]["stream"], sent[3]["store"]), (True, False))
        answer = json.loads(sink.bodies[0][1])
        self.assertEqual(answer["object"], "response.compaction")
        self.assertEqual(answer["output"], [USER, item])
        self.assertEqual(answer["usage"]["input_tokens"], 7)
        self.assertEqual(turn.usage.input, 7)

    def test_oauthCompactWithoutItemIs502(self) -> None:
        rig = PathDialerRig([account("o", type="oauth")])
        rig.script("o", sse(
            frame("response.created", response={"id": "r", "status": "in_progress"}),
            frame("response.output_text.delta", item_id="m", output_index=0, delta="Hi"),
            frame("response.completed", response={"id": "r", "status": "completed",
                                                   "output": [], "usage": {"input_tokens": 1}}),
        ))
        _, sink, _ = rig.request(R.compactRequest(), {"model": "gpt-5.5", "input": "x"})
        self.assertEqual(sink.errors[0].status, 502)

    def test_helpers(self) -> None:
        self.assertTrue(endsWithTrigger({"input": [USER, TRIGGER]}))
        self.assertFalse(endsWithTrigger({"input": [TRIGGER, USER]}))
        self.assertFalse(endsWithTrigger({"input": "text"}))
        body = compactionTurnBody({"model": "m", "input": "hello", "stream": False,
                                   "store": True, "background": True})
        self.assertEqual(body["input"][-1], TRIGGER)
        self.assertNotIn("background", body)
        keys = compactionKeys([USER, {"type": "compaction", "encrypted_content": "E"}])
        self.assertEqual(keys, (("compaction", affinityKey("compaction", "E")),))
        shape = compactShape({"input": [USER, {"role": "assistant", "content": "x"}]},
                             {"id": "r", "created_at": 1, "output": [
                                 {"type": "compaction", "encrypted_content": "E"}]})
        self.assertEqual([i.get("type") for i in shape["output"]], ["message", "compaction"])


class OwnerBoundTests(SynchronousTestCase):
    def owned(self, rig, name="retrieve", owner="a"):
        method = {"delete": b"DELETE", "cancel": b"POST"}.get(name, b"GET")
        return R.ownedRequest(name, method, "resp_1", owner,
                              {"input_items": "/input_items", "cancel": "/cancel"}.get(name, ""),
                              b"stream=true" if name == "stream" else b"")

    def test_neverMovesAndHoldsNoSlot(self) -> None:
        """
        R87: a retrieve goes to the owner only: a 503 there is the client's
        answer after the owner's attempts, never another account's; a poll
        takes no account slot and no key slot.
        """
        rig = PathDialerRig([account("a", priority=2), account("b", priority=1)])
        rig.script("a", status(503))
        _, sink, outcome = rig.request(self.owned(rig), model=None)
        self.assertEqual(outcome, ["failed"])
        self.assertEqual({s[0] for s in rig.sent}, {"a"})
        self.assertEqual(sink.errors[0].status, 502)
        rig = PathDialerRig([account("a", concurrency=1)])
        rig.script("a", jsonAnswer({"id": "resp_1", "status": "completed"}))
        # The account's one slot and the key's one slot are taken: a poll
        # still goes at once (it holds neither).
        self.successResultOf(rig.admission.tryAcquire("account", "a", 1))
        self.successResultOf(rig.admission.tryAcquire("user", "one", 1))
        _, sink, outcome = rig.request(self.owned(rig), model=None,
                                       client=ClientKey(name="one", key="k1", concurrency=1))
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.sent[-1][1:3], (b"GET", "/responses/resp_1"))

    def test_streamResumeHoldsASlot(self) -> None:
        """
        R88: a stream resume holds the owner's slot while relay streams.
        """
        rig = PathDialerRig([account("a", concurrency=1)])
        rig.script("a", sse(
            frame("response.output_text.delta", item_id="m", output_index=0, delta="Hi"),
            frame("response.completed", response={"id": "resp_1", "status": "completed",
                                                   "output": [], "background": True,
                                                   "usage": {"input_tokens": 3}}),
            delay=1.0))
        _, sink, outcome = rig.request(self.owned(rig, "stream"), model=None, stream=True)
        self.assertEqual(rig.load("a")["a"], (1, 0))
        rig.clock.advance(1.0)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.load("a")["a"], (0, 0))
        self.assertEqual(rig.sent[0][2], "/responses/resp_1?stream=true")
        self.assertEqual(sink.events[-1], "response.completed")

    def test_backgroundUsageCountedOnce(self) -> None:
        """
        R88: polling a finished background response twice counts its usage
        once; a stored response that is not a background one is not
        counted again.
        """
        rig = PathDialerRig([account("a")])
        done = {"id": "resp_1", "status": "completed", "background": True,
                "usage": {"input_tokens": 9, "output_tokens": 1, "total_tokens": 10}}
        rig.script("a", jsonAnswer(done))
        first, _, _ = rig.request(self.owned(rig), model=None)
        second, _, _ = rig.request(self.owned(rig), model=None)
        self.assertEqual((first.usage.input, second.usage), (9, None))
        rig.script("a", jsonAnswer(dict(done, background=False, id="resp_2")))
        third, _, _ = rig.request(R.ownedRequest("retrieve", b"GET", "resp_2", "a"), model=None)
        self.assertIsNone(third.usage)

    def test_removedOwnerIs404(self) -> None:
        rig = PathDialerRig([account("a")])
        _, sink, _ = rig.request(self.owned(rig, owner="gone"), model=None)
        self.assertEqual(sink.errors[0].status, 404)
        self.assertEqual(rig.sent, [])

    def test_requestFinishedWithoutAccount(self) -> None:
        """
        A request that ended before any account (its owner is gone) says
        so in C{relay.request_finished}'s text, never C{on None}.
        """
        from twisted.logger import formatEvent

        rig = PathDialerRig([account("a")])
        with capturedLogs() as logs:
            rig.request(self.owned(rig, owner="gone"), model=None)
        (line,) = [e for e in logs if e.get("event") == "relay.request_finished"]
        self.assertIsNone(line["account_id"])
        self.assertNotIn("None", formatEvent(line))
        self.assertIn("with no account after 0 attempt(s)", formatEvent(line))

    def test_requestFinishedIsNotATurn(self) -> None:
        rig = PathDialerRig([account("a")])
        rig.script("a", jsonAnswer({"id": "resp_1", "deleted": True}))
        with capturedLogs() as logs:
            rig.request(self.owned(rig, "delete"), model=None)
        names = [e.get("event") for e in logs]
        self.assertIn("relay.request_finished", names)
        self.assertNotIn("relay.turn_finished", names)
        (line,) = [e for e in logs if e.get("event") == "relay.request_finished"]
        self.assertEqual((line["request_kind"], line["outcome"]), ("delete", "completed"))


class AccountTypeTests(SynchronousTestCase):
    def test_inputTokensOnApiKeyAccountsOnly(self) -> None:
        """
        R87: input token counts go to an API-key account even when an OAuth
        account is preferred; with none there is a 400 saying why.
        """
        rig = PathDialerRig([account("o", type="oauth", priority=0), account("a", priority=9)])
        rig.script("a", jsonAnswer({"object": "response.input_tokens", "input_tokens": 3}))
        _, sink, outcome = rig.request(R.inputTokensRequest(), {"model": "gpt-5.5", "input": "x"})
        self.assertEqual(outcome, ["completed"])
        self.assertEqual([s[0] for s in rig.sent], ["a"])
        rig = PathDialerRig([account("o", type="oauth")])
        _, sink, _ = rig.request(R.inputTokensRequest(), {"model": "gpt-5.5", "input": "x"})
        self.assertEqual(sink.errors[0].status, 400)
        self.assertIn("API-key", sink.errors[0].message)

    def test_backgroundOnApiKeyAccountsOnly(self) -> None:
        """
        R88: a background create is barred from OAuth accounts.
        """
        rig = Rig([account("o", type="oauth", priority=0), account("a", priority=9)])
        turn = Turn(entrypoint="http", endpoint="responses", client=KEY, model="gpt-5.5",
                    body={"model": "gpt-5.5", "background": True}, stream=False, background=True)
        selection = self.successResultOf(rig.scheduler.select(turn))
        self.assertEqual(selection.account.id, "a")
        rig = Rig([account("o", type="oauth")])
        failure = self.failureResultOf(rig.scheduler.select(turn))
        self.assertEqual(failure.value.error.param, "background")

    def test_manifestOnOAuthAccountsOnly(self) -> None:
        rig = Rig([account("a", priority=0), account("o", type="oauth", priority=9)])
        turn = Turn(entrypoint="http", endpoint="responses", client=KEY, model=None, body={},
                    stream=False, request=R.manifestRequest("0.171.0"))
        self.assertEqual(self.successResultOf(rig.scheduler.select(turn)).account.id, "o")


class SchedulerRecordTests(SynchronousTestCase):
    def test_lookupResponse(self) -> None:
        """
        The owner contract (R39, R104): C{(account id, key name)} once
        recorded, L{None} for an id relay holds no record for.
        """
        rig = Rig([account("a")])
        self.assertIsNone(self.successResultOf(rig.scheduler.lookupResponse("resp_x")))
        turn = Turn(entrypoint="http", endpoint="responses", client=KEY, model="m", body={},
                    stream=False)
        self.successResultOf(rig.scheduler.recordResponse(turn, "resp_x", rig.accounts["a"]))
        self.assertEqual(self.successResultOf(rig.scheduler.lookupResponse("resp_x")), ("a", "t"))

    def test_affinityLayer(self) -> None:
        """
        R89/R90: a turn whose affinity names a recorded account goes there,
        over priority; an unknown record falls through.
        """
        rig = Rig([account("a", priority=1), account("b", priority=9)])
        key = affinityKey("compaction", "E")
        self.successResultOf(rig.scheduler.recordAffinity(key, rig.accounts["b"]))
        turn = Turn(entrypoint="http", endpoint="responses", client=KEY, model="gpt-5.5",
                    body={}, stream=False, affinity=(("compaction", key),))
        selection = self.successResultOf(rig.scheduler.select(turn))
        self.assertEqual((selection.account.id, selection.record.layer), ("b", "compaction"))
        turn.affinity = (("compaction", affinityKey("compaction", "other")),)
        self.assertEqual(self.successResultOf(rig.scheduler.select(turn)).account.id, "a")

    def test_noSlot(self) -> None:
        NO_SLOT.release()
        self.assertIsNone(self.successResultOf(NO_SLOT.renew()))


class WatchAndTranscriptTests(SynchronousTestCase):
    def test_compactionWatchSeesEveryWire(self) -> None:
        """
        R89: the compaction item is found in an output_item.done event, a
        terminal event's output and a JSON body; the raw pass-through is off.
        """
        items = []
        sink = CompactionWatch(FakeSink(), items)
        self.assertIsNone(getattr(sink, "writeRaw", None))
        item = {"type": "compaction", "encrypted_content": "E"}
        sink.writeEvent(Event(b"response.output_item.done", json.dumps(
            {"type": "response.output_item.done", "item": item}).encode()))
        sink.writeBody(200, {}, json.dumps({"output": [dict(item, encrypted_content="F")]}))
        self.assertEqual([i["encrypted_content"] for i in items], ["E", "F"])

    def test_transcriptDropsTriggersAndRestartsFromCompaction(self) -> None:
        """
        R89: the WebSocket transcript never keeps a used trigger and starts
        again at the compaction item.
        """
        state = ConnectionState()
        item = {"type": "compaction", "encrypted_content": "E"}
        state.record(None, [USER, TRIGGER], {"id": "resp_1", "output": [item]})
        self.assertEqual(state.items, [item])
        turn = Turn(entrypoint="ws", endpoint="responses", client=KEY, model="m",
                    body={"input": [USER]}, stream=True, previousResponseId="resp_1")
        self.assertEqual(state.expandedBody(turn)["input"], [item, USER])

    def test_queuedIsNotAnEmptyCompletion(self) -> None:
        self.assertFalse(isEmptyCompleted({"status": "queued", "output": []}))
        self.assertTrue(isEmptyCompleted({"status": "completed", "output": []}))
        self.assertTrue(isEmptyCompleted({"output": []}))


class CatalogTests(SynchronousTestCase):
    MANIFEST = {"models": [{"slug": "gpt-5.5"}, {"slug": "gpt-4.1"}]}

    def test_manifestCachedRevalidatedAndFiltered(self) -> None:
        """
        R92: one fetch serves until the TTL; then a revalidation with the
        upstream's ETag (a 304 keeps the copy); only models an account serves
        are listed.
        """
        rig = PathDialerRig([account("o", type="oauth", models=("gpt-5.5",))])
        catalog = ModelCatalog(runner=rig.runner, accounts=list(rig.accounts.values()), ttl=60)
        rig.script("o", jsonAnswer(self.MANIFEST, headers={"content-type": "application/json",
                                                           "etag": '"v1"'}),
                   jsonAnswer({}, code=304, headers={"etag": '"v1"'}))
        first = self.successResultOf(_run(catalog.manifest(KEY, "0.171.0", "r")))
        self.assertEqual([m["slug"] for m in first["models"]], ["gpt-5.5"])
        _run(catalog.manifest(KEY, "0.171.0", "r"))
        self.assertEqual(len(rig.sent), 1)
        rig.clock.advance(61)
        again = self.successResultOf(_run(catalog.manifest(KEY, "0.171.0", "r")))
        self.assertEqual(again, first)
        self.assertEqual(rig.sent[1][4].get("if-none-match"), '"v1"')
        self.assertEqual(rig.sent[1][2], "/models?client_version=0.171.0")

    def test_listingDeclaredAndUpstream(self) -> None:
        rig = PathDialerRig([account("a", models=("m1",), model_mapping={"alias": "m1"}),
                             account("b")])
        rig.script("b", jsonAnswer({"object": "list", "data": [{"id": "up1"}]}))
        catalog = ModelCatalog(runner=rig.runner, accounts=list(rig.accounts.values()))
        listing = self.successResultOf(_run(catalog.listing(KEY, "r")))
        self.assertEqual([m["id"] for m in listing["data"]], ["alias", "m1", "up1"])
        self.assertEqual([s[0] for s in rig.sent], ["b"])

    def test_captureSink(self) -> None:
        sink = CaptureSink()
        sink.writeBody(200, {"etag": "x"}, b"{}")
        self.assertEqual((sink.status, sink.headers, sink.body), (200, {"etag": "x"}, b"{}"))


def _run(coroutine):
    from twisted.internet.defer import Deferred

    return Deferred.fromCoroutine(coroutine)
