"""
Tests for L{relay.wire.jsoncodec}: its C{loads} gives what C{json.loads} gives
(values and errors), on generated documents and on mutated texts; its
C{dumpsRecord} reads back as the record it wrote.
"""

from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from relay.wire import jsoncodec
from relay.wire.jsoncodec import dumpsRecord, loads


def _same(a, b) -> bool:
    """
    Equal values of equal types all the way down (C{1 == 1.0} and
    C{0.0 == -0.0} are not enough here; NaN equals NaN).
    """
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


def _outcome(parse, data):
    try:
        return ("ok", parse(data))
    except RecursionError:
        return ("deep", None)
    except ValueError as e:
        return ("error", str(e))


def _agree(testCase, data: bytes) -> None:
    mine, theirs = _outcome(loads, data), _outcome(json.loads, data)
    testCase.assertEqual(mine[0], theirs[0], data[:200])
    if mine[0] == "ok":
        testCase.assertTrue(_same(mine[1], theirs[1]), (data[:200], mine[1], theirs[1]))
    else:
        testCase.assertEqual(mine[1], theirs[1])


_scalars = (
    st.none() | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
_documents = st.recursive(
    _scalars,
    lambda inner: (st.lists(inner, max_size=5)
                   | st.dictionaries(st.text(max_size=8), inner, max_size=5)),
    max_leaves=30,
)
_numbers = st.from_regex(rb"\A-?(0|[1-9][0-9]{0,25})(\.[0-9]{1,25})?([eE][-+]?[0-9]{1,3})?\Z")


class LoadsTests(SynchronousTestCase):
    """
    L{loads} is C{json.loads}.
    """

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_documents, st.booleans())
    def test_documents(self, value, ascii) -> None:
        """
        Any document, written with or without C{\\u} escapes, reads the
        same.
        """
        _agree(self, json.dumps(value, ensure_ascii=ascii).encode("utf-8"))

    @settings(max_examples=600, deadline=None)
    @given(_numbers)
    @example(b"9223372036854775807")
    @example(b"9223372036854775808")
    @example(b"18446744073709551616")
    @example(b"-9223372036854775809")
    @example(b"123456789012345678")
    @example(b"1e400")
    @example(b"-0")
    @example(b"-0.0")
    @example(b"2.2250738585072011e-308")
    @example(b"0.30000000000000004")
    def test_numbers(self, text) -> None:
        """
        Every JSON number reads as the standard library reads it: an
        integer beyond 64 bits stays an exact integer, a float is the same
        double, one out of range is the standard library's infinity.
        """
        _agree(self, text)
        _agree(self, b'{"n":[' + text + b"]}")

    @settings(max_examples=600, deadline=None)
    @given(_documents, st.data())
    def test_mutatedTexts(self, value, data) -> None:
        """
        Texts with bytes changed, inserted or cut: the fast path accepts
        only what the standard library accepts, with the same value, and
        refuses with the standard library's own message.
        """
        text = bytearray(json.dumps(value).encode("utf-8"))
        for _ in range(data.draw(st.integers(1, 3))):
            at = data.draw(st.integers(0, len(text)))
            byte = data.draw(st.sampled_from(
                b' \t\n\r\x0c\x00"\\,:[]{}-+.eE0123456789ntfuNI\xef\xbb\xbf\xc3\xed\xa0\x80/'))
            how = data.draw(st.sampled_from(["insert", "replace", "cut"]))
            if how == "insert" or at == len(text):
                text[at:at] = bytes([byte])
            elif how == "replace":
                text[at] = byte
            else:
                del text[at]
        _agree(self, bytes(text))

    def test_whatOrjsonRefuses(self) -> None:
        """
        Texts orjson refuses and the standard library reads or refuses in
        its own way: non-finite numbers, lone and paired surrogate
        escapes, encoded surrogates, a byte-order mark, UTF-16, invalid
        UTF-8, empty input.
        """
        for data in [b"NaN", b"[Infinity]", b"-Infinity", b'"\\ud800"', b'"\\ud83d\\ude00"',
                     b'"\xed\xa0\x80"', b"\xef\xbb\xbf{}", '{"a":1}'.encode("utf-16"),
                     b'"\xff"', b"", b" ", b"[1,]", b"{'a':1}", b"01", b"1.", b".5", b"+1"]:
            _agree(self, data)

    def test_nesting(self) -> None:
        """
        Nesting orjson stops at goes to the standard library, which reads
        it or raises its own RecursionError.
        """
        for depth in (10, 500, 1023, 1024, 1025, 5000, 200_000):
            data = b"[" * depth + b"]" * depth
            mine, theirs = _outcome(loads, data), _outcome(json.loads, data)
            self.assertEqual(mine[0], theirs[0], depth)

    def test_manyBracketsTakeTheStandardLibrary(self) -> None:
        """
        More than L{relay.wire.jsoncodec.MAX_FAST_BRACKETS} opening brackets
        (of either kind, nested or not) are never given to orjson.
        """
        from relay.wire.jsoncodec import MAX_FAST_BRACKETS

        calls = []

        def spy(data):
            calls.append(data)
            return json.loads(data)

        self.patch(jsoncodec, "_orjsonLoads", spy)
        half = MAX_FAST_BRACKETS // 2
        fits = b"[" + b",".join([b"{}"] * (half - 1) + [b"[]"] * half) + b"]"
        self.assertEqual(loads(fits), [{}] * (half - 1) + [[]] * half)
        self.assertEqual(len(calls), 1)
        loads(b"[{}," + fits[1:])
        loads(b"[" * (MAX_FAST_BRACKETS + 1) + b"]" * (MAX_FAST_BRACKETS + 1))
        self.assertEqual(len(calls), 1)

    def test_longTextsTakeTheStandardLibrary(self) -> None:
        """
        A text longer than L{relay.wire.jsoncodec.MAX_FAST_BYTES} is never given
        to orjson (nor copied to be checked); one of that length is.
        """
        from relay.wire.jsoncodec import MAX_FAST_BYTES

        calls = []

        def spy(data):
            calls.append(data)
            return json.loads(data)

        self.patch(jsoncodec, "_orjsonLoads", spy)
        fits = b'["' + b"x" * (MAX_FAST_BYTES - 4) + b'"]'
        self.assertEqual(len(fits), MAX_FAST_BYTES)
        self.assertEqual(loads(fits), ["x" * (MAX_FAST_BYTES - 4)])
        self.assertEqual(len(calls), 1)
        self.assertEqual(loads(b" " + fits), ["x" * (MAX_FAST_BYTES - 4)])
        self.assertEqual(len(calls), 1)

    def test_strAndOtherTypes(self) -> None:
        """
        A C{str} (and a bytearray) is read by the standard library.
        """
        self.assertEqual(loads('{"a":[1,2.5,"é"]}'), {"a": [1, 2.5, "é"]})
        self.assertEqual(loads(bytearray(b"[1]")), [1])
        with self.assertRaises(ValueError):
            loads("{")

    def test_longDigitRunsTakeTheStandardLibrary(self) -> None:
        """
        A run of 19 digits (in a number or a string) is never given to
        orjson; 18 are.
        """
        calls = []

        def spy(data):
            calls.append(data)
            return json.loads(data)

        self.patch(jsoncodec, "_orjsonLoads", spy)
        self.assertEqual(loads(b"[123456789012345678]"), [123456789012345678])
        self.assertEqual(len(calls), 1)
        self.assertEqual(loads(b"[1234567890123456789]"), [1234567890123456789])
        self.assertEqual(loads(b'["id_1234567890123456789"]'), ["id_1234567890123456789"])
        self.assertEqual(len(calls), 1)


class DumpsRecordTests(SynchronousTestCase):
    """
    L{dumpsRecord}: compact, readable back, with the standard library's
    fallback.
    """

    @settings(max_examples=300, deadline=None)
    @given(_documents)
    def test_readsBack(self, value) -> None:
        """
        What it writes reads back as the value (integers beyond 64 bits
        included, through the fallback).
        """
        self.assertTrue(_same(loads(dumpsRecord(value).encode("utf-8")), value))

    def test_compactAndDefault(self) -> None:
        """
        No spaces; other values through C{default} (C{str} unless given).
        """
        class Thing:
            def __str__(self):
                return "thing"

        self.assertEqual(dumpsRecord({"a": [1, "é"], "b": Thing()}), '{"a":[1,"é"],"b":"thing"}')
        self.assertEqual(dumpsRecord({"n": 2**70}), '{"n":%d}' % 2**70)
        self.assertEqual(dumpsRecord({1: "x"}), '{"1":"x"}')
        self.assertEqual(dumpsRecord([Thing()], default=lambda o: 7), "[7]")


class LoadsLargeTests(SynchronousTestCase):
    """
    L{jsoncodec.loadsLarge}: a large client body read by orjson only where
    that gives C{json.loads}' value; everything else is left to L{loads}.
    """

    def _large(self, value) -> bytes:
        return json.dumps({"pad": "x" * (jsoncodec.MAX_FAST_BYTES + 10), "v": value}).encode()

    def test_sameValue(self) -> None:
        """
        A large document reads as C{json.loads} reads it, through orjson.
        """
        calls = []
        real = jsoncodec._orjsonLoads
        self.patch(jsoncodec, "_orjsonLoads", lambda d: calls.append(d) or real(d))
        for value in ([{"type": "message", "content": [{"text": "h\u00e9 \U0001f600 \\ \" \n"}]}],
                      {"a": [1, -2, 2**40, None, True, 1.5]}, [2**63 - 1, 2**64 - 1], "\u2028"):
            data = self._large(value)
            self.assertTrue(_same(jsoncodec.loadsLarge(data), json.loads(data)))
        self.assertEqual(len(calls), 4)

    def test_leftToLoads(self) -> None:
        """
        Texts orjson must not decide: nesting deeper than
        L{jsoncodec.MAX_FAST_DEPTH}, an integer beyond 64 bits beside a
        float, what orjson refuses, a C{str}.
        """
        deep = b'{"a":' + b"[" * 300 + b"]" * 300 + b',"pad":"' + b"x" * 70000 + b'"}'
        bigint = self._large([1.5, 2**70])
        negative = self._large([-(2**70)])
        for data in (deep, bigint, negative, self._large("\ud800").replace(b"\\\\", b"\\"),
                     b"[NaN," + b"1," * 40000 + b"1]", '"' + "x" * 70000 + '"'):
            self.assertIs(jsoncodec.loadsLarge(data), jsoncodec.NOT_FAST, data[:40])

    def test_deepestNesting(self) -> None:
        """
        Nesting far past orjson's own limit (1,024 levels; orjson 3.8 had
        none and overflowed the C stack at ~10^5) is left to L{loads},
        without a count of the text's brackets first.
        """
        for depth in (1025, 200_000):
            data = b"[" * depth + b"]" * depth
            self.assertIs(jsoncodec.loadsLarge(data), jsoncodec.NOT_FAST)

    def test_manyBrackets(self) -> None:
        """
        Many brackets that nest shallowly, and a run of digits inside a
        string beside a small float, are read by orjson: the value is
        C{json.loads}'.
        """
        calls = []
        real = jsoncodec._orjsonLoads
        self.patch(jsoncodec, "_orjsonLoads", lambda d: calls.append(d) or real(d))
        for data in (b"[" + b",".join([b"[{}]"] * 30000) + b"]",
                     self._large([1.5, "12345678901234567890123", 2**63 - 1, 1e17])):
            self.assertTrue(_same(jsoncodec.loadsLarge(data), json.loads(data)))
        self.assertEqual(len(calls), 2)

    def test_shape(self) -> None:
        """
        What the value holds, counted in the pass that checks its depth:
        dicts and lists, dict pairs, list elements.
        """
        shape = []
        data = self._large([{"a": [1, 2]}, [], "s"])
        jsoncodec.loadsLarge(data, shape)
        # {pad, v}, [..], {a}, [1, 2], []: 5 containers; pairs pad, v, a; elements 3 + 2
        self.assertEqual(shape, [(5, 3, 5)])
        self.assertIs(jsoncodec.loadsLarge(b"[" * 300 + b"]" * 300, shape), jsoncodec.NOT_FAST)
        self.assertEqual(len(shape), 1)

    def test_shapeWide(self) -> None:
        """
        R103: strings (keys and values) that are not ASCII hold 2 or 4
        bytes a character; what they take is a fourth count.
        """
        import sys

        shape = []
        key, text = "\u0100" + "k" * 10, "\U0001f600" + "a" * 1000
        data = self._large([{key: text}, "\u00e9", "ascii"])
        value = jsoncodec.loadsLarge(data, shape)
        self.assertEqual(value, json.loads(data))
        (read, one), two = value["v"][0].popitem(), value["v"][1]
        self.assertEqual(shape[0][3], sum(map(sys.getsizeof, (read, one, two))))
        self.assertGreater(sys.getsizeof(one), 4 * len(text))

    def test_loadJSON(self) -> None:
        """
        L{relay.frontdoor.jsonbody.loadJSON} agrees with C{json.loads} on
        large texts, and refuses a large one holding an unpaired surrogate,
        C{NaN} or deep nesting as it refuses a small one.
        """
        from relay.frontdoor.jsonbody import NESTING_MESSAGE, loadJSON

        data = self._large([{"k": "\U0001f600"}])
        self.assertEqual(loadJSON(data), json.loads(data))
        pad = b',"pad":"' + b"x" * 70000 + b'"}'
        for bad in (b'{"a":"\\ud800"' + pad, b'{"a":NaN' + pad, b'{"a":-Infinity' + pad):
            self.assertRaises(ValueError, loadJSON, bad)
        with self.assertRaises(ValueError) as e:
            loadJSON(b'{"a":' + b"[" * 200000 + b"]" * 200000 + pad)
        self.assertEqual(str(e.exception), NESTING_MESSAGE)


class ShapeBoundTests(SynchronousTestCase):
    """
    L{relay.frontdoor.budgets.parsedBound}, held while a large body is
    parsed (R103), is never below the estimate the body is held at
    afterwards (L{relay.frontdoor.budgets.shapeEstimate}), whatever the
    shape, the tightest ones included.
    """

    def _check(self, data: bytes) -> None:
        from relay.frontdoor.budgets import parsedBound, shapeEstimate

        shape = []
        value = jsoncodec.loadsLarge(data, shape)
        if value is jsoncodec.NOT_FAST:
            return
        self.assertLessEqual(shapeEstimate(len(data), *shape[0]), parsedBound(len(data)))

    @given(_documents, st.booleans())
    @settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
    def test_documents(self, value, ascii) -> None:
        self._check(json.dumps(value, ensure_ascii=ascii, separators=(",", ":")).encode())

    def test_tightest(self) -> None:
        for piece in (b"{}", b"[]", b"[[]]", b"0", b'{"":0}', b'{"":{}}', b'{"":[]}'):
            for n in (1, 2, 3, 1000):
                self._check(b"[" + b",".join([piece] * n) + b"]")
                self._check(b'{"a":' + b"[" + b",".join([piece] * n) + b"]}")
        for depth in (2, 100, jsoncodec.MAX_FAST_DEPTH):
            chain = b"[" * depth + b"]" * depth
            self._check(chain)
            self._check(b"[" + b",".join([chain[1:-1]] * 50) + b"]")
