# -*- test-case-name: tests.test_tenancy, tests.test_budgets, tests.test_frontdoor -*-
"""
The key's checks before a turn takes a slot or reaches an account
(behaviour.md R102, R105, R108): the start-up gate, the key policy
(disabled, expired, model allow/deny lists, an unpriced model for a money
budget; the accounts the key may reach), the budget reservation and the
C{rpm}/C{tpm} windows, in that order. A turn over its key's window waits
for it when the wait fits C{scheduling.fallback_wait_timeout}, like a turn
waiting for a full slot (R113, on every entrypoint).

A refusal raises L{Refused} carrying the L{relay.base.records.ClientError} the
turn's sink writes (L{relay.frontdoor.door.FrontDoor}).
"""

from __future__ import annotations

from typing import Optional

from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from relay.engine.cancel import ClientGone, raceCancel
from relay.base.logs import ClassLogger
from relay.base.records import ClientError, Turn
from relay.usage.estimate import inputTokens, outputTokens

STARTUP_WAIT_SECONDS = 10.0
"""R105: how long a turn that arrives before the stores are loaded waits for
them; after that it goes on, and selection skips an account whose tokens
are still loading (C{tokens_loading})."""


class Refused(Exception):
    """
    The front door refused a turn.

    @ivar error: the L{ClientError} its sink writes.
    """

    def __init__(self, error: ClientError):
        super().__init__(error.message)
        self.error = error


class KeyChecks:
    """
    The checks of L{relay.frontdoor.keychecks}, on the parts the engine
    was given (C{clock}, C{keyPolicy}, C{usage}, C{startupGate}, read when
    a turn is checked: the application sets them once built).

    @ivar parts: an object with those attributes (the
        L{relay.engine.runner.TurnRunner}); a missing one is L{None}.
    """

    _log = ClassLogger()

    def __init__(self, parts):
        self.parts = parts

    def _part(self, name: str):
        return getattr(self.parts, name, None)

    def stores(self) -> Optional[Deferred]:
        """
        R105: the start-up gate's wait (L{None} once the stores are
        loaded), for L{pending} and L{check}.
        """
        gate = getattr(self.parts, "startupGate", None)  # _part's, inline (per turn)
        return gate.wait() if gate is not None else None

    def pending(self, turn: Turn, stores: Optional[Deferred]) -> bool:
        """
        Whether L{check} has to wait for anything (C{stores}, the gate's
        wait from L{stores}; a budget; the key's windows); when not,
        L{checkNow} is all of it.
        """
        if stores is not None:
            return True
        key = turn.client
        parts = self.parts
        usage = getattr(parts, "usage", None)
        if usage is not None and usage.hasBudget(key.name):
            return True
        return getattr(parts, "keyPolicy", None) is not None and bool(key.rpm or key.tpm)

    def checkNow(self, turn: Turn) -> None:
        """
        The key policy (R102), which needs no wait: puts the accounts the
        key may reach on the turn (C{Turn.allowedAccounts}, for selection).

        @raise Refused: with the policy's L{ClientError}.
        """
        policy = getattr(self.parts, "keyPolicy", None)
        if policy is None:
            return
        key = turn.client
        turn.allowedAccounts = policy.allowedAccounts(key)
        error = policy.refusal(key, turn.model, self.parts.clock.seconds())
        if error is None:
            return
        self._log.info(
            "key {key_name} refused: {message}",
            event="relay.key_policy_refused",
            key_name=key.name,
            code=error.code,
            message=error.message,
            request_id=turn.requestId,
        )
        raise Refused(error)

    async def check(self, turn: Turn, stores: Optional[Deferred] = None,
                    keepalive=None) -> None:
        """
        Every check, in order: wait for the stores (R105: the key policy
        reads the control plane's keys and disables), the key policy, the
        budget reservation (R108; the hold is put on the turn,
        C{Turn.budgetHold}, and the engine releases what the turn's usage
        did not settle), the key's windows.

        @param stores: the start-up gate's wait (L{stores}), or L{None}.
        @param keepalive: the turn's L{relay.engine.keepalive.StreamKeepalive}
            while it is at the door (a streaming turn), or L{None}.
        @raise Refused: a refusal (a reservation taken is given back).
        @raise ClientGone: the client left while a check waited.
        """
        if stores is not None:
            await self._waitForStores(turn, stores)
        self.checkNow(turn)
        usage = self._part("usage")
        if usage is not None and usage.hasBudget(turn.client.name):
            await self._reserveBudget(turn)
        policy = self._part("keyPolicy")
        if policy is not None and (turn.client.rpm or turn.client.tpm):
            await self._admitRate(turn, policy, keepalive)

    async def _admitRate(self, turn: Turn, policy, keepalive) -> None:
        """
        R113: count the turn in its key's C{rpm}/C{tpm} windows
        (L{relay.tenants.keypolicy.KeyPolicy.admitRate}); over them, wait
        until the window lets a turn start when that is at most
        C{scheduling.fallback_wait_timeout} seconds from the first refusal
        (cancellable; keepalives at least every C{scheduling.ping_interval}
        for a streaming turn, as in a slot wait, R31), then try again;
        else refuse with the window's 429 (C{Retry-After}; in-band with
        its time on a WebSocket).

        @raise Refused: the window's error (or the 503 of unreadable
            shared windows, C{fail_closed}).
        @raise ClientGone: the client left while waiting.
        """
        clock = self.parts.clock
        settings = self._part("settings")
        scheduling = settings.current.scheduling if settings is not None else None
        limit = scheduling.fallback_wait_timeout if scheduling is not None else 0.0
        began = clock.seconds()
        while True:
            error = await policy.admitRate(turn)
            if error is None:
                return
            now = clock.seconds()
            if error.resetsAt is None or error.resetsAt - began > limit:
                # the key's windows: a 429 with Retry-After and the
                # x-ratelimit-* headers (KeyPolicy.admitRate)
                raise Refused(error)
            wait = max(error.resetsAt - now, 0.001)
            self._log.info(
                "turn {request_id} waits {wait_ms} ms for key {key_name}'s rate window",
                event="relay.key_rate_wait", key_name=turn.client.name,
                wait_ms=int(wait * 1000), request_id=turn.requestId,
            )
            if keepalive is not None:
                keepalive.beginWait(scheduling.ping_interval)  # R31's pace
            try:
                await raceCancel(deferLater(clock, wait), turn.cancel)
            finally:
                if keepalive is not None:
                    keepalive.endWait()

    def keyRefusal(self, key) -> Optional[ClientError]:
        """
        The refusals that need only the key (R102 with R103: disabled,
        expired), given before a body is read or a WebSocket upgraded.

        @param key: the authenticated L{relay.base.records.ClientKey}.
        @return: the L{ClientError}, or L{None}.
        """
        policy = self._part("keyPolicy")
        if policy is None:
            return None
        return policy.keyRefusal(key, self.parts.clock.seconds())

    def refusal(self, turn: Turn) -> Optional[ClientError]:
        """
        The key policy's answer for a C{response.create} relay answers
        without a generation (an C{http_bridge} prewarm), so it is refused
        exactly like a turn would be (behaviour.md R102).

        @return: the L{ClientError}, or L{None}.
        """
        policy = self._part("keyPolicy")
        if policy is None:
            return None
        now = self.parts.clock.seconds()
        usage = self._part("usage")
        return policy.refusal(turn.client, turn.model, now) or (
            usage.overBudget(turn.client.name, now) if usage is not None else None
        )

    async def _waitForStores(self, turn: Turn, pending: Deferred) -> None:
        """
        R105: no turn on an account before its tokens, the settings and the
        control plane's first read (pauses, admin keys and disables) are
        loaded: the one start-up gate (L{relay.process.readiness.StartupGate}).
        A turn that arrives first waits (cancellable, at most
        L{STARTUP_WAIT_SECONDS}; a store whose read failed sets its flag,
        R35/R101, so a silent store ends the wait); then selection's
        C{tokens_loading} block skips what is still not loaded.

        @param pending: the gate's L{Deferred} (C{StartupGate.wait}), not
            yet fired.
        """
        self._log.info(
            "turn {request_id} waits for the stores to load", event="relay.turn_waits_for_stores",
            request_id=turn.requestId,
        )
        pending.addTimeout(STARTUP_WAIT_SECONDS, self.parts.clock)
        try:
            await raceCancel(pending, turn.cancel)
        except ClientGone:
            raise
        except Exception:  # noqa: BLE001 - timed out: go on, loading accounts are skipped
            self._log.warn(
                "stores not loaded after {seconds} s; turn {request_id} goes on",
                event="relay.stores_not_loaded", seconds=STARTUP_WAIT_SECONDS,
                request_id=turn.requestId,
            )

    async def _reserveBudget(self, turn: Turn) -> None:
        """
        R102, R108: a key with a token or money budget reserves the turn's
        estimate (L{_budgetEstimate}) before the turn takes a slot or
        reaches an account; a key whose budget minus spend minus its other
        turns' reservations is not above zero gets a 429. The hold is put
        on the turn (C{Turn.budgetHold}): its usage settles it, the turn's
        end releases what was not settled.

        @raise Refused: with the budget's L{ClientError}.
        """
        if turn.request is not None and not turn.request.billed:
            return
        usage = self.parts.usage
        tokens, nanos = await self._budgetEstimate(turn)
        error, hold = await usage.reserve(turn.client.name, tokens, nanos)
        if error is None:
            turn.budgetHold = hold
            if turn.cancel.cancelled:
                raise ClientGone(turn.cancel.reason or "client_gone")
            return
        self._log.warn(
            "key {key_name} is over its budget",
            event="relay.token_budget_exceeded",
            key_name=turn.client.name,
            message=error.message,
            request_id=turn.requestId,
        )
        raise Refused(error)

    async def _budgetEstimate(self, turn: Turn) -> tuple:
        """
        R108: what a turn may use before it runs: input from the body
        (L{relay.usage.estimate.inputTokens}) plus, for a turn chained by
        C{previous_response_id}, the chain's last known input + output;
        output from the body's C{max_output_tokens} (chat:
        C{max_completion_tokens}, C{max_tokens}), else (or where the key
        may reach an account that drops that limit: OAuth,
        L{relay.tenants.keypolicy.KeyPolicy.outputLimitHonoured}) the key's
        C{max_turn_output_tokens}; the cost at the dearest price of the
        accounts the key may reach (L{relay.tenants.keypolicy.KeyPolicy.estimate}).

        @return: C{(tokens, nano-dollars)}.
        """
        key = turn.client
        policy = self._part("keyPolicy")
        previous = turn.previousResponseId or turn.body.get("previous_response_id")
        chain = await self.parts.usage.chainTokens(
            previous if isinstance(previous, str) else None)
        given = inputTokens(turn.body, turn.bodySize) + chain
        honoured = policy is None or policy.outputLimitHonoured(key, turn.model)
        out = outputTokens(turn.body if honoured else None, key.max_turn_output_tokens)
        nanos = 0
        if policy is not None and (key.daily_usd is not None or key.monthly_usd is not None):
            nanos = policy.estimate(key, turn.model, turn.body, given, out)
            if turn.endpoint in ("images", "image_edits"):
                nanos += policy.imagesEstimate(key, turn.model, turn.body)  # R115: per image
        return given + out, nanos
