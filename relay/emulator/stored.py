# -*- test-case-name: tests.test_emulator_responsesapi -*-
"""
Stored and background responses (the API-key route only; the ChatGPT backend stores nothing):
what C{GET}/C{DELETE /v1/responses/{id}}, C{GET …/{id}/input_items} and
C{POST …/{id}/cancel} answer, and the background run behind C{background: true}
(protocol.md 1; behaviour.md R87, R88).

A background response is created C{queued} and answered at once; its events
(C{response.created}, C{response.queued}, then the planned turn) then happen on the emulator's
clock (the script's C{delay} between events), so a client that polls
sees C{queued}, C{in_progress}, then the terminal status. C{GET …?stream=true&starting_after=N}
replays the events after sequence number C{N} and follows the run live to its end. A cancel
stops the run: the status becomes C{cancelled} and live streams end with C{response.cancelled}.
The run finishing whole is a generation (L{relay.emulator.chaos}); retrieving, streaming,
listing, cancelling and deleting never are.

The items of the stored responses (input and output) are indexed by id: a turn's input item
given by id only (L{namedById}) is resolved from its account's stored items
(L{ResponseStore.resolve}), else answered as the API answers an unknown item
(L{unknownItemError}, 404).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from attrs import define, field

from relay.emulator.state import newId, responseObject

MAX_STORED = 10_000
"""The most stored responses kept; the oldest are forgotten first."""

ACTIVE = ("queued", "in_progress")
"""The statuses of a background response that is still running."""


def inputItemsWithIds(items: list) -> list:
    """
    The input items as C{GET …/input_items} lists them: each with an C{id} (messages get
    C{msg_…}, other items keep theirs or get one), messages with C{status: completed}.

    @param items: the normalised input items of the request.
    @return: new item dicts.
    """
    out = []
    for item in items:
        if not isinstance(item, dict):
            continue
        item = dict(item)
        kind = item.get("type") or ("message" if "role" in item else "item")
        item.setdefault("type", kind)
        if kind == "message":
            item.setdefault("status", "completed")
            content = item.get("content")
            if isinstance(content, str):
                item["content"] = [{"type": "input_text", "text": content}]
        item.setdefault("id", newId("msg" if kind == "message" else "item"))
        out.append(item)
    return out


@define(eq=False)
class StoredResponse:
    """
    One stored response.

    @ivar responseId: its C{resp_…} id.
    @ivar credential: the owning account's bearer (only it may read it).
    @ivar body: the create request's body.
    @ivar inputItems: the input items, with ids (L{inputItemsWithIds}).
    @ivar events: the planned events, with sequence numbers, ending with the terminal one.
    @ivar final: the response object once the run ends (or was planned to end).
    @ivar background: created with C{background: true}.
    @ivar status: C{queued}, C{in_progress}, C{completed}, C{incomplete}, C{failed} or
        C{cancelled}.
    @ivar emitted: how many of L{events} have happened (all of them for a response that is
        not a background one).
    @ivar createdAt: Unix seconds.
    """

    responseId: str
    credential: str | None
    body: dict
    inputItems: list
    events: list
    final: dict
    background: bool = False
    status: str = "completed"
    emitted: int = 0
    createdAt: float = 0.0
    stopRun: Callable[[], None] | None = None
    _listeners: list = field(factory=list)

    def snapshot(self) -> dict:
        """
        The response object as C{GET /v1/responses/{id}} answers it now.
        """
        if self.status in ACTIVE:
            return responseObject(self.responseId, self.body, self.createdAt, self.status,
                                  [], None) | {"background": True}
        out = dict(self.final, status=self.status)
        if self.background:
            out["background"] = True
        return out

    def happened(self) -> list:
        """
        The events that have happened so far.
        """
        return self.events[: self.emitted]

    def emit(self, event: dict) -> None:
        """
        One more planned event happened (the background run); live streams get it.
        """
        self.emitted += 1
        kind = event.get("type")
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            self.status = kind.split(".", 1)[1]
        elif kind not in ("response.created", "response.queued"):
            self.status = "in_progress"
        for send, _finish in list(self._listeners):
            send(event)
        if self.status not in ACTIVE:
            self._end()

    def listen(self, send: Callable[[dict], None], finish: Callable[[], None]) -> Callable:
        """
        Follow the run live: C{send(event)} for each later event, C{finish()} at its end.

        @return: a no-argument callable that stops listening (the client left).
        """
        entry = (send, finish)
        self._listeners.append(entry)

        def forget() -> None:
            if entry in self._listeners:
                self._listeners.remove(entry)

        return forget

    def _end(self) -> None:
        listeners, self._listeners = self._listeners, []
        for _send, finish in listeners:
            finish()

    def cancel(self, now: float) -> None:
        """
        Stop a running background response: status C{cancelled}, and live streams end with
        C{response.cancelled}.
        """
        if self.stopRun is not None:
            self.stopRun()
            self.stopRun = None
        self.status = "cancelled"
        self.final = responseObject(self.responseId, self.body, self.createdAt, "cancelled",
                                    [], None)
        event = {"type": "response.cancelled", "sequence_number": self.emitted,
                 "response": dict(self.final, background=True)}
        self.events = self.events[: self.emitted] + [event]
        self.emitted += 1
        for send, _finish in list(self._listeners):
            send(event)
        self._end()


def storedItems(stored: StoredResponse) -> list:
    """
    The items a stored response keeps, each with an id: its input items, then its output
    items (what an C{item_reference} can name).
    """
    output = stored.final.get("output") if isinstance(stored.final, dict) else None
    return [i for i in (*stored.inputItems, *(output or []))
            if isinstance(i, dict) and i.get("id") and namedById(i) is None]


def namedById(item: Any) -> str | None:
    """
    The id of the stored item an input item makes the API resolve, or L{None}: an
    C{item_reference} (whose C{type} is optional: an item with an C{id}, no C{type} and no
    C{role}), or a C{reasoning} item with an C{id} and no C{encrypted_content} (the stored
    reasoning is looked up by id).
    """
    if not isinstance(item, dict):
        return None
    kind = item.get("type")
    if kind == "reasoning":
        if item.get("encrypted_content"):
            return None
    elif kind != "item_reference" and not (kind is None and "role" not in item):
        return None
    ref = item.get("id")
    return ref if isinstance(ref, str) and ref else None


def unknownItemError(itemId: str, storeFlag: Any) -> dict:
    """
    The 404 error object OpenAI answers for an item it does not hold (with its hint when the
    request itself has C{store: false}).
    """
    message = f"Item with id '{itemId}' not found."
    if storeFlag is False:
        message += (" Items are not persisted when `store` is set to false. Try again with"
                    " `store` set to true, or remove this item from your input.")
    return {"message": message, "type": "invalid_request_error", "param": "input",
            "code": None}


def resolveItems(store: ResponseStore, route: str, credential: str | None, items: list,
                 storeFlag: Any = None) -> tuple:
    """
    What the API does with the items of a request's input given by id (L{namedById}): the
    API-key route resolves them from the account's stored responses
    (L{ResponseStore.resolve}); the ChatGPT backend stores nothing, so there each is unknown.

    @return: C{(items, None)} (the same list when nothing was resolved), or C{(None, error
        object)} (the caller answers 404).
    """
    if route == "oauth":
        for item in items:
            ref = namedById(item)
            if ref is not None:
                return None, unknownItemError(ref, False)
        return items, None
    return store.resolve(credential, items, storeFlag)


@define(eq=False)
class ResponseStore:
    """
    The stored responses of every account, bounded by L{MAX_STORED}, and an index of their
    items (L{storedItems}) by id.
    """

    _byId: OrderedDict = field(factory=OrderedDict)
    _items: dict = field(factory=dict)
    """item id -> C{(response id, item)}."""

    def add(self, stored: StoredResponse) -> None:
        """
        Keep a response.
        """
        self._byId[stored.responseId] = stored
        for item in storedItems(stored):
            self._items[item["id"]] = (stored.responseId, item)
        while len(self._byId) > MAX_STORED:
            _, old = self._byId.popitem(last=False)
            self._forgetItems(old)

    def _forgetItems(self, stored: StoredResponse) -> None:
        for item in storedItems(stored):
            if self._items.get(item["id"], (None,))[0] == stored.responseId:
                del self._items[item["id"]]

    def item(self, credential: str | None, itemId: str) -> dict | None:
        """
        A stored item of C{credential}'s account, or L{None} (unknown, or another
        account's).
        """
        entry = self._items.get(itemId)
        if entry is None or self.get(credential, entry[0]) is None:
            return None
        return entry[1]

    def resolve(self, credential: str | None, items: list,
                storeFlag: Any = None) -> tuple:
        """
        The input with every item given by id (L{namedById}) replaced by the stored item of
        C{credential}'s account, as the API resolves it.

        @return: C{(items, None)}, or C{(None, error object)} for the first unknown id (the
            caller answers 404).
        """
        out = None
        for index, item in enumerate(items):
            ref = namedById(item)
            if ref is None:
                continue
            found = self.item(credential, ref)
            if found is None:
                return None, unknownItemError(ref, storeFlag)
            if out is None:
                out = list(items)
            out[index] = dict(found)
        return (items if out is None else out), None

    def get(self, credential: str | None, responseId: str) -> StoredResponse | None:
        """
        A stored response of C{credential}'s account, or L{None} (unknown, deleted, or
        another account's: upstream does not say which).
        """
        stored = self._byId.get(responseId)
        if stored is None or stored.credential != credential:
            return None
        return stored

    def delete(self, credential: str | None, responseId: str) -> bool:
        """
        Forget a stored response of C{credential}'s account.

        @return: whether there was one.
        """
        stored = self.get(credential, responseId)
        if stored is None:
            return False
        if stored.stopRun is not None:
            stored.stopRun()
            stored.stopRun = None
        del self._byId[responseId]
        self._forgetItems(stored)
        return True


def listPage(items: list, query: dict) -> dict:
    """
    One page of C{GET …/input_items}: C{order} (C{desc} by default), C{limit} (20, at most
    100) and C{after} (an item id).

    @param items: the items, oldest first.
    @param query: the query parameters (first values, as strings).
    @return: C{{"object": "list", "data", "first_id", "last_id", "has_more"}}.
    @raise ValueError: for a bad C{limit} or C{order} (the caller answers 400).
    """
    order = query.get("order") or "desc"
    if order not in ("asc", "desc"):
        raise ValueError("order must be asc or desc")
    try:
        limit = int(query.get("limit") or 20)
    except ValueError:
        raise ValueError("limit must be an integer") from None
    if not 1 <= limit <= 100:
        raise ValueError("limit must be between 1 and 100")
    ordered = list(items) if order == "asc" else list(reversed(items))
    after = query.get("after")
    if after:
        ids = [i.get("id") for i in ordered]
        ordered = ordered[ids.index(after) + 1:] if after in ids else []
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }


def backgroundEvents(events: list, responseId: str, body: dict, now: float) -> list:
    """
    The events of a background run: C{response.created} (status C{queued}), then
    C{response.queued}, then the rest of the planned turn, every C{response} marked
    C{background: true} and the sequence numbers counted from 0. (The SDK's stream helper,
    which also replays a background stream from its start, needs C{response.created} first.)

    @param events: the planned turn's events (L{relay.emulator.state.buildTurn}).
    """
    queued = responseObject(responseId, body, now, "queued", [], None)
    head = [{"type": "response.created", "response": queued},
            {"type": "response.queued", "response": queued}]
    out = []
    for index, event in enumerate([*head, *events[1:]]):
        event = dict(event, sequence_number=index)
        response = event.get("response")
        if isinstance(response, dict):
            event["response"] = dict(response, background=True)
        out.append(event)
    return out


__all__ = [
    "ACTIVE", "ResponseStore", "StoredResponse", "backgroundEvents", "inputItemsWithIds",
    "listPage", "namedById", "resolveItems", "storedItems", "unknownItemError",
]
