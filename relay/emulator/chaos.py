# -*- test-case-name: tests.test_emulator_chaos -*-
"""
Seeded random faults and the per-turn generation ledger: the emulator's chaos mode, for
rehearsing a gateway under every fault kind at once (relay's chaos soak uses it; operators can
too, from C{etc/emulator.yaml} or live through the control API).

Chaos configuration (the C{chaos:} key of the emulator configuration, or the body of
C{PUT /_emulator/chaos}; C{null} or C{DELETE} turns it off)::

    chaos:
      seed: 7                 # any integer; the same seed gives the same faults
      rate: 0.3               # share of requests (and of WebSocket turns) that get a fault
      handshake_rate: 0.05    # share of WebSocket upgrades that get a ws_handshake_* fault
      accounts: [a1, o1]      # optional: only these account names (default: every account)
      faults:                 # weighted choices, each a fault object of the usual format
        - {weight: 3, kind: status, preset: unavailable}
        - {weight: 1, kind: status, preset: usage_limit, resets_in_seconds: 5}
        - {weight: 1, kind: reset_before_headers}
        - {weight: 1, kind: hang_before_headers}
        - {weight: 1, kind: cut_after_events, events: 4}
        - {weight: 1, kind: delay_first_output, seconds: 1.5}
        - {weight: 1, kind: end_after_events, events: 3}
        - {weight: 1, kind: ws_handshake_status, code: 503, transport: ws}

A fault scripted for an account (C{fault:}, C{PUT /_emulator/faults/...}) always wins; chaos
only decides requests that no scripted fault applies to. C{times} has no meaning here and is
refused. Choices that do not apply to the stage (a C{ws_handshake_*} kind for a request, a
C{transport: ws} fault for HTTP) are left out of the draw for that stage.

Determinism: the draw for a request is a function of the seed, the request's I{turn key}
(see L{turnKey}), how many requests with that key came before it, and the stage -- never of
arrival order or timing. So a client that tags its turns gets the same faults on every run,
however the requests of many clients interleave. Requests without a key draw from a
per-process sequence (deterministic only when they arrive in the same order).

The turn ledger (C{GET /_emulator/turns}, C{DELETE} forgets it) lists per turn key every
request (time, account name, transport) and every I{generation}: an answer the emulator
delivered whole to a connection that was still open -- a Responses stream or WebSocket turn
that sent C{response.completed} or C{response.incomplete}, a chat stream that sent its final
chunk and C{[DONE]}, a non-stream 200 body. Failed, cut, cleanly-ended-without-terminal and
C{stream_error} answers, prewarms (C{generate: false}) and answers whose client left first are
not generations. A gateway that generates one client turn twice shows two.

C{GET /_emulator/generations} lists every generation with the usage the answer reported
(L{TurnLedger.usage}), so a test can check that a gateway counted every token the emulator
generated (behaviour.md R107).
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from typing import Any

from attrs import define, field, frozen

from relay.emulator.state import ANY, HANDSHAKE_KINDS, Fault, parseFault

CHAOS_KEYS = frozenset({"seed", "rate", "handshake_rate", "accounts", "faults"})
"""The keys a chaos configuration may have."""

LEDGER_MAX_TURNS = 200_000
"""The most turn keys the ledger keeps; the oldest are forgotten first."""

LEDGER_MAX_GENERATIONS = 200_000
"""The most generations L{TurnLedger.usage} lists; the oldest are forgotten first."""


def generationUsage(final: Any) -> dict:
    """
    The usage of one generation, from the answer it delivered: a Responses C{response}
    object (protocol.md 2.7) or a C{chat.completion} (protocol.md 3).

    @param final: the response or completion object, or L{None}.
    @return: C{{"response_id", "model", "input_tokens", "cached_tokens", "output_tokens",
        "reasoning_tokens"}}; the counts are 0 when the answer carried no usage.
    """
    final = final if isinstance(final, dict) else {}
    usage = final.get("usage") if isinstance(final.get("usage"), dict) else {}
    chat = "prompt_tokens" in usage
    inputDetails = usage.get("prompt_tokens_details" if chat else "input_tokens_details")
    outputDetails = usage.get(
        "completion_tokens_details" if chat else "output_tokens_details")
    inputDetails = inputDetails if isinstance(inputDetails, dict) else {}
    outputDetails = outputDetails if isinstance(outputDetails, dict) else {}
    return {
        "response_id": final.get("id"),
        "model": final.get("model"),
        "input_tokens": int(usage.get("prompt_tokens" if chat else "input_tokens") or 0),
        "cached_tokens": int(inputDetails.get("cached_tokens") or 0),
        "output_tokens": int(usage.get("completion_tokens" if chat else "output_tokens") or 0),
        "reasoning_tokens": int(outputDetails.get("reasoning_tokens") or 0),
    }

CLIENT_REQUEST_ID = "x-client-request-id"
"""The header a gateway names its turn in (relay sends the turn's request id in it)."""


def turnKey(body: Any, headers: dict | None = None) -> str | None:
    """
    The client turn a request belongs to: the body's C{client_metadata.turn_id} (Codex's
    turn metadata, protocol.md 4.2) when it is a non-empty string, else the
    C{x-client-request-id} header when C{headers} are given.

    @param body: the parsed JSON body or WebSocket frame.
    @param headers: the request's lower-cased headers, or L{None} for a WebSocket frame (the
        upgrade's headers name the connection, not the turn).
    @return: the key, or L{None}.
    """
    if isinstance(body, dict):
        metadata = body.get("client_metadata")
        if isinstance(metadata, dict):
            turnId = metadata.get("turn_id")
            if isinstance(turnId, str) and turnId:
                return turnId
    if headers is not None:
        value = headers.get(CLIENT_REQUEST_ID)
        if isinstance(value, str) and value:
            return value
    return None


def _rate(spec: dict, key: str) -> float:
    """
    Read a probability.

    @raise ValueError: when it is not a number in [0, 1].
    """
    value = spec.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"chaos.{key} must be a number from 0 to 1")
    return float(value)


@frozen
class ChaosPlan:
    """
    A parsed chaos configuration (see the module docstring).

    @ivar seed: the seed.
    @ivar rate: the fault probability of a request or WebSocket turn.
    @ivar handshakeRate: the fault probability of a WebSocket upgrade.
    @ivar accounts: account names chaos applies to, or L{None} for every account.
    @ivar choices: C{(weight, fault spec)} pairs; specs are re-parsed at draw time so
        presets see the current time.
    """

    seed: int
    rate: float
    handshakeRate: float
    accounts: frozenset | None
    choices: tuple

    @classmethod
    def parse(cls, spec: Any) -> ChaosPlan | None:
        """
        Parse and validate a chaos configuration.

        @param spec: the JSON/YAML value, or L{None} (no chaos).
        @return: the plan, or L{None}.
        @raise ValueError: naming the bad key.
        """
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise ValueError("chaos must be a mapping")
        unknown = set(spec) - CHAOS_KEYS
        if unknown:
            raise ValueError(f"chaos: unknown keys {sorted(unknown)}")
        seed = spec.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError("chaos.seed must be an integer")
        accounts = spec.get("accounts")
        if accounts is not None and (
            not isinstance(accounts, list) or not all(isinstance(a, str) for a in accounts)
        ):
            raise ValueError("chaos.accounts must be a list of account names")
        faults = spec.get("faults") or []
        if not isinstance(faults, list):
            raise ValueError("chaos.faults must be a list")
        choices = []
        for index, entry in enumerate(faults):
            if not isinstance(entry, dict):
                raise ValueError(f"chaos.faults[{index}] must be a mapping")
            entry = dict(entry)
            weight = entry.pop("weight", 1)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
                raise ValueError(f"chaos.faults[{index}].weight must be a positive number")
            if "times" in entry:
                raise ValueError(f"chaos.faults[{index}]: times has no meaning in chaos")
            try:
                parseFault(entry)
            except ValueError as e:
                raise ValueError(f"chaos.faults[{index}]: {e}") from e
            choices.append((float(weight), entry))
        return cls(
            seed=seed,
            rate=_rate(spec, "rate"),
            handshakeRate=_rate(spec, "handshake_rate"),
            accounts=frozenset(accounts) if accounts is not None else None,
            choices=tuple(choices),
        )

    def toJSON(self) -> dict:
        """
        The plan in its configuration format.
        """
        return {
            "seed": self.seed,
            "rate": self.rate,
            "handshake_rate": self.handshakeRate,
            "accounts": sorted(self.accounts) if self.accounts is not None else None,
            "faults": [dict(spec, weight=weight) for weight, spec in self.choices],
        }

    def pick(self, name: str, key: str, attempt: int, transport: str, handshake: bool,
             now: float) -> Fault | None:
        """
        Draw the fault of one request, deterministically.

        @param name: the account's name.
        @param key: the turn key (or a sequence key for requests without one).
        @param attempt: how many requests with C{key} came before this one.
        @param transport: C{"http"} or C{"ws"}.
        @param handshake: whether this is a WebSocket upgrade.
        @param now: Unix seconds, for presets.
        @return: the fault, or L{None}.
        """
        if self.accounts is not None and name not in self.accounts:
            return None
        stage = "handshake" if handshake else "turn"
        rng = random.Random(f"{self.seed}|{key}|{attempt}|{stage}")
        if rng.random() >= (self.handshakeRate if handshake else self.rate):
            return None
        eligible = []
        for weight, spec in self.choices:
            kind = spec.get("kind") or "status"
            if (kind in HANDSHAKE_KINDS) != handshake:
                continue
            if not handshake and spec.get("transport", ANY) not in (ANY, transport):
                continue
            eligible.append((weight, spec))
        if not eligible:
            return None
        point = rng.random() * sum(weight for weight, _ in eligible)
        for weight, spec in eligible:
            point -= weight
            if point < 0:
                return parseFault(spec, now)
        return parseFault(eligible[-1][1], now)


@frozen
class TurnDraw:
    """
    What the emulator knows of one request's turn, for chaos and the ledger.

    @ivar key: the turn key (L{turnKey}), or L{None}.
    @ivar drawKey: the key chaos draws with: C{key}, or a sequence key without one.
    @ivar attempt: how many requests with C{drawKey} came before this one.
    """

    key: str | None
    drawKey: str
    attempt: int


@define(eq=False)
class TurnLedger:
    """
    Requests and generations per turn key (see the module docstring). Bounded by
    L{LEDGER_MAX_TURNS}.

    @ivar turns: key -> C{{"requests": [[time, name, transport]], "generations":
        [[time, name]]}}, oldest key first.
    @ivar total: every generation, with or without a turn key (never forgotten by the bound).
    @ivar byAccount: account name -> its generations, with or without a turn key.
    @ivar usage: every generation, oldest first (at most L{LEDGER_MAX_GENERATIONS}):
        L{generationUsage} plus C{time} (Unix seconds) and C{account} (the account's name).
    """

    turns: OrderedDict = field(factory=OrderedDict)
    total: int = 0
    byAccount: dict = field(factory=dict)
    usage: deque = field(factory=lambda: deque(maxlen=LEDGER_MAX_GENERATIONS))
    _sequence: int = 0

    def _next(self) -> TurnDraw:
        """
        A draw for a request without a turn key.
        """
        self._sequence += 1
        return TurnDraw(None, f"#{self._sequence}", 0)

    def arrived(self, key: str | None, name: str, transport: str, now: float) -> TurnDraw:
        """
        Note one request (or WebSocket turn) of a turn.

        @param key: the turn key, or L{None} (not recorded).
        @param name: the account's name.
        @param transport: C{"http"} or C{"ws"}.
        @param now: Unix seconds.
        @return: the request's L{TurnDraw}.
        """
        if key is None:
            return self._next()
        entry = self.turns.get(key)
        if entry is None:
            entry = self.turns[key] = {"requests": [], "generations": []}
            while len(self.turns) > LEDGER_MAX_TURNS:
                self.turns.popitem(last=False)
        entry["requests"].append([now, name, transport])
        return TurnDraw(key, key, len(entry["requests"]) - 1)

    def handshake(self, key: str | None) -> TurnDraw:
        """
        The draw of a WebSocket upgrade (not recorded as a request of the turn).

        @param key: the upgrade's C{x-client-request-id}, or L{None}.
        """
        if key is None:
            return self._next()
        entry = self.turns.get(key)
        return TurnDraw(None, key, len(entry["requests"]) if entry is not None else 0)

    def generated(self, draw: TurnDraw | None, name: str, now: float,
                  final: Any = None) -> None:
        """
        Note one generation (in the turn's entry only with a turn key).

        @param draw: the request's L{TurnDraw}.
        @param name: the account's name.
        @param now: Unix seconds.
        @param final: the response or completion object delivered (its usage is listed in
            L{usage}), or L{None}.
        """
        self.total += 1
        self.byAccount[name] = self.byAccount.get(name, 0) + 1
        self.usage.append(dict(generationUsage(final), time=now, account=name))
        if draw is None or draw.key is None:
            return
        entry = self.turns.get(draw.key)
        if entry is not None:
            entry["generations"].append([now, name])

    def clear(self) -> None:
        """
        Forget every turn.
        """
        self.turns.clear()
        self._sequence = 0
        self.total = 0
        self.byAccount.clear()
        self.usage.clear()

    def toJSON(self) -> dict:
        """
        The ledger as JSON: C{{key: {"requests": [...], "generations": [...]}}}.
        """
        return dict(self.turns)
