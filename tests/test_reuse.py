"""
L{relay.frontdoor.reuse.HistoryReuse}: a Codex turn's body read as the
extension of the body its key sent before, with the value C{json.loads}
gives for the whole text, or not at all.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from relay.frontdoor.reuse import HistoryReuse
from relay.wire import jsoncodec
from relay.wire.rawjson import RawObject

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | _text
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)
_items = st.lists(st.dictionaries(st.sampled_from(["type", "role", "content", "id"]), _values,
                                  max_size=4), max_size=6)


def _body(items: list, tail: str = "c1", pad: int = 20000) -> bytes:
    body = {"model": "gpt-5", "instructions": "x" * pad, "input": items,
            "tools": [{"type": "function", "name": "shell"}], "prompt_cache_key": tail}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _read(raw: bytes):
    shape = []
    value = jsoncodec.loadsLarge(raw, shape)
    return value, (shape[0] if shape else None)


def _remember(reuse: HistoryReuse, key: str, raw: bytes, replaces=None):
    value, shape = _read(raw)
    if value is not jsoncodec.NOT_FAST:  # the body would be read by json.loads, not kept
        reuse.remember(key, RawObject(raw, value), shape, replaces)


class ExtensionTests(SynchronousTestCase):
    """
    A body that extends a known one is read from the known one and the
    added items only, with the whole text's value and shape.
    """

    @given(_items, _items, st.booleans())
    @settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
    def test_sameValue(self, history, added, ascii) -> None:
        reuse = HistoryReuse()
        first = _body(history)
        _remember(reuse, "k", first)
        second = _body(history + added)
        found = reuse.read("k", second)
        expected, shape = _read(second)
        if expected is jsoncodec.NOT_FAST and found is None:
            return  # read whole, by the standard library
        self.assertIsNotNone(found)
        value, counts, _, layout = found
        self.assertEqual(json.dumps(value, sort_keys=True), json.dumps(json.loads(second),
                                                                       sort_keys=True))
        self.assertEqual(layout, RawObject(second, value).layout())  # the moved spans
        if shape is not None:
            self.assertEqual(counts, shape)

    @given(_items, st.binary(max_size=40) | st.sampled_from([
        b'],"model":"evil","input":[', b',1],"input":[2', b'', b',', b']', b',{}', b'],"x":1',
        b',"a"],"prompt_cache_key":"z","input":["b"', b' ,1', b',NaN', b',"\\ud800"',
        b',' + b'[' * 300 + b']' * 300]))
    @settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
    def test_neverAnotherValue(self, history, inserted) -> None:
        """
        Whatever bytes stand where new items would: the value read is
        C{json.loads}' of the whole text, or nothing is read (the body
        is then parsed whole, and refused if it is not JSON).
        """
        reuse = HistoryReuse()
        first = _body(history)
        _remember(reuse, "k", first)
        close = first.rindex(b'],"tools":')
        second = first[:close] + inserted + first[close:]
        found = reuse.read("k", second)
        try:
            expected = json.loads(second)
        except (ValueError, RecursionError):
            self.assertIsNone(found)
            return
        if found is not None:
            self.assertEqual(json.dumps(found[0], sort_keys=True),
                             json.dumps(expected, sort_keys=True))

    def test_duplicatedKeys(self) -> None:
        """
        A top-level key repeated after C{input} (C{json.loads} keeps its
        last occurrence) puts another member's array before the C{]} the
        known body ends its history with: items added there extend that
        member, not C{input}. Such a body is never extended; the value is
        the whole read's (relay's view is what upstream, sent the client's
        bytes, reads).
        """
        from relay.frontdoor.parse import readJSON

        pad = "x" * 20000
        cases = [
            ('{"model":"m","instructions":"%s","input":[{"a":1}],"tools":[{"t":1}],'
             '"tools":[{"t":2}]}',
             '{"model":"m","instructions":"%s","input":[{"a":1}],"tools":[{"t":1},{"e":1}],'
             '"tools":[{"t":2}]}'),
            ('{"tools":[1],"instructions":"%s","input":[{"a":1}],"tools":[1]}',
             '{"tools":[1],"instructions":"%s","input":[{"a":1}],"tools":[1,{"e":1}]}'),
        ]
        for old, new in cases:
            old, new = (old % pad).encode(), (new % pad).encode()
            reuse = HistoryReuse()
            _remember(reuse, "k", old)
            self.assertEqual(reuse.read("k", old)[0], json.loads(old))  # the same body again
            found = reuse.read("k", new)
            if found is not None:
                self.assertEqual(found[0], readJSON(new))
            self.assertIsNone(found)
            self.assertEqual(reuse.size, 0)  # never extended: dropped
        # a history that is one array extends, and so do the bodies extending it
        reuse = HistoryReuse()
        first = _body([{"a": 1}])
        _remember(reuse, "k", first)
        second = _body([{"a": 1}, {"b": 2}])
        found = reuse.read("k", second)
        _remember(reuse, "k", second, found[2])
        self.assertTrue(found[2].single)
        third = _body([{"a": 1}, {"b": 2}, {"c": 3}])
        self.assertEqual(reuse.read("k", third)[0], json.loads(third))

    def test_notExtensions(self) -> None:
        """
        Another conversation's tail, an item changed, the history cut: not
        read.
        """
        items = [{"type": "message", "content": "a"}, {"type": "message", "content": "b"}]
        reuse = HistoryReuse()
        _remember(reuse, "k", _body(items))
        for other in (_body(items + [{"c": 1}], tail="c2"),
                      _body([items[0], {"type": "message", "content": "B"}, {"c": 1}]),
                      _body(items[:1]), _body(items, pad=20001)):
            self.assertIsNone(reuse.read("k", other))
        self.assertEqual(reuse.hits, 0)

    def test_sameBody(self) -> None:
        items = [{"type": "message", "content": "a"}]
        reuse = HistoryReuse()
        raw = _body(items)
        _remember(reuse, "k", raw)
        value, counts, known, _ = reuse.read("k", bytes(bytearray(raw)))
        self.assertEqual(value, json.loads(raw))
        self.assertEqual(counts, _read(raw)[1])

    def test_emptyHistory(self) -> None:
        reuse = HistoryReuse()
        _remember(reuse, "k", _body([]))
        second = _body([{"a": 1}, [2]])
        value, counts, _, layout = reuse.read("k", second)
        self.assertEqual(layout, RawObject(second, value).layout())
        self.assertEqual(value, json.loads(second))
        self.assertEqual(counts, _read(second)[1])

    def test_keysApart(self) -> None:
        reuse = HistoryReuse()
        _remember(reuse, "alice", _body([{"a": 1}]))
        self.assertIsNone(reuse.read("bob", _body([{"a": 1}, {"b": 2}])))
        self.assertIsNotNone(reuse.read("alice", _body([{"a": 1}, {"b": 2}])))

    def test_notLaidOut(self) -> None:
        """
        A body not written compactly has no layout: not kept.
        """
        reuse = HistoryReuse()
        raw = json.dumps({"model": "m", "input": [{"a": 1}], "pad": "x" * 20000}).encode()
        _remember(reuse, "k", raw)
        self.assertEqual(reuse.size, 0)


class BoundsTests(SynchronousTestCase):
    """
    One body per conversation; at most C{perKey} per key and C{maxBytes}
    in all, the least recently kept dropped first.
    """

    def test_replaces(self) -> None:
        reuse = HistoryReuse()
        first = _body([{"a": 1}])
        _remember(reuse, "k", first)
        second = _body([{"a": 1}, {"b": 2}])
        found = reuse.read("k", second)
        _remember(reuse, "k", second, found[2])
        self.assertEqual(reuse.size, len(second))
        self.assertIsNone(reuse.read("k", _body([{"a": 1}, {"c": 3}])))
        self.assertIsNotNone(reuse.read("k", _body([{"a": 1}, {"b": 2}, {"c": 3}])))

    def test_resendKeepsOne(self) -> None:
        """
        The same body again (a retry; wrk's repeated body), read while
        another copy is in flight: the body it repeats stays, one.
        """
        reuse = HistoryReuse()
        raw = _body([{"a": 1}])
        _remember(reuse, "k", raw)
        copies = [bytes(bytearray(raw)) for _ in range(5)]
        found = [reuse.read("k", c) for c in copies]
        for copy, f in zip(copies, found):
            _remember(reuse, "k", copy, f[2])
        self.assertEqual(reuse.size, len(raw))
        self.assertIsNotNone(reuse.read("k", _body([{"a": 1}, {"b": 2}])))

    def test_perKey(self) -> None:
        reuse = HistoryReuse(perKey=2)
        for tail in ("c1", "c2", "c3"):
            _remember(reuse, "k", _body([{"a": 1}], tail=tail))
        self.assertIsNone(reuse.read("k", _body([{"a": 1}, {"b": 1}], tail="c1")))
        self.assertIsNotNone(reuse.read("k", _body([{"a": 1}, {"b": 1}], tail="c3")))
        self.assertEqual(reuse.size, 2 * len(_body([{"a": 1}], tail="c3")))

    def test_maxBytes(self) -> None:
        """
        Bodies that extended one (conversations that go on) are dropped
        only for others of their kind.
        """
        one = len(_body([{"a": 1}, {"b": 1}]))
        reuse = HistoryReuse(maxBytes=2 * one, probationBytes=one)
        for key in ("a", "b", "c"):
            _remember(reuse, key, _body([{"a": 1}]))
            second = _body([{"a": 1}, {"b": 1}])
            _remember(reuse, key, second, reuse.read(key, second)[2])
        self.assertEqual(reuse.size, 2 * one)
        self.assertIsNone(reuse.read("a", _body([{"a": 1}, {"b": 1}, {"c": 1}])))
        self.assertIsNotNone(reuse.read("c", _body([{"a": 1}, {"b": 1}, {"c": 1}])))

    def test_parsedRatio(self) -> None:
        """
        The bounds count bytes; a body whose parse takes many times its
        bytes (C{[{},{},...]}: 24 times) counts its parse's estimate over
        L{PARSED_RATIO}, so a client cannot make the kept bodies take ~25
        times the bounds (about 1 GiB for 40 MiB of such bodies, kept
        between its requests).
        """
        tiny = b'{"model":"m","input":[' + b",".join([b"{}"] * 8000) + b'],"prompt_cache_key":"c"}'
        reuse = HistoryReuse()
        _remember(reuse, "k", tiny)
        self.assertGreater(reuse.size, 10 * len(tiny))
        reuse = HistoryReuse(probationBytes=reuse.size)
        _remember(reuse, "k", tiny)
        _remember(reuse, "k", _body([{"a": 1}]))  # pushes it out
        self.assertEqual(reuse.size, len(_body([{"a": 1}])))
        codex = _body([{"type": "message", "role": "user", "content": "x" * 40}] * 100)
        reuse = HistoryReuse()
        _remember(reuse, "k", codex)
        self.assertEqual(reuse.size, len(codex))  # a history counts its bytes

    def test_probation(self) -> None:
        """
        One-off bodies (extending none) push out only each other, never a
        conversation that went on.
        """
        one = len(_body([{"a": 1}], tail="c00"))
        reuse = HistoryReuse(maxBytes=10 * one, probationBytes=2 * one)
        _remember(reuse, "k", _body([{"a": 1}], tail="c00"))
        second = _body([{"a": 1}, {"b": 1}], tail="c00")
        _remember(reuse, "k", second, reuse.read("k", second)[2])
        for n in range(1, 10):
            _remember(reuse, "k", _body([{"a": 1}], tail=f"c{n:02d}"))
        self.assertIsNotNone(reuse.read("k", _body([{"a": 1}, {"b": 1}, {"c": 1}], tail="c00")))
        self.assertIsNotNone(reuse.read("k", _body([{"a": 1}, {"b": 1}], tail="c09")))
        self.assertIsNone(reuse.read("k", _body([{"a": 1}, {"b": 1}], tail="c07")))
        self.assertEqual(reuse.size, len(second) + 2 * one)
