# -*- test-case-name: tests.test_requests -*-
"""
Compaction kept intact (behaviour.md R87, R89; protocol.md 2.8).

A compaction turn is a Responses turn whose last input item is
C{{"type": "compaction_trigger"}}; it answers one C{compaction} item whose
C{encrypted_content} only the producing account can open. relay:

  - passes a trigger upstream only as the last item of its turn (the
    transcripts relay keeps drop used triggers, L{relay.entry.ws});
  - notes which account produced each compaction item (L{CompactionWatch},
    L{recordCompaction}), so a later turn carrying it goes there
    (L{compactionKeys}, the scheduler's affinity layer), and never drops
    one to make a turn fit another account (R7 strips encrypted reasoning
    only);
  - serves C{POST /v1/responses/compact} on an OAuth account, whose backend
    retired that path, as the equivalent compaction turn
    (L{oauthCompactAttempt}), answered in the compact shape
    (L{CompactSink}).
"""

from __future__ import annotations

import json
from itertools import compress, repeat

from twisted.logger import Logger

from relay.engine.httpattempt import attemptHTTP
from relay.engine.pump import AttemptResult
from relay.base.records import ClientError, Turn
from relay.scheduling.itemowners import storedReference
from relay.translate.assemble import ResponseAssembler

_log = Logger()

COMPACTION_TRIGGER = "compaction_trigger"
"""The input item that asks for a compaction turn (protocol.md 2.8)."""

_ITEM_DONE = b"response.output_item.done"


def endsWithTrigger(body: dict) -> bool:
    """
    Whether a Responses body is a compaction turn: its last input item is
    C{{"type": "compaction_trigger"}} (protocol.md 2.8, R89).
    """
    items = body.get("input")
    if not isinstance(items, list) or not items:
        return False
    last = items[-1]
    return isinstance(last, dict) and last.get("type") == COMPACTION_TRIGGER


_dictGet = dict.get

_NAMED = frozenset({"compaction", COMPACTION_TRIGGER})
"""The item types L{inputFacts} reads without C{references}."""

_READ = _NAMED | {"reasoning", "item_reference", None}
"""The item types L{inputFacts} reads with C{references} (L{None}: no
C{type}, an easy message or an item named by its id alone)."""


def inputFacts(items, references: list | None = None) -> tuple:
    """
    One pass over a turn's input for R89: the affinity keys of its
    C{compaction} items (L{compactionKeys}) and whether a
    C{compaction_trigger} sits anywhere but last (a used one the client
    replayed; upstream refuses it there).

    @param references: when a list, the ids of the stored items the input
        names (R104, L{relay.scheduling.itemowners.storedReference}) are
        appended to it, in the same pass.
    @return: C{(keys, misplaced)}.
    """
    if type(items) is not list:
        return (), False
    # Most items are messages, calls and their outputs, which no rule here
    # reads: their types are read and matched in C (a Codex history's
    # hundreds of items), and only the others are looked at below. An item
    # that is not a dict, or a type that is not hashable, takes the walk
    # over every item.
    try:
        kinds = list(map(_dictGet, items, repeat("type")))
        wanted = _NAMED if references is None else _READ
        at = list(compress(range(len(kinds)), map(wanted.__contains__, kinds)))
    except TypeError:
        at = range(len(items))
        kinds = None
    if not at:
        return (), False
    from relay.scheduling.scheduler import affinityKey

    keys = ()
    misplaced = False
    last = len(items) - 1
    for index in at:
        item = items[index]
        if type(item) is not dict:
            continue
        kind = item.get("type") if kinds is None else kinds[index]
        if kind == "reasoning" and item.get("encrypted_content"):
            continue  # carries itself: names no stored item (storedReference)
        if kind == "compaction":
            content = item.get("encrypted_content")
            if isinstance(content, str) and content:
                keys += (("compaction", affinityKey("compaction", content)),)
        elif kind == COMPACTION_TRIGGER and index != last:
            misplaced = True
        elif references is not None and (
                kind == "reasoning" or kind == "item_reference" or kind is None):
            ref = storedReference(item, kind)
            if ref is not None:
                references.append(ref)
    return keys, misplaced


def withoutUsedTriggers(items: list) -> list:
    """
    R89: the input with every C{compaction_trigger} but a last one removed
    (a trigger passes upstream only as the last item of its turn).
    """
    last = len(items) - 1
    return [item for index, item in enumerate(items)
            if not (type(item) is dict and item.get("type") == COMPACTION_TRIGGER
                    and index != last)]


def compactionKeys(items) -> tuple:
    """
    R89: the affinity keys of the C{compaction} items a turn carries (the
    account that produced one can open it; another answers
    C{invalid_encrypted_content}).

    @param items: the turn's input items.
    @return: C{(("compaction", store key), ...)} for
        C{Turn.affinity}.
    """
    from relay.scheduling.scheduler import affinityKey

    if type(items) is not list:
        return ()
    out = ()
    for item in items:
        if type(item) is dict and item.get("type") == "compaction":
            content = item.get("encrypted_content")
            if isinstance(content, str) and content:
                out += (("compaction", affinityKey("compaction", content)),)
    return out


class CompactionWatch:
    """
    A sink in front of a compaction turn's sink: it sees every event (the
    raw pass-through is off for these few-event turns) and keeps the
    C{compaction} items of the answer, whatever the wire (SSE, WebSocket
    frames, a JSON body), for L{recordCompaction}. Everything else is the
    inner sink's.
    """

    def __init__(self, inner, items: list):
        self._inner = inner
        self._items = items

    def __getattr__(self, name):
        if name == "writeRaw":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def _keep(self, item) -> None:
        if isinstance(item, dict) and item.get("type") == "compaction":
            if item.get("encrypted_content") and item not in self._items:
                self._items.append(item)

    def writeEvent(self, event) -> None:
        if event.type == _ITEM_DONE or event.terminal:
            data = event.json() if event.type != b"[DONE]" else {}
            self._keep(data.get("item"))
            response = data.get("response")
            if isinstance(response, dict):
                for item in response.get("output") or []:
                    self._keep(item)
        self._inner.writeEvent(event)

    def writeBody(self, status, headers, body) -> None:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            for item in parsed.get("output") or []:
                self._keep(item)
        self._inner.writeBody(status, headers, body)


def recordCompaction(runner, turn: Turn, account) -> None:
    """
    R89: remember that C{account} produced the compaction items of C{turn}
    (in the local map at once, the store write on its way), so the turn
    that carries one next goes back to it.
    """
    from relay.scheduling.scheduler import affinityKey

    for item in turn.compactionItems or ():
        key = affinityKey("compaction", item["encrypted_content"])
        runner.scheduler.recordAffinity(key, account).addErrback(
            lambda f: _log.failure("recording a compaction owner failed", f,
                                   request_id=turn.requestId)
        )


def compactionTurnBody(body: dict) -> dict:
    """
    R87: the compaction turn an OAuth account runs for a compact request:
    the request's input plus a trailing C{compaction_trigger}, streamed,
    C{store: false} (the ChatGPT backend refuses anything else).
    """
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": items}]}]
    items = [i for i in (items if isinstance(items, list) else [])
             if not (isinstance(i, dict) and i.get("type") == COMPACTION_TRIGGER)]
    out = {k: v for k, v in body.items() if k not in ("input", "stream", "store", "background")}
    out.update(input=[*items, {"type": COMPACTION_TRIGGER}], stream=True, store=False)
    return out


class CompactSink:
    """
    Answers a compact request from the compaction turn an OAuth account ran
    (R87): the turn's events are collected (nothing reaches the client
    before the end, so a failure before it may fail over); at the terminal
    event the client gets the compact shape, C{{"id", "object":
    "response.compaction", "created_at", "output": [the user messages of
    the input..., the compaction item], "usage"}}.

    @ivar holdsOutput: like the JSON sink, it writes nothing before the end.
    """

    holdsOutput = True

    def __init__(self, inner, request: dict):
        self._inner = inner
        self._request = request
        self._assembler = ResponseAssembler()
        self.committed = False

    def __getattr__(self, name):
        if name == "writeRaw":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def keepalive(self) -> None:
        """
        A non-streaming client gets no keepalive (R31).
        """

    def commit(self, headers) -> None:
        self.committed = True
        self._headers = dict(headers or {})

    def writeEvent(self, event) -> None:
        if event.type == _ITEM_DONE:
            self._assembler.add(event.json())
            return
        if not event.terminal or event.type == b"[DONE]":
            return
        response = event.json().get("response")
        response = self._assembler.complete(response) if isinstance(response, dict) else {}
        if event.type != b"response.completed":
            error = response.get("error") if isinstance(response.get("error"), dict) else {}
            self._inner.fail(ClientError(
                502, "upstream_error",
                str(error.get("message") or "The compaction turn did not complete"),
                code=error.get("code"),
            ))
            return
        compaction = [i for i in response.get("output") or []
                      if isinstance(i, dict) and i.get("type") == "compaction"]
        if len(compaction) != 1:
            self._inner.fail(ClientError(
                502, "upstream_error",
                f"The upstream compaction turn returned {len(compaction)} compaction items"
                " instead of one",
            ))
            return
        self._inner.writeBody(200, getattr(self, "_headers", {}),
                              json.dumps(compactShape(self._request, response)).encode())

    def writeBody(self, status, headers, body) -> None:
        self._inner.writeBody(status, headers, body)

    def fail(self, error) -> None:
        self._inner.fail(error)

    def finish(self) -> None:
        self._inner.finish()


def compactShape(request: dict, response: dict) -> dict:
    """
    The C{POST /v1/responses/compact} answer built from a compaction turn's
    final response (protocol.md 1): the user messages of the request's
    input, then the one compaction item; the turn's id, time and usage.
    """
    items = request.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": items}]}]
    users = [i for i in (items if isinstance(items, list) else [])
             if isinstance(i, dict) and i.get("type", "message") == "message"
             and i.get("role") == "user"]
    compaction = [i for i in response.get("output") or []
                  if isinstance(i, dict) and i.get("type") == "compaction"]
    return {
        "id": response.get("id"),
        "object": "response.compaction",
        "created_at": response.get("created_at"),
        "output": [*users, *compaction],
        "usage": response.get("usage"),
    }


async def oauthCompactAttempt(runner, turn: Turn, sink, account, release) -> AttemptResult:
    """
    R87: C{compact} on an OAuth account, whose backend retired
    C{/responses/compact}: the compaction turn (L{compactionTurnBody}) on
    its C{/responses}, through the engine's own HTTP attempt (so its
    staging, R23 classification and usage are the same as any turn's), the
    client answered in the compact shape by L{CompactSink}.
    """
    from attrs import evolve

    compaction = evolve(turn, body=compactionTurnBody(turn.body), stream=False, request=None,
                        background=False)
    compaction.usage = None
    wrapped = CompactSink(sink, turn.body)
    try:
        return await attemptHTTP(runner, compaction, wrapped, account, release)
    finally:
        if turn.usage is None:
            turn.usage = compaction.usage
        turn.upstreamRequestId = compaction.upstreamRequestId
        if turn.firstOutputAt is None:
            turn.firstOutputAt = compaction.firstOutputAt


__all__ = [
    "CompactSink", "CompactionWatch", "compactShape", "compactionKeys", "compactionTurnBody",
    "endsWithTrigger", "inputFacts", "oauthCompactAttempt", "recordCompaction",
    "withoutUsedTriggers",
]
