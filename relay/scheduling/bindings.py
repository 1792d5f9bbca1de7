# -*- test-case-name: tests.test_scheduler -*-
"""
What account selection remembers in the state store (behaviour.md R35,
R38-R40, R89, R90, R104): session bindings, response owners and affinity
records, each with a bounded local map beside it for when the store misses
or fails.

Store keys (R38, R39, R40):

  - C{sticky_session:0:openai:{hash}} -> account id (the session binding);
  - C{sticky_session:0:openai:response:{sha256(id)}} -> account id (the
    response owner);
  - C{openai:http-response-owner:key:{sha256(id)}} -> the owner record
    C{{"key": name, "account": id}} (R40, R104; TTL
    C{response_owner_ttl_seconds}; see L{Bindings.lookupResponse}).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Optional
from weakref import WeakKeyDictionary

from attrs import define, field
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.base.eager import eagerDeferred
from relay.base.records import Account, Turn
from relay.interfaces import IStateStore
from relay.scheduling.itemowners import itemOwnerKey
from relay.state.settings import RuntimeSettings

#: At most this many response owners are kept in the local map (R39).
LOCAL_OWNER_CAPACITY = 65536


def sessionKey(sessionHash: str) -> str:
    """
    The store key of a sticky session binding (R38).

    @param sessionHash: the 16-hex-digit hash from L{relay.scheduling.session.sessionHash}.
    @return: C{sticky_session:0:openai:{hash}}.
    """
    return f"sticky_session:0:openai:{sessionHash}"


def _digest(responseId: str) -> str:
    """
    @param responseId: a response id.
    @return: its sha256 as hex.
    """
    return hashlib.sha256(responseId.encode("utf-8")).hexdigest()


def responseKey(responseId: str) -> str:
    """
    The store key of a response's owner account (R39).

    @param responseId: the upstream response id (C{resp_...}).
    @return: C{sticky_session:0:openai:response:{sha256(responseId)}}.
    """
    return f"sticky_session:0:openai:response:{_digest(responseId)}"


def responseOwnerKey(responseId: str) -> str:
    """
    The store key of the client key that owns a response (R40).

    @param responseId: the upstream response id.
    @return: C{openai:http-response-owner:key:{sha256(responseId)}}.
    """
    return f"openai:http-response-owner:key:{_digest(responseId)}"


def responseKeys(responseId: str) -> tuple:
    """
    L{responseKey} and L{responseOwnerKey} of one response, from
    one sha256 of its id (a turn writes both).

    @return: C{(responseKey(responseId), responseOwnerKey(responseId))}.
    """
    digest = _digest(responseId)
    return (f"sticky_session:0:openai:response:{digest}",
            f"openai:http-response-owner:key:{digest}")


_OWNER_RECORDS: dict = {}
"""C{(key owner id, account id)} -> its L{ownerRecord} (a
bounded set: configured keys and accounts; cleared when full)."""
_OWNER_RECORDS_MAX = 4096


def ownerRecord(keyOwner: str, accountId: str) -> str:
    """
    The value of a response's (and its items') owner record (R104): the
    key's owner identity and the account, as compact JSON (read by
    L{parseOwner}); built once per C{(key, account)}.

    @param keyOwner: the key's L{relay.base.records.ClientKey.ownerId}.
    @param accountId: the account that served the response.
    @return: C{{"key":keyOwner,"account":accountId}}.
    """
    ident = (keyOwner, accountId)
    record = _OWNER_RECORDS.get(ident)
    if record is None:
        record = json.dumps({"key": keyOwner, "account": accountId}, separators=(",", ":"))
        if len(_OWNER_RECORDS) >= _OWNER_RECORDS_MAX:
            _OWNER_RECORDS.clear()
        _OWNER_RECORDS[ident] = record
    return record


def affinityKey(kind: str, value: str) -> str:
    """
    The store key of an affinity record: which account issued a turn-state
    token (R90) or produced a C{compaction} item (R89).

    @param kind: C{compaction} or C{turn_state}.
    @param value: the token, or the item's C{encrypted_content}.
    @return: C{openai:affinity:{kind}:{sha256(value)}}.
    """
    return f"openai:affinity:{kind}:{_digest(value)}"


def turnStateSessionKey(sessionHash: str) -> str:
    """
    The store key of the C{x-codex-turn-state} the upstream gave a
    WebSocket session (R90), carried on the 101 of its next connection.

    @param sessionHash: the session hash (R37) of the client key and the
        session header.
    """
    return f"openai:ws-turn-state:{sessionHash}"


def _none(result) -> None:
    """
    Drop C{result}: a store write's result is not the caller's (the
    Deferred fires with L{None}).
    """


def parseOwner(raw: str) -> tuple:
    """
    An owner record: C{{"key": name, "account": id}} (R104), or the bare
    key name of records written by older relays.

    @return: C{(keyName, accountId or None)}.
    """
    if raw.startswith("{"):
        try:
            value = json.loads(raw)
            return value.get("key"), value.get("account")
        except (ValueError, AttributeError):
            return None, None
    return raw, None


@define(eq=False)
class Bindings:
    """
    The scheduler's records in the L{IStateStore} (R38-R40, R89, R90,
    R104); a store error is logged and never raised (R35: fail open, or
    for an owner lookup fail closed).

    @ivar _store: the L{IStateStore}.
    @ivar _clock: the L{IReactorTime} for Unix seconds.
    @ivar _settings: the L{RuntimeSettings}; the TTLs of
        C{.current.scheduling} are read on every call (R74).
    @ivar _log: the scheduler's logger.
    @ivar _keptBindings: turns whose selection must not rewrite the session
        binding (R-B6), consulted by L{bind}.
    @ivar _localOwners: a bounded local map response id -> (account id,
        client key name, expiry), used when the store misses or fails (R39).
    @ivar _localAffinity: a bounded local map key -> (value, expiry) of
        L{recordValue}.
    """

    _store: IStateStore
    _clock: IReactorTime
    _settings: RuntimeSettings
    _log: Logger
    _keptBindings: WeakKeyDictionary = field(factory=WeakKeyDictionary, init=False)
    _localOwners: OrderedDict = field(factory=OrderedDict, init=False)
    _localAffinity: OrderedDict = field(factory=OrderedDict, init=False)
    _localBindings: OrderedDict = field(factory=OrderedDict, init=False)
    """Session hash -> the account this process last bound it to (bounded):
    the guess of L{guess}."""
    _boundTurns: WeakKeyDictionary = field(factory=WeakKeyDictionary, init=False)
    """Turns whose selection already wrote (or refreshed) their binding to
    the chosen account with the slot held, so L{bind} need not again."""

    def guess(self, sessionHash: str) -> Optional[str]:
        """
        The account this process last bound the session to, or L{None}
        (a guess: the store holds the binding, R38).
        """
        return self._localBindings.get(sessionHash)

    def selected(self, turn: Turn, keep: bool) -> None:
        """
        A selection for C{turn} was made: remember whether it kept the
        session binding (R-B6, read by L{bind}) and forget an earlier
        selection's write.
        """
        if keep:
            self._keptBindings[turn] = True
        elif self._keptBindings.data:
            self._keptBindings.pop(turn, None)
        if self._boundTurns.data:
            # (A weak dictionary's pop builds a weak reference.)
            self._boundTurns.pop(turn, None)

    def written(self, turn: Turn, accountId: str) -> None:
        """
        The selection wrote (or refreshed) C{turn}'s session binding to
        C{accountId} with the slot held: L{bind} need not again.
        """
        self._boundTurns[turn] = accountId
        self.noteBinding(turn.sessionHash, accountId)

    def recordAffinity(self, key: str, account: Account) -> Deferred:
        """
        Remember that C{account} issued a turn-state token (R90) or produced
        a C{compaction} item (R89), with TTL C{previous_response_ttl_seconds},
        in the store and a bounded local map (fail open, R35).

        @param key: an L{affinityKey}.
        @return: Deferred firing with L{None}; store errors are logged.
        """
        return self.recordValue(key, account.id)

    def recordValue(self, key: str, value: str) -> Deferred:
        """
        Keep a short string under C{key} for C{previous_response_ttl_seconds}
        (R39's lifetime), in the store and a bounded local map (fail open,
        R35): an affinity record, or the turn-state token the upstream gave
        a WebSocket session (R90, L{turnStateSessionKey}).

        @return: Deferred firing with L{None}; store errors are logged.
        """
        ttl = self._settings.current.scheduling.previous_response_ttl_seconds
        owners = self._localAffinity
        owners.pop(key, None)
        owners[key] = (value, self._clock.seconds() + ttl)
        while len(owners) > LOCAL_OWNER_CAPACITY:
            owners.popitem(last=False)
        return eagerDeferred(self.write("setValue", key, value, ttl))

    def recallValue(self, key: str) -> Deferred:
        """
        What L{recordValue} kept under C{key}: the store, then the local map.

        @return: Deferred firing with the string, or L{None}.
        """
        return eagerDeferred(self.recalled(key))

    def claimOnce(self, key: str, ttl: float) -> Deferred:
        """
        Whether this is the first claim of C{key} within C{ttl} seconds, in
        every process sharing the store (an atomic counter): a background
        response's usage is counted once, whoever sees it finished first
        (R88). A store error falls back to this process's own memory.

        @return: Deferred firing with L{True} for the first claim.
        """
        return eagerDeferred(self._claimOnce(key, ttl))

    async def _claimOnce(self, key: str, ttl: float) -> bool:
        try:
            return (await self._store.incrementCounter(key, ttl, refresh=False)) == 1
        except Exception as e:  # noqa: BLE001 - R35: fail open, locally
            self._log.error(
                "state store claim failed for {key}: {error}",
                event="openai.sticky_write_failed", op="incrementCounter", key=key,
                error=repr(e),
            )
            first = key not in self._localAffinity
            self._localAffinity[key] = ("", self._clock.seconds() + ttl)
            return first

    def affinityOwner(self, key: str) -> Deferred:
        """
        The account recorded by L{recordAffinity} for C{key}.

        @return: Deferred firing with an account id, or L{None}.
        """
        return eagerDeferred(self.recalled(key))

    def bind(self, turn: Turn, account: Account) -> Deferred:
        """
        Write the session binding after admission (R38), with TTL
        C{sticky_session_ttl_seconds}; a no-op for turns without a session
        hash and for turns whose selection kept the existing binding
        (R-B6).

        @return: Deferred firing with L{None}; store errors are logged.
        """
        if not turn.sessionHash:
            return succeed(None)
        if self._keptBindings.data and self._keptBindings.get(turn):
            return succeed(None)
        if self._boundTurns.data and self._boundTurns.pop(turn, None) == account.id:
            # The selection wrote it with the slot held.
            return succeed(None)
        ttl = self._settings.current.scheduling.sticky_session_ttl_seconds
        self.noteBinding(turn.sessionHash, account.id)
        return eagerDeferred(self.write("setValue", sessionKey(turn.sessionHash), account.id, ttl))

    def unbind(self, turn: Turn) -> Deferred:
        """
        Delete the session binding (rotate transport policy, R72).

        @return: Deferred firing with L{None}; store errors are logged.
        """
        return Deferred.fromCoroutine(self._unbind(turn))

    def recordResponse(self, turn: Turn, responseId: str, account: Account) -> Deferred:
        """
        Remember that C{account} owns C{responseId} (R39) and that the
        turn's client key owns it (R40), both with TTL
        C{previous_response_ttl_seconds}, in the store and the local map;
        and (R104) that the key owns the output items in
        C{turn.outputItemIds}, in the same store operation
        (L{relay.scheduling.itemowners.itemOwnerKey}, the owner record's
        value and TTL).

        @return: Deferred firing with L{None}; store errors are logged.
        """
        if not responseId:
            return succeed(None)
        setValues = getattr(self._store, "setValues", None)
        if setValues is None:
            return eagerDeferred(self._recordResponse(turn, responseId, account))
        # A store with setValues (both built-in ones) gets its one
        # operation straight from here: no coroutine and no await per turn.
        try:
            records, ttl = self._responseRecords(turn, responseId, account)
        except BaseException:  # noqa: BLE001 - delivered as the Deferred's failure
            return fail()
        try:
            d = setValues(records, ttl)
        except Exception as e:  # noqa: BLE001 - logged, never raised (as _write)
            self._writeFailed("setValues", (records, ttl), e)
            return succeed(None)
        if d.called and d.result is None:
            return d

        def failed(f):
            if not isinstance(f.value, Exception):
                return f
            self._writeFailed("setValues", (records, ttl), f.value)
            return None

        return d.addCallbacks(_none, failed)


    async def get(self, key: str) -> Optional[str]:
        """
        Read a key; a store error counts as "no value" (R35, logged by
        L{got}).
        """
        return await self.got(self.read(key), key)

    def read(self, key: str) -> Deferred:
        """
        Start reading a key (see L{got}); a store that raises at once gives
        a failed Deferred.
        """
        try:
            return self._store.getValue(key)
        except Exception:  # noqa: BLE001 - delivered through the Deferred, logged by _got
            return fail()

    async def got(self, d: Deferred, key: str) -> Optional[str]:
        """
        The value a L{read} of C{key} gives; a store error counts as "no
        value" (R35), logged.
        """
        try:
            return await d
        except Exception as e:
            self._log.error(
                "state store read failed for {key}: {error}",
                event="openai.sticky_read_failed", key=key, error=repr(e),
            )
            return None

    def send(self, op: str, *args) -> None:
        """
        Call a store write method without waiting for it; errors are logged
        as L{write} logs them.
        """
        try:
            d = getattr(self._store, op)(*args)
        except Exception:  # noqa: BLE001 - logged by the errback below
            d = fail()

        def _eb(f):
            self._log.error(
                "state store {op} failed for {key}: {error}",
                event="openai.sticky_write_failed", op=op, key=args[0], error=repr(f.value),
            )

        d.addErrback(_eb)

    async def write(self, op: str, *args) -> None:
        """
        Call a store write method; errors are logged, never raised.

        @param op: C{setValue}, C{touchValue} or C{deleteValue}.
        """
        try:
            await getattr(self._store, op)(*args)
        except Exception as e:
            self._writeFailed(op, args, e)

    def _writeFailed(self, op: str, args: tuple, e: Exception) -> None:
        """
        Log a store write that failed (L{write}).
        """
        key = ", ".join(p[0] for p in args[0]) if op == "setValues" else args[0]
        self._log.error(
            "state store {op} failed for {key}: {error}",
            event="openai.sticky_write_failed", op=op, key=key, error=repr(e),
        )

    def noteBinding(self, sessionHash: str, accountId: Optional[str]) -> None:
        """
        Keep (or with L{None}, forget) the local guess of a session's
        binding (L{guess}).
        """
        bindings = self._localBindings
        bindings.pop(sessionHash, None)
        if accountId is not None:
            bindings[sessionHash] = accountId
            while len(bindings) > LOCAL_OWNER_CAPACITY:
                bindings.popitem(last=False)

    async def _unbind(self, turn: Turn) -> None:
        """
        See L{unbind}.
        """
        if turn.sessionHash:
            self.noteBinding(turn.sessionHash, None)
            await self.write("deleteValue", sessionKey(turn.sessionHash))

    async def _recordResponse(self, turn: Turn, responseId: str, account: Account) -> None:
        """
        See L{recordResponse}. Two records: the routing binding (R39, TTL
        C{previous_response_ttl_seconds}) and the owner record (R104: the
        key and the account, JSON, TTL C{response_owner_ttl_seconds}, as
        long as upstream keeps a stored response).
        """
        if not responseId:
            return
        records, ttl = self._responseRecords(turn, responseId, account)
        # Both writes leave at once: a reader in another process
        # must not find the owner without the key (R40) a round trip later.
        if getattr(self._store, "setValues", None) is not None:
            # One operation for both (each with its own TTL).
            await self.write("setValues", records, ttl)
            return
        writes = [
            Deferred.fromCoroutine(self.write("setValue", key, value, t))
            for key, value, t in records
        ]
        for d in writes:
            await d

    def _responseRecords(self, turn: Turn, responseId: str, account: Account) -> tuple:
        """
        Remember the owner locally and build the store records of
        L{_recordResponse}.

        @return: C{(records, ttl)}: C{(key, value, ttl)} triples (the
            routing binding, the owner record, the items' owner records)
            and the routing binding's TTL.
        """
        s = self._settings.current.scheduling
        ttl = s.previous_response_ttl_seconds
        ownerTtl = max(ttl, s.response_owner_ttl_seconds)
        # R104: owned by the key's owner identity (ClientKey.ownerId): a
        # file key's name, an admin key's name with its issuance.
        keyOwner = turn.client.ownerId
        accountId = account.id
        self._remember(responseId, accountId, keyOwner, ownerTtl)
        owner = ownerRecord(keyOwner, accountId)
        bindingKey, ownerKey = responseKeys(responseId)
        records = ((bindingKey, accountId, ttl), (ownerKey, owner, ownerTtl))
        if turn.outputItemIds:
            # R104: its output items belong to the key too (the same record
            # and lifetime, in the same operation: no extra round trip).
            records += tuple((itemOwnerKey(i), owner, ownerTtl) for i in turn.outputItemIds)
        return records, ttl

    def _remember(self, responseId: str, accountId: str, keyName: str, ttl: float) -> None:
        """
        Put a response owner into the bounded local map (R39).
        """
        owners = self._localOwners
        owners.pop(responseId, None)
        owners[responseId] = (accountId, keyName, self._clock.seconds() + ttl)
        while len(owners) > LOCAL_OWNER_CAPACITY:
            owners.popitem(last=False)

    def _local(self, responseId: str) -> Optional[tuple]:
        """
        @return: the live local C{(accountId, keyName)} of a response, or
            L{None}.
        """
        entry = self._live(self._localOwners, responseId)
        return None if entry is None else entry[:2]

    def _live(self, local: OrderedDict, key: str) -> Optional[tuple]:
        """
        The entry of a local map (its expiry last) while it lives; an
        expired one is dropped.
        """
        entry = local.get(key)
        if entry is None:
            return None
        if entry[-1] <= self._clock.seconds():
            del local[key]
            return None
        return entry

    def lookupResponse(self, responseId: str) -> Deferred:
        """
        Who owns a response id (behaviour.md R39, R40, R104): the key that
        created it and the account that served it, from the store's owner
        record (persisted with the store: Redis, or the embedded store),
        else this process's local map.

        The contract with every route that names a response (retrieve,
        delete, cancel, input items, continuations): L{None} means relay
        holds no owner record, and the caller must fail closed (an unknown
        id, C{previous_response_not_found} / 404), never serve it on
        another key's context.

        @param responseId: the response id (C{resp_...}).
        @return: a Deferred firing with L{None} or C{(accountId, keyName)}
            (C{accountId} may be L{None} for a record written before the
            account was kept with it and whose routing binding expired).
            Store errors count as "no record" (fail closed, logged).
        """
        return eagerDeferred(self.findResponse(responseId))

    async def findResponse(self, responseId: str) -> Optional[tuple]:
        if not responseId:
            return None
        raw = await self.get(responseOwnerKey(responseId))
        if raw:
            keyName, accountId = parseOwner(raw)
            if accountId is None:
                accountId = await self.get(responseKey(responseId))
            if keyName:
                return (accountId, keyName)
        return self._local(responseId)

    async def responseOwner(self, responseId: str) -> Optional[str]:
        """
        The account id that owns a response (R39): the routing binding,
        then the owner record (R104), then the local map.
        """
        owner = await self.get(responseKey(responseId))
        if owner:
            return owner
        found = await self.findResponse(responseId)
        return found[0] if found else None

    async def recalled(self, key: str) -> Optional[str]:
        """
        See L{affinityOwner}: the store, then the local map.
        """
        owner = await self.get(key)
        if owner and owner.startswith("{"):
            # R104: an item owner record (relay.scheduling.itemowners)
            # names the account that stored the item.
            owner = parseOwner(owner)[1]
        if owner:
            return owner
        entry = self._live(self._localAffinity, key)
        return None if entry is None else entry[0]

    async def responseKeyName(self, responseId: str) -> Optional[str]:
        """
        The client key name that owns a response (R40), or L{None}.
        """
        found = await self.findResponse(responseId)
        return found[1] if found else None

