# -*- test-case-name: tests.test_responsesapi, tests.test_itemowners -*-
"""
What the entrypoints note on a turn for behaviour.md R88-R90, in one place:
a background create, and the affinity of the C{compaction} items and the
C{x-codex-turn-state} token a turn carries (the account that produced or
issued them is preferred, L{relay.scheduling.scheduler}); and, in the same
pass, the stored items the input names by id (R104,
L{relay.scheduling.itemowners}), which selection checks.
"""

from __future__ import annotations

from relay.engine.compaction import inputFacts, withoutUsedTriggers
from relay.base.records import Turn
from relay.scheduling.scheduler import affinityKey


def annotateTurn(turn: Turn) -> None:
    """
    What a Responses turn (or compact request) carries for R88-R90, and
    the one body fix R89 asks for (a C{compaction_trigger} that is not the
    last input item is dropped: it was used already): a
    background create (C{background: true}, HTTP only); the affinity of the
    C{compaction} items in its input (R89; one type check per item, a
    fraction of the body's parse) and of its C{x-codex-turn-state} (R90, a
    header of the request or of the WebSocket upgrade).

    @param turn: the L{Turn}, its C{headers} and C{body} set.
    """
    body = turn.body
    if turn.entrypoint == "http" and body.get("background") is True:
        turn.background = True
    items = body.get("input")
    references = []
    affinity, misplaced = inputFacts(items, references)
    if references:
        turn.itemReferences = tuple(references)  # R104 (relay.scheduling.itemowners)
    if misplaced:
        # R89: a used trigger the client replayed never goes upstream.
        turn.body = body = dict(body, input=withoutUsedTriggers(items))
    token = turn.headers.get("x-codex-turn-state")
    if token:
        affinity += (("turn_state", affinityKey("turn_state", token)),)
    if affinity:
        turn.affinity = affinity


__all__ = ["annotateTurn"]
