# -*- test-case-name: tests.test_proxyhealth -*-
"""
Egress proxy quarantine (sub2api's stream circuit; behaviour.md
R41 "proxy quarantine" compatibility check).

A stream cut in the middle (the upstream connection dropped while an SSE
body or WebSocket turn was being read) through a proxy counts against that
proxy. C{cuts} such cuts within C{window_seconds} quarantine the proxy for
C{quarantine_seconds}: every account dialling through the same proxy id is
skipped by the scheduler's compatibility check until then, unless every
candidate is quarantined (the scheduler fails open and logs it).

State is in memory, per process, keyed by L{relay.base.records.ProxySpec.id}, and
driven by the injected clock only: a quarantine ends lazily the first time
the state is read after its end (L{ProxyHealth.isQuarantined},
L{ProxyHealth.snapshot}), which logs C{relay.proxy_quarantine_lifted}.

Logs name a proxy by id, host and port; never by its credentials.
"""

from __future__ import annotations

from attrs import define, field
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.base.records import Account, ProxySpec

CUTS = 2
"""Mid-stream cuts through one proxy that quarantine it."""

WINDOW_SECONDS = 60.0
"""The cuts must fall within this many seconds."""

QUARANTINE_SECONDS = 600.0
"""How long a quarantine lasts."""


@define(eq=False)
class _ProxyState:
    """
    What is known about one proxy.

    @ivar spec: the last L{ProxySpec} seen under this id (host and port for
        logs and the admin API).
    @ivar cuts: clock times of recent cuts, oldest first, within the window.
    @ivar until: the end of the quarantine, or L{None} when not quarantined.
    @ivar quarantines: how many times this proxy was quarantined.
    @ivar totalCuts: every cut recorded, for the admin API.
    """

    spec: ProxySpec
    cuts: list = field(factory=list)
    until: float | None = None
    quarantines: int = 0
    totalCuts: int = 0


@define(eq=False)
class ProxyHealth:
    """
    Quarantine state of the egress proxies. See the module docstring.

    @ivar _clock: the L{IReactorTime}.
    @ivar cuts: cuts that quarantine a proxy.
    @ivar windowSeconds: the window the cuts must fall in.
    @ivar quarantineSeconds: the quarantine length.
    """

    _clock: IReactorTime
    cuts: int = CUTS
    windowSeconds: float = WINDOW_SECONDS
    quarantineSeconds: float = QUARANTINE_SECONDS
    _proxies: dict = field(factory=dict, init=False)

    _log = Logger()

    # -- recording -------------------------------------------------------------

    def streamCut(self, account: Account, kind: str = "read_error") -> float | None:
        """
        Record that a stream through C{account}'s proxy was cut mid-stream.
        A direct account (no proxy) is ignored.

        @param account: the L{Account} whose stream broke.
        @param kind: what broke, for logs (e.g. C{read_error}).
        @return: the quarantine end (clock seconds) when this cut started a
            quarantine, else L{None}.
        """
        proxy = account.proxy
        if proxy is None:
            return None
        return self.proxyCut(proxy, account.id, kind)

    def proxyCut(
        self, proxy: ProxySpec, accountId: str | None = None, kind: str = "read_error"
    ) -> float | None:
        """
        Record a mid-stream cut through C{proxy}.

        @param proxy: the L{ProxySpec}.
        @param accountId: the account whose stream broke, for logs.
        @param kind: what broke, for logs.
        @return: the quarantine end when this cut started one, else L{None}.
        """
        now = self._clock.seconds()
        state = self._stateFor(proxy)
        state.totalCuts += 1
        self._expire(state, now)
        state.cuts = [t for t in state.cuts if now - t <= self.windowSeconds]
        state.cuts.append(now)
        self._log.info(
            "stream cut through proxy {proxy_id} ({proxy_host}:{proxy_port}),"
            " {cuts} in {window}s",
            event="relay.proxy_stream_cut",
            proxy_id=proxy.id,
            proxy_host=proxy.host,
            proxy_port=proxy.port,
            account_id=accountId,
            kind=kind,
            cuts=len(state.cuts),
            window=self.windowSeconds,
        )
        if state.until is not None or len(state.cuts) < self.cuts:
            return None
        state.until = now + self.quarantineSeconds
        state.quarantines += 1
        count, state.cuts = len(state.cuts), []
        self._log.warn(
            "proxy {proxy_id} ({proxy_host}:{proxy_port}) quarantined until {until}"
            " after {cuts} stream cuts",
            event="relay.proxy_quarantined",
            proxy_id=proxy.id,
            proxy_host=proxy.host,
            proxy_port=proxy.port,
            until=state.until,
            cuts=count,
            window=self.windowSeconds,
            account_id=accountId,
        )
        return state.until

    # -- reading ----------------------------------------------------------------

    def isQuarantined(self, account: Account) -> bool:
        """
        The scheduler's compatibility hook: whether C{account}'s proxy is
        quarantined now.

        @param account: an L{Account}.
        @return: L{False} for a direct account or a healthy proxy.
        """
        proxy = account.proxy
        if proxy is None:
            return False
        return self.quarantinedUntil(proxy.id) is not None

    def quarantinedProxies(self, now: float) -> list:
        """
        The proxies quarantined at C{now} (the scheduler checks
        the accounts behind them; every other account is not quarantined).

        @param now: Unix seconds.
        @return: proxy ids.
        """
        return [pid for pid, state in self._proxies.items()
                if state.until is not None and now < state.until]

    def quarantinedUntil(self, proxyId: str) -> float | None:
        """
        @param proxyId: a L{ProxySpec.id}.
        @return: the quarantine end (clock seconds), or L{None} when the
            proxy is not quarantined now.
        """
        state = self._proxies.get(proxyId)
        if state is None:
            return None
        self._expire(state, self._clock.seconds())
        return state.until

    def snapshot(self) -> dict:
        """
        The state of every proxy seen so far, for the admin API.

        @return: proxy id -> C{{"state": "quarantined" | "ok", "until":
            float or None, "cuts": recent cuts in the window, "total_cuts",
            "quarantines", "host", "port"}} (no credentials).
        """
        now = self._clock.seconds()
        out = {}
        for proxyId, state in sorted(self._proxies.items()):
            self._expire(state, now)
            recent = [t for t in state.cuts if now - t <= self.windowSeconds]
            out[proxyId] = {
                "state": "quarantined" if state.until is not None else "ok",
                "until": state.until,
                "cuts": len(recent),
                "total_cuts": state.totalCuts,
                "quarantines": state.quarantines,
                "host": state.spec.host,
                "port": state.spec.port,
            }
        return out

    def lift(self, proxyId: str) -> bool:
        """
        End a proxy's quarantine and forget its recent cuts (an operator's
        "clear" of an account dialling through it).

        @param proxyId: a L{ProxySpec.id}.
        @return: L{True} when a quarantine was in force.
        """
        state = self._proxies.get(proxyId)
        if state is None:
            return False
        active = state.until is not None and self._clock.seconds() < state.until
        state.until = None
        state.cuts = []
        if active:
            self._log.info(
                "proxy {proxy_id} ({proxy_host}:{proxy_port}) quarantine lifted by an operator",
                event="relay.proxy_quarantine_lifted",
                proxy_id=state.spec.id,
                proxy_host=state.spec.host,
                proxy_port=state.spec.port,
                until=None,
            )
        return active

    # -- internals --------------------------------------------------------------

    def _stateFor(self, proxy: ProxySpec) -> _ProxyState:
        state = self._proxies.get(proxy.id)
        if state is None:
            state = self._proxies[proxy.id] = _ProxyState(spec=proxy)
        else:
            state.spec = proxy
        return state

    def _expire(self, state: _ProxyState, now: float) -> None:
        """
        End C{state}'s quarantine if its time is up, and log it.
        """
        if state.until is None or now < state.until:
            return
        until, state.until = state.until, None
        self._log.info(
            "proxy {proxy_id} ({proxy_host}:{proxy_port}) quarantine lifted",
            event="relay.proxy_quarantine_lifted",
            proxy_id=state.spec.id,
            proxy_host=state.spec.host,
            proxy_port=state.spec.port,
            until=until,
        )
