# -*- test-case-name: tests.test_tenants_explain -*-
"""
Explain a decision before it happens.

L{Explainer.explain} answers "which account would the next turn of this
key get, and why not each other one" without admitting anything: no slot
taken, no rate counted, no binding written, no decision logged. It runs the
scheduler's own selection in its dry-run mode
(L{relay.scheduling.scheduler.AccountScheduler.preview}) on a L{Turn} built
the way the entrypoints build one, after the key policy the engine checks
first (L{relay.tenants.keypolicy.KeyPolicy}); it holds no rule of its own.

For every configured account the answer says one of:

  - C{chosen}: the account the turn would get, with the layer
    (C{previous_response_id}, C{session_hash}, C{load_balance}) and either
    a free slot or the wait plan (sticky or fallback, timeout, places);
  - C{not_in_group}: the key may not reach it (C{accounts:}/C{group:});
  - the scheduler's own reason: C{model_not_served}, C{endpoint_not_served},
    C{oauth_http_continuation}, C{unschedulable: <block>} (cooling,
    rate-limited, breaker, needs login...) with the time it ends,
    C{proxy_quarantined};
  - C{candidate}: it could serve, and why it lost: C{slots full}, or its
    place in the order (priority, load, usage-window quota).

Every row carries the account's C{health} (its attempt ends of the last 15
minutes, L{relay.policy.outcomes}); a C{failing} or C{degraded} account
says so in its C{why}, and when the chosen one is, the answer's
C{warnings} say so too (C{chosen_failing}, C{chosen_degraded}).

The prediction is exact for the next selection when nothing changes in
between (ties are broken with a copy of the scheduler's shuffle state);
a test asserts that explain and the real decision agree.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from attrs import define

from relay.base.records import Turn
from relay.scheduling.scheduler import DRY_LEASE, loadRate
from relay.scheduling.session import sessionHash

__all__ = ["Explainer"]


def _iso(seconds: Optional[float]) -> Optional[str]:
    if not seconds:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


@define(eq=False)
class Explainer:
    """
    See the module docstring.

    @ivar clock: the injected L{IReactorTime}.
    @ivar scheduler: the L{relay.scheduling.scheduler.AccountScheduler}.
    @ivar keys: the L{relay.entry.http.KeyRing}.
    @ivar accounts: the live account registry.
    @ivar policy: the L{relay.tenants.keypolicy.KeyPolicy}.
    @ivar admission: the L{relay.interfaces.ISlotAdmission} (loads).
    @ivar ledger: the L{relay.usage.ledger.UsageLedger}, or L{None}.
    @ivar settings: the L{relay.state.settings.RuntimeSettings}.
    """

    clock: Any
    scheduler: Any
    keys: Any
    accounts: Any
    policy: Any
    admission: Any
    ledger: Any = None
    settings: Any = None
    outcomes: Any = None
    """The L{relay.policy.outcomes.AttemptOutcomes} (each account's recent
    attempt ends), or L{None}."""

    def keyNamed(self, name: str):
        """
        @return: the L{relay.base.records.ClientKey} named C{name}, or L{None}.
        """
        for key in self.keys.keys:
            if key.name == name:
                return key
        return None

    async def explain(self, key, model: str, session: Optional[str] = None,
                      previous: Optional[str] = None, entrypoint: str = "http",
                      endpoint: str = "responses") -> dict:
        """
        The next turn's decision for C{key}.

        @param key: the L{relay.base.records.ClientKey}.
        @param model: the client model name.
        @param session: the client's session id (its C{session_id} header,
            Codex's thread id) or L{None}; hashed like the entrypoints do.
        @param previous: a C{previous_response_id}, or L{None}.
        @param entrypoint: C{http} or C{ws}.
        @param endpoint: C{responses} or C{chat}.
        @return: a JSON-ready dict (see the module docstring and docs/keys.md).
        """
        now = self.clock.seconds()
        turn = Turn(
            entrypoint=entrypoint, endpoint=endpoint, client=key, model=model,
            body={"model": model}, stream=True,
            sessionHash=sessionHash(session, key.name) if session else None,
            previousResponseId=previous or None, requestId="explain",
            phase="first_turn" if entrypoint == "ws" else "request",
        )
        answer: dict = {
            "key": key.name, "model": model, "entrypoint": entrypoint, "endpoint": endpoint,
            "session_hash": turn.sessionHash, "previous_response_id": turn.previousResponseId,
            "now": now,
        }
        # The key policy, in the engine's order (nothing counted).
        refusal = None
        if self.policy is not None:
            refusal = self.policy.refusal(key, model, now)
            turn.allowedAccounts = self.policy.allowedAccounts(key)
        if refusal is None and self.ledger is not None:
            refusal = self.ledger.overBudget(key.name, now)
        rate = None
        if self.policy is not None:
            rate = await self.policy.peekRate(key)
            answer["rate"] = None if rate is None else rate.asDict()
            if refusal is None and rate is not None and not rate.allowed:
                from relay.tenants.keypolicy import _rateError

                refusal = _rateError(key, rate, model)
        answer["refused"] = None if refusal is None else {
            "status": refusal.status, "code": refusal.code, "message": refusal.message,
        }
        allowed = turn.allowedAccounts
        answer["group"] = key.group
        answer["allowed_accounts"] = None if allowed is None else sorted(allowed)

        preview = await self.scheduler.preview(turn)
        answer["decision"] = self._decision(preview)
        answer["accounts"] = await self._accounts(preview, allowed)
        answer["warnings"] = []
        for row in answer["accounts"]:
            health = row.get("health") or {}
            if row["verdict"] == "chosen":
                answer["decision"]["health_state"] = health.get("state")
                if health.get("state") in ("failing", "degraded"):
                    answer["warnings"].append({
                        "code": "chosen_" + health["state"], "account": row["id"],
                        "message": f"the chosen account {row['id']} is {health['state']}:"
                                   f" {health.get('why')}",
                    })
        return answer

    def _health(self, accountId: str) -> Optional[dict]:
        """
        @return: the account's recent attempt ends and the state they mean
            (L{relay.policy.outcomes.healthState}, without its blocks, which
            the verdict names), or L{None}.
        """
        if self.outcomes is None:
            return None
        from relay.policy.outcomes import healthState

        return healthState(self.outcomes.counts(accountId))

    def _decision(self, preview) -> dict:
        if preview.selection is None:
            error = preview.error
            return {"account": None, "status": error.status, "code": error.code,
                    "message": error.message,
                    "retry_after": dict(error.headers).get("Retry-After")}
        selection = preview.selection
        record = selection.record
        plan = selection.waitPlan
        out = {
            "account": selection.account.id,
            "layer": record.layer,
            "sticky_previous_hit": record.sticky_previous_hit,
            "sticky_session_hit": record.sticky_session_hit,
            "sticky_busy_bypass": record.sticky_busy_bypass,
            "quota_decided": record.quota_decided,
            "slot": "free" if selection.lease is DRY_LEASE else "wait",
            "wait_plan": None,
        }
        if plan is not None:
            out["wait_plan"] = {
                "plan": plan.plan, "timeout_seconds": plan.timeout,
                "max_waiting": plan.max_waiting, "max_concurrency": plan.max_concurrency,
            }
        return out

    async def _accounts(self, preview, allowed) -> list:
        accounts = list(self.accounts)
        loads = {}
        try:
            loads = await self.admission.load("account", [a.id for a in accounts])
        except Exception:  # noqa: BLE001 - a view; loads then unknown
            loads = {}
        ctx = preview.ctx
        chosen = preview.selection.account.id if preview.selection is not None else None
        scheduling = self.settings.current.scheduling if self.settings is not None else None
        threshold = scheduling.quota_threshold_percent if scheduling is not None else None
        rows = []
        for account in accounts:
            inUse, waiting = tuple(loads.get(account.id, (0, 0)))
            used = self.scheduler.usedPercent(account)
            row = {
                "id": account.id, "type": account.type, "priority": account.priority,
                "concurrency": account.concurrency, "in_use": inUse, "waiting": waiting,
                "load_percent": round(loadRate(inUse, waiting, account.concurrency), 1),
                "quota_used_percent": None if used is None else round(used, 1),
                "verdict": None, "why": None, "until": None, "until_iso": None,
                "health": self._health(account.id),
            }
            if allowed is not None and account.id not in allowed:
                row.update(verdict="not_in_group",
                           why="not among the accounts the key may reach")
            elif account.id == chosen:
                row.update(verdict="chosen", why=self._chosenWhy(preview))
            elif ctx is None:
                row.update(verdict="not_considered", why=preview.error.message
                           if preview.error is not None else None)
            else:
                reason = self.scheduler.why(ctx, account)
                if reason is not None:
                    row.update(verdict=reason[0], why=reason[0], until=reason[1],
                               until_iso=_iso(reason[1]))
                else:
                    row.update(verdict="candidate",
                               why=self._lostWhy(account, inUse, waiting, used, threshold,
                                                 preview))
            health = row["health"] or {}
            if health.get("state") in ("failing", "degraded") and row["verdict"] != "not_in_group":
                # R86's recorded ends: never chosen (or passed over) silently.
                row["why"] = f"{row['why']} -- {health['state']}: {health['why']}"
            rows.append(row)
        return rows

    @staticmethod
    def _chosenWhy(preview) -> str:
        selection = preview.selection
        layer = selection.record.layer
        if selection.lease is DRY_LEASE:
            return f"{layer}: a slot is free now"
        plan = selection.waitPlan
        return (f"{layer}: every slot is taken; the turn would wait up to"
                f" {plan.timeout:g} s on the {plan.plan} plan ({plan.max_waiting} places)")

    @staticmethod
    def _lostWhy(account, inUse, waiting, used, threshold, preview) -> str:
        if account.concurrency > 0 and inUse + waiting >= account.concurrency:
            return (f"slots full ({inUse}/{account.concurrency} in use, {waiting} waiting);"
                    " a turn would wait for it only if no other account is free")
        selection = preview.selection
        if selection is None:
            return "not chosen"
        best = selection.account
        if account.priority > best.priority:
            return f"lower priority ({account.priority} > {best.priority})"
        if used is not None and threshold is not None and used >= threshold:
            return f"usage window at {used:.0f} % (threshold {threshold:g} %): used last"
        if selection.record.layer != "load_balance":
            return f"the turn is bound to {best.id} ({selection.record.layer})"
        return "later in the load-balance order (load rate, last use, ties shuffled)"
