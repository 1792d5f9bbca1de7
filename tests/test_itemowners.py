"""
behaviour.md R104 for stored items and conversations
(L{relay.scheduling.itemowners}): a turn naming a stored item by id must
own it (relay records the owner of every output item of a completed
response, with the response's owner record, in the same store operation);
a C{conversation} is refused.
"""

from __future__ import annotations

import json

from twisted.internet.defer import fail
from twisted.trial.unittest import SynchronousTestCase

from relay.engine.compaction import inputFacts
from relay.entry.annotate import annotateTurn
from relay.base.records import ClientKey, Turn
from relay.scheduling.itemowners import (
    MAX_OWNED_ITEMS,
    itemOwnerKey,
    outputItemIds,
)
from relay.scheduling.scheduler import responseOwnerKey
from tests.test_runner import Rig, sse, status
from tests.test_runner import account as raccount
from tests.test_runner import frame as sseFrame
from tests.test_scheduler import SchedulerMixin, account

ALICE = ClientKey(name="alice", key="sk-alice", concurrency=0)
BOB = ClientKey(name="bob", key="sk-bob", concurrency=0)


def references(items) -> list:
    out = []
    inputFacts(items, out)
    return out


def turnWith(client, items=None, entrypoint="http", **body):
    body = {"model": "gpt-5.5", **({"input": items} if items is not None else {}), **body}
    turn = Turn(entrypoint=entrypoint, endpoint="responses", client=client, model="gpt-5.5",
                body=body, stream=True, wsMode="ctx_pool" if entrypoint == "ws" else None,
                requestId="r")
    annotateTurn(turn)
    return turn


def ref(itemId):
    return {"type": "item_reference", "id": itemId}


class ReferenceTests(SynchronousTestCase):
    """
    Which input items make upstream resolve a stored item by id.
    """

    def test_itemReference(self):
        self.assertEqual(references([ref("msg_a"), ref("fc_b")]), ["msg_a", "fc_b"])

    def test_untypedIdOnly(self):
        """
        C{ItemReference.type} is optional: an item with an id and no type
        nor role is a reference; an easy message is not.
        """
        self.assertEqual(references([{"id": "msg_a"}]), ["msg_a"])
        self.assertEqual(references([{"role": "user", "content": "hi", "id": "msg_x"}]), [])

    def test_sameAsTheWalkOverEveryItem(self):
        """
        L{inputFacts} reads only the items a rule needs, finding them by
        type in one C-level pass; the answer is the one walk over every
        item gives, also for inputs that take that walk (a non-dict item,
        an unhashable C{type}, a dict subclass).
        """
        from collections import OrderedDict

        from relay.engine.compaction import COMPACTION_TRIGGER
        from relay.scheduling.itemowners import storedReference
        from relay.scheduling.scheduler import affinityKey

        def walk(items, refs):
            if type(items) is not list:
                return (), False
            keys, misplaced, last = (), False, len(items) - 1
            for index, item in enumerate(items):
                if type(item) is not dict:
                    continue
                kind = item.get("type")
                if kind == "compaction":
                    content = item.get("encrypted_content")
                    if isinstance(content, str) and content:
                        keys += (("compaction", affinityKey("compaction", content)),)
                elif kind == COMPACTION_TRIGGER and index != last:
                    misplaced = True
                elif refs is not None and kind in ("reasoning", "item_reference", None):
                    r = storedReference(item, kind)
                    if r is not None:
                        refs.append(r)
            return keys, misplaced

        history = [{"type": "message", "role": "user", "content": "hi"},
                   {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                   {"type": "reasoning", "id": "rs_1", "encrypted_content": "gAAA"},
                   {"type": "reasoning", "id": "rs_2"},
                   {"type": "compaction", "encrypted_content": "enc"},
                   {"type": "compaction", "encrypted_content": ""},
                   {"type": COMPACTION_TRIGGER}, ref("msg_a"), {"id": "msg_b"},
                   {"role": "user", "content": "x", "id": "msg_c"},
                   OrderedDict(type="item_reference", id="msg_d"),
                   {"type": "function_call_output", "call_id": "c", "output": "ok"}]
        inputs = [history, history + [{"type": COMPACTION_TRIGGER}], history[:2], [],
                  history + ["text"], history + [{"type": ["x"]}], [{"type": {}}, ref("m")],
                  "hi", None, [{"type": True}, {"type": 1.5}, {"type": "Reasoning"}]]
        for items in inputs:
            for refs in (None, []):
                expected = None if refs is None else []
                self.assertEqual(
                    (inputFacts(items, refs), refs), (walk(items, expected), expected), items)

    def test_reasoningById(self):
        """
        A reasoning item with an id and no C{encrypted_content} is looked up
        in storage; with its encrypted content it carries itself.
        """
        self.assertEqual(references([{"type": "reasoning", "id": "rs_a", "summary": []}]),
                         ["rs_a"])
        self.assertEqual(references([{"type": "reasoning", "id": "rs_a",
                                      "encrypted_content": None, "summary": []}]), ["rs_a"])
        self.assertEqual(references([{"type": "reasoning", "id": "rs_a", "summary": [],
                                      "encrypted_content": "gAAA"}]), [])

    def test_inlineItemsAreNot(self):
        """
        Items that carry their content (a message or a function call output
        with its id) and malformed ids are not references.
        """
        self.assertEqual(references([
            {"type": "message", "id": "msg_a", "role": "assistant", "content": []},
            {"type": "function_call_output", "id": "fco_a", "call_id": "c", "output": "x"},
            {"type": "item_reference", "id": 7}, {"type": "item_reference", "id": ""},
            {"type": "item_reference"}, "text",
        ]), [])

    def test_annotate(self):
        """
        The entrypoints' one pass over the input notes the references on
        the turn; a turn without any carries none.
        """
        self.assertEqual(turnWith(ALICE, [ref("msg_a"), {"type": "message", "role": "user",
                                                         "content": "x"}]).itemReferences,
                         ("msg_a",))
        self.assertEqual(turnWith(ALICE, "just text").itemReferences, ())

    def test_outputItemIds(self):
        """
        The ids of a response's output items, at most L{MAX_OWNED_ITEMS}.
        """
        output = [{"type": "message", "id": f"msg_{i}"} for i in range(MAX_OWNED_ITEMS + 5)]
        ids = outputItemIds({"output": [None, {"type": "x"}, *output]})
        self.assertEqual(len(ids), MAX_OWNED_ITEMS - 2)
        self.assertEqual(ids[0], "msg_0")
        self.assertEqual(outputItemIds({"output": []}), [])
        self.assertEqual(outputItemIds(None), [])


class _CountingStore:
    """
    Delegates to a store, counting reads and C{setValues} calls.
    """

    def __init__(self, store):
        self._store = store
        self.reads = []
        self.writes = []
        self.failReads = False

    def __getattr__(self, name):
        return getattr(self._store, name)

    def getValue(self, key):
        self.reads.append(key)
        if self.failReads and key.startswith("openai:http-response-owner:item:"):
            return fail(RuntimeError("store down"))
        return self._store.getValue(key)

    def setValues(self, pairs, ttl):
        self.writes.append([p[0] for p in pairs])
        return self._store.setValues(pairs, ttl)


class SelectionTests(SchedulerMixin, SynchronousTestCase):
    """
    The check at selection, on every entrypoint (the same function checks
    C{previous_response_id}).
    """

    def setUp(self):
        self.build([account("a")])
        self.counting = _CountingStore(self.store)
        self.scheduler._bindings._store = self.counting
        recorded = turnWith(ALICE)
        recorded.outputItemIds = ("msg_a", "fc_a")
        self.successResultOf(self.scheduler.recordResponse(recorded, "resp_a", self.accounts[0]))

    def test_recordedInTheSameOperation(self):
        """
        The item owner records go with the response's in one C{setValues}
        (no extra round trip), with the owner record's value and lifetime.
        """
        [keys] = self.counting.writes
        self.assertIn(responseOwnerKey("resp_a"), keys)
        self.assertIn(itemOwnerKey("msg_a"), keys)
        self.assertIn(itemOwnerKey("fc_a"), keys)
        values = self.store._values
        self.assertEqual(values[itemOwnerKey("msg_a")], values[responseOwnerKey("resp_a")])
        self.assertEqual(json.loads(values[itemOwnerKey("fc_a")][0])["key"], "alice")

    def test_ownerServed(self):
        for entrypoint in ("http", "ws"):
            turn = turnWith(ALICE, [ref("msg_a"), {"id": "fc_a"}], entrypoint)
            self.assertEqual(self.select(turn).account.id, "a")

    def test_foreignRefused(self):
        """
        Key B naming key A's item is answered like an unknown item: 404
        C{invalid_request_error}, C{param: input}; on the WebSocket an
        error event and the connection stays open.
        """
        for entrypoint in ("http", "ws"):
            error = self.selectFails(turnWith(BOB, [ref("msg_a")], entrypoint))
            self.assertEqual((error.status, error.type, error.param, error.code),
                             (404, "invalid_request_error", "input", None))
            self.assertEqual(error.message, "Item with id 'msg_a' not found.")
            self.assertIsNone(error.wsClose)

    def test_oneForeignAmongOwnRefused(self):
        error = self.selectFails(turnWith(ALICE, [ref("msg_a"), ref("msg_zz")]))
        self.assertEqual(error.message, "Item with id 'msg_zz' not found.")

    def test_reasoningByIdChecked(self):
        error = self.selectFails(turnWith(BOB, [{"type": "reasoning", "id": "fc_a",
                                                 "summary": []}]))
        self.assertEqual(error.status, 404)

    def test_unknownFailsClosed(self):
        error = self.selectFails(turnWith(ALICE, [ref("msg_nobody")], "ws"))
        self.assertEqual(error.status, 404)

    def test_storeErrorFailsClosed(self):
        self.counting.failReads = True
        error = self.selectFails(turnWith(ALICE, [ref("msg_a")]))
        self.assertEqual(error.status, 404)
        self.flushLoggedErrors(RuntimeError)

    def test_noReadsWithoutReferences(self):
        """
        A turn naming no stored item reads no item owner record.
        """
        self.counting.reads.clear()
        self.select(turnWith(ALICE, [{"type": "message", "role": "user", "content": "x"}]))
        self.assertFalse([k for k in self.counting.reads if ":item:" in k])

    def test_conversationRefused(self):
        """
        relay serves no Conversations API: C{conversation} (an id or
        C{{"id": ...}}) is a 400 on every entrypoint; null is absent.
        """
        for entrypoint in ("http", "ws"):
            for value in ("conv_1", {"id": "conv_1"}):
                error = self.selectFails(turnWith(ALICE, "hi", entrypoint, conversation=value))
                self.assertEqual((error.status, error.type, error.param, error.code),
                                 (400, "invalid_request_error", "conversation",
                                  "unsupported_parameter"))
                self.assertIn("Conversations API", error.message)
                self.assertIsNone(error.wsClose)
        self.assertEqual(self.select(turnWith(ALICE, "hi", conversation=None)).account.id, "a")


COMPLETED_ITEMS = sseFrame("response.completed", response={
    "id": "resp_1", "status": "completed",
    "output": [{"type": "reasoning", "id": "rs_1", "summary": []},
               {"type": "message", "id": "msg_1", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi"}]}],
    "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}})


class RecordingTests(SynchronousTestCase):
    """
    A completed turn (SSE and JSON) records its output items for the key;
    a later turn naming them is served for that key only, and a refused
    turn dials nothing.
    """

    def check(self, rig, stream=True):
        from tests.test_runner import FakeSink

        turn = Turn(entrypoint="http", endpoint="responses", client=ALICE, model="gpt-5.5",
                    body={"model": "gpt-5.5", "input": "hi", "stream": stream}, stream=stream,
                    requestId="r1")
        outcome = []
        rig.runner.run(turn, FakeSink()).addCallback(outcome.append)
        self.assertEqual(outcome, ["completed"])
        for itemId in ("rs_1", "msg_1"):
            raw = self.successResultOf(rig.store.getValue(itemOwnerKey(itemId)))
            self.assertEqual(json.loads(raw), {"key": "alice", "account": "a"})
        dialled = len(rig.dialer.ids())
        sink = FakeSink()
        rig.runner.run(turnWith(BOB, [ref("msg_1")]), sink).addCallback(outcome.append)
        self.assertEqual(outcome[-1], "failed")
        self.assertEqual(sink.errors[0].status, 404)
        self.assertEqual(len(rig.dialer.ids()), dialled)
        rig.script("a", sse(COMPLETED_ITEMS))
        rig.runner.run(turnWith(ALICE, [ref("msg_1")]), FakeSink()).addCallback(outcome.append)
        self.assertEqual(outcome[-1], "completed")
        self.assertEqual(len(rig.dialer.ids()), dialled + 1)

    def test_stream(self):
        rig = Rig([raccount("a")])
        rig.script("a", sse(COMPLETED_ITEMS))
        self.check(rig)

    def test_json(self):
        rig = Rig([raccount("a")])
        body = json.loads(COMPLETED_ITEMS.split(b"data: ", 1)[1])["response"]
        rig.script("a", status(200, body))
        self.check(rig, stream=False)


class RoutingTests(SchedulerMixin, SynchronousTestCase):
    """
    Upstream resolves an item on the account that stored it: a turn naming
    one prefers that account.
    """

    def test_itemAccountPreferred(self):
        self.build([account(i) for i in "abcde"])
        recorded = turnWith(ALICE)
        recorded.outputItemIds = ("msg_c",)
        self.successResultOf(self.scheduler.recordResponse(recorded, "resp_c",
                                                           self.accounts[2]))
        for n in range(8):
            turn = turnWith(ALICE, [ref("msg_c"), {"type": "message", "role": "user",
                                                   "content": f"turn {n}"}])
            selection = self.select(turn)
            self.assertEqual(selection.account.id, "c")
            if selection.lease is not None:
                selection.lease.release()


class RequestKindTests(SchedulerMixin, SynchronousTestCase):
    """
    Compact and input-token requests (R87) are selected like turns: the
    same check.
    """

    def test_compactAndInputTokens(self):
        from relay.engine import requests as R

        self.build([account("a")])
        for kind in (R.compactRequest(), R.inputTokensRequest()):
            turn = turnWith(BOB, [ref("msg_a")])
            turn.request = kind
            self.assertEqual(self.selectFails(turn).status, 404)
            turn = turnWith(BOB, "hi", conversation="conv_1")
            turn.request = kind
            self.assertEqual(self.selectFails(turn).param, "conversation")
