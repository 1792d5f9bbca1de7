# -*- test-case-name: tests.test_oauth -*-
"""
L{_Slot}: one OAuth account's token state in this process, as
L{relay.oauth.credentials.OAuthCredentials} and its collaborators
(L{relay.oauth.records}, L{relay.oauth.refresher}) keep it.
"""

from __future__ import annotations

from typing import Any, Optional

from attrs import define

from relay.base.records import Account
from relay.oauth.tokens import TokenRecord

_CHANGES = [0]
"""Bumped by every change of a L{_Slot} (and of the slot set), so
L{CredentialManager.flagged} knows when its answer may have changed."""


def _touched(instance, attribute, value):
    """
    attrs C{on_setattr}: note that a slot changed.
    """
    _CHANGES[0] += 1
    return value


@define(eq=False, on_setattr=_touched)
class _Slot:
    """
    One OAuth account's token state in this process.

    @ivar account: the configured account.
    @ivar seed: the fingerprint of its configured tokens.
    @ivar record: the newest known L{TokenRecord}, or L{None} before start.
    @ivar dial: the account to dial (C{credential} = access token).
    @ivar waiters: callers waiting on the running refresh, or L{None} when
        none runs.
    @ivar timer: the proactive refresh call.
    @ivar invalidated: the current access token got a 401 after a refresh.
    @ivar pending: new tokens whose write failed (not used until written).
    @ivar nextAttempt: no automatic refresh before this (backoff), seconds.
    @ivar refreshes: successful refreshes by this process.
    @ivar refreshFailures: token requests of this process that failed
        (transient, permanent or in doubt), for
        C{relay_oauth_refresh_failures_total}.
    @ivar doubtTimer: the call at the in-doubt access token's expiry, which
        logs C{relay.oauth_needs_login}; L{None} when none is planned.
    @ivar doubtKey: the (access token, expiry) C{doubtTimer} is for.
    @ivar doubtAnnounced: the (access token, expiry) whose expiry was
        already logged (once per in-doubt token).
    @ivar loading: a L{relay.oauth.records.TokenRecords.load} of this slot runs (a
        periodic sync does not start a second one beside it).
    """

    account: Account
    seed: str
    record: Optional[TokenRecord] = None
    dial: Optional[Account] = None
    waiters: Optional[list] = None
    timer: Any = None
    invalidated: bool = False
    pending: Optional[TokenRecord] = None
    pendingCall: Any = None
    nextAttempt: float = 0.0
    refreshes: int = 0
    refreshFailures: int = 0
    doubtTimer: Any = None
    doubtKey: Any = None
    doubtAnnounced: Any = None
    loading: bool = False
