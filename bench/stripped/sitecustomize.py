"""
relay with its records switched off, for C{bench/ceiling.py} only: not a
product change and never on a relay that serves anyone.

Put this directory after relay's source tree on C{PYTHONPATH}; as relay's
modules are imported, it replaces with no-ops:

  - stage 1 (C{RELAY_STRIPPED=1}): the info log lines (the decision line,
    C{relay.turn_finished}, the access line), the Prometheus updates of a
    turn, the usage ledger, the account history and the request log: every
    record an operator reads;
  - stage 2 (C{RELAY_STRIPPED=2}): stage 1 and the response owner records
    (R39, R40, R104): a C{previous_response_id} no longer finds its account.

What stays is the turn itself: the key, its policy, the body, account
selection, slot admission, the upstream request and answer, the attempt's
end and the account's state (R86). A stripped relay's CPU per turn is
therefore an upper bound on what any redesign of the records could win.
"""

import builtins
import os
import sys

STAGE = int(os.environ.get("RELAY_STRIPPED", "1"))


def _nothing(*args, **kwargs):
    return None


def _notOwned(*args, **kwargs):
    return False


def _recorded(*args, **kwargs):
    from twisted.internet.defer import succeed

    return succeed(None)


def _setAll(cls, names, value) -> None:
    for name in names:
        getattr(cls, name)  # an AttributeError: the module is not complete yet
        setattr(cls, name, value)


PATCHES = {
    "relay.base.logs": lambda m: _setAll(m._LeanLogger, ["info"], _nothing),
    "relay.process.app": lambda m: _setAll(m._Site, ["log"], _nothing),
    "relay.console.metrics": lambda m: _setAll(m.RelayMetrics, [
        "turnFinished", "requestFinished", "firstOutput", "upstreamStatus", "addedLatency",
        "tokens", "waitFinished"], _nothing),
    "relay.usage.ledger": lambda m: _setAll(m.UsageLedger, ["record"], _nothing),
    "relay.console.history": lambda m: _setAll(m.AccountHistory, [
        "attempt", "firstOutput", "failover"], _nothing),
    "relay.tenants.requestlog": lambda m: [
        _setAll(c, ["add"], _nothing) for c in (m._Buffered, m.MemoryRequestLog)],
}
if STAGE >= 2:
    PATCHES["relay.engine.runner"] = lambda m: _setAll(m.TurnRunner, ["ownResponse"], _notOwned)
    PATCHES["relay.scheduling.scheduler"] = lambda m: _setAll(
        m.AccountScheduler, ["recordResponse"], _recorded)

_import = builtins.__import__
_patched = set()


def _importing(name, *args, **kwargs):
    module = _import(name, *args, **kwargs)
    for target, patch in PATCHES.items():
        if target not in _patched and target in sys.modules:
            try:
                patch(sys.modules[target])
            except AttributeError:
                continue
            _patched.add(target)
    if len(_patched) == len(PATCHES):
        builtins.__import__ = _import  # every import after start-up costs nothing more
        sys.stderr.write(f"bench/stripped: relay's records off (stage {STAGE})\n")
    return module


builtins.__import__ = _importing


def _report() -> None:
    missed = sorted(set(PATCHES) - _patched)
    if missed:
        sys.stderr.write(f"bench/stripped: not switched off: {', '.join(missed)}\n")


import atexit  # noqa: E402

atexit.register(_report)
