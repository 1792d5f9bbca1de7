"""
L{relay.state.redisbatch.RedisBatch} on a recording Redis double and
L{Clock}: what one reactor turn's operations become on the wire (issue 24).
"""

from __future__ import annotations

import json

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.wire.redisclient import RedisUnavailable
from relay.state.redisbatch import BATCH_LUA, SOLO, RedisBatch


class _Redis:
    """
    Records L{relay.wire.redisclient.RedisService.execute} calls; each returns
    an unfired Deferred the test fires.
    """

    def __init__(self):
        self.calls = []

    def execute(self, timeout, method, *args, **kwargs):
        d = Deferred()
        self.calls.append((timeout, method, args, d))
        return d


class RedisBatchTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.redis = _Redis()
        self.batch = RedisBatch(self.redis, self.clock)

    def test_oneTurnOneRoundTrip(self):
        """
        Operations issued in one reactor turn are sent together at its end,
        as one C{EVAL} of L{BATCH_LUA} (smallest timeout), in issue order;
        each Deferred fires with its own reply.
        """
        get = self.batch.call(5, "GET", ["k"], [])
        setv = self.batch.call(2, "SET", ["j"], ["v", "PX", 1000])
        states = self.batch.call(5, "MHGETALL", ["a1", "a2"], [])
        self.assertEqual(self.redis.calls, [])
        self.clock.advance(0)
        [(timeout, method, args, d)] = self.redis.calls
        self.assertEqual((timeout, method, args[0]), (2, "eval", BATCH_LUA))
        self.assertEqual(args[1], ["k", "j", "a1", "a2"])
        self.assertEqual(json.loads(args[2][0]), [["GET", 1, []], ["SET", 1, ["v", "PX", "1000"]],
                                                  ["MHGETALL", 2, []]])
        self.assertNoResult(get)
        d.callback(["x", "OK", [["f", "1"], []]])
        self.assertEqual(self.successResultOf(get), "x")
        self.assertEqual(self.successResultOf(setv), "OK")
        self.assertEqual(self.successResultOf(states), [["f", "1"], []])
        self.assertEqual((self.batch.batches, self.batch.operations), (1, 3))

    def test_aloneIsThePlainCommand(self):
        """
        A batch of one operation is the plain command; relay's own
        operations are their standalone scripts (L{SOLO}).
        """
        get = self.batch.call(5, "GET", ["k"], [])
        self.clock.advance(0)
        incr = self.batch.call(5, "RELAY_INCR", ["c"], [60000, "1"])
        self.clock.advance(0)
        [(_, m1, a1, d1), (_, m2, a2, d2)] = self.redis.calls
        self.assertEqual((m1, a1), ("execute_command", ("GET", "k")))
        self.assertEqual((m2, a2), ("eval", (SOLO["RELAY_INCR"], ["c"], ["60000", "1"])))
        d1.callback(None)
        d2.callback(3)
        self.assertIsNone(self.successResultOf(get))
        self.assertEqual(self.successResultOf(incr), 3)

    def test_nextTurnNextBatch(self):
        """
        An operation issued after the batch left goes in the next one.
        """
        self.batch.call(5, "GET", ["k"], [])
        self.clock.advance(0)
        self.batch.call(5, "GET", ["k2"], [])
        self.assertEqual(len(self.redis.calls), 1)
        self.clock.advance(0)
        self.assertEqual(len(self.redis.calls), 2)

    def test_oneOperationFails(self):
        """
        An error reply of one operation fails that operation alone, with
        L{RedisUnavailable}.
        """
        from txredisapi import ResponseError

        ok = self.batch.call(5, "GET", ["k"], [])
        bad = self.batch.call(5, "RELAY_INCR", ["h"], [1000, "1"])
        self.clock.advance(0)
        self.redis.calls[0][3].callback(["v", ResponseError("WRONGTYPE Operation against a key")])
        self.assertEqual(self.successResultOf(ok), "v")
        self.failureResultOf(bad, RedisUnavailable)

    def test_roundTripFails(self):
        """
        A failed round trip (timeout, lost connection) fails every
        operation of the batch with its failure.
        """
        a = self.batch.call(5, "GET", ["k"], [])
        b = self.batch.call(5, "HDEL", ["h"], ["f"])
        self.clock.advance(0)
        self.redis.calls[0][3].errback(RedisUnavailable("eval", "timeout"))
        self.failureResultOf(a, RedisUnavailable)
        self.failureResultOf(b, RedisUnavailable)

    def test_touchFoldedIntoWrite(self):
        """
        A C{PEXPIRE} followed by a C{SET ... PX} of the same key in one
        batch is not sent; it succeeds when the C{SET} does.
        """
        touch = self.batch.call(5, "PEXPIRE", ["s"], [1000])
        write = self.batch.call(5, "SET", ["s"], ["a1", "PX", 1000])
        self.clock.advance(0)
        [(_, method, args, d)] = self.redis.calls
        self.assertEqual((method, args), ("execute_command", ("SET", "s", "a1", "PX", "1000")))
        d.callback("OK")
        self.assertEqual(self.successResultOf(touch), 1)
        self.assertEqual(self.successResultOf(write), "OK")
        self.assertEqual(self.batch.operations, 2)

    def test_noFoldAcrossAnotherOperation(self):
        """
        Anything else on the key between the C{PEXPIRE} and the C{SET}
        keeps both (a read must see the touched key).
        """
        self.batch.call(5, "PEXPIRE", ["s"], [1000])
        self.batch.call(5, "GET", ["s"], [])
        self.batch.call(5, "SET", ["s"], ["a1", "PX", 1000])
        self.clock.advance(0)
        [(_, method, args, _)] = self.redis.calls
        self.assertEqual(len(json.loads(args[2][0])), 3)

    def test_noFoldOfAnotherKey(self):
        """
        A C{SET} of another key folds nothing.
        """
        self.batch.call(5, "PEXPIRE", ["s"], [1000])
        self.batch.call(5, "SET", ["t"], ["a1", "PX", 1000])
        self.clock.advance(0)
        self.assertEqual(len(json.loads(self.redis.calls[0][2][2][0])), 2)


class LeadingBatchTests(SynchronousTestCase):
    """
    L{RedisBatch} with C{leading=True} (the slot admission's): a lone call
    leaves at once; calls made while one is in flight are batched.
    """

    def setUp(self):
        self.clock = Clock()
        self.redis = _Redis()
        self.batch = RedisBatch(self.redis, self.clock, leading=True)

    def test_loneCallLeavesAtOnce(self):
        """
        With nothing queued or in flight, a call is sent synchronously as
        its plain command; once its reply is in, the next one is too.
        """
        first = self.batch.call(2, "ZREM", ["s"], ["p-1"])
        [(_, method, args, d)] = self.redis.calls
        self.assertEqual((method, args), ("execute_command", ("ZREM", "s", "p-1")))
        d.callback(1)
        self.assertEqual(self.successResultOf(first), 1)
        self.batch.call(2, "ZREM", ["s"], ["p-2"])
        self.assertEqual(len(self.redis.calls), 2)

    def test_callsDuringAFlightAreBatched(self):
        """
        Calls made while one is in flight wait for the end of the reactor
        turn and leave together, without waiting for the first's reply.
        """
        self.batch.call(2, "ZREM", ["s"], ["p-1"])
        second = self.batch.call(2, "ZREM", ["s"], ["p-2"])
        third = self.batch.call(2, "ZREM", ["t"], ["p-3"])
        self.assertEqual(len(self.redis.calls), 1)
        self.clock.advance(0)
        self.assertEqual(len(self.redis.calls), 2)
        _, method, args, d = self.redis.calls[1]
        self.assertEqual((method, args[1]), ("eval", ["s", "t"]))
        d.callback([1, 0])
        self.assertEqual((self.successResultOf(second), self.successResultOf(third)), (1, 0))

    def test_flushSendsNow(self):
        """
        L{RedisBatch.flush} sends what is queued without waiting for the
        end of the reactor turn (the drain's release of leftover slots).
        """
        self.batch.call(2, "ZREM", ["s"], ["p-1"])
        self.batch.call(2, "ZREM", ["s"], ["p-2"])
        self.batch.flush()
        self.assertEqual(len(self.redis.calls), 2)


class CancelledOperationTests(SynchronousTestCase):
    """
    An operation its caller cancelled while the round trip was in flight.
    """

    def test_othersStillDelivered(self):
        """
        The late reply of a cancelled operation is dropped; the other
        operations of the batch still get theirs (success or failure).
        """
        clock, redis = Clock(), _Redis()
        batch = RedisBatch(redis, clock)
        gone = batch.call(2, "GET", ["a"], [])
        kept = batch.call(2, "GET", ["b"], [])
        clock.advance(0)
        gone.cancel()
        self.failureResultOf(gone)
        redis.calls[0][3].callback(["x", "y"])
        self.assertEqual(self.successResultOf(kept), "y")
        gone2 = batch.call(2, "GET", ["a"], [])
        kept2 = batch.call(2, "GET", ["b"], [])
        clock.advance(0)
        gone2.cancel()
        self.failureResultOf(gone2)
        redis.calls[1][3].errback(RedisUnavailable("eval", "down"))
        self.failureResultOf(kept2, RedisUnavailable)
