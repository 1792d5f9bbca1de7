# -*- test-case-name: tests.test_control -*-
"""
Wires the control plane into a running relay: its store (the
same backend as the settings: Redis, else the SQLite C{database}, else
memory), the account, login and audit services, the usage probe, the
key, group and price services, their routes under C{/admin}, the
C{control} readiness check, and the service that starts and stops them.
"""

from __future__ import annotations

from typing import Any

from attrs import define
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, maybeDeferred

from relay.control.accounts.check import CredentialCheck
from relay.control.accounts.resource import AccountsResource
from relay.control.accounts.service import AccountService
from relay.control.audit.resource import AuditResource, ControlAdmin
from relay.control.audit.service import AuditTrail
from relay.control.groups.resource import GroupsResource
from relay.control.groups.service import GroupService
from relay.control.keys.resource import KeysResource
from relay.control.keys.service import KeyService
from relay.control.logins.resource import LoginsResource
from relay.control.logins.service import LoginService
from relay.control.prices.resource import PricesResource
from relay.control.prices.service import PriceService

__all__ = ["ControlParts", "ControlService", "assembleControl", "controlStoreFor"]

RESYNC_SECONDS = 30.0
"""How often the plane re-reads the store anyway (a missed message cannot
outlive it)."""

LOGIN_SWEEP_SECONDS = 30.0
"""How often pending logins are checked for expiry."""


def controlStoreFor(config, reactor, redis=None, settingsStore=None):
    """
    The control store of a relay: Redis with C{state.backend: redis}, else
    the SQLite C{database} (sharing the settings store's connection), else
    memory (nothing survives a restart).

    @param config: the L{relay.base.records.RelayConfig}.
    @param reactor: the reactor (the clock of every timeout).
    @param redis: the L{relay.wire.redisclient.RedisService}, with Redis.
    @param settingsStore: the settings store (a
        L{relay.state.settingsdb.SQLiteSettingsStore} when there is a database).
    @rtype: L{relay.interfaces.IControlStore}
    """
    from relay.state.settingsdb import SQLiteSettingsStore

    if config.state.backend == "redis" and redis is not None:
        from relay.control.store.redis import CHANNEL, RedisControlStore
        from relay.wire.redisclient import parseRedisUrl

        # Pub/sub channels are server-wide, not per database: relays on
        # another database of the same server hear nothing of these.
        dbid = parseRedisUrl(config.state.redis_url).dbid
        channel = CHANNEL if dbid is None else f"{CHANNEL}:{dbid}"
        return RedisControlStore(redis=redis, clock=reactor, channel=channel)
    if isinstance(settingsStore, SQLiteSettingsStore):
        from relay.control.store.sqlite import SQLiteControlStore

        return SQLiteControlStore(database=settingsStore, clock=reactor)
    from relay.control.store.memory import MemoryControlStore

    return MemoryControlStore(clock=reactor)


class ControlService(MultiService):
    """
    Starts the control plane (its change feed and first read) after the
    Redis client, with its periodic jobs (the resync, the login sweep, the
    usage probe tick); on stop, ends the device polls and the feed.
    """

    def __init__(self, plane, logins, probe, clock, resets=None):
        super().__init__()
        from relay.oauth.usageprobe import PROBE_TICK_SECONDS
        from relay.console.view import periodic

        self.plane = plane
        self.logins = logins
        periodic(RESYNC_SECONDS, plane.refresh, clock).setServiceParent(self)
        periodic(LOGIN_SWEEP_SECONDS, lambda: Deferred.fromCoroutine(logins.sweep()),
                 clock).setServiceParent(self)
        if probe is not None:
            periodic(PROBE_TICK_SECONDS, probe.tick, clock).setServiceParent(self)
        if resets is not None:
            from relay.oauth.resets import TICK_SECONDS

            periodic(TICK_SECONDS, resets.tick, clock).setServiceParent(self)

    def startService(self) -> None:
        """
        Read the store (accounts wait for it, at most a few seconds), then
        the timers.
        """
        self.plane.start()
        super().startService()

    def stopService(self) -> Deferred:
        """
        Stop polling and timers, then the feed.
        """
        self.logins.stop()
        d = maybeDeferred(super().stopService)
        d.addBoth(lambda _: self.plane.stop())
        return d


@define(eq=False)
class ControlParts:
    """
    The control plane's parts, for the app and tests.
    """

    plane: Any
    store: Any
    accounts: Any
    logins: Any
    audit: Any
    probe: Any
    service: Any
    resource: Any
    keys: Any = None
    groups: Any = None
    prices: Any = None
    resets: Any = None


def assembleControl(app, admin, view, redis) -> ControlParts:
    """
    Build the control plane of C{app}.

    @param app: the L{relay.process.app.RelayApplication} (its C{extras["control"]}
        is the plane the scheduler already asks).
    @param admin: the operator surface's C{/admin} resource.
    @param view: the L{relay.console.view.OperatorView} (new tokens for a
        re-login).
    @param redis: the L{relay.wire.redisclient.RedisService}, with Redis.
    @rtype: L{ControlParts}
    """
    from twisted.web.client import BrowserLikePolicyForHTTPS

    from relay.oauth.egress import EgressClient
    from relay.oauth.resets import BankedResets
    from relay.oauth.usageprobe import UsageProbe

    reactor, config = app.reactor, app.config
    plane = app.extras["control"]
    store = controlStoreFor(config, reactor, redis, app.settings.store)
    plane.attach(store)
    audit = AuditTrail(store=store, clock=reactor)
    accounts = AccountService(plane=plane, clock=reactor)
    trustRoot = app.extras.get("trustRoot")
    policy = BrowserLikePolicyForHTTPS(trustRoot) if trustRoot is not None else None
    egress = EgressClient(reactor=reactor, settings=app.settings, tlsPolicy=policy)
    credentials = app.extras.get("credentials")
    accounts.credentials = credentials
    logins = LoginService(plane=plane, accounts=accounts, tokens=view, egress=egress,
                          settings=app.settings, clock=reactor, audit=audit,
                          credentials=credentials)
    logins.watch()
    probe = UsageProbe(clock=reactor, accounts=app.live.accounts, credentials=credentials,
                       quota=app.extras["quota"], egress=egress, settings=app.settings,
                       store=app.store, paused=plane.isPaused)
    resets = BankedResets(clock=reactor, accounts=app.live.accounts, credentials=credentials,
                          egress=egress, quota=app.extras["quota"], store=app.store,
                          clear=app.runner.bookkeeping.clear, reprobe=probe.probe,
                          paused=plane.isPaused, groups=lambda: _groups(app, plane))
    probe.resets = resets
    # Keys, groups and prices.
    keys = KeyService(plane=plane, clock=reactor, usage=app.extras.get("usage"))
    groups = GroupService(plane=plane, clock=reactor)
    prices = PriceService(plane=plane, clock=reactor)
    readiness = app.extras.get("readiness")
    if readiness is not None:
        readiness.addCheck("control", lambda: plane.ready)
    adminKey = app.live.adminKey
    routes = {
        b"accounts": AccountsResource(adminKey, accounts, admin.route(b"accounts"), logins,
                                      resets, CredentialCheck(app.live.accounts, egress,
                                                              credentials, reactor)),
        b"logins": LoginsResource(adminKey, logins),
        b"audit": AuditResource(adminKey, audit, reactor),
        b"keys": KeysResource(adminKey, keys),
        b"groups": GroupsResource(adminKey, groups),
        b"prices": PricesResource(adminKey, prices),
    }
    resource = ControlAdmin(admin, audit, routes)
    service = ControlService(plane, logins, probe, reactor, resets)
    return ControlParts(plane=plane, store=store, accounts=accounts, logins=logins,
                        audit=audit, probe=probe, service=service, resource=resource,
                        keys=keys, groups=groups, prices=prices, resets=resets)


def _groups(app, plane) -> dict:
    """
    @return: group -> account ids, the file's and the admin ones
        (L{relay.oauth.resets.BankedResets}: "no other account of its
        group can serve").
    """
    groups = dict(getattr(app.live.config, "groups", None) or {})
    policy = getattr(plane, "keyPolicy", None)
    groups.update(getattr(policy, "adminGroups", None) or {})
    return groups
