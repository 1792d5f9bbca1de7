"""
A turn runner on a L{Clock} with issue 22's parts wired as the application
wires them: the key policy (memory rate windows), the price table, the
usage ledger and a memory request log. Shared by the tenants' unit tests.
"""

from __future__ import annotations

from relay.base.records import ClientKey, RelayConfig, Turn
from relay.process.live import LiveConfiguration
from relay.tenants.keypolicy import KeyPolicy
from relay.tenants.prices import PriceTable
from relay.tenants.ratelimit import MemoryRateLimiter
from relay.tenants.requestlog import MemoryRequestLog
from relay.usage.holds import MemoryBudgetHolds
from relay.usage.ledger import UsageLedger
from relay.usage.store import MemoryUsageStore
from tests.test_runner import FakeSink, Rig, account

__all__ = ["TenantsRig", "account", "key"]


def key(name="bob", **policy) -> ClientKey:
    """
    A client key with C{policy} fields and no concurrency limit.
    """
    policy.setdefault("concurrency", 0)
    return ClientKey(name=name, key="sk-" + name, **policy)


class RecordingSink(FakeSink):
    """
    A L{FakeSink} that keeps its last error as C{failed}, as relay's
    sinks do (the turn's record reads it).
    """

    failed = None

    def fail(self, error):
        self.failed = error
        super().fail(error)


class TenantsRig(Rig):
    """
    L{Rig} plus the tenants' parts.

    @ivar live: the L{LiveConfiguration} (its C{config.groups}).
    @ivar policy: the L{KeyPolicy}.
    @ivar limiter: its L{MemoryRateLimiter}.
    @ivar ledger: the L{UsageLedger} (money budgets from the keys).
    @ivar holds: its L{MemoryBudgetHolds} (R108).
    @ivar log: the L{MemoryRequestLog}.
    """

    def __init__(self, accounts, keys=(), groups=None, prices=None, **settings):
        super().__init__(accounts, **settings)
        config = RelayConfig(accounts=tuple(accounts), keys=tuple(keys), groups=groups or {})
        self.live = LiveConfiguration.fromConfig(config)
        self.scheduler._balancer._accounts = self.live.accounts
        self.limiter = MemoryRateLimiter(clock=self.clock)
        self.prices = PriceTable(prices or {})
        self.policy = KeyPolicy(clock=self.clock, live=self.live, limiter=self.limiter,
                                prices=self.prices)
        self.holds = MemoryBudgetHolds(clock=self.clock)
        self.ledger = UsageLedger(clock=self.clock, store=MemoryUsageStore(), holds=self.holds)
        self.ledger.setBudgets(keys)
        self.log = MemoryRequestLog(clock=self.clock)
        self.runner.keyPolicy = self.policy
        self.runner.prices = self.prices
        self.runner.usage = self.ledger
        self.runner.requestLog = self.log

    def turn(self, client, model="gpt-5.5", stream=True, entrypoint="http", **kw) -> Turn:
        return Turn(entrypoint=entrypoint, endpoint=kw.pop("endpoint", "responses"),
                    client=client, model=model,
                    body={"model": model, "input": "hi", "stream": stream}, stream=stream,
                    requestId=kw.pop("requestId", "req"), **kw)

    def go(self, turn, sink=None):
        sink = sink or RecordingSink()
        outcome = []
        self.door.enter(turn, sink).addCallback(outcome.append)
        return sink, outcome

    def records(self) -> list:
        return list(self.log._records)
