# -*- test-case-name: tests.test_modelname -*-
"""
One normalised model name (behaviour.md R110).

A client chooses its model name freely: C{gpt-5.5}, C{GPT-5.5},
C{"gpt-5.5 "}, the dated snapshot C{gpt-5.5-2026-04-23}, or an operator's
alias (an account's C{model_mapping} key). relay reasons about all of them
with one function, L{normalise}, which every consumer uses: key allow- and
deny-lists (L{listed}), account C{models} (L{relay.base.records.Account.servesModel},
which also picks the account set the scheduler's groups hold), the price
table (L{relay.tenants.prices.PriceTable.lookup}) and metric labels
(L{ModelCatalogue.label}).

L{normalise} gives the name relay reasons with: the mapping applied (an
exact key, else a key equal after trimming and lower-casing), trimmed,
lower-cased, and a dated snapshot suffix (C{-YYYY-MM-DD}) folded into its
family when the family is a name relay knows (the C{known} set: the price
table's models, the accounts' C{models} and mappings, or the entries of the
list being matched) and the full snapshot name is not itself known.

The normalised name is for matching only. What goes upstream is the
client's name, or the mapping's value, byte for byte
(L{relay.base.records.Account.upstreamModel}): fine-tune ids
(C{ft:gpt-4o-mini:org::abc}) are case-sensitive.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Callable, Iterable, Mapping, Optional

__all__ = [
    "OTHER",
    "SNAPSHOT",
    "ModelCatalogue",
    "listed",
    "mapped",
    "matchKey",
    "normalise",
]

SNAPSHOT = re.compile(r"-\d{4}-\d{2}-\d{2}\Z")
"""A dated snapshot suffix: C{gpt-4.1-2025-04-14} is a snapshot of
C{gpt-4.1}."""

OTHER = "other"
"""The metric label of a model name relay does not know (R110: labels from
client-chosen names never grow without bound)."""


def matchKey(name: Any) -> Optional[str]:
    """
    A name as relay compares it: trimmed and lower-cased.

    @param name: a model name; anything not a C{str} reads as none.
    @return: the key, or L{None} for a non-string or a blank name.
    """
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    return key or None


def mapped(name: Optional[str], mapping: Optional[Mapping[str, str]]) -> Optional[str]:
    """
    The value C{mapping} gives C{name}: its exact key, else the key equal
    to it once both are trimmed and lower-cased (L{matchKey}); a snapshot
    of a mapped name is not mapped (the client asked for that snapshot).

    @param name: the client's model name, or L{None}.
    @param mapping: requested name -> upstream name (an account's
        C{model_mapping}), or L{None}.
    @return: the mapped upstream name, unaltered, or L{None} when no
        mapping applies.
    """
    if not mapping or not isinstance(name, str):
        return None
    found = mapping.get(name)
    if found is not None:
        return found
    key = matchKey(name)
    if key is None:
        return None
    return _foldedMapping(tuple(mapping.items())).get(key)


@lru_cache(maxsize=1024)
def _foldedMapping(items: tuple) -> dict:
    """
    A mapping keyed by L{matchKey} (the first of keys that fold alike wins).
    """
    folded: dict = {}
    for key, value in items:
        k = matchKey(key)
        if k is not None and k not in folded:
            folded[k] = value
    return folded


@lru_cache(maxsize=1024)
def _keys(names: tuple) -> frozenset:
    """
    The L{matchKey}s of C{names} (a tuple, so it can be cached: account
    C{models}, a key's lists).
    """
    return frozenset(k for k in map(matchKey, names) if k is not None)


def normalise(name: Any, known: Optional[Iterable[str]] = None,
              mapping: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """
    The name relay reasons with (R110; see the module docstring).

    @param name: a client's (or upstream) model name.
    @param known: the names relay knows, as L{matchKey}s (a set or
        frozenset is used as is; other iterables are folded first), or
        L{None}: no snapshot is folded.
    @param mapping: an account's C{model_mapping} to apply first, or
        L{None}.
    @return: a trimmed, lower-cased name; L{None} for a blank or
        non-string name.
    """
    target = mapped(name, mapping) if mapping else None
    key = matchKey(name if target is None else target)
    if key is None or known is None:
        return key
    if not isinstance(known, (set, frozenset)):
        known = _keys(tuple(known))
    if key in known:
        return key
    family = SNAPSHOT.sub("", key)
    if family != key and family in known:
        return family
    return key


def listed(name: Any, names: Optional[Iterable[str]]) -> bool:
    """
    Whether C{name} is one of C{names} as R110 matches lists: the entry
    itself or, for a dated snapshot, its family, in any case and with any
    surrounding blanks (denying C{gpt-5.5} denies C{GPT-5.5},
    C{"gpt-5.5 "} and C{gpt-5.5-2026-04-23}; allowing it allows them). An
    entry that is itself a snapshot matches only that snapshot.

    @param name: a model name (a client's, or an account's mapped one).
    @param names: a list's entries (a key's C{models} or C{deny_models},
        an account's C{models}), or L{None} (matches nothing).
    """
    if not names:
        return False
    known = _keys(tuple(names))
    key = normalise(name, known)
    return key is not None and key in known


CANONICAL_MEMO = 1024
"""How many client model names L{ModelCatalogue.canonical} remembers (then
it forgets them all and starts again: bounded whatever clients send)."""


class ModelCatalogue:
    """
    The model names relay knows (R110): the price table's models and every
    account's C{models}, C{model_mapping} keys and values. A name
    normalises into this set to be priced, served or labelled.

    @ivar prices: the L{relay.tenants.prices.PriceTable}, or L{None}.
    @ivar accounts: returns the configured accounts (read per call, so a
        reload or an account added through the admin API applies at once).
    """

    def __init__(self, accounts: Callable[[], Iterable[Any]], prices: Any = None):
        self.accounts = accounts
        self.prices = prices
        self._cache: tuple = (None, None, frozenset())
        self._canonical: tuple = (None, {})

    def known(self) -> frozenset:
        """
        @return: the known names as L{matchKey}s (rebuilt when the
            accounts or the prices change).
        """
        accounts = tuple(self.accounts())
        table = self.prices.names() if self.prices is not None else ()
        accountsSeen, tableSeen, names = self._cache
        if (accountsSeen is accounts or accountsSeen == accounts) and tableSeen is table:
            return names
        found = set(table)
        for account in accounts:
            found.update(getattr(account, "models", None) or ())
            mapping = getattr(account, "model_mapping", None) or {}
            found.update(mapping)
            found.update(mapping.values())
        names = _keys(tuple(sorted(n for n in found if isinstance(n, str))))
        self._cache = (accounts, table, names)
        return names

    def canonical(self, name: Any) -> Optional[str]:
        """
        @return: L{normalise}'s name when relay knows it, else L{None}.
            Remembered per name for one known set (L{known} returns a new
            object when it changes, which starts afresh), at most
            L{CANONICAL_MEMO} names.
        """
        known = self.known()
        seen, memo = self._canonical
        if seen is not known:
            memo = {}
            self._canonical = (known, memo)
        elif type(name) is str:
            found = memo.get(name, memo)
            if found is not memo:
                return found
        key = normalise(name, known)
        found = key if key in known else None
        if type(name) is str:
            if len(memo) >= CANONICAL_MEMO:
                memo.clear()
            memo[name] = found
        return found

    def label(self, name: Any) -> str:
        """
        The metric label of a model name: its known normalised name, else
        L{OTHER} (a bounded set whatever clients send).
        """
        return self.canonical(name) or OTHER
