# -*- test-case-name: tests.test_control_keys -*-
"""
L{KeyService}: the rules of client keys managed through the admin API
(behaviour.md R99, R102).

  - B{Issue} (C{POST /admin/keys} C{{"name", "label"?, <policy>}}): relay
    generates the secret (L{relay.tenants.keydigest.newKeySecret}) and
    answers it B{once}, in this answer (C{"secret"}); the store keeps only
    its SHA-256 digest. A name the file uses, or an admin key has, is a
    409. The policy fields are the file's (C{keys[]} in config.md,
    validated by the same rules): C{concurrency}, C{daily_tokens},
    C{monthly_tokens}, C{models}, C{deny_models}, C{expires_at}, C{rpm},
    C{tpm}, C{accounts} or C{group}, C{daily_usd}, C{monthly_usd},
    C{max_turn_output_tokens} (R108).
  - B{Edit} (C{PATCH /admin/keys/{name}}): policy fields and C{label};
    C{null} removes a limit. A file key's fields are the file's: 409
    naming the file.
  - B{Revoke} (C{DELETE /admin/keys/{name}}): gone from every process's
    key ring at once (this one before the answer, the others within a
    second): the next request is a 401, an open WebSocket's next
    C{response.create} a close 1008, on every mode; turns already running
    finish. File keys: 409 naming the file.
  - B{Disable / enable} (C{POST /admin/keys/{name}/disable} (optional body
    C{{"reason"}}), C{/enable}): any key, file or admin; kept in the store
    (kind C{key_disabled}), so it survives restarts and reloads until
    enabled. A disabled key is refused 401 / close 1008 (R102). A key the
    file says C{disabled: true} cannot be enabled here (409 naming the
    file).
  - B{Read} (C{GET /admin/keys}, C{GET /admin/keys/{name}}): every key,
    C{source: file | admin}, its policy, whether it is disabled or
    expired, and its usage and cost today and this month (UTC). Never a
    secret or a digest.

Every change is written to the store first and answered once it is in
force in this process (L{relay.control.plane.ControlPlane.refresh}).
"""

from __future__ import annotations

import base64
import os
from typing import Any, Optional

from attrs import define

from relay.control.accounts.records import describeConfigError
from relay.control.keys.records import (
    KEY,
    KEY_DISABLED,
    NAME,
    POLICY_FIELDS,
    publicKey,
    storedPolicy,
    validatePolicy,
)
from relay.control.service import PlaneService
from relay.control.store import ANY, VersionConflict
from relay.control.web import ControlError
from relay.base.logs import registerSecrets
from relay.base.records import ConfigError
from relay.tenants.keydigest import keyDigest, keyHint, newKeySecret

__all__ = ["KeyService"]

_REFUSED = {
    "key": "relay generates the secret and shows it once in this answer; it cannot be given",
    "key_env": "relay generates the secret; keys that read an environment variable belong in"
               " the file",
    "disabled": "use POST /admin/keys/{name}/disable and /enable",
}


def _invalid(message: str, param: Optional[str] = None) -> ControlError:
    return ControlError(400, "invalid_key", message, param)


def _notFound(name: str) -> ControlError:
    return ControlError(404, "key_not_found", f"No key {name!r}", "name")


@define(eq=False)
class KeyService(PlaneService):
    """
    See the module docstring (plane, clock and store: L{PlaneService}).

    @ivar usage: the L{relay.usage.ledger.UsageLedger} (usage and cost per
        key), or L{None}.
    """

    usage: Any = None

    @property
    def ring(self):
        return self.plane.live.keys

    def _fileKey(self, name: str):
        return next((k for k in self.ring.fileKeys if k.name == name), None)

    def _fileConflict(self, name: str, what: str) -> ControlError:
        return ControlError(
            409, "file_key",
            f"key {name!r} is declared in {self.plane.fileName}: {what} there and reload (the"
            " admin API may disable and enable a file key)", "name")

    # -- reading --------------------------------------------------------------------------

    def viewOf(self, name: str) -> dict:
        """
        @return: the public view of a key in force (file or admin), without
            usage.
        @raise ControlError: 404.
        """
        key = self.ring.byName(name)
        if key is None:
            raise _notFound(name)
        admin = self.plane.adminKeys.get(name)
        disabled = self.plane.keyDisables.get(name)
        fileKey = self._fileKey(name) if admin is None else None
        return publicKey(key, "admin" if admin is not None else "file", self._clock.seconds(),
                         admin[0].data if admin is not None else None,
                         disabled.data if disabled is not None else None,
                         fileDisabled=bool(fileKey is not None and fileKey.disabled))

    async def _usage(self) -> dict:
        """
        @return: key name -> C{{"today": counts, "month": counts}} (UTC day
            and month; L{relay.usage.tokens.TokenCounts.asDict} fields).
        """
        if self.usage is None:
            return {}
        from relay.usage.store import dayStart, monthStart

        now = self._clock.seconds()
        out: dict = {}
        for period, since in (("today", dayStart(now)), ("month", monthStart(now))):
            for row in await self.usage.totals(since, "key"):
                out.setdefault(row["key"], {})[period] = {
                    k: v for k, v in row.items() if k != "key"}
        return out

    def _withUsage(self, view: dict, usage: dict) -> dict:
        empty = {"requests": 0, "total_tokens": 0, "cost_usd": 0.0, "unpriced_requests": 0}
        counted = usage.get(view["name"], {})
        view["usage"] = {period: counted.get(period, dict(empty)) for period in ("today", "month")}
        return view

    async def list(self) -> tuple:
        """
        @return: C{(200, {"keys": [views with usage], "now"})}: the file's
            keys in file order, then the admin keys by name.
        """
        usage = await self._usage()
        names = [k.name for k in self.ring.keys]
        return 200, {"keys": [self._withUsage(self.viewOf(n), usage) for n in names],
                     "now": self._clock.seconds()}

    async def one(self, name: str) -> tuple:
        """
        @return: C{(200, {"key": view with usage})}.
        @raise ControlError: 404.
        """
        view = self.viewOf(name)
        return 200, {"key": self._withUsage(view, await self._usage())}

    # -- checks ----------------------------------------------------------------------------

    def _validate(self, values: dict) -> dict:
        """
        Validate policy fields and what they name (accounts in force,
        groups of the file or the API).

        @return: the converted values.
        @raise ControlError: 400 naming the field.
        """
        try:
            converted = validatePolicy(values)
        except ConfigError as e:
            message, param = describeConfigError(e, "key")
            raise _invalid(message, param)
        for i, accountId in enumerate(converted.get("accounts") or ()):
            if self.plane.live.accounts.byId(accountId) is None:
                raise _invalid(f"accounts[{i}]: unknown account id {accountId!r}", "accounts")
        group = converted.get("group")
        if group is not None:
            fileGroups = getattr(self.plane.live.config, "groups", None) or {}
            if group not in fileGroups and group not in self.plane.groups:
                raise _invalid(f"group: unknown group {group!r} (GET /admin/groups lists them)",
                               "group")
        return converted

    @staticmethod
    def _checkFields(body: dict, allowed: tuple) -> None:
        for name in body:
            if name in _REFUSED:
                raise _invalid(f"{name}: {_REFUSED[name]}", name)
            if name not in allowed:
                raise _invalid(f"unknown field {name}", name)

    @staticmethod
    def _label(body: dict):
        label = body.get("label")
        if label is not None and (not isinstance(label, str) or len(label) > 200):
            raise _invalid("label: expected a string of at most 200 characters", "label")
        return label

    # -- issue ------------------------------------------------------------------------------

    async def create(self, body: dict, address: Optional[str], note: dict) -> tuple:
        """
        Issue a key (see the module docstring).

        @return: C{(201, {"key": view, "secret": the secret, shown once})}.
        @raise ControlError: 400 (a field), 409 (the name exists).
        """
        self._checkFields(body, ("name", "label") + POLICY_FIELDS)
        name = body.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise _invalid("name: required, 1 to 64 letters, digits and . _ @ : - (starting"
                           " with a letter or digit)", "name")
        note.update(target=name, detail={"fields": sorted(body)})
        if self._fileKey(name) is not None:
            raise ControlError(409, "key_exists",
                               f"key {name!r} is declared in {self.plane.fileName}; key names"
                               " are unique across the file and the admin API", "name")
        if name in self.plane.adminKeys:
            raise ControlError(409, "key_exists", f"key {name!r} already exists", "name")
        label = self._label(body)
        converted = self._validate({k: v for k, v in body.items() if k in POLICY_FIELDS})
        secret = newKeySecret()
        # Redacted from every log line from now on (it is in this answer only).
        registerSecrets({secret})
        now = self._clock.seconds()
        # R104: this issuance's owner identity (ClientKey.ownerId); a key
        # issued again under this name gets another, so it never continues
        # this one's conversations.
        issuance = base64.urlsafe_b64encode(os.urandom(9)).decode("ascii")
        data = {"digest": keyDigest(secret).hex(), "hint": keyHint(secret),
                "policy": storedPolicy(converted), "label": label, "created_at": now,
                "created_from": address, "issuance": issuance}
        # A disable left by an earlier key of this name is not this key's
        # (removed first, so the new key is never in force with it).
        await self.store.delete(KEY_DISABLED, name, ANY)
        try:
            await self.store.put(KEY, name, data, None)
        except VersionConflict:
            raise ControlError(409, "key_exists", f"key {name!r} already exists", "name")
        await self.plane.refresh()
        view = self._withUsage(self.viewOf(name), {})
        return 201, {"key": view, "secret": secret,
                     "note": "The secret is shown once, here: relay keeps only its SHA-256"
                             " digest and cannot show it again."}

    # -- edit -------------------------------------------------------------------------------

    async def _adminRecord(self, name: str, what: str):
        record = await self.store.get(KEY, name)
        if record is None:
            if self._fileKey(name) is not None:
                raise self._fileConflict(name, what)
            raise _notFound(name)
        return record

    async def update(self, name: str, body: dict, address: Optional[str], note: dict) -> tuple:
        """
        Change an admin key's policy fields or label; C{null} removes a
        limit.

        @return: C{(200, {"key": view, "changed": [fields]})}.
        @raise ControlError: 404, 409 (a file key, or changed meanwhile),
            400 (a field).
        """
        note.update(target=name, detail={"fields": sorted(body)})
        record = await self._adminRecord(name, "change its fields")
        self._checkFields(body, ("label",) + POLICY_FIELDS)
        if not body:
            raise _invalid("nothing to change: give at least one of label, "
                           + ", ".join(POLICY_FIELDS))
        data = dict(record.data)
        if "label" in body:
            data["label"] = self._label(body)
        policy = dict(data.get("policy") or {})
        for field, value in body.items():
            if field == "label":
                continue
            if value is None:
                policy.pop(field, None)
            else:
                policy[field] = value
        # One of accounts and group: setting one drops the other.
        if body.get("accounts") is not None and "group" not in body:
            policy.pop("group", None)
        if body.get("group") is not None and "accounts" not in body:
            policy.pop("accounts", None)
        data["policy"] = storedPolicy(self._validate(policy))
        data.update(updated_at=self._clock.seconds(), updated_from=address)
        await self.store.put(KEY, name, data, record.version)
        await self.plane.refresh()
        return 200, {"key": self._withUsage(self.viewOf(name), await self._usage()),
                     "changed": sorted(body)}

    # -- revoke -----------------------------------------------------------------------------

    async def delete(self, name: str, address: Optional[str], note: dict) -> tuple:
        """
        Revoke an admin key at once (see the module docstring).

        @return: C{(200, {"deleted": name})}.
        @raise ControlError: 404, 409 (a file key).
        """
        note.update(target=name)
        record = await self._adminRecord(name, "remove it")
        await self.store.delete(KEY, name, record.version)
        await self.store.delete(KEY_DISABLED, name, ANY)
        await self.plane.refresh()
        return 200, {"deleted": name}

    # -- disable ----------------------------------------------------------------------------

    async def setDisabled(self, name: str, disabled: bool, body: dict,
                          address: Optional[str], note: dict) -> tuple:
        """
        Disable or enable any key in force.

        @param body: C{{"reason": "..."}} optionally, to disable.
        @return: C{(200, {"key": view})}.
        @raise ControlError: 404, 400 (a bad reason), 409 (enabling a key
            the file disables).
        """
        note.update(target=name)
        if self.ring.byName(name) is None:
            raise _notFound(name)
        if disabled:
            for field in body:
                if field != "reason":
                    raise _invalid(f"unknown field {field}", field)
            reason = body.get("reason")
            if reason is not None and (not isinstance(reason, str) or len(reason) > 200):
                raise _invalid("reason: expected a string of at most 200 characters", "reason")
            if reason:
                note["detail"] = {"reason": reason}
            await self.store.put(KEY_DISABLED, name, {
                "disabled_at": self._clock.seconds(), "by": address, "reason": reason}, ANY)
        else:
            fileKey = self._fileKey(name) if name not in self.plane.adminKeys else None
            if fileKey is not None and fileKey.disabled:
                raise self._fileConflict(name, "it is disabled: true; change that")
            await self.store.delete(KEY_DISABLED, name, ANY)
        await self.plane.refresh()
        return 200, {"key": self._withUsage(self.viewOf(name), await self._usage())}
