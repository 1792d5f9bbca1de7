# -*- test-case-name: tests.test_operators -*-
"""
L{OperatorDirectory}: the operators in force (L{relay.interfaces.IOperatorDirectory}).

The file's operators (config.md C{operators:}) come first and stay the
file's: the API neither changes nor removes them (409 naming the file).
The API's are records of kind L{OPERATOR} in the control store, id = the
name, data C{{"role", "password_hash", "email", "created_at",
"created_by", "updated_at", "updated_by"}} (an Argon2 hash, never a
password). Reads come from a mirror the store's change feed keeps
current (another process's change within a second on Redis).

Rules (docs/security.md "Operators"): names are unique across both; only
an owner adds, changes or removes an owner or makes someone one
(L{relay.operators.roles.mayManage}); the last owner is never removed or
demoted (the admin key still acts as one, but a console without an owner
is a trap).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from zope.interface import implementer

from relay.configuration.operators import OPERATOR_NAME
from relay.control.store import VersionConflict
from relay.control.web import ControlError
from relay.interfaces import IOperatorDirectory
from relay.operators.passwords import checkPassword, hashPassword
from relay.operators.roles import OWNER, ROLES, Principal, mayManage

__all__ = ["OPERATOR", "OperatorDirectory"]

OPERATOR = "operator"
"""The store kind of operators added through the admin API."""


def _invalid(message: str, param: Optional[str] = None) -> ControlError:
    return ControlError(400, "invalid_operator", message, param)


def _forbidden(message: str) -> ControlError:
    return ControlError(403, "forbidden", message)


def _email(value) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str) or "@" not in value or len(value) > 254:
        raise _invalid("email: expected an e-mail address", "email")
    return value.strip()


@implementer(IOperatorDirectory)
@define(eq=False)
class OperatorDirectory:
    """
    See the module docstring.

    @ivar store: the L{relay.interfaces.IControlStore}.
    @ivar clock: stamps records.
    @ivar fileOperators: a no-argument callable returning the file's
        L{relay.configuration.operators.OperatorSpec}s in force (a reload
        changes them).
    @ivar fileName: the configuration file's name, for messages.
    """

    store: Any
    clock: Any
    fileOperators: Callable[[], tuple] = lambda: ()
    fileName: str = "the configuration file"
    _records: dict = field(factory=dict)
    _unsubscribe: Optional[Callable] = None
    _log = Logger()

    # -- reads ------------------------------------------------------------

    def _file(self) -> dict:
        return {spec.name: spec for spec in self.fileOperators() or ()}

    def find(self, name) -> Optional[dict]:
        spec = self._file().get(name)
        if spec is not None:
            return {"name": spec.name, "role": spec.role, "source": "file", "email": spec.email,
                    "password": spec.password_hash is not None}
        record = self._records.get(name)
        if record is None:
            return None
        data = record.data
        return {"name": name, "role": data.get("role"), "source": "admin",
                "email": data.get("email"), "password": bool(data.get("password_hash")),
                "created_at": data.get("created_at"), "created_by": data.get("created_by"),
                "updated_at": data.get("updated_at"), "updated_by": data.get("updated_by")}

    def byEmail(self, value) -> Optional[str]:
        if not isinstance(value, str) or not value:
            return None
        wanted = value.strip().lower()
        for view in self.list():
            if (view.get("email") or "").lower() == wanted:
                return view["name"]
        for view in self.list():
            if view["name"].lower() == wanted:
                return view["name"]
        return None

    def passwordHash(self, name) -> Optional[str]:
        spec = self._file().get(name)
        if spec is not None:
            return spec.password_hash
        record = self._records.get(name)
        return None if record is None else record.data.get("password_hash")

    def list(self) -> list:
        files = self._file()
        names = sorted(files) + sorted(n for n in self._records if n not in files)
        return [self.find(n) for n in names]

    def _owners(self) -> list:
        return [v["name"] for v in self.list() if v["role"] == OWNER]

    # -- writes -----------------------------------------------------------

    async def add(self, name, role, password, email, actor: Principal) -> dict:
        if not isinstance(name, str) or not OPERATOR_NAME.fullmatch(name):
            raise _invalid("name: 1 to 64 letters, digits and . _ @ - (starting with a letter"
                           " or digit)", "name")
        if role not in ROLES:
            raise _invalid("role: expected owner, admin or viewer", "role")
        refused = mayManage(actor, role)
        if refused:
            raise _forbidden(refused)
        email = _email(email)
        if password is None and email is None:
            raise _invalid("password: required (or email, for an operator who signs in with"
                           " OIDC only)", "password")
        if password is not None:
            problem = checkPassword(password)
            if problem:
                raise _invalid(problem, "password")
        if name in self._file():
            raise ControlError(409, "operator_exists",
                               f"operator {name!r} is declared in {self.fileName}", "name")
        now = self.clock.seconds()
        data = {"role": role, "email": email, "created_at": now, "created_by": actor.actor,
                "password_hash": hashPassword(password) if password is not None else None}
        try:
            record = await self.store.put(OPERATOR, name, data, None)
        except VersionConflict:
            raise ControlError(409, "operator_exists", f"operator {name!r} exists already",
                               "name") from None
        self._records[name] = record
        return self.find(name)

    async def _current(self, name):
        if name in self._file():
            raise ControlError(409, "file_operator",
                               f"operator {name!r} is declared in {self.fileName}: change it"
                               " there and reload", "name")
        record = await self.store.get(OPERATOR, name)
        if record is None:
            raise ControlError(404, "operator_not_found", f"No operator {name!r}", "name")
        return record

    def _keepsAnOwner(self, name: str) -> None:
        if self._owners() == [name]:
            raise ControlError(409, "last_owner",
                               f"operator {name!r} is the last owner: make another owner first",
                               "name")

    async def change(self, name, changes: dict, actor: Principal) -> tuple:
        for key in changes:
            if key not in ("role", "password", "email"):
                raise _invalid(f"unknown field {key}", key)
        if not changes:
            raise _invalid("nothing to change: give role, password or email")
        record = await self._current(name)
        data = dict(record.data)
        role = changes.get("role", data.get("role"))
        if role not in ROLES:
            raise _invalid("role: expected owner, admin or viewer", "role")
        refused = mayManage(actor, data.get("role"), role)
        if refused:
            raise _forbidden(refused)
        if data.get("role") == OWNER and role != OWNER:
            self._keepsAnOwner(name)
        revoke = ROLES.index(role) > ROLES.index(data.get("role", OWNER))
        if "password" in changes:
            problem = checkPassword(changes["password"])
            if problem:
                raise _invalid(problem, "password")
            data["password_hash"] = hashPassword(changes["password"])
            revoke = True
        if "email" in changes:
            data["email"] = _email(changes["email"])
        data.update(role=role, updated_at=self.clock.seconds(), updated_by=actor.actor)
        self._records[name] = await self.store.put(OPERATOR, name, data, record.version)
        return self.find(name), revoke

    async def remove(self, name, actor: Principal) -> None:
        record = await self._current(name)
        refused = mayManage(actor, record.data.get("role"))
        if refused:
            raise _forbidden(refused)
        if record.data.get("role") == OWNER:
            self._keepsAnOwner(name)
        await self.store.delete(OPERATOR, name, record.version)
        self._records.pop(name, None)

    # -- the mirror -------------------------------------------------------

    def start(self) -> Deferred:
        if self._unsubscribe is None:
            self._unsubscribe = self.store.subscribe(self._changed)
        return self._reload()

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def _reload(self) -> Deferred:
        d = self.store.list(OPERATOR)

        def _cbRecords(records):
            self._records = {r.id: r for r in records}

        d.addCallback(_cbRecords)
        d.addErrback(lambda f: self._log.error(
            "reading the operators failed: {error}", error=str(f.value),
            event="relay.operators_read_failed"))
        return d

    def _changed(self, change) -> None:
        if change.kind is None:
            self._reload()
            return
        if change.kind != OPERATOR:
            return
        if change.deleted:
            self._records.pop(change.id, None)
            return
        d = self.store.get(OPERATOR, change.id)

        def _cbRecord(record):
            if record is None:
                self._records.pop(change.id, None)
            else:
                self._records[change.id] = record

        d.addCallback(_cbRecord)
        d.addErrback(lambda f: self._reload())
        return None

