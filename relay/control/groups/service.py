# -*- test-case-name: tests.test_control_keys -*-
"""
L{GroupService}: account groups over the admin API.

A key bound to a group (C{group:} on the key) only ever reaches the
group's accounts (L{relay.tenants.keypolicy.KeyPolicy.allowedAccounts}). The
file's C{groups:} stay the file's (read-only here, like file accounts);
the API adds its own, which admin keys may be bound to:

  - C{GET /admin/groups}: every group, C{source: file | admin}, its
    accounts and the keys bound to it;
  - C{PUT /admin/groups/{name}} C{{"accounts": [ids], "label"}}: add or
    replace an admin group (201 when new); a file group's name is a 409
    naming the file; every id must be an account in force;
  - C{DELETE /admin/groups/{name}}: an admin group no admin key is bound
    to (else 409 naming the keys).

B{Kind C{group}}: one record per admin group, id = its name, data
C{{"accounts": [ids], "label", "created_at", "created_from",
"updated_at", "updated_from"}}. A group keeps ids of accounts deleted
later: they reach nothing (a group never widens by itself).
"""

from __future__ import annotations

from typing import Optional

from attrs import define

from relay.control.keys.records import NAME
from relay.control.service import PlaneService
from relay.control.web import ControlError

__all__ = ["GROUP", "GroupService", "groupAccounts", "groupView"]

GROUP = "group"
"""The store kind of account groups added through the admin API."""


def groupAccounts(record) -> tuple:
    """
    @return: the account ids of a stored group.
    """
    ids = (record.data or {}).get("accounts") or ()
    return tuple(i for i in ids if isinstance(i, str) and i)


def groupView(name: str, accounts, source: str, data: Optional[dict] = None,
              usedBy=()) -> dict:
    """
    The admin view of an account group.

    @param accounts: its account ids.
    @param source: C{file} or C{admin}.
    @param data: the admin record's data, if any.
    @param usedBy: the names of the keys bound to it.
    """
    data = data or {}
    return {"name": name, "source": source, "accounts": list(accounts),
            "label": data.get("label"), "keys": sorted(usedBy),
            "created_at": data.get("created_at"), "updated_at": data.get("updated_at")}


def _invalid(message: str, param: Optional[str] = None) -> ControlError:
    return ControlError(400, "invalid_group", message, param)


@define(eq=False)
class GroupService(PlaneService):
    """
    See the module docstring (plane, clock and store: L{PlaneService}).
    """

    def _fileGroups(self) -> dict:
        return getattr(self.plane.live.config, "groups", None) or {}

    def _boundTo(self, name: str) -> list:
        return sorted(k.name for k in self.plane.live.keys.keys if k.group == name)

    def view(self, name: str) -> dict:
        """
        @return: one group's view.
        @raise ControlError: 404.
        """
        files = self._fileGroups()
        if name in files:
            return groupView(name, files[name], "file", None, self._boundTo(name))
        record = self.plane.groups.get(name)
        if record is None:
            raise ControlError(404, "group_not_found", f"No group {name!r}", "name")
        return groupView(name, groupAccounts(record), "admin", record.data, self._boundTo(name))

    def list(self) -> tuple:
        """
        @return: C{(200, {"groups": [views]})}: the file's, then the admin
            API's, each sorted by name.
        """
        names = sorted(self._fileGroups()) + sorted(
            n for n in self.plane.groups if n not in self._fileGroups())
        return 200, {"groups": [self.view(n) for n in names]}

    async def put(self, name: str, body: dict, address: Optional[str], note: dict) -> tuple:
        """
        Add or replace an admin group.

        @return: C{(201 or 200, {"group": view})}.
        @raise ControlError: 400 (a field), 409 (a file group).
        """
        note.update(target=name, detail={"fields": sorted(body)})
        if not NAME.fullmatch(name):
            raise _invalid("name: 1 to 64 letters, digits and . _ @ : - (starting with a letter"
                           " or digit)", "name")
        if name in self._fileGroups():
            raise ControlError(
                409, "file_group",
                f"group {name!r} is declared in {self.plane.fileName}: change it there and"
                " reload", "name")
        for field in body:
            if field not in ("accounts", "label"):
                raise _invalid(f"unknown field {field}", field)
        ids = body.get("accounts")
        if not isinstance(ids, list) or not ids:
            raise _invalid("accounts: required, a non-empty list of account ids", "accounts")
        for i, accountId in enumerate(ids):
            if not isinstance(accountId, str) or not accountId:
                raise _invalid(f"accounts[{i}]: expected an account id", "accounts")
            if self.plane.live.accounts.byId(accountId) is None:
                raise _invalid(f"accounts[{i}]: unknown account id {accountId!r}", "accounts")
        label = body.get("label")
        if label is not None and (not isinstance(label, str) or len(label) > 200):
            raise _invalid("label: expected a string of at most 200 characters", "label")
        record = await self.store.get(GROUP, name)
        now = self._clock.seconds()
        data = dict(record.data) if record is not None else {
            "created_at": now, "created_from": address}
        data.update(accounts=list(dict.fromkeys(ids)), label=label)
        if record is not None:
            data.update(updated_at=now, updated_from=address)
        await self.store.put(GROUP, name, data, record.version if record is not None else None)
        await self.plane.refresh()
        return (201 if record is None else 200), {"group": self.view(name)}

    async def delete(self, name: str, address: Optional[str], note: dict) -> tuple:
        """
        Remove an admin group no admin key is bound to.

        @return: C{(200, {"deleted": name})}.
        @raise ControlError: 404, 409 (a file group, or keys bound to it).
        """
        note.update(target=name)
        if name in self._fileGroups():
            raise ControlError(
                409, "file_group",
                f"group {name!r} is declared in {self.plane.fileName}: remove it there and"
                " reload", "name")
        record = await self.store.get(GROUP, name)
        if record is None:
            raise ControlError(404, "group_not_found", f"No group {name!r}", "name")
        bound = self._boundTo(name)
        if bound:
            raise ControlError(
                409, "group_in_use",
                f"group {name!r} is the group of the key(s) {', '.join(bound)}; change their"
                " group first", "name")
        await self.store.delete(GROUP, name, record.version)
        await self.plane.refresh()
        return 200, {"deleted": name}
