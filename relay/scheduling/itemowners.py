# -*- test-case-name: tests.test_itemowners -*-
"""
behaviour.md R104 for what a turn's input names by id: stored items and
conversations. A key never reaches another key's conversation, and a
conversation is more than its responses: the Responses API also resolves,
from the account's storage, input items given by id only
(protocol facts checked against OpenAI's published types and errors):

  - C{{"type": "item_reference", "id": "..."}} (openai-python
    C{ResponseInputItemParam}'s C{ItemReference}, whose C{type} is
    optional: an item with an C{id}, no C{type} and no C{role} is one too);
  - a C{reasoning} item with an C{id} and no C{encrypted_content}: upstream
    looks the stored reasoning up by id (the 404 "Item with id 'rs_...' not
    found. Items are not persisted when C{store} is set to false", vercel/ai#7543
    and vercel/ai#10290).

On a shared upstream account key B could otherwise read key A's messages,
function calls and outputs. So relay records, when a response completes,
an owner record per output item id (L{itemOwnerKey}: the same value, TTL
and persistence as the response's owner record, written in the same store
operation; at most L{MAX_OWNED_ITEMS} per response), and a turn naming an
item by id must own every one of them, else it is answered like upstream
answers an unknown item (L{itemNotFound}, 404, fail closed), before any
account is chosen: no turn is started and nothing is billed.

relay does not serve the Conversations API (C{/v1/conversations}), so no
conversation id can belong to a key: a turn with a C{conversation}
parameter is refused (L{conversationRefused}).
"""

from __future__ import annotations

import hashlib

from relay.base.records import ClientError

MAX_OWNED_ITEMS = 256
"""The most output items of one response whose owner is recorded (the
first ones, in output order); a reference to a later item is refused like
an unknown one."""


def itemOwnerKey(itemId: str) -> str:
    """
    The store key of the client key that owns an output item (R104). It
    shares the response owner records' prefix, so the embedded store
    persists it too (L{relay.state.durable.DURABLE_PREFIXES}).

    @param itemId: the upstream item id (C{msg_...}, C{fc_...}, C{rs_...}).
    @return: C{openai:http-response-owner:item:{sha256(itemId)}}.
    """
    digest = hashlib.sha256(itemId.encode("utf-8")).hexdigest()
    return f"openai:http-response-owner:item:{digest}"


def storedReference(item: dict, kind) -> str | None:
    """
    The id of a stored item that C{item} makes upstream resolve, or
    L{None}. Called by the one pass over a turn's input
    (L{relay.engine.compaction.inputFacts}) only for the kinds that can be
    one: C{item_reference}, no C{type}, C{reasoning}.

    @param item: an input item (a dict).
    @param kind: its C{type} value.
    @return: the id (a non-empty string), or L{None}.
    """
    if kind == "reasoning":
        if item.get("encrypted_content"):
            return None
    elif kind is None and "role" in item:
        return None  # an easy message ({"role", "content"})
    ref = item.get("id")
    return ref if type(ref) is str and ref else None


def outputItemIds(response) -> list:
    """
    The ids of a completed response's output items, at most
    L{MAX_OWNED_ITEMS}.

    @param response: the response object (of the terminal event, or the
        JSON body), or anything else (nothing).
    @return: a list of strings.
    """
    output = response.get("output") if type(response) is dict else None
    if type(output) is not list or not output:
        return []
    ids = []
    for item in output[:MAX_OWNED_ITEMS]:
        if type(item) is dict:
            itemId = item.get("id")
            if type(itemId) is str and itemId:
                ids.append(itemId)
    return ids


def itemNotFound(itemId: str) -> ClientError:
    """
    R104's answer for an item the key does not own (unknown, or another
    key's; never said which), in OpenAI's words for an unknown item: 404
    C{invalid_request_error}, C{param: input}, no code (vercel/ai#10290
    quotes the body). On the WebSocket: an C{error} event with
    status 404, and the connection stays open.
    """
    return ClientError(404, "invalid_request_error", f"Item with id '{itemId}' not found.",
                       param="input")


CONVERSATION_MESSAGE = (
    "relay does not serve the Conversations API, so the `conversation` parameter is not"
    " supported; send the conversation's items in `input`, or chain responses with"
    " `previous_response_id`."
)


def conversationRefused() -> ClientError:
    """
    The 400 for a turn naming a C{conversation} (C{"conv_..."} or
    C{{"id": "conv_..."}}): relay never created one for the key.
    """
    return ClientError(400, "invalid_request_error", CONVERSATION_MESSAGE,
                       code="unsupported_parameter", param="conversation")


__all__ = [
    "CONVERSATION_MESSAGE", "MAX_OWNED_ITEMS", "conversationRefused", "itemNotFound",
    "itemOwnerKey", "outputItemIds", "storedReference",
]
