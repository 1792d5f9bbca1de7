# -*- test-case-name: tests.test_control -*-
"""
L{AccountService}: the rules of accounts changed through the admin API.

  - B{Add} (C{POST /admin/accounts}): an API-key or an OAuth account with
    the file's fields and the file's validation (one clear 400 per
    problem, naming the field). Fields that name something on the relay
    host (C{*_env}, C{auth_file}) are refused; an OAuth account may bring a
    Codex C{auth.json} document as C{auth_json} (or log in,
    L{relay.control.logins}). An id the file uses, or an admin account
    has, is a 409.
  - B{Edit} (C{PATCH /admin/accounts/{id}}): priority, concurrency, models,
    model mapping, proxy, ws_mode, label (and a new C{api_key}); a file
    account's fields are the file's: 409 naming the file.
  - B{Delete} (C{DELETE /admin/accounts/{id}}): the account takes no new
    turn, running turns finish; file accounts: 409 naming the file.
  - B{Pause / resume} (C{POST /admin/accounts/{id}/disable}, C{/enable}):
    any account, file or admin; kept in the store, so it survives restarts
    and reloads until enabled.

Secrets are write-only: no answer and no log line carries an API key, a
token or a proxy password after it was sent (they are registered for log
redaction the moment they arrive, R99, R100). Every change is written to
the store first and answered once it is in force in this process
(L{relay.control.plane.ControlPlane.refresh}); other processes apply it
within a second.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from attrs import define

from relay.configuration.parse import ACCOUNT_FIELDS as FILE_FIELDS
from relay.control.accounts.records import (
    ACCOUNT,
    ADMIN_ONLY_FIELDS,
    EDITABLE_FIELDS,
    FILE_ONLY_FIELDS,
    PAUSE,
    accountFromSpec,
    describeConfigError,
    publicAccount,
    specSecrets,
)
from relay.control.service import PlaneService
from relay.control.store import ANY, VersionConflict
from relay.control.web import ControlError
from relay.base.logs import registerSecrets
from relay.base.records import ConfigError

__all__ = ["ACCOUNT_ID", "AccountService"]

ACCOUNT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}")
"""What an admin account's id may be: it appears in URL paths, metrics
labels and logs."""


def _invalid(message: str, param: Optional[str] = None) -> ControlError:
    return ControlError(400, "invalid_account", message, param)


@define(eq=False)
class AccountService(PlaneService):
    """
    See the module docstring (plane, clock and store: L{PlaneService}).

    @ivar credentials: the L{relay.interfaces.ICredentialSource} (the pool's
        OAuth identities, for the duplicate warning), or L{None}.
    """

    credentials: Any = None

    def emailOf(self, account) -> Optional[str]:
        """
        @return: the e-mail address an OAuth account is signed in as (its
            admin record's, else its current token's), or L{None}.
        """
        from relay.oauth.tokens import emailOf

        record = self.plane.admin.get(account.id)
        known = ((record[0].data.get("identity") or {}).get("email")
                 if record is not None else None)
        if known or self.credentials is None:
            return known
        return emailOf(self.credentials.current(account).credential)

    def duplicates(self, identity: dict, accountId: str) -> list:
        """
        @return: the C{duplicate_identity} warnings of an identity about to
            be (or just) added as C{accountId}
            (L{relay.control.accounts.identity}).
        """
        from relay.control.accounts.identity import duplicateWarnings

        return duplicateWarnings(identity, list(self.plane.live.accounts), accountId,
                                 self.emailOf)

    def _proxies(self) -> tuple:
        return tuple(self.plane.live.config.proxies)

    def _inFile(self, accountId: str) -> bool:
        return any(a.id == accountId for a in self.plane.live.config.accounts)

    def _fileConflict(self, accountId: str, what: str) -> ControlError:
        return ControlError(
            409, "file_account",
            f"account {accountId!r} is declared in {self.plane.fileName}: {what} there and"
            " reload (the admin API may pause, enable, clear and log in a file account)",
            "id",
        )

    def _validate(self, spec: dict):
        try:
            return accountFromSpec(spec, self._proxies())
        except ConfigError as e:
            message, param = describeConfigError(e)
            raise _invalid(message, param)

    def view(self, accountId: str) -> dict:
        """
        @return: the public view of an account in force (file or admin).
        @raise ControlError: 404 for an unknown account.
        """
        account = self.plane.live.accounts.byId(accountId)
        if account is None:
            raise ControlError(404, "account_not_found", f"No account {accountId!r}", "id")
        record = self.plane.admin.get(accountId)
        pause = self.plane.pauses.get(accountId)
        return publicAccount(account, "admin" if record is not None else "file",
                             record[0].data if record is not None else None,
                             pause.data if pause is not None else None)

    # -- add ------------------------------------------------------------------------------

    def specFromBody(self, body: dict) -> tuple:
        """
        Check a new account's body and split it into the file-like spec and
        the admin fields (label).

        @return: C{(spec, label)}.
        @raise ControlError: 400 naming the field.
        """
        for name in body:
            if name in FILE_ONLY_FIELDS:
                raise _invalid(
                    f"{name}: not accepted through the admin API (it names something on the"
                    f" relay host); give the value itself", name)
            if name not in FILE_FIELDS and name not in ADMIN_ONLY_FIELDS:
                raise _invalid(f"unknown field {name}", name)
        accountId = body.get("id")
        if not isinstance(accountId, str) or not ACCOUNT_ID.fullmatch(accountId):
            raise _invalid("id: required, 1 to 64 letters, digits and . _ @ : - (starting with"
                           " a letter or digit)", "id")
        label = body.get("label")
        if label is not None and (not isinstance(label, str) or len(label) > 200):
            raise _invalid("label: expected a string of at most 200 characters", "label")
        spec = {k: v for k, v in body.items() if k not in ADMIN_ONLY_FIELDS}
        if "auth_json" in body:
            spec = self._withAuthJSON(spec, body["auth_json"])
        return spec, label

    @staticmethod
    def _withAuthJSON(spec: dict, document) -> dict:
        from relay.oauth.authfile import AuthFileError, parseAuth

        if spec.get("type") != "oauth":
            raise _invalid("auth_json: only for an oauth account", "auth_json")
        given = [k for k in ("access_token", "refresh_token", "id_token") if k in spec]
        if given:
            raise _invalid(f"give auth_json or tokens ({given[0]}), not both", "auth_json")
        try:
            auth = parseAuth(document)
        except AuthFileError as e:
            raise _invalid(f"auth_json: {e}", "auth_json")
        spec = dict(spec)
        for name, value in (("access_token", auth.access_token),
                            ("refresh_token", auth.refresh_token), ("id_token", auth.id_token)):
            if value:
                spec[name] = value
        if auth.account_id and "chatgpt_account_id" not in spec:
            spec["chatgpt_account_id"] = auth.account_id
        return spec

    async def create(self, body: dict, address: Optional[str], note: dict,
                     login: Optional[dict] = None) -> tuple:
        """
        Add an account (see the module docstring).

        @param body: the request's JSON object (file fields, C{label},
            C{auth_json}).
        @param address: the admin's address (stored as C{created_from}).
        @param note: filled with the audit's details (field names only).
        @param login: for an account a ChatGPT login created:
            C{{"flow", "at", "plan"}}.
        @return: C{(201, {"account": view, "warnings": [...]})}: a
            C{duplicate_identity} warning when the ChatGPT identity is
            already in the pool (the account is added all the same).
        @raise ControlError: 400 (a field), 409 (the id exists).
        """
        # Secrets are redacted from every log line before anything can log
        # them (even a refusal).
        registerSecrets(specSecrets(body))
        spec, label = self.specFromBody(body)
        accountId = spec["id"]
        note.update(account=accountId, detail={"type": spec.get("type"),
                                               "fields": sorted(body)})
        if self._inFile(accountId):
            raise ControlError(
                409, "account_exists",
                f"account {accountId!r} is declared in {self.plane.fileName}; account ids are"
                " unique across the file and the admin API", "id")
        if accountId in self.plane.admin:
            raise ControlError(409, "account_exists", f"account {accountId!r} already exists",
                               "id")
        account = self._validate(spec)
        registerSecrets(specSecrets(spec, account))
        data = {"spec": spec, "label": label, "created_at": self._clock.seconds(),
                "created_from": address}
        if login is not None:
            data["login"] = login
        identity = None
        if account.type == "oauth":
            from relay.control.accounts.identity import identityOf

            identity = identityOf(spec.get("access_token"), spec.get("id_token"))
            identity["chatgpt_account_id"] = (identity["chatgpt_account_id"]
                                              or account.chatgpt_account_id)
            data["identity"] = identity
        # Before it is added: the pool as it was.
        warnings = self.duplicates(identity, accountId) if identity else []
        try:
            await self.store.put(ACCOUNT, accountId, data, None)
        except VersionConflict:
            raise ControlError(409, "account_exists", f"account {accountId!r} already exists",
                               "id")
        await self.plane.refresh()
        if warnings:
            note.setdefault("detail", {})["warnings"] = [w["code"] for w in warnings]
        return 201, {"account": self.view(accountId), "warnings": warnings}

    # -- edit -----------------------------------------------------------------------------

    async def update(self, accountId: str, body: dict, address: Optional[str],
                     note: dict) -> tuple:
        """
        Change an admin account's editable fields (see the module
        docstring); C{null} removes a field (C{models}: every model,
        C{proxy}: direct, C{ws_mode}: the gateway default).

        @return: C{(200, {"account": view, "changed": [fields]})}.
        @raise ControlError: 404, 409 (a file account, or changed
            meanwhile), 400 (a field).
        """
        registerSecrets(specSecrets(body))
        note.update(account=accountId, detail={"fields": sorted(body)})
        record = await self._adminRecord(accountId, "edit its fields")
        if not body:
            raise _invalid("nothing to change: give at least one of "
                           + ", ".join(EDITABLE_FIELDS))
        for name in body:
            if name not in EDITABLE_FIELDS:
                raise _invalid(
                    f"{name}: cannot be changed (editable: {', '.join(EDITABLE_FIELDS)}); delete"
                    " the account and add it again", name)
        data = dict(record.data)
        spec = dict(data.get("spec") or {})
        if "api_key" in body and spec.get("type") != "apikey":
            raise _invalid("api_key: only an apikey account has one; log in again instead",
                           "api_key")
        for name, value in body.items():
            if name == "label":
                if value is not None and (not isinstance(value, str) or len(value) > 200):
                    raise _invalid("label: expected a string of at most 200 characters", "label")
                data["label"] = value
                continue
            if name in ("proxy", "proxy_id"):
                spec.pop("proxy", None)
                spec.pop("proxy_id", None)
            if value is None:
                spec.pop(name, None)
            else:
                spec[name] = value
        account = self._validate(spec)
        registerSecrets(specSecrets(spec, account))
        data["spec"] = spec
        data["updated_at"] = self._clock.seconds()
        data["updated_from"] = address
        await self.store.put(ACCOUNT, accountId, data, record.version)
        await self.plane.refresh()
        return 200, {"account": self.view(accountId), "changed": sorted(body)}

    async def _adminRecord(self, accountId: str, what: str):
        record = await self.store.get(ACCOUNT, accountId)
        if record is None:
            if self._inFile(accountId):
                raise self._fileConflict(accountId, what)
            raise ControlError(404, "account_not_found", f"No account {accountId!r}", "id")
        return record

    # -- delete ---------------------------------------------------------------------------

    async def delete(self, accountId: str, address: Optional[str], note: dict) -> tuple:
        """
        Remove an admin account: it takes no new turn, its running turns
        finish (as a reload's removal); its pause goes with it.

        @return: C{(200, {"deleted": id})}.
        @raise ControlError: 404, 409 (a file account).
        """
        note.update(account=accountId)
        record = await self._adminRecord(accountId, "delete it")
        await self.store.delete(ACCOUNT, accountId, record.version)
        await self.store.delete(PAUSE, accountId, ANY)
        await self.plane.refresh()
        return 200, {"deleted": accountId}

    # -- pause ------------------------------------------------------------------------------

    async def setPaused(self, accountId: str, paused: bool, body: dict,
                        address: Optional[str], note: dict) -> tuple:
        """
        Pause (C{disable}) or resume (C{enable}) any account in force.

        @param body: C{{"reason": "..."}} optionally, for a pause.
        @return: C{(200, {"account": view})}.
        @raise ControlError: 404 for an account not in force; 400 for a
            bad reason.
        """
        note.update(account=accountId)
        if self.plane.live.accounts.byId(accountId) is None:
            raise ControlError(404, "account_not_found", f"No account {accountId!r}", "id")
        if paused:
            reason = body.get("reason")
            if reason is not None and (not isinstance(reason, str) or len(reason) > 200):
                raise _invalid("reason: expected a string of at most 200 characters", "reason")
            for name in body:
                if name != "reason":
                    raise _invalid(f"unknown field {name}", name)
            await self.store.put(PAUSE, accountId, {
                "paused_at": self._clock.seconds(), "by": address, "reason": reason}, ANY)
            note.update(detail={"reason": reason})
        else:
            await self.store.delete(PAUSE, accountId, ANY)
        await self.plane.refresh()
        return 200, {"account": self.view(accountId)}
