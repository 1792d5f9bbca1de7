"""
Tests for L{relay.usage.holds} (behaviour.md R108): the budget reservation
store's contract, run here on L{MemoryBudgetHolds} and on a real Redis in
tests/integration/test_budget_holds.py (L{RedisBudgetHolds}); and the
estimate of L{relay.usage.estimate}.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.interfaces import IBudgetHolds
from relay.usage.estimate import inputTokens, outputTokens
from relay.usage.holds import MemoryBudgetHolds, RedisBudgetHolds

T0 = 1_700_000_000.0

DAY = ("d:1", 3600)
MONTH = ("m:1", 3600)


def usd(limit: int, known: int = 0, name="daily_usd", period="d:1"):
    """
    A money limit of C{limit} nano-dollars with C{known} spent.
    """
    return (name, period, "n", limit, known)


def tokens(limit: int, known: int = 0, name="daily_tokens", period="d:1"):
    """
    A token limit.
    """
    return (name, period, "t", limit, known)


async def holdsContract(holds, advance) -> None:
    """
    What every L{IBudgetHolds} provider does (R108). Raises
    C{AssertionError} on a difference.

    @param holds: a fresh provider (no holds for keys C{k}, C{j}).
    @param advance: an async callable taking seconds: lets that much time
        pass on the provider's clock.
    """
    assert verifyObject(IBudgetHolds, holds)
    # A key with room takes a hold even larger than its budget (a small
    # budget still serves one turn); the next one sees it.
    assert await holds.reserve("k", "h1", 10, 900, [usd(500)], 60) is None
    assert await holds.outstanding("k") == (10, 900)
    assert await holds.reserve("k", "h2", 10, 100, [usd(500)], 60) == ("daily_usd", 900)
    # What the caller knows counts with the holds.
    assert await holds.reserve("j", "x", 1, 100, [usd(500, known=450)], 60) is None
    assert await holds.reserve("j", "y", 1, 100, [usd(500, known=400)], 60) == (
        "daily_usd", 500)
    # Tokens and money each against their own limits; the first without
    # room is named, and nothing is held for a refusal.
    refused = await holds.reserve("j", "z", 1, 1, [usd(10_000), tokens(1)], 60)
    assert refused == ("daily_tokens", 1), refused
    assert await holds.outstanding("j") == (1, 100)
    # Release drops a hold without counting anything.
    await holds.release("k", "h1")
    assert await holds.outstanding("k") == (0, 0)
    assert await holds.reserve("k", "h3", 5, 300, [usd(500)], 60) is None
    # Settle drops the hold and counts the real figure for the periods:
    # later checks count it even when the caller does not know it yet.
    await holds.settle("k", "h3", 7, 400, [DAY, MONTH])
    assert await holds.outstanding("k") == (0, 0)
    assert await holds.reserve("k", "h4", 1, 1, [usd(500)], 60) is None
    assert await holds.reserve("k", "h5", 1, 1, [usd(401)], 60) == ("daily_usd", 401)
    assert await holds.reserve("k", "h6", 1, 1, [tokens(8, period="m:1", name="m")], 60) == (
        "m", 8)
    # The caller's figure and the settled one are the same spend seen twice:
    # the larger counts, not their sum.
    assert await holds.reserve("k", "h7", 1, 1, [usd(1000, known=400)], 60) is None
    await holds.release("k", "h4")
    await holds.release("k", "h7")
    # Another period starts empty.
    assert await holds.reserve("k", "h8", 1, 1, [usd(100, period="d:2")], 60) is None
    await holds.release("k", "h8")
    # Settling twice, or a hold already gone, is harmless.
    await holds.settle("k", "gone", 0, 0, [DAY])
    await holds.release("k", "gone")
    # Holds expire by themselves (a crashed process's).
    assert await holds.reserve("e", "h", 5, 5, [usd(5)], 1) is None
    assert await holds.reserve("e", "h2", 5, 5, [usd(5)], 1) == ("daily_usd", 5)
    await advance(1.5)
    assert await holds.outstanding("e") == (0, 0)
    assert await holds.reserve("e", "h3", 5, 5, [usd(5)], 1) is None
    # A chain's tokens, for the turn that continues it.
    assert await holds.chainTokens("resp_none") == 0
    await holds.rememberChain("resp_1", 1234, 60)
    assert await holds.chainTokens("resp_1") == 1234


class MemoryHoldsTests(SynchronousTestCase):
    """
    L{MemoryBudgetHolds} passes the contract, on a L{Clock}.
    """

    def test_contract(self):
        clock = Clock()
        clock.advance(T0)

        async def advance(seconds):
            clock.advance(seconds)

        self.successResultOf(Deferred.fromCoroutine(
            holdsContract(MemoryBudgetHolds(clock=clock), advance)))

    def test_chain_expires(self):
        """
        A chain's tokens live C{ttl} seconds.
        """
        clock = Clock()
        holds = MemoryBudgetHolds(clock=clock)
        holds.rememberChain("r", 5, 10)
        clock.advance(11)
        self.assertEqual(self.successResultOf(holds.chainTokens("r")), 0)


class RedisHoldsShapeTests(SynchronousTestCase):
    """
    L{RedisBudgetHolds} without a server: one C{EVAL} per reserve and per
    settle, every key it touches in C{KEYS} (the real server runs the
    contract in tests/integration/test_budget_holds.py).
    """

    def setUp(self):
        self.calls = []
        self.replies = []

        class FakeRedis:
            def execute(fake, timeout, method, *args):
                self.calls.append((method,) + args)
                return succeed(self.replies.pop(0) if self.replies else None)

        self.holds = RedisBudgetHolds(redis=FakeRedis())

    def test_reserve(self):
        self.assertIsNone(self.successResultOf(
            self.holds.reserve("bob", "h", 3, 4, [usd(10), tokens(5, period="m:2")], 60)))
        (method, _script, keys, args), = self.calls
        self.assertEqual(method, "eval")
        self.assertEqual(keys, ["relay:budget:h:bob", "relay:budget:s:bob:d:1",
                                "relay:budget:s:bob:m:2"])
        self.assertEqual(args, ["h", "3", "4", "60.0", "daily_usd", "n", "10", "0",
                                "daily_tokens", "t", "5", "0"])
        self.replies.append([b"daily_usd", b"12"])
        self.assertEqual(self.successResultOf(
            self.holds.reserve("bob", "h", 3, 4, [usd(10)], 60)), ("daily_usd", 12))

    def test_settle(self):
        self.successResultOf(self.holds.settle("bob", "h", 3, 4, [DAY, MONTH]))
        (method, _script, keys, args), = self.calls
        self.assertEqual(keys, ["relay:budget:h:bob", "relay:budget:s:bob:d:1",
                                "relay:budget:s:bob:m:1"])
        self.assertEqual(args, ["h", "3", "4", "3600", "3600"])


class EstimateTests(SynchronousTestCase):
    """
    L{inputTokens} and L{outputTokens}: what a reservation assumes (R108).
    """

    def test_input(self):
        """
        A quarter of the size of what the body gives the model, at least 1.
        """
        self.assertEqual(inputTokens({"input": [{"content": "x" * 400}]}), 104)
        self.assertEqual(inputTokens({"instructions": "x" * 400}), 100)
        # A bare string is the user message it stands for (as the emulator
        # counts it).
        self.assertEqual(inputTokens({"input": "hi", "model": "m" * 1000}), 13)
        self.assertGreater(inputTokens({"messages": [{"role": "user", "content": "y" * 800}]}),
                           200)
        self.assertEqual(inputTokens(None), 1)

    def test_output(self):
        """
        The request's own limit, else the key's C{max_turn_output_tokens}.
        """
        self.assertEqual(outputTokens({"max_output_tokens": 50}, 32000), 50)
        self.assertEqual(outputTokens({"max_tokens": 7}, 32000), 7)
        self.assertEqual(outputTokens({"max_output_tokens": True}, 32000), 32000)
        self.assertEqual(outputTokens({}, 1000), 1000)
        self.assertEqual(outputTokens({}, None), 32000)
