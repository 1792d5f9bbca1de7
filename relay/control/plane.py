# -*- test-case-name: tests.test_control -*-
"""
L{ControlPlane}: what operators changed, applied to the running relay,
the way a reload is applied (L{relay.process.reload}).

The accounts in force (the live set every consumer reads,
L{relay.process.live.AccountRegistry}) are B{the file's accounts, then
the admin accounts} (records of kind C{account} in the control store,
oldest first). Whenever the store changes -- this process's own write at
once, another process's within a second (Redis pub/sub) -- the plane
re-reads the records and puts the merged set in force with
L{relay.interfaces.ILiveAccounts.replace}: a new account serves the next
turn; a removed one takes no new turn while its running turns finish
(they hold the account object they selected); a changed one's pooled
upstream sockets are retired once idle; cooldowns, streaks and sticky
bindings of unchanged accounts are kept (they are keyed by id in the
state store); an account whose credential, endpoint or proxy changed
starts afresh -- exactly what a reload does, through the same
subscribers. A reload keeps the admin accounts: the live configuration
merges them into the file's (L{overlay}).

B{Pauses} (records of kind C{pause}, for any account) take an account
out of scheduling without taking it out of the set: the scheduler's
C{extraBlock} hook asks L{blockReason}, and the operator view shows the
block (kind C{paused}); its state (cooldowns, bindings, tokens) is kept,
and it is paused again after a restart or a reload until enabled. An
admin clear (R95) lifts learnt blocks, never a pause.

B{Keys, groups and prices} (L{relay.control.keys},
L{relay.control.groups}, L{relay.control.prices}) are applied the same
way, from the same reads: the admin keys (kind C{key}) and the disables of
any key (C{key_disabled}) go into the L{relay.entry.http.KeyRing}
(L{relay.entry.http.KeyRing.replaceAdmin}), so a deleted key's next request
is a 401 and an open WebSocket's next turn a close 1008 on every process;
the admin groups (C{group}) into the key policy; the admin prices
(C{prices}) into the price table.

B{Start-up} (behaviour.md R105, R101). Until the store's first read is
settled the ring is C{pending} and the plane's flag of relay's one
start-up gate (L{relay.process.readiness.StartupGate}, C{control}) is
unset: a turn waits at the gate (bounded) and a client request waits at
its headers (L{relay.entry.body}), so neither a paused account nor a key
disabled through the API slips through, and no turn is refused for the
moment. The first read settles when it is applied, when it fails (fail
open, R35: the file's accounts and keys serve, logged, and the next
change or re-subscription reads again) or after L{LOADING_GRACE_SECONDS};
C{/readyz} lists C{control} until a read succeeded (L{ready}).

B{Ids are unique across the file and the admin API.} The API refuses an
id the file uses (409) and a reload that would add an id an admin account
has (the reload is refused, nothing changes, one line naming the id:
L{reloadProblems}); a file edited while relay was stopped can still
clash: the admin account wins then (logged), because it may hold the
only copy of a ChatGPT login, while the file's entry is still in the
file. See docs/accounts.md.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from relay.control.accounts.records import (
    ACCOUNT,
    PAUSE,
    accountFromSpec,
    specSecrets,
)
from relay.control.groups.service import GROUP, groupAccounts
from relay.control.keys.records import KEY, KEY_DISABLED, keyFromRecord
from relay.control.prices.service import PRICES, pricesOf
from relay.control.store import ControlChange
from relay.base.records import Account, ConfigError

__all__ = ["ControlPlane", "LOADING_GRACE_SECONDS", "PAUSED_KIND"]

RETRY_SECONDS = 2.0
"""How soon a failed read of the control store is tried again."""

_KINDS = (ACCOUNT, PAUSE, KEY, KEY_DISABLED, GROUP, PRICES)
"""The kinds the plane reads, in the order L{ControlPlane._apply} takes
them."""

PAUSED_KIND = "paused"
"""The block kind of a paused account in the operator view."""

LOADING_GRACE_SECONDS = 10.0
"""How long after start the start-up gate waits for the control store's
first read (a paused account must never serve before its pause is known);
a store that does not answer by then is read again in the background and
accounts serve meanwhile (logged)."""


@define(eq=False)
class ControlPlane:
    """
    See the module docstring.

    @ivar _clock: the reactor's clock.
    @ivar live: the L{relay.process.live.LiveConfiguration} to change.
    @ivar configPath: the configuration file (named in 409 answers), or
        L{None}.
    @ivar store: the L{relay.interfaces.IControlStore}; set once the
        settings store exists (L{attach}).
    @ivar admin: account id -> C{(ControlRecord, Account)} of the admin
        accounts in force.
    @ivar pauses: account id -> the C{pause} L{ControlRecord}.
    @ivar invalid: account id -> why an admin record does not validate
        (e.g. its C{proxy_id} was removed); such an account is not in force.
    @ivar keyPolicy: the L{relay.tenants.keypolicy.KeyPolicy} (its
        C{adminGroups}), set by the app; or L{None}.
    @ivar prices: the L{relay.tenants.prices.PriceTable}, set by the app;
        or L{None}.
    @ivar adminKeys: key name -> C{(ControlRecord, ClientKey)} of the admin
        keys in force.
    @ivar keyDisables: key name -> the C{key_disabled} L{ControlRecord}.
    @ivar groups: group name -> the C{group} L{ControlRecord}.
    @ivar priceRecord: the C{prices} L{ControlRecord}, or L{None}.
    @ivar invalidKeys: key name -> why its record is not in force.
    """

    _clock: IReactorTime
    live: Any
    configPath: Optional[str] = None
    store: Any = None
    admin: dict = field(factory=dict, repr=False)
    pauses: dict = field(factory=dict, repr=False)
    invalid: dict = field(factory=dict)
    keyPolicy: Any = None
    prices: Any = None
    adminKeys: dict = field(factory=dict, repr=False)
    keyDisables: dict = field(factory=dict, repr=False)
    groups: dict = field(factory=dict, repr=False)
    priceRecord: Any = field(default=None, repr=False)
    invalidKeys: dict = field(factory=dict)
    _loaded: bool = field(default=False, init=False)
    _running: bool = field(default=False, init=False)
    onSettled: Optional[Callable] = None
    """Called (no argument) once the first read is settled: the start-up
    gate's C{control} flag (L{relay.process.app}); L{None}: nobody waits."""
    _settled: bool = field(default=False, init=False)
    _syncing: Optional[Deferred] = field(default=None, init=False)
    _again: bool = field(default=False, init=False)
    _waiters: list = field(factory=list, init=False)
    _clashes: set = field(factory=set, init=False)
    _unsubscribe: Optional[Callable] = field(default=None, init=False)
    _retry: Any = field(default=None, init=False)
    _log = Logger()

    # -- wiring ------------------------------------------------------------------------

    def attach(self, store) -> None:
        """
        Use C{store} and apply its changes from now on; the live
        configuration merges the admin accounts into every reload.

        @param store: the L{relay.interfaces.IControlStore}.
        """
        if self._unsubscribe is not None:
            self._unsubscribe()
        self.store = store
        self._unsubscribe = store.subscribe(self._onChange)
        self.live.overlay = self.overlay

    @property
    def fileName(self) -> str:
        """
        @return: the configuration file's path, for messages.
        """
        return self.configPath or "the configuration file"

    def start(self) -> Deferred:
        """
        Start the change feed and read the store (service start): a store
        with C{readNow} (the embedded SQLite file) is read at once, before
        relay listens; otherwise (Redis), until the first read is settled
        (at most L{LOADING_GRACE_SECONDS}) the key ring is C{pending} and
        the start-up gate holds turns (L{onSettled}; see the module
        docstring).

        @return: a Deferred firing once read (or the read failed, logged);
            it never fails.
        """
        self._running = True
        if not self._loaded:
            self._settled = False
            self.live.keys.pending = True
            self._clock.callLater(LOADING_GRACE_SECONDS, self._graceOver)
        else:
            self._settle()
        readNow = getattr(self.store, "readNow", None)
        if readNow is not None:
            # The embedded store is a local file: read it before the port
            # opens, so no turn waits for it (and none meets a paused
            # account, R105).
            try:
                records = readNow(_KINDS)
            except Exception as e:  # noqa: BLE001 - logged; the async read follows
                self._log.warn("reading the control store at start failed: {error}",
                               event="relay.control_sync_failed", error=str(e))
            else:
                self._apply(*(records[kind] for kind in _KINDS))
        d = self.store.start()
        d.addErrback(lambda f: self._log.failure("starting the control feed failed", f))
        d.addCallback(lambda _: self.refresh())
        return d

    def stop(self) -> Deferred:
        """
        Stop the change feed (service stop).
        """
        self._running = False
        retry, self._retry = self._retry, None
        if retry is not None and retry.active():
            retry.cancel()
        return self.store.stop() if self.store is not None else succeed(None)

    # -- reading the store -----------------------------------------------------------

    def _graceOver(self) -> None:
        if not self._settled:
            self._log.warn(
                "the control store was not read within {seconds} s of start; the file's keys"
                " and accounts serve without the admin API's keys, disables and pauses until"
                " it is",
                event="relay.control_sync_failed", seconds=LOADING_GRACE_SECONDS)
            self._settle()

    def _retryLater(self) -> None:
        """
        A read failed: read again in L{RETRY_SECONDS} (once; a change or a
        re-subscription of the feed reads sooner), so a store that comes
        back is applied -- and C{/readyz} says ready -- without waiting
        for the next change.
        """
        if not self._running or (self._retry is not None and self._retry.active()):
            return

        def again():
            self._retry = None
            if self._running:
                self.refresh()

        self._retry = self._clock.callLater(RETRY_SECONDS, again)

    def storeUnreachable(self) -> None:
        """
        The control store's Redis was found silent (L{relay.wire.redisclient.
        RedisService.unreachableListeners}): a first read still in flight
        will not be answered before its timeout, so it settles now (fail
        open, R35, R101: turns waiting at the start-up gate go on at once
        instead of after the store's timeout). Later, nothing.
        """
        if self._running and not self._settled:
            self._log.warn(
                "the control store's Redis does not answer; the file's accounts and keys serve"
                " without the admin API's until a read succeeds",
                event="relay.control_sync_failed")
            self._settle()

    def _settle(self) -> None:
        """
        The first read is settled (applied, failed, or the grace ran out):
        the key ring is no longer pending and the start-up gate's flag is
        set (once).
        """
        self.live.keys.pending = False
        if self._settled:
            return
        self._settled = True
        if self.onSettled is not None:
            try:
                self.onSettled()
            except Exception:  # noqa: BLE001 - logged; the plane goes on
                self._log.failure("releasing the start-up gate failed")

    @property
    def running(self) -> bool:
        """
        Whether the plane was started (L{start}) and not stopped.
        """
        return self._running

    @property
    def ready(self) -> bool:
        """
        Whether the store has been read since start (C{/readyz}: R105).
        """
        return self._loaded or not self._running

    def _onChange(self, change: ControlChange) -> None:
        if change.kind is None or change.kind in _KINDS:
            self.refresh()

    def refresh(self) -> Deferred:
        """
        Re-read the admin accounts and pauses and put them in force.
        Calls that arrive while a read runs are served by one more read
        after it (so the newest write is always seen).

        @return: a Deferred firing once a read that began after this call
            has been applied; it never fails (a failure is logged; the
            previous state stays in force).
        """
        waiter = Deferred()
        self._waiters.append(waiter)
        if self._syncing is not None:
            self._again = True
            return waiter
        self._run()
        return waiter

    def _run(self) -> None:
        waiters, self._waiters = self._waiters, []
        self._again = False
        self._syncing = Deferred.fromCoroutine(self._sync())

        def _done(result):
            if isinstance(result, Failure):
                self._log.failure("applying the control store failed", result,
                                  event="relay.control_sync_failed")
            self._syncing = None
            for w in waiters:
                w.callback(None)
            if self._again or self._waiters:
                self._run()

        self._syncing.addBoth(_done)

    async def _sync(self) -> None:
        if self.store is None:
            return
        try:
            read = [await self.store.list(kind) for kind in _KINDS]
        except Exception as e:  # noqa: BLE001 - logged; the previous state stays
            self._retryLater()
            if not self._settled:
                # R35, R101: the first read failed; fail open at once rather
                # than holding turns for the whole grace.
                self._log.warn(
                    "reading the control store at start failed: {error}; the file's accounts"
                    " and keys serve without the admin API's until a read succeeds",
                    event="relay.control_sync_failed", error=str(e),
                )
                self._settle()
                return
            self._log.warn(
                "reading the control store failed: {error}; the accounts and keys in force"
                " are kept",
                event="relay.control_sync_failed", error=str(e),
            )
            return
        self._apply(*read)

    def _apply(self, accounts: list, pauses: list, keys: list = (), disables: list = (),
               groups: list = (), prices: list = ()) -> None:
        """
        Put the admin accounts and pauses read from the store in force,
        then the keys, groups and prices (L{_applyTenants}).
        """
        self._applyTenants(keys, disables, groups, prices)
        self.pauses = {r.id: r for r in pauses}
        proxies = tuple(self.live.config.proxies)
        admin, invalid = {}, {}
        for record in accounts:
            spec = record.data.get("spec") or {}
            try:
                account = accountFromSpec(spec, proxies)
            except ConfigError as e:
                invalid[record.id] = str(e)
                if self.invalid.get(record.id) != str(e):
                    self._log.error(
                        "admin account {account_id} is not in force: {problem}",
                        event="relay.control_account_invalid", account_id=record.id,
                        problem=str(e),
                    )
                continue
            if account.id != record.id:
                invalid[record.id] = "its id does not match its record"
                continue
            from relay.base.logs import registerSecrets

            registerSecrets(specSecrets(spec, account))
            admin[record.id] = (record, account)
        self.admin, self.invalid = admin, invalid
        self._loaded = True
        self._settle()
        change = self.live.accounts.replace(self.overlay(tuple(self.live.config.accounts)))
        if change:
            self._log.info(
                "control plane applied: accounts +{added} -{removed} ~{changed}",
                event="relay.control_applied", **change.asDict(),
            )

    def _applyTenants(self, keys, disables, groups, prices) -> None:
        """
        The admin groups into the key policy, the admin prices
        into the price table, then the admin keys and the disables into the
        key ring (last: a key's group is known before the key serves).
        """
        self.groups = {r.id: r for r in groups}
        if self.keyPolicy is not None:
            self.keyPolicy.adminGroups = {r.id: groupAccounts(r) for r in groups}
        self.priceRecord = prices[0] if prices else None
        if self.prices is not None:
            try:
                self.prices.setAdmin(pricesOf(self.priceRecord))
            except ConfigError as e:
                self._log.error("the admin prices are not in force: {problem}",
                                event="relay.control_prices_invalid", problem=str(e))
        admin, invalid = {}, {}
        for record in keys:
            try:
                admin[record.id] = (record, keyFromRecord(record))
            except (ConfigError, ValueError) as e:
                invalid[record.id] = str(e)
                if self.invalidKeys.get(record.id) != str(e):
                    self._log.error(
                        "admin key {key_name} is not in force: {problem}",
                        event="relay.control_key_invalid", key_name=record.id, problem=str(e))
        self.adminKeys, self.invalidKeys = admin, invalid
        self.keyDisables = {r.id: r for r in disables}
        ring = self.live.keys
        ring.replaceAdmin([key for _, key in admin.values()], self.keyDisables)

    # -- what the rest of relay asks --------------------------------------------------

    def overlay(self, fileAccounts: tuple) -> tuple:
        """
        The accounts to put in force for the file's C{fileAccounts}: the
        file's (less any id an admin account has: the admin account wins,
        logged once), then the admin accounts, oldest first.

        @rtype: L{tuple} of L{Account}
        """
        kept = []
        for account in fileAccounts:
            if account.id in self.admin:
                if account.id not in self._clashes:
                    self._clashes.add(account.id)
                    self._log.error(
                        "account id {account_id} is in {file} and was added through the admin"
                        " API; the admin account is in force, the file's entry is ignored:"
                        " delete one of them or rename the file's",
                        event="relay.control_id_clash", account_id=account.id,
                        file=self.fileName,
                    )
                continue
            kept.append(account)
        ordered = sorted(self.admin.values(),
                         key=lambda pair: (pair[0].data.get("created_at") or 0, pair[0].id))
        return tuple(kept) + tuple(account for _, account in ordered)

    def sourceOf(self, accountId: str) -> Optional[str]:
        """
        @return: C{admin}, C{file}, or L{None} for an account not in force.
        """
        if accountId in self.admin:
            return "admin"
        if any(a.id == accountId for a in self.live.config.accounts):
            return "file"
        return None

    def isPaused(self, accountId: str) -> bool:
        """
        @return: whether the account is paused.
        """
        return accountId in self.pauses

    def blockReason(self, account: Account, now: float):
        """
        The scheduler's C{extraBlock} answer for the control plane: a paused
        account is never scheduled (permanent until enabled). Before the
        store's first read no turn gets here: it waits at the start-up gate
        (see the module docstring), so no account is blocked for that
        moment.

        @param now: Unix seconds.
        @return: L{None}, or C{(reason, until)} (C{until} 0: until enabled).
        """
        pause = self.pauses.get(account.id)
        if pause is not None:
            return ("paused: " + (pause.data.get("reason") or "by admin"), 0)
        return None

    def flagged(self, now: float):
        """
        The accounts L{blockReason} may refuse at C{now}: the
        paused ones (before the store's first read no turn is scheduled:
        it waits at the start-up gate, R105).

        @param now: Unix seconds.
        @return: account ids.
        """
        return self.pauses.keys()

    def blocksOf(self, account: Account, now: float) -> list:
        """
        The operator view's blocks from the control plane (the shape of
        L{relay.policy.health.AccountHealth.blocks}).
        """
        if account.id not in self.pauses:
            return []
        reason = self.pauses[account.id].data.get("reason") or "by admin"
        return [{"scope": "account", "model": None, "kind": PAUSED_KIND, "reason": reason,
                 "until": None}]

    def viewOf(self, account: Account) -> dict:
        """
        The control plane's fields of an account's row in C{GET
        /admin/accounts}: C{source} (C{file} | C{admin}), C{label},
        C{paused}, C{paused_at}, C{paused_reason}, C{paused_by} (the
        admin's address), C{created_at}. Never a secret.
        """
        record = self.admin.get(account.id)
        data = record[0].data if record is not None else {}
        pause = self.pauses.get(account.id)
        return {
            "source": "admin" if record is not None else "file",
            "label": data.get("label"),
            "paused": pause is not None,
            "paused_at": pause.data.get("paused_at") if pause is not None else None,
            "paused_reason": pause.data.get("reason") if pause is not None else None,
            "paused_by": pause.data.get("by") if pause is not None else None,
            "created_at": data.get("created_at"),
        }

    def reloadProblems(self, config) -> list:
        """
        What stops a reload of C{config} because of the admin accounts
        (L{relay.process.reload.ConfigReloader.checks}): an id the file
        would add that an admin account has, a proxy an admin account uses
        that the file would remove; and a key name or group name
        the file would add that the admin API has, a file group an admin key
        is bound to that the file would remove. One line each; nothing
        changes.

        @param config: the reloaded L{relay.base.records.RelayConfig}.
        @rtype: L{list} of L{str}
        """
        problems = []
        for i, account in enumerate(config.accounts):
            if account.id in self.admin:
                problems.append(
                    f"accounts[{i}].id: {account.id!r} is already an account added through the"
                    " admin API; delete that one (DELETE /admin/accounts/"
                    f"{account.id}) or give the file's entry another id"
                )
        for i, key in enumerate(config.keys):
            if key.name in self.adminKeys:
                problems.append(
                    f"keys[{i}].name: {key.name!r} is already a key issued through the admin"
                    f" API; revoke that one (DELETE /admin/keys/{key.name}) or give the file's"
                    " entry another name"
                )
        fileGroups = getattr(config, "groups", None) or {}
        for name in sorted(fileGroups):
            if name in self.groups:
                problems.append(
                    f"groups.{name}: {name!r} is already a group added through the admin API;"
                    f" delete that one (DELETE /admin/groups/{name}) or rename the file's"
                )
        for name, (_, key) in sorted(self.adminKeys.items()):
            if (key.group is not None and key.group not in fileGroups
                    and key.group not in self.groups):
                problems.append(
                    f"groups: {key.group!r} is the group of the admin key {name!r}; keep it in"
                    " the file or change that key's group first"
                )
        proxyIds = {p.id for p in config.proxies}
        for accountId, (record, _) in sorted(self.admin.items()):
            proxyId = (record.data.get("spec") or {}).get("proxy_id")
            if proxyId is not None and proxyId not in proxyIds:
                problems.append(
                    f"proxies: {proxyId!r} is the proxy of the admin account {accountId!r};"
                    " keep it in the file or change that account's proxy first"
                )
        return problems
