# -*- test-case-name: tests.test_operations -*-
"""
Live reload: C{SIGHUP} or C{POST /admin/reload} re-reads the
configuration file the process started with and applies the difference
without dropping a turn.

Order:

 1. B{Validate completely first}, with start-up's own code:
    L{relay.configuration.parse.loadConfig}, L{relay.configuration.check.checkComponents} and
    L{relay.configuration.parse.checkDatabase}. Any problem and nothing changes: each
    problem is one line (logged as C{relay.config_reload_failed}, and
    listed in the admin answer), and the process keeps serving with what
    it had. (The file validator stops at its first problem, as it does at
    start-up; the component and database checks each add their own line.)
 2. B{Refuse what needs a restart}: C{listen}, C{log.format}, C{database},
    C{state.*} and C{components.*} are kept at their running values, one
    line each saying so. B{The rest still applies} (decision recorded
    here and in docs/operating.md): the running process then matches the file
    everywhere it can, and the answer says which keys wait for a restart.
 3. B{Apply}: client keys and accounts go into the live configuration
    (L{relay.process.live}) at once: new ones are usable by the next
    request; removed ones take no new turn while their running turns
    finish; changed credentials, proxies, priorities, concurrency and
    model mappings apply to new attempts (a running attempt keeps the
    account object it selected). Account state (cooldowns, streaks,
    sticky bindings, response owners) is keyed by id and survives; a
    changed or removed account's C{ctx_pool} connections are retired once
    idle (an L{relay.process.live.AccountRegistry} subscriber), an
    unchanged account's stay; an account whose credential, endpoint or
    proxy changed (C{renewed}) has its cooldowns, streaks and breaker
    cleared, since they were learnt about its old identity. The
    C{gateway:} section becomes the new base of the runtime settings; a
    value an operator set live with C{PUT /admin/settings} still wins over
    the file (persisted, R74), as at start-up
    (L{relay.state.settings.RuntimeSettings.rebase}).
 4. B{Log} C{relay.config_reloaded} with what changed: ids and names,
    never secrets.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from attrs import define, evolve, field, frozen
from twisted.logger import Logger

from relay.base.records import ConfigError, RelayConfig
from relay.process.live import AccountSetChange, LiveConfiguration

__all__ = ["ConfigReloader", "ReloadResult", "refusedChanges"]

RESTART_SECTIONS = ("listen", "log_format", "database", "state", "components")
"""The L{RelayConfig} fields a reload never changes (they need a restart)."""

_KEY_PATHS = {"log_format": "log.format"}
"""Field name -> the key path an operator writes, where they differ."""


def _fieldsOf(value) -> dict:
    """
    @return: an attrs value's fields by name (one level).
    """
    from attrs import asdict

    return asdict(value, recurse=False)


def refusedChanges(running: RelayConfig, new: RelayConfig) -> tuple:
    """
    The keys whose change a reload refuses because they need a restart.

    @param running: the configuration in force.
    @param new: the reloaded one.
    @return: key paths (e.g. C{listen}, C{state.redis_url}), in
        L{RESTART_SECTIONS} order. Values are never included: a Redis
        URL may hold a password.
    @rtype: L{tuple} of L{str}
    """
    refused = []
    for name in RESTART_SECTIONS:
        old, now = getattr(running, name), getattr(new, name)
        if old == now:
            continue
        if name in ("state", "components"):
            before, after = _fieldsOf(old), _fieldsOf(now)
            refused.extend(f"{name}.{k}" for k in before if before[k] != after[k])
        else:
            refused.append(_KEY_PATHS.get(name, name))
    return tuple(refused)


def _keep(running: RelayConfig, new: RelayConfig) -> RelayConfig:
    """
    C{new} with every restart-only field at its running value.
    """
    return evolve(new, **{name: getattr(running, name) for name in RESTART_SECTIONS})


def _keyChanges(running: RelayConfig, new: RelayConfig) -> dict:
    """
    Client keys added, removed and changed (secret or concurrency), by name.
    """
    before = {k.name: k for k in running.keys}
    after = {k.name: k for k in new.keys}
    return {
        "added": sorted(after.keys() - before.keys()),
        "removed": sorted(before.keys() - after.keys()),
        "changed": sorted(n for n in before.keys() & after.keys() if before[n] != after[n]),
    }


@frozen
class ReloadResult:
    """
    What one reload did.

    @ivar applied: whether anything was put in force (L{False} when the
        file had a problem: then nothing changed).
    @ivar problems: one line per problem that stopped the reload.
    @ivar refused: key paths kept at their running values (they need a
        restart); the rest applied.
    @ivar accounts: ids added, removed and changed.
    @ivar keys: client key names added, removed and changed.
    @ivar gateway: dotted C{gateway:} names whose value in force changed.
    @ivar adminKeyChanged: whether C{admin_key} changed (never its value).
    @ivar source: who asked (C{sighup}, C{admin}); not in the answer.
    """

    applied: bool
    problems: tuple = ()
    refused: tuple = ()
    accounts: AccountSetChange = field(factory=AccountSetChange)
    keys: dict = field(factory=lambda: {"added": [], "removed": [], "changed": []})
    gateway: tuple = ()
    adminKeyChanged: bool = False
    source: str | None = None

    def asDict(self) -> dict:
        """
        @return: the admin answer's JSON object (no secrets).
        """
        return {
            "applied": self.applied,
            "problems": list(self.problems),
            "refused": [
                {"key": key, "message": f"{key}: a change needs a restart; the running value kept"}
                for key in self.refused
            ],
            "changes": {
                "accounts": self.accounts.asDict(),
                "keys": dict(self.keys),
                "gateway": list(self.gateway),
                "admin_key": self.adminKeyChanged,
            },
        }


def _startupChecks(config: RelayConfig) -> list:
    """
    Start-up's checks beyond the file itself (L{relay.tap.Options.configure}):
    the components and the database path, each problem one line.

    @return: the problem lines (empty when all is well).
    """
    from relay.configuration.parse import checkDatabase
    from relay.configuration.check import checkComponents

    problems = []
    for check in (checkComponents, checkDatabase):
        try:
            check(config)
        except ConfigError as e:
            problems.append(str(e))
    return problems


@define(eq=False)
class ConfigReloader:
    """
    Re-reads the configuration file and applies the difference (see the
    module docstring).

    @ivar path: the file the process started with, or L{None} (reload
        unavailable: a relay built from a string in tests).
    @ivar live: the L{LiveConfiguration} to change.
    @ivar settings: the L{relay.state.settings.RuntimeSettings} to rebase.
    @ivar listenOverride: the C{--listen} given on the command line, which
        overrides the file's C{listen} at start-up and so on reload too.
    @ivar environ: where C{*_env} keys are looked up.
    @ivar onApplied: callables C{(result, config)} run after a reload
        applied (e.g. the site's body limit); exceptions are logged.
    @ivar load: the loader (L{relay.configuration.parse.loadConfig}); tests swap it.
    @ivar checks: start-up's extra checks, C{config -> [problem lines]}.
    """

    path: str | None
    live: LiveConfiguration
    settings: object
    listenOverride: str | None = None
    environ: Mapping[str, str] = os.environ
    onApplied: list = field(factory=list)
    load: Callable | None = None
    checks: Callable = _startupChecks
    _log = Logger()

    def reload(self, source: str = "admin") -> ReloadResult:
        """
        Validate the file, then apply it (see the module docstring). Never
        raises for a bad file; a bug is logged and reported as a problem.

        @param source: who asked (C{sighup}, C{admin}), for the log.
        @rtype: L{ReloadResult}
        """
        try:
            config, problems = self._validate()
            if problems:
                return self._failed(problems, source)
            return self._apply(config, source)
        except Exception:  # noqa: BLE001 - logged; one bad part must not stop the rest
            self._log.failure(
                "reloading the configuration failed", event="relay.config_reload_failed"
            )
            return self._failed(["internal error while reloading; see the log"], source, log=False)

    def _validate(self):
        """
        @return: C{(config, problems)}; C{config} is L{None} when the file
            itself is bad.
        """
        if self.path is None:
            return None, ["no configuration file to reload (relay was not started with --config)"]
        from relay.configuration.parse import loadConfig

        load = self.load or loadConfig
        try:
            config = load(self.path, environ=self.environ)
        except ConfigError as e:
            return None, [str(e)]
        if self.listenOverride:
            config = evolve(config, listen=self.listenOverride)
        return config, list(self.checks(config))

    def _failed(self, problems, source: str, log: bool = True) -> ReloadResult:
        """
        Report a reload that changed nothing, one log line per problem.
        """
        if log:
            for problem in problems:
                self._log.error(
                    "config reload failed, nothing changed: {problem}",
                    event="relay.config_reload_failed",
                    problem=problem,
                    source=source,
                    path=self.path,
                )
        return ReloadResult(applied=False, problems=tuple(problems), source=source)

    def _apply(self, config: RelayConfig, source: str) -> ReloadResult:
        """
        Put a validated C{config} in force (restart-only keys kept).
        """
        from relay.configuration.parse import secretsOf
        from relay.base.logs import registerSecrets

        running = self.live.config
        refused = refusedChanges(running, config)
        config = _keep(running, config)
        # New secrets are redacted before anything about them is logged.
        registerSecrets(secretsOf(config))
        keys = _keyChanges(running, config)
        adminKeyChanged = running.admin_key != config.admin_key
        accounts = self.live.apply(config)
        gateway = self.settings.rebase(config.gateway)
        result = ReloadResult(
            applied=True,
            refused=refused,
            accounts=accounts,
            keys=keys,
            gateway=tuple(sorted(gateway)),
            adminKeyChanged=adminKeyChanged,
            source=source,
        )
        for key in refused:
            self._log.warn(
                "config reload: {key} needs a restart; the running value is kept",
                event="relay.config_reload_refused",
                key=key,
                source=source,
            )
        changes = result.accounts.asDict()
        unchanged = not (
            any(changes[k] for k in ("added", "removed", "changed"))
            or any(keys[k] for k in ("added", "removed", "changed"))
            or result.gateway
            or adminKeyChanged
        )
        self._log.info(
            "configuration reloaded ({source}): nothing changed"
            if unchanged
            else "configuration reloaded ({source}): accounts +{added} -{removed} ~{changed},"
            " keys +{keys_added} -{keys_removed} ~{keys_changed}, gateway {gateway}",
            event="relay.config_reloaded",
            source=source,
            added=changes["added"],
            removed=changes["removed"],
            changed=changes["changed"],
            keys_added=keys["added"],
            keys_removed=keys["removed"],
            keys_changed=keys["changed"],
            gateway=list(result.gateway),
            admin_key_changed=adminKeyChanged,
            refused=list(refused),
        )
        for hook in list(self.onApplied):
            try:
                hook(result, config)
            except Exception:  # noqa: BLE001 - logged; one bad part must not stop the rest
                self._log.failure("a reload hook failed", event="relay.config_listener_failed")
        return result
