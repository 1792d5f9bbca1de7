# -*- test-case-name: tests.test_scheduler_index -*-
"""
What selection knows about the pool without looking at every account on
every turn (a turn's cost independent of the pool's size).

L{PoolIndex} holds, for one snapshot of the configured accounts (the live
registry's tuple: a reload or an admin change gives a new one, and the index
starts again), the lists every selection of a kind of turn starts from:

  - the accounts a key may reach (its account group) and their id map;
  - of those, the ones that serve a model (R44), and whether any serves the
    turn's endpoint;
  - of those, the static candidates: serve the model and the endpoint, and
    are of an account type the turn may use (R42, R87, R88);
  - the accounts behind each proxy (for a quarantine).

Each is built on first use and kept for the snapshot. The dynamic part of
eligibility -- runtime blocks, the C{extraBlock} hook's blocks, proxy
quarantine -- is not indexed here: the scheduler asks its sources which
accounts they may refuse now (the state store's
L{relay.interfaces.IAccountStates.flagged}, the C{flagged} hook beside
C{extraBlock}) and checks only those; every other static candidate is
eligible.
"""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

from attrs import define, field


@define(eq=False)
class StaticCandidates:
    """
    The static candidates of one kind of turn.

    @ivar accounts: in configured order.
    @ivar ids: their ids.
    """

    accounts: list
    ids: frozenset


@define(eq=False)
class PoolIndex:
    """
    Per-snapshot lists of a pool (see the module docstring).

    @ivar accounts: the snapshot (a tuple of L{relay.base.records.Account}).
    @ivar ids: their ids, in order.
    @ivar byId: account id -> account.
    """

    accounts: tuple
    ids: tuple = field(init=False)
    byId: dict = field(init=False)
    _groups: dict = field(factory=dict, init=False)
    _serving: dict = field(factory=dict, init=False)
    _static: dict = field(factory=dict, init=False)
    _proxies: Optional[dict] = field(default=None, init=False)
    position: dict = field(init=False)
    """account id -> its place in the configured order."""
    buckets: Optional[dict] = field(default=None, init=False)
    """C{(priority, last-used second)} -> ids in configured order: the
    load-balance order of the accounts nothing else distinguishes (idle,
    no usage window), built by L{placeAll}."""
    bucketKeys: list = field(factory=list, init=False)
    """The keys of L{buckets}, ascending."""

    def __attrs_post_init__(self) -> None:
        self.ids = tuple(a.id for a in self.accounts)
        self.byId = {a.id: a for a in self.accounts}
        self.position = {a.id: i for i, a in enumerate(self.accounts)}

    def placeAll(self, lastUsedSecond) -> None:
        """
        Build L{buckets} for every account.

        @param lastUsedSecond: C{(account) -> int}, -1 for never used.
        """
        self.buckets, self.bucketKeys = {}, []
        for account in self.accounts:
            self._add((account.priority, lastUsedSecond(account)), account.id)

    def moved(self, account, old: int, new: int) -> None:
        """
        The account's last-used second changed from C{old} to C{new}.
        """
        if self.buckets is None or old == new or account.id not in self.byId:
            return
        key = (account.priority, old)
        members = self.buckets.get(key)
        if members is not None:
            position = self.position
            where = position[account.id]
            i = bisect.bisect_left(members, where, key=position.__getitem__)
            if i < len(members) and members[i] == account.id:
                del members[i]
            if not members:
                del self.buckets[key]
                i = bisect.bisect_left(self.bucketKeys, key)
                if i < len(self.bucketKeys) and self.bucketKeys[i] == key:
                    del self.bucketKeys[i]
        self._add((account.priority, new), account.id)

    def _add(self, key: tuple, accountId: str) -> None:
        members = self.buckets.get(key)
        if members is None:
            members = self.buckets[key] = []
            bisect.insort(self.bucketKeys, key)
        bisect.insort(members, accountId, key=self.position.__getitem__)

    def candidates(self, allowed: Optional[frozenset]) -> tuple:
        """
        The accounts a key may reach.

        @param allowed: the key's account ids, or L{None} for every account.
        @return: C{(accounts in configured order, id -> account)}.
        """
        if allowed is None:
            return self.accounts, self.byId
        found = self._groups.get(allowed)
        if found is None:
            accounts = [a for a in self.accounts if a.id in allowed]
            found = self._groups[allowed] = (accounts, {a.id: a for a in accounts})
        return found

    def serving(self, allowed: Optional[frozenset], model: str, endpoint: str) -> tuple:
        """
        Of L{candidates}, those that serve C{model} (after mapping, R44).

        @return: C{(accounts, their ids, whether any serves endpoint)}.
        """
        key = (allowed, model, endpoint)
        found = self._serving.get(key)
        if found is None:
            accounts = [a for a in self.candidates(allowed)[0] if a.servesModel(model)]
            found = self._serving[key] = (
                accounts, frozenset(a.id for a in accounts),
                any(a.servesEndpoint(endpoint) for a in accounts),
            )
        return found

    def static(self, allowed: Optional[frozenset], model: str, endpoint: str,
               oauthBarred: bool, onlyOAuth: bool) -> StaticCandidates:
        """
        Of L{serving}, those that serve C{endpoint} and are of a type the
        turn may use (the static checks of the scheduler's compatibility
        check, in its order).
        """
        key = (allowed, model, endpoint, oauthBarred, onlyOAuth)
        found = self._static.get(key)
        if found is None:
            accounts = [
                a for a in self.serving(allowed, model, endpoint)[0]
                if a.servesEndpoint(endpoint)
                and not (oauthBarred and a.type == "oauth")
                and not (onlyOAuth and a.type != "oauth")
            ]
            found = self._static[key] = StaticCandidates(accounts, frozenset(a.id for a in accounts))
        return found

    def behindProxies(self, proxyIds) -> list:
        """
        @param proxyIds: proxy ids.
        @return: the ids of the accounts that dial through any of them.
        """
        if self._proxies is None:
            proxies: dict = {}
            for account in self.accounts:
                if account.proxy is not None:
                    proxies.setdefault(account.proxy.id, []).append(account.id)
            self._proxies = proxies
        out = []
        for pid in proxyIds:
            out.extend(self._proxies.get(pid, ()))
        return out


def sameSnapshot(index: Optional[PoolIndex], accounts: Sequence) -> bool:
    """
    Whether C{index} was built for exactly these account objects, in this
    order.
    """
    if index is None:
        return False
    old = index.accounts
    if old is accounts:
        return True
    return len(old) == len(accounts) and all(a is b for a, b in zip(old, accounts))
