"""
behaviour.md R96 -- no process ever presents a refresh token that the store
shows as replaced -- where the processes' view of the token record
disagrees (found by tests.integration.test_redis_sentinel on a loaded box):

  - peers configured with the same login but different access tokens (each
    relay process's file written at another moment; a peer configured with
    an older copy of a login that was rotated since, or replaced by a new
    login): the configuration's refresh token is known to the stored
    lineage, so the store wins and nothing spent is seeded again;
  - a store that goes back (the last writes lost at a Redis failover:
    replication is asynchronous, so the promoted replica may lack the
    rotated record or even the in-flight marker): a process that knows the
    newer record writes it back (on its next read, and soon after a
    Sentinel promotion), and no trigger of a refresh -- the proactive
    timer, the expiry check before a dial, the refresh after a 401 --
    presents the rotated-away token.

L{OAuthCredentials} on a Clock with memory stores and a fake token endpoint
that rotates refresh tokens as the real one does.
"""

from __future__ import annotations

import copy

from attrs import define, evolve, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from relay.interfaces import ITokenEndpoint
from relay.base.records import GatewaySettings, OAuthSettings
from relay.oauth.credentials import SWITCH_SYNC_DELAYS, OAuthCredentials
from relay.oauth.endpoint import TokenReply
from relay.oauth.store import MemoryTokenStore
from relay.oauth.tokens import (
    RETIRED_KEEP,
    STATUS_OK,
    TokenRecord,
    fingerprint,
    retiredAfter,
)
from relay.state.settings import RuntimeSettings
from tests.test_oauth import NOW, account, token


@implementer(ITokenEndpoint)
@define(eq=False)
class RotatingEndpoint:
    """
    A token endpoint that rotates: the current refresh token gets a new
    access token and C{rt-<n+1>}; any other is C{refresh_token_reused}
    (protocol.md 7.4), counted.

    @ivar current: the refresh token the server takes now.
    @ivar sent: every refresh token presented, in order.
    @ivar reused: refresh tokens presented after they were rotated.
    @ivar answered: called (no arguments) after each answer, or L{None}.
    """

    current: str = "rt-0"
    issued: int = 0
    sent: list = field(factory=list)
    reused: list = field(factory=list)
    answered: object = None

    def refresh(self, account, refreshToken, timeout):
        """
        See L{ITokenEndpoint.refresh}.
        """
        self.sent.append(refreshToken)
        if self.answered is not None:
            self.answered()
        if refreshToken != self.current:
            self.reused.append(refreshToken)
            return succeed(TokenReply(401, {"error": {
                "code": "refresh_token_reused", "message": "already used"}}))
        self.issued += 1
        self.current = f"rt-{self.issued}"
        return succeed(TokenReply(200, {
            "access_token": token(NOW + 36_000 + self.issued, NOW, account="acct-1"),
            "refresh_token": self.current, "id_token": None, "expires_in": 36_000,
        }))


@define(eq=False)
class LosingStore(MemoryTokenStore):
    """
    A memory store that can go back: L{loseLast} forgets the last C{n}
    record writes, as a promoted Redis replica lacks what the old master
    acknowledged but had not passed on.
    """

    history: list = field(factory=list)

    def save(self, accountId, version, record, expected):
        before = copy.deepcopy(self.records)
        d = super().save(accountId, version, record, expected)
        if self.records != before:
            self.history.append(before)
        return d

    def loseLast(self, n: int) -> None:
        self.records = self.history[-n]
        del self.history[-n:]


class _Base(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.clock.advance(NOW)
        self.settings = RuntimeSettings(current=GatewaySettings(
            oauth=OAuthSettings(refresh_margin_seconds=600)))
        self.store = LosingStore(clock=self.clock)
        self.endpoint = RotatingEndpoint()

    def process(self, acct) -> OAuthCredentials:
        """
        One relay process: its own L{OAuthCredentials} on the shared store
        and token endpoint, started.
        """
        credentials = OAuthCredentials(
            clock=self.clock, settings=self.settings, store=self.store,
            endpoint=self.endpoint, accounts=[acct],
        )
        self.successResultOf(credentials.start())
        self.addCleanup(credentials.stop)
        return credentials

    def stored(self) -> TokenRecord:
        return TokenRecord.fromJSON(self.successResultOf(self.store.load("o1")))

    def assertNoReuse(self) -> None:
        self.assertEqual(self.endpoint.reused, [])
        self.assertEqual(len(self.endpoint.sent), len(set(self.endpoint.sent)),
                         self.endpoint.sent)


class LineageTests(_Base):
    """
    A configuration holding a refresh token the stored lineage knows is an
    older copy of that lineage, whatever its access token.
    """

    def test_peerWithOtherAccessToken(self):
        """
        Two processes configured with the same refresh token but different
        access tokens (the integration test's two files, minted a moment
        apart): the second one, starting after the first refreshed, adopts
        the stored tokens instead of seeding the spent refresh token, and
        its own refresh presents the current one.
        """
        first = self.process(account(access=token(NOW + 6, NOW)))
        self.assertTrue(self.successResultOf(
            first.refresh(account(), reason="proactive", force=True)))
        self.assertEqual(self.endpoint.sent, ["rt-0"])
        second = self.process(account(access=token(NOW + 7, NOW)))
        acct = account()
        self.assertEqual(second.current(acct).refresh_token, "rt-1")
        self.assertEqual(self.stored().tokens.refresh_token, "rt-1")
        self.assertTrue(self.successResultOf(second.refresh(acct, force=True)))
        self.assertEqual(self.endpoint.sent, ["rt-0", "rt-1"])
        self.assertNoReuse()
        self.assertEqual(second.view(acct)["token_status"], STATUS_OK)

    def test_newLoginKeepsSpentTokens(self):
        """
        A new login in one process's configuration replaces the lineage; a
        peer still configured with the old login's (spent) refresh token
        adopts the new lineage rather than seeding the spent token back.
        """
        old = account(access=token(NOW + 3600, NOW))
        first = self.process(old)
        self.successResultOf(first.refresh(old, force=True))  # rt-0 -> rt-1
        self.endpoint.current = "rt-login"
        relogin = account(access=token(NOW + 3601, NOW), refresh="rt-login")
        second = self.process(relogin)
        self.assertEqual(second.current(relogin).refresh_token, "rt-login")
        third = self.process(old)
        self.assertEqual(third.current(old).refresh_token, "rt-login")
        self.assertEqual(self.stored().tokens.refresh_token, "rt-login")
        self.assertTrue(self.stored().retires("rt-0"))
        self.assertTrue(self.stored().retires("rt-1"))
        self.assertTrue(self.successResultOf(third.refresh(old, force=True)))
        self.assertNoReuse()

    def test_sameTokensStillSeedOnce(self):
        """
        The configuration's own lineage still wins on a restart, and a
        configuration with another refresh token (a new login) still
        replaces the store (tests.test_oauth's seeding rules hold).
        """
        acct = account()
        self.process(acct)
        self.assertEqual(self.stored().version, 1)
        self.process(acct)
        self.assertEqual(self.stored().version, 1)
        relogin = account(refresh="rt-new")
        self.assertEqual(self.process(relogin).current(relogin).refresh_token, "rt-new")

    def test_retiredKeepsFirstAndNewest(self):
        """
        The retired list is bounded: the lineage's first refresh token and
        the newest others.
        """
        retired = ()
        for i in range(RETIRED_KEEP + 10):
            retired = retiredAfter(retired, f"rt-{i}")
        self.assertEqual(len(retired), RETIRED_KEEP)
        self.assertEqual(retired[0], fingerprint("rt-0"))
        self.assertEqual(retired[-1], fingerprint(f"rt-{RETIRED_KEEP + 9}"))
        self.assertNotIn(fingerprint("rt-5"), retired)
        self.assertEqual(retiredAfter(retired, None, ""), retired)

    def test_adminTokensRetireTheReplaced(self):
        """
        New tokens from an operator retire the replaced refresh token; the
        one the operator gives is current (even one relay had retired).
        """
        acct = account()
        credentials = self.process(acct)
        self.successResultOf(credentials.refresh(acct, force=True))  # rt-0 -> rt-1
        self.successResultOf(credentials.setTokens("o1", token(NOW + 3600, NOW), "rt-0"))
        record = self.stored()
        self.assertEqual(record.tokens.refresh_token, "rt-0")
        self.assertFalse(record.retires("rt-0"))
        self.assertTrue(record.retires("rt-1"))


class StoreWentBackTests(_Base):
    """
    The store loses its last writes (a Redis failover after an
    unreplicated write): the process that knows the newer record writes it
    back, and no refresh presents the rotated-away token.
    """

    def _scenario(self, lost: int, restorer: str, trigger: str) -> None:
        """
        C{writer} refreshes (rt-0 -> rt-1: an in-flight marker, then the
        new record); C{peer} has read the new record; C{late} still holds
        the record from before. The store loses the last C{lost} writes;
        C{restorer} re-reads (a periodic sync or the Sentinel switch
        hook); then C{late} refreshes through C{trigger}.
        """
        acct = account(access=token(NOW + 3600, NOW))
        writer = self.process(acct)
        late = self.process(acct)
        self.assertTrue(self.successResultOf(writer.refresh(acct, force=True)))
        peer = self.process(acct)
        self.assertEqual(peer.current(acct).refresh_token, "rt-1")
        self.assertEqual(late.current(acct).refresh_token, "rt-0")
        self.store.loseLast(lost)
        self.assertEqual(self.stored().tokens.refresh_token, "rt-0")
        processes = {"writer": writer, "peer": peer}
        if restorer.endswith("switch"):
            processes[restorer.split()[0]].storeSwitched()
            self.clock.advance(SWITCH_SYNC_DELAYS[0])
        else:
            self.successResultOf(processes[restorer].sync())
        self.assertEqual(self.stored().tokens.refresh_token, "rt-1")
        if trigger == "proactive":
            self.clock.advance(late.refreshAt(acct) - self.clock.seconds() + 1)
        elif trigger == "401":
            self.successResultOf(late.refresh(acct, stale=late.current(acct).credential))
        else:
            late.invalidate(acct)
            d = late.ready(acct)
            self.assertIsNotNone(d)
            self.successResultOf(d)
        self.assertNoReuse()
        self.assertEqual(late.current(acct).refresh_token, "rt-1")
        self.assertEqual(late.view(acct)["token_status"], STATUS_OK)
        self.assertEqual(self.stored().status, STATUS_OK)
        # Later refreshes go on from the current token, in any process.
        self.assertTrue(self.successResultOf(peer.refresh(acct, force=True)))
        self.assertNoReuse()

    def test_lostRecordWriterSyncs401(self):
        """
        The new record is lost (the marker survives); the writer's next
        read writes it back; a 401 in a late process uses it.
        """
        self._scenario(lost=1, restorer="writer", trigger="401")

    def test_lostMarkerAndRecordPeerSyncsProactive(self):
        """
        The marker and the new record are lost (the store is back at the
        record before the refresh); a peer that read the new record writes
        it back; the late process's proactive refresh sends nothing spent.
        """
        self._scenario(lost=2, restorer="peer", trigger="proactive")

    def test_lostMarkerAndRecordSwitchExpired(self):
        """
        The same after a Sentinel promotion: the switch hook re-reads
        within L{SWITCH_SYNC_DELAYS}; the late process's refresh before a
        dial (its access token unusable) uses the written-back tokens.
        """
        self._scenario(lost=2, restorer="writer switch", trigger="expired")

    def test_lostRecordPeerSwitchProactive(self):
        """
        The new record lost, the peer's switch hook writes it back, the late
        process refreshes on its timer.
        """
        self._scenario(lost=1, restorer="peer switch", trigger="proactive")

    def test_writerRefreshesAfterLoss(self):
        """
        Without any re-read first, the writer's own next refresh (under the
        lock it re-reads) writes its newer record back and presents its
        current token, never the lost one's; before the fix its marker
        write conflicted for ever.
        """
        acct = account(access=token(NOW + 3600, NOW))
        writer = self.process(acct)
        self.successResultOf(writer.refresh(acct, force=True))
        self.store.loseLast(2)
        self.assertTrue(self.successResultOf(writer.refresh(acct, force=True)))
        self.assertEqual(self.endpoint.sent, ["rt-0", "rt-1"])
        self.assertEqual(self.stored().tokens.refresh_token, "rt-2")
        self.assertNoReuse()

    def test_lostDoubtIsWrittenBack(self):
        """
        A lost write that did not rotate (the in-doubt mark after a token
        request that got no answer) is written back too, so a peer does not
        send the in-doubt token.
        """
        acct = account(access=token(NOW + 3600, NOW))
        writer = self.process(acct)
        late = self.process(acct)
        record = self.stored()
        doubtful = evolve(record, version=record.version + 1, status="in_doubt",
                          reason="refresh_in_doubt")
        self.assertTrue(self.successResultOf(
            self.store.save("o1", doubtful.version, doubtful.toJSON(), record.version)))
        self.successResultOf(writer.sync())
        self.store.loseLast(1)
        self.assertEqual(self.stored().status, STATUS_OK)
        self.successResultOf(writer.sync())
        self.assertEqual(self.stored().status, "in_doubt")
        self.successResultOf(late.refresh(acct, force=True))
        self.assertEqual(self.endpoint.sent, [])

    def test_pendingTokensWinOverPeersDoubt(self):
        """
        The store fails after the token request (the new tokens wait in
        memory); a peer then finds the in-flight marker without its lock
        and marks the refresh token in doubt. When the store is back the
        waiting tokens are written over the in-doubt record (it still holds
        the token just used), not dropped: the login survives and nothing
        is sent twice.
        """
        acct = account(access=token(NOW + 3600, NOW))
        writer = self.process(acct)
        peer = self.process(acct)
        store = self.store
        self.endpoint.answered = lambda: setattr(store, "failing", True)
        refreshed = writer.refresh(acct, force=True)
        self.clock.pump([0.5] * 8)  # _persist's three attempts
        self.assertFalse(self.successResultOf(refreshed))
        self.assertTrue(writer.view(acct)["token_unpersisted"])
        self.endpoint.answered = None
        store.failing = False
        self.successResultOf(peer.refresh(acct, force=True))
        self.assertEqual(self.stored().status, "in_doubt")
        self.clock.advance(5)  # the pending write's retry
        self.assertEqual(self.stored().tokens.refresh_token, "rt-1")
        self.assertEqual(self.stored().status, STATUS_OK)
        self.assertEqual(writer.current(acct).refresh_token, "rt-1")
        self.successResultOf(peer.sync())
        self.assertEqual(peer.current(acct).refresh_token, "rt-1")
        self.assertEqual(self.endpoint.sent, ["rt-0"])
        self.assertNoReuse()

    def test_noSwitchHookWhenStopped(self):
        """
        A stopped process schedules nothing on a switch.
        """
        credentials = self.process(account())
        credentials.stop()
        credentials.storeSwitched()
        self.assertEqual(self.clock.getDelayedCalls(), [])


@define(eq=False)
class _CountedLoads(MemoryTokenStore):
    """
    A memory store whose loads wait for the test, counted.
    """

    waiting: list = field(factory=list)

    def load(self, accountId):
        d = Deferred()
        self.waiting.append(d)
        return d.addCallback(lambda _: super(_CountedLoads, self).load(accountId))


class StartTests(_Base):
    """
    The periodic sync does not start a second load beside start-up's.
    """

    def test_syncDuringStart(self):
        """
        A sync while start-up still reads the record leaves it to start-up:
        one read, one seeding write.
        """
        store = _CountedLoads(clock=self.clock)
        credentials = OAuthCredentials(
            clock=self.clock, settings=self.settings, store=store,
            endpoint=self.endpoint, accounts=[account()],
        )
        self.addCleanup(credentials.stop)
        started = credentials.start()
        synced = credentials.sync()
        self.successResultOf(synced)
        self.assertEqual(len(store.waiting), 1)
        while store.waiting:
            store.waiting.pop(0).callback(None)
        self.successResultOf(started)
        self.assertEqual(credentials.view(account())["token_version"], 1)


class WiringTests(SynchronousTestCase):
    """
    relay.process.app subscribes the token records' re-read to the Sentinel switch.
    """

    def test_switchHookWired(self):
        """
        With C{state.redis_sentinels} the Redis client's switch listeners
        include L{OAuthCredentials.storeSwitched}, so a promotion re-reads
        the token records.
        """
        from twisted.internet.testing import MemoryReactorClock

        from relay.process.app import buildApplication
        from relay.configuration.parse import settingsFromString

        text = (
            'listen: "tcp:0:interface=127.0.0.1"\ndatabase: ":memory:"\n'
            "accounts: [{id: o1, type: oauth, refresh_token: rt-0,"
            " chatgpt_account_id: acct-1}]\n"
            "state: {backend: redis, redis_url: 'redis://127.0.0.1:1/0',"
            " redis_sentinels: ['127.0.0.1:1'], redis_master_name: m}\n"
        )
        app = buildApplication(settingsFromString(text), MemoryReactorClock())
        credentials = app.extras["credentials"]
        self.assertIn(credentials.storeSwitched, app.services[0].switchListeners)
