# -*- test-case-name: tests.test_usage_probe -*-
"""
L{UsageProbe}: the usage windows of idle OAuth accounts.

relay learns an OAuth account's 5-hour and weekly windows from its
traffic (L{relay.scheduling.quota}); an idle account would show stale
numbers and quota-aware scheduling would misjudge it. So every few
seconds the probe looks at each OAuth account and reads
C{GET /backend-api/wham/usage} (protocol.md 7.4) with its current bearer
and C{chatgpt-account-id}, through its egress proxy (behaviour.md R97),
when:

  - its last snapshot (from traffic or a probe) is older than
    C{gateway.oauth.usage_probe_interval_seconds} (default 300, 0 = off):
    an account whose traffic reported its windows more recently is not
    probed -- never more often than traffic would tell; or
  - a cooldown of it has just ended (C{gateway.oauth.usage_probe_after_cooldown},
    default on) and nothing was heard of it since: a window that reset
    shows as such before the next turn.

Never probed: paused accounts, accounts in a cooldown, and accounts whose
tokens are not usable (C{needs_login}, loading, refresh failing).

Processes sharing a state store probe each account once per interval
between them: a probe is claimed with a fixed-window counter
(C{usage_probe:<id>}, L{relay.interfaces.IStateStore.incrementCounter})
and its snapshot is shared as a value (C{usage_probe_result:<id>}) that
the other processes adopt.
"""

from __future__ import annotations

import json
from typing import Any, Optional
from urllib.parse import urlsplit

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.oauth.windows import Snapshot, Window, windowsFromWham

__all__ = ["PROBE_TICK_SECONDS", "UsageProbe", "usageURL"]

PROBE_TICK_SECONDS = 5.0
"""How often the probe looks at the accounts, seconds."""

PROBE_TIMEOUT_SECONDS = 15.0
"""A probe's whole exchange, seconds."""

CLAIM_PREFIX = "usage_probe:"
RESULT_PREFIX = "usage_probe_result:"


def usageURL(baseURL: str) -> str:
    """
    The usage endpoint beside an OAuth account's Codex base URL:
    C{https://chatgpt.com/backend-api/codex} gives
    C{https://chatgpt.com/backend-api/wham/usage}; another base gives
    C{<scheme>://<host>/backend-api/wham/usage}.
    """
    base = baseURL.rstrip("/")
    if base.endswith("/codex"):
        return base[: -len("/codex")] + "/wham/usage"
    parts = urlsplit(base)
    return f"{parts.scheme}://{parts.netloc}/backend-api/wham/usage"


def _snapshotJSON(snapshot: Snapshot) -> str:
    def window(w: Optional[Window]):
        return None if w is None else [w.used_percent, w.window_minutes, w.reset_at]

    return json.dumps({"p": window(snapshot.primary), "s": window(snapshot.secondary),
                       "plan": snapshot.plan, "at": snapshot.observed_at})


def _snapshotFrom(raw) -> Optional[Snapshot]:
    try:
        value = json.loads(raw)

        def window(w):
            return None if w is None else Window(float(w[0]), w[1], w[2])

        return Snapshot(window(value["p"]), window(value["s"]), value.get("plan"),
                        float(value["at"]), "probe")
    except (TypeError, ValueError, KeyError, IndexError):
        return None


@define(eq=False)
class UsageProbe:
    """
    See the module docstring.

    @ivar _clock: Unix seconds; the tick's timer.
    @ivar accounts: the live accounts (L{relay.interfaces.ILiveAccounts}).
    @ivar credentials: the L{relay.interfaces.ICredentialSource}.
    @ivar quota: the L{relay.scheduling.quota.UsageWindows}.
    @ivar egress: the L{relay.interfaces.IEgressClient}.
    @ivar settings: the L{relay.state.settings.RuntimeSettings}.
    @ivar store: the L{relay.interfaces.IStateStore} (cooldowns, the
        shared claim and result).
    @ivar paused: C{account id -> bool}, or L{None}.
    @ivar probes: probes this process sent (for the view and tests).
    """

    _clock: IReactorTime
    accounts: Any
    credentials: Any
    quota: Any
    egress: Any
    settings: Any
    store: Any
    paused: Any = None
    resets: Any = None
    """The L{relay.oauth.resets.BankedResets} that keeps the banked resets
    count each usage answer carries (protocol.md 7.3a), or L{None}."""
    probes: int = 0
    _cooling: dict = field(factory=dict, init=False)
    _inflight: set = field(factory=set, init=False)
    _log = Logger()

    def tick(self) -> Deferred:
        """
        Look at every OAuth account once (the periodic job); never fails.
        """
        d = Deferred.fromCoroutine(self._tick())
        d.addErrback(lambda f: self._log.failure("usage probe tick failed", f))
        return d

    async def _tick(self) -> None:
        oauth = self.settings.current.oauth
        interval = float(oauth.usage_probe_interval_seconds)
        afterCooldown = bool(oauth.usage_probe_after_cooldown)
        if interval <= 0 and not afterCooldown:
            return
        accounts = [a for a in self.accounts if a.type == "oauth"]
        if not accounts:
            return
        now = self._clock.seconds()
        states = await self.store.getAccountStates([a.id for a in accounts])
        for account in accounts:
            if self.paused is not None and self.paused(account.id):
                continue
            runtime = states.get(account.id)
            blocked = runtime.unschedulable(now) if runtime is not None else None
            if blocked is not None:
                if blocked[1]:
                    self._cooling[account.id] = blocked[1]
                continue
            snapshot = self.quota.get(account.id)
            heard = snapshot.observed_at if snapshot is not None else None
            cooledAt = self._cooling.pop(account.id, None)
            due = interval > 0 and (heard is None or now - heard >= interval)
            if afterCooldown and cooledAt is not None and (heard is None or heard < cooledAt):
                due = True
            if not due or account.id in self._inflight:
                continue
            if self.credentials.blockReason(account, now) is not None:
                continue
            await self._probeShared(account, interval, now,
                                    cooledAt if afterCooldown else None)

    async def _probeShared(self, account, interval: float, now: float,
                           cooledAt: Optional[float]):
        """
        Adopt another process's probe that is fresh enough, or claim the
        probe (once per interval, or once per ended cooldown, between the
        processes) and send it.
        """
        shared = await self.store.getValue(RESULT_PREFIX + account.id)
        snapshot = _snapshotFrom(shared) if shared else None
        if snapshot is not None:
            fresh = snapshot.observed_at >= cooledAt if cooledAt is not None else (
                now - snapshot.observed_at < interval)
            if fresh:
                self.quota.observe(account.id, snapshot)
                return
        if cooledAt is not None:
            key, window = f"{CLAIM_PREFIX}{account.id}:{int(cooledAt)}", 600.0
        else:
            key, window = CLAIM_PREFIX + account.id, max(1.0, interval * 0.9)
        claim = await self.store.incrementCounter(key, window, False)
        if claim not in (0, 1):
            return  # another process probes it (0: a store that failed open)
        await self.probe(account)

    async def probe(self, account) -> Optional[Snapshot]:
        """
        Read one account's usage now.

        @return: the L{Snapshot} recorded, or L{None} (not an answer relay
            could read; logged).
        """
        self._inflight.add(account.id)
        try:
            dial = self.credentials.current(account)
            headers = {"authorization": "Bearer " + (dial.credential or ""),
                       "originator": "codex_cli_rs"}
            if dial.chatgpt_account_id:
                headers["chatgpt-account-id"] = dial.chatgpt_account_id
            self.probes += 1
            try:
                reply = await self.egress.request(account.proxy, "GET", usageURL(account.base_url),
                                                  headers, None, PROBE_TIMEOUT_SECONDS)
            except Exception as e:  # noqa: BLE001 - logged; tried again next interval
                self._log.info("usage probe of {account_id} failed: {error}",
                               account_id=account.id, error=type(e).__name__,
                               event="relay.usage_probe_failed")
                return None
            now = self._clock.seconds()
            body = reply.json() if reply.status == 200 else None
            if body is not None and self.resets is not None:
                self.resets.note(account.id, body)
            snapshot = windowsFromWham(body, now) if body is not None else None
            if snapshot is None:
                self._log.info("usage probe of {account_id}: status {status}, no windows",
                               account_id=account.id, status=reply.status,
                               event="relay.usage_probe_failed")
                return None
            self.quota.observe(account.id, snapshot)
            interval = float(self.settings.current.oauth.usage_probe_interval_seconds)
            await self.store.setValue(RESULT_PREFIX + account.id, _snapshotJSON(snapshot),
                                      max(60.0, 2 * interval))
            self._log.info(
                "usage of {account_id}: {primary}% / {secondary}% (probe)",
                event="relay.usage_probed", account_id=account.id,
                primary=snapshot.primary.used_percent if snapshot.primary else None,
                secondary=snapshot.secondary.used_percent if snapshot.secondary else None,
            )
            return snapshot
        finally:
            self._inflight.discard(account.id)
