# -*- test-case-name: tests.test_resets -*-
"""
L{BankedResets}: a ChatGPT login's banked rate-limit resets ("reset
credits", protocol.md 7.3a), shown, redeemed by an operator, and
optionally redeemed by relay itself.

  - C{GET /backend-api/wham/rate-limit-reset-credits} lists a login's
    credits (C{{"available_count", "credits": [...]}}); the usage answer
    (L{relay.oauth.usageprobe}) carries the count too (L{note}).
  - C{POST .../rate-limit-reset-credits/consume} with
    C{{"redeem_request_id"}} redeems one: C{{"code": "reset" |
    "nothing_to_reset" | "no_credit" | "already_redeemed",
    "windows_reset"}}. After C{reset} the account's blocks are lifted (its
    usage-limit cooldown described the window that was reset) and its
    windows are read again.
  - C{accounts[].auto_redeem_resets} (config.md, default off): every
    L{TICK_SECONDS} relay redeems one of an account's credits by itself
    when its window is spent (a window at 100 % that has not reset, or a
    cooldown of the account) and no other account of its group can serve
    (each is spent, cooling down or paused; without a group, the other
    accounts of the pool), and it has a credit left (a count never heard
    is asked for first: a cooling account is not probed). Never more than
    one redeem in flight per account.

Every call goes through the account's egress proxy (behaviour.md R97)
with its current bearer and C{chatgpt-account-id}.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.oauth.usageprobe import usageURL

__all__ = ["BankedResets", "RedeemError", "TICK_SECONDS", "resetsURL"]

TICK_SECONDS = 5.0
"""How often automatic redeeming looks at the accounts, seconds."""

TIMEOUT_SECONDS = 10.0
"""One call's whole exchange, seconds (Codex's own timeout for these)."""


class RedeemError(Exception):
    """
    A redeem that could not be asked: C{status} is the admin answer's.
    """

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def resetsURL(baseURL: str) -> str:
    """
    The banked resets endpoint beside an OAuth account's Codex base URL:
    C{https://chatgpt.com/backend-api/codex} gives
    C{https://chatgpt.com/backend-api/wham/rate-limit-reset-credits}.
    """
    return usageURL(baseURL)[: -len("/usage")] + "/rate-limit-reset-credits"


def availableOf(body: Any) -> Optional[int]:
    """
    @return: C{available_count} of a credits list or of a usage answer's
        C{rate_limit_reset_credits}, or L{None}.
    """
    if not isinstance(body, dict):
        return None
    summary = body.get("rate_limit_reset_credits", body)
    count = summary.get("available_count") if isinstance(summary, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


@define(eq=False)
class BankedResets:
    """
    See the module docstring.

    @ivar accounts: the live accounts (iterable; C{byId}).
    @ivar credentials: the L{relay.interfaces.ICredentialSource}.
    @ivar egress: the L{relay.interfaces.IEgressClient}.
    @ivar quota: the L{relay.interfaces.IUsageWindows} (C{get(id)}).
    @ivar store: the L{relay.interfaces.IStateStore} (C{getAccountStates}).
    @ivar clear: C{clear(account)} -> a Deferred: lifts an account's blocks
        (L{relay.policy.bookkeeping.AccountBookkeeping.clear}).
    @ivar reprobe: C{reprobe(account)} -> a coroutine or Deferred reading
        its windows again, or L{None}.
    @ivar paused: C{account id -> bool}, or L{None}.
    @ivar groups: C{() -> {group: [account ids]}}, or L{None}.
    @ivar available: account id -> the last known count of its credits.
    """

    _clock: IReactorTime
    accounts: Any
    credentials: Any
    egress: Any
    quota: Any
    store: Any
    clear: Callable
    reprobe: Optional[Callable] = None
    paused: Optional[Callable] = None
    groups: Optional[Callable] = None
    available: dict = field(factory=dict)
    redeems: int = 0
    _inflight: set = field(factory=set, init=False)
    _log = Logger()

    def note(self, accountId: str, body: Any) -> None:
        """
        Keep the credits count a usage answer or a list carried.
        """
        count = availableOf(body)
        if count is not None:
            self.available[accountId] = count

    def _headers(self, account) -> dict:
        dial = self.credentials.current(account)
        headers = {"authorization": "Bearer " + (dial.credential or ""),
                   "originator": "codex_cli_rs"}
        if dial.chatgpt_account_id:
            headers["chatgpt-account-id"] = dial.chatgpt_account_id
        return headers

    def _oauth(self, accountId: str):
        account = self.accounts.byId(accountId)
        if account is None:
            raise RedeemError(404, "account_not_found", f"No account {accountId!r}")
        if account.type != "oauth":
            raise RedeemError(400, "not_oauth", "Only a ChatGPT (oauth) login banks resets")
        return account

    async def list(self, accountId: str) -> dict:
        """
        Read an account's credits now.

        @return: the upstream's C{{"available_count", "credits"}}.
        @raise RedeemError: not an OAuth account, or no answer (502).
        """
        account = self._oauth(accountId)
        try:
            reply = await self.egress.request(account.proxy, "GET", resetsURL(account.base_url),
                                              self._headers(account), None, TIMEOUT_SECONDS)
        except Exception as e:  # noqa: BLE001 - the operator sees the kind
            raise RedeemError(502, "upstream_error", f"Listing resets failed: {type(e).__name__}")
        if reply.status != 200:
            raise RedeemError(502, "upstream_error", f"Listing resets: status {reply.status}")
        body = reply.json()
        self.note(accountId, body)
        return body

    async def redeem(self, accountId: str, by: str = "operator") -> dict:
        """
        Redeem one of an account's banked resets.

        @param by: C{operator} or C{auto}, for the log.
        @return: the upstream's C{{"code", "windows_reset"}}.
        @raise RedeemError: not an OAuth account, a redeem of it already in
            flight (409), or no answer (502).
        """
        account = self._oauth(accountId)
        if accountId in self._inflight:
            raise RedeemError(409, "redeem_in_progress", "A redeem of this account is running")
        self._inflight.add(accountId)
        try:
            body = {"redeem_request_id": os.urandom(16).hex()}
            self.redeems += 1
            try:
                reply = await self.egress.request(
                    account.proxy, "POST", resetsURL(account.base_url) + "/consume",
                    dict(self._headers(account), **{"content-type": "application/json"}),
                    json.dumps(body).encode(), TIMEOUT_SECONDS)
            except Exception as e:  # noqa: BLE001
                raise RedeemError(502, "upstream_error",
                                  f"Redeeming a reset failed: {type(e).__name__}")
            if reply.status != 200:
                raise RedeemError(502, "upstream_error", f"Redeeming a reset: status {reply.status}")
            answer = reply.json()
            code = answer.get("code") if isinstance(answer, dict) else None
            self._log.info("{by} redeemed a banked reset of {account_id}: {code}",
                           event="relay.reset_redeemed", by=by, account_id=accountId, code=code)
            if code == "reset":
                if accountId in self.available:
                    self.available[accountId] = max(0, self.available[accountId] - 1)
                await self.clear(account)
                if self.reprobe is not None:
                    await self.reprobe(account)
            elif code == "no_credit":
                self.available[accountId] = 0
            return answer if isinstance(answer, dict) else {"code": None}
        finally:
            self._inflight.discard(accountId)

    # -- automatic redeeming ----------------------------------------------------------

    def tick(self) -> Deferred:
        """
        The periodic look at the accounts with C{auto_redeem_resets};
        never fails.
        """
        d = Deferred.fromCoroutine(self._tick())
        d.addErrback(lambda f: self._log.failure("automatic reset redeeming failed", f))
        return d

    async def _tick(self) -> None:
        accounts = list(self.accounts)
        wanting = [a for a in accounts if a.type == "oauth" and a.auto_redeem_resets
                   and self.available.get(a.id, 1) > 0 and a.id not in self._inflight]
        if not wanting:
            return
        now = self._clock.seconds()
        states = await self.store.getAccountStates([a.id for a in accounts])
        for account in wanting:
            if self._paused(account.id) or not self._spent(account, states, now):
                continue
            others = [a for a in self._peers(account, accounts) if a.id != account.id]
            if any(not self._paused(a.id) and not self._spent(a, states, now) for a in others):
                continue
            try:
                if account.id not in self.available:
                    # Never heard (a cooling account is not probed): ask.
                    await self.list(account.id)
                    if not self.available.get(account.id):
                        continue
                await self.redeem(account.id, by="auto")
            except RedeemError as e:
                self._log.info("automatic redeem of {account_id} failed: {error}",
                               event="relay.reset_redeem_failed", account_id=account.id,
                               error=e.message)

    def _paused(self, accountId: str) -> bool:
        return bool(self.paused is not None and self.paused(accountId))

    def _spent(self, account, states: dict, now: float) -> bool:
        """
        Whether an account cannot serve now: a cooldown or block, or a
        usage window at 100 % that has not reset.
        """
        runtime = states.get(account.id)
        if runtime is not None and runtime.unschedulable(now) is not None:
            return True
        snapshot = self.quota.get(account.id) if self.quota is not None else None
        if snapshot is None:
            return False
        return any(w is not None and w.usedAt(now) >= 100
                   for w in (snapshot.primary, snapshot.secondary))

    def _peers(self, account, accounts: list) -> list:
        """
        The accounts of C{account}'s groups, or every account when it is
        in none.
        """
        groups = self.groups() if self.groups is not None else {}
        members = set()
        for ids in (groups or {}).values():
            if account.id in ids:
                members.update(ids)
        if not members:
            return accounts
        return [a for a in accounts if a.id in members]
