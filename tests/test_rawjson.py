"""
Tests for L{relay.wire.rawjson}: a large client body goes upstream as its
own bytes with only the members relay changed written anew, and only
where that means what the body means.
"""

from __future__ import annotations

import json

import orjson
from twisted.trial.unittest import SynchronousTestCase

from relay.wire.rawjson import RawObject

HISTORY = [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                              "text": "caf\u00e9 \"q\" \\ \n"}]},
           {"type": "reasoning", "encrypted_content": "gAAA" * 50}]
BODY = {"model": "gpt-5.5", "instructions": "be \u2713", "input": HISTORY, "tools": [],
        "stream": False, "store": False, "prompt_cache_key": "pck"}


def raw(body=BODY) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class SpliceTests(SynchronousTestCase):
    def test_unchanged(self):
        """
        A body relay did not change is the client's bytes.
        """
        data = raw()
        parsed = json.loads(data)
        self.assertEqual(RawObject(data, parsed).splice(dict(parsed)), data)

    def test_membersInPieces(self):
        """
        Whatever relay changed, adds, drops or reorders, the spliced bytes
        are the client's members and the new ones joined by commas, in the
        body's order (members that follow each other in the client's bytes
        go as one piece); unchanged, the whole text is one view.
        """
        import random

        data = raw()
        parsed = json.loads(data)
        obj = RawObject(data, parsed)
        _, spans, _ = obj.layout()
        rng = random.Random(38)
        for _ in range(300):
            body = dict(parsed)
            for key in list(body):
                roll = rng.random()
                if key != "input" and roll < 0.2:
                    body.pop(key)
                elif key != "input" and roll < 0.4:
                    body[key] = "new"
            for key in ("stream_options", "user"):
                if rng.random() < 0.3:
                    body[key] = {"k": 1}
            if rng.random() < 0.3:
                keys = list(body)
                rng.shuffle(keys)
                body = {k: body[k] for k in keys}
            members = [data[spans[k][0]:spans[k][1]] if k in spans and body[k] is parsed[k]
                       else orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in body.items()]
            pieces = obj.splice(body, pieces=True)
            if pieces is None:
                continue  # a changed member the history's bytes could hide
            self.assertEqual(b"".join(pieces), b"{" + b",".join(members) + b"}")
            self.assertEqual(json.loads(b"".join(pieces)), body)
        whole = obj.splice(dict(parsed), pieces=True)
        self.assertEqual([bytes(p) for p in whole], [b"{", data[1:-1], b"}"])

    def test_pieces(self):
        """
        As pieces (for an L{relay.interfaces.IPiecesDialer}): the history
        is a view of the client's bytes, never a copy; joined, the pieces
        are the spliced bytes.
        """
        data = raw()
        parsed = json.loads(data)
        body = dict(parsed, prompt_cache_key="scoped")
        pieces = RawObject(data, parsed).splice(body, pieces=True)
        self.assertEqual(b"".join(pieces), RawObject(data, parsed).splice(body))
        views = [p for p in pieces if isinstance(p, memoryview)]
        self.assertTrue(views)
        self.assertTrue(all(v.obj is data for v in views))
        self.assertGreater(max(map(len, views)), len(data) // 2)

    def test_changedAfter(self):
        """
        Members after the history changed, removed or added: the history's
        bytes are the client's, the result parses to the body.
        """
        data = raw()
        parsed = json.loads(data)
        body = dict(parsed, prompt_cache_key="scoped", stream=True)
        body.pop("store")
        body["extra"] = {"a": 1}
        out = RawObject(data, parsed).splice(body)
        self.assertEqual(json.loads(out), body)
        self.assertEqual(list(json.loads(out)), list(body))
        self.assertIn(raw({"input": HISTORY})[1:-1], out)

    def test_changedBeforeHistory(self):
        """
        A member before the history may change only when the history's
        bytes cannot hold an earlier occurrence of it.
        """
        data = raw()
        parsed = json.loads(data)
        body = dict(parsed, model="mapped")
        self.assertEqual(json.loads(RawObject(data, parsed).splice(body)), body)
        sneaky = data.replace(b'"tools":[]', b'"model":"gpt-5.5","tools":[]')
        parsed = json.loads(sneaky)
        self.assertIsNone(RawObject(sneaky, parsed).splice(dict(parsed, model="mapped")))

    def test_duplicateHiddenInHistory(self):
        """
        R112: a C{prompt_cache_key} given twice, the first time before the
        history and again inside the bytes relay does not read, is never
        spliced as the client's (upstream would keep the unscoped one).
        """
        data = (b'{"prompt_cache_key":"victim","input":[{"type":"message"}],'
                b'"prompt_cache_key":"victim"}')
        parsed = json.loads(data)
        self.assertIsNone(RawObject(data, parsed).splice(dict(parsed, prompt_cache_key="s")))

    def test_removedHidden(self):
        """
        A member relay removed that the history's bytes also hold is not
        spliced away.
        """
        data = b'{"input":[1],"stream":false,"input":[2],"stream":false}'
        parsed = json.loads(data)
        body = dict(parsed)
        body.pop("stream")
        self.assertIsNone(RawObject(data, parsed).splice(body))

    def test_notCompact(self):
        """
        Spaces, ASCII escapes, a key that is not a plain name, no history,
        a changed history: the caller encodes the body whole.
        """
        for data in (json.dumps(BODY).encode(), json.dumps(BODY, separators=(",", ":")).encode(),
                     raw(dict(BODY, **{"a b": 1})), raw({"model": "m"})):
            parsed = json.loads(data)
            self.assertIsNone(RawObject(data, parsed).splice(dict(parsed, model="x")))
        data = raw()
        parsed = json.loads(data)
        self.assertIsNone(RawObject(data, parsed).splice(dict(parsed, input=[])))

    def test_scalarsByValue(self):
        """
        A scalar set again to an equal value counts as unchanged; C{1} is
        not C{true}.
        """
        data = raw()
        parsed = json.loads(data)
        self.assertEqual(RawObject(data, parsed).splice(dict(parsed, store=False)), data)
        body = dict(parsed, stream=0)
        self.assertEqual(json.loads(RawObject(data, parsed).splice(body)), body)
        self.assertEqual(orjson.loads(RawObject(data, parsed).splice(body))["stream"], 0)
