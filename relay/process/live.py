# -*- test-case-name: tests.test_operations -*-
"""
The live configuration's one home.

Every part of a running relay that needs the accounts reads them through
one L{AccountRegistry} (the scheduler, the WebSocket entry, C{/v1/models},
the operator view); every entrypoint authenticates through one
L{relay.entry.http.KeyRing}. A reload swaps their contents in place, so
nothing holds a stale copy. L{LiveConfiguration} keeps them together with
the L{RelayConfig} in force.

The hook: L{AccountRegistry.subscribe} tells a listener which account ids
were added, removed or changed (never secrets), after the new set is in
force. relay itself subscribes the C{ctx_pool} upstream pool (it retires a
changed or removed account's connections once idle); a per-account
credential source (e.g. OAuth tokens) subscribes the same way to
forget or rebuild an account's state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Optional

from attrs import define, field, frozen
from twisted.logger import Logger
from zope.interface import implementer

from relay.interfaces import ILiveAccounts
from relay.base.records import Account, RelayConfig

__all__ = ["AccountRegistry", "AccountSetChange", "LiveConfiguration"]


@frozen
class AccountSetChange:
    """
    What a reload did to the account set: ids only, never secrets.

    @ivar added: ids that are new.
    @ivar removed: ids that are gone (their running turns finish; they
        take no new turn).
    @ivar changed: ids whose settings differ (credential, proxy, priority,
        concurrency, models, mapping, ...): new attempts use the new ones.
    @ivar renewed: the changed ids whose identity upstream changed (type,
        C{base_url}, credential, C{chatgpt_account_id} or proxy): what was
        learnt about the old one (cooldowns, streaks, the breaker) no
        longer applies, so relay clears it; a change of priority,
        concurrency, models or mapping alone keeps the account's state.
    """

    added: frozenset = frozenset()
    removed: frozenset = frozenset()
    changed: frozenset = frozenset()
    renewed: frozenset = frozenset()

    def __bool__(self) -> bool:
        """
        @return: whether anything changed.
        """
        return bool(self.added or self.removed or self.changed)

    def asDict(self) -> dict:
        """
        @return: C{{"added": [...], "removed": [...], "changed": [...]}},
            each sorted, for logs and the admin answer.
        """
        return {
            "added": sorted(self.added),
            "removed": sorted(self.removed),
            "changed": sorted(self.changed),
            "renewed": sorted(self.renewed),
        }


def diffAccounts(old: Iterable[Account], new: Iterable[Account]) -> AccountSetChange:
    """
    Compare two account sets by id.

    @param old: the accounts in force.
    @param new: the accounts to put in force.
    @rtype: L{AccountSetChange}
    """
    before = {a.id: a for a in old}
    after = {a.id: a for a in new}
    changed = frozenset(i for i in before.keys() & after.keys() if before[i] != after[i])
    return AccountSetChange(
        added=frozenset(after.keys() - before.keys()),
        removed=frozenset(before.keys() - after.keys()),
        changed=changed,
        renewed=frozenset(i for i in changed if _identity(before[i]) != _identity(after[i])),
    )


def _identity(account: Account) -> tuple:
    """
    What an account is upstream: its type, endpoint, credential, ChatGPT
    account and egress proxy.
    """
    return (
        account.type, account.base_url, account.credential, account.chatgpt_account_id,
        account.proxy,
    )


@implementer(ILiveAccounts)
@define(eq=False)
class AccountRegistry:
    """
    The accounts in force (L{ILiveAccounts}). Reads are a tuple snapshot:
    iterating while a reload happens sees either the old or the new set,
    never a mix.

    @ivar _accounts: the accounts in force.
    @ivar _listeners: subscribers, called with an L{AccountSetChange}.
    """

    _accounts: tuple = field(default=(), converter=tuple)
    _listeners: list = field(factory=list, init=False)
    _log = Logger()

    def __iter__(self):
        return iter(self._accounts)

    def __len__(self) -> int:
        return len(self._accounts)

    def __getitem__(self, index):
        return self._accounts[index]

    def __bool__(self) -> bool:
        return bool(self._accounts)

    def snapshot(self) -> tuple:
        """
        The accounts in force, as one immutable tuple: the same object until
        the set changes (the scheduler's per-snapshot index keys
        on it).
        """
        return self._accounts

    def byId(self, accountId: str) -> Account | None:
        """
        See L{ILiveAccounts.byId}.
        """
        for account in self._accounts:
            if account.id == accountId:
                return account
        return None

    def replace(self, accounts: Iterable[Account]) -> AccountSetChange:
        """
        See L{ILiveAccounts.replace}.
        """
        accounts = tuple(accounts)
        change = diffAccounts(self._accounts, accounts)
        self._accounts = accounts
        if change:
            for listener in list(self._listeners):
                try:
                    listener(change)
                except Exception:  # noqa: BLE001 - logged; one bad part must not stop the rest
                    self._log.failure(
                        "an account-set listener failed",
                        event="relay.config_listener_failed",
                    )
        return change

    def subscribe(self, listener: Callable[[AccountSetChange], object]) -> Callable[[], None]:
        """
        See L{ILiveAccounts.subscribe}.
        """
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe


@define(eq=False)
class LiveConfiguration:
    """
    The configuration a running relay serves with: what a reload changes.

    @ivar config: the L{RelayConfig} in force (after a reload, with any
        refused keys still at their start-up values).
    @ivar accounts: the L{AccountRegistry} every consumer reads.
    @ivar keys: the L{relay.entry.http.KeyRing} every entrypoint
        authenticates with.
    @ivar overlay: L{None}, or C{fileAccounts -> accounts in force}: the
        control plane (L{relay.control.plane.ControlPlane.overlay})
        adds the accounts an operator added through the admin API, so a
        reload keeps them.
    """

    config: RelayConfig
    accounts: AccountRegistry
    keys: object
    overlay: Optional[Callable[[tuple], tuple]] = None

    @classmethod
    def fromConfig(cls, config: RelayConfig) -> LiveConfiguration:
        """
        Build the live configuration a process starts with.

        @param config: the parsed start-up L{RelayConfig}.
        """
        from relay.frontdoor.keyring import KeyRing

        return cls(
            config=config, accounts=AccountRegistry(config.accounts), keys=KeyRing(config.keys)
        )

    def adminKey(self) -> str | None:
        """
        @return: the admin key in force (C{admin_key}), or L{None} when the
            admin API is disabled. Read per request, so a reload rotates it.
        """
        return self.config.admin_key

    def metricsKey(self) -> str | None:
        """
        @return: the read-only C{metrics_key} in force (opens C{/metrics}
            only, R99), or L{None}.
        """
        return self.config.metrics_key

    def apply(self, config: RelayConfig) -> AccountSetChange:
        """
        Put C{config}'s keys, accounts and admin key in force (the gateway
        section is L{relay.state.settings.RuntimeSettings.rebase}'s). Keys
        first, so a new key and a new account arrive together for the
        next request.

        @param config: the validated L{RelayConfig}, refused keys already
            reverted (L{relay.process.reload}).
        @return: what happened to the account set.
        """
        self.config = config
        self.keys.replace(config.keys)
        accounts = tuple(config.accounts)
        if self.overlay is not None:
            accounts = self.overlay(accounts)
        return self.accounts.replace(accounts)
