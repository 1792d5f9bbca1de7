# -*- test-case-name: tests.test_responsesapi -*-
"""
The relay's resource tree (protocol.md 1): the turn routes of
L{relay.entry.http}, everything under C{/v1/responses/} that is not a turn
(L{relay.entry.responsesapi}, behaviour.md R87-R91), both shapes of
C{/v1/models} (L{relay.entry.models}, R92), the Anthropic Messages API
(L{relay.entry.messages}, R115), the prefixless aliases,
C{/backend-api/codex/responses} and C{/healthz}. The application adds the
operator routes.
"""

from __future__ import annotations

from twisted.web.resource import Resource

from relay.engine.catalog import ModelCatalog
from relay.entry.http import HealthResource, JSONRoot, KeyRing, TurnResource
from relay.entry.keylimits import KeyIdentityResource, KeyUsageResource
from relay.entry.media import mediaRoutes
from relay.tenants.keyusage import accountsCheckBody, whoamiBody
from relay.entry.messages import MessagesResource
from relay.entry.models import ModelsResource
from relay.entry.responsesapi import ResponsesResource
from relay.frontdoor.door import FrontDoor
from relay.translate.anthropic.models import AnthropicModels


def buildRoot(runner, keys: KeyRing, accounts, websocket=None, door=None,
              anthropicModels=None) -> Resource:
    """
    The relay's resource tree (protocol.md 1): C{/v1/...}, the prefixless
    aliases, C{/backend-api/codex/responses} and C{…/models}, and C{/healthz}.

    @param door: the L{FrontDoor} every turn route hands its turns to
        (one around C{runner} when not given).
    @param anthropicModels: the live
        L{relay.translate.anthropic.models.AnthropicModels} of the Messages
        surface (the shipped defaults when not given).

    @return: the root L{Resource}; the application adds C{admin} and
        C{metrics} children.
    """
    door = door if door is not None else FrontDoor(runner)
    responses = ResponsesResource(
        TurnResource(door, keys, "responses", websocket), runner, keys, door
    )
    chat = TurnResource(door, keys, "chat")
    anthropic = anthropicModels if anthropicModels is not None else AnthropicModels()
    models = ModelsResource(keys, ModelCatalog(runner=runner, accounts=accounts), anthropic)
    root = JSONRoot()
    v1 = JSONRoot()
    for parent in (root, v1):
        parent.putChild(b"responses", responses)
        chatParent = JSONRoot()
        chatParent.putChild(b"completions", chat)
        parent.putChild(b"chat", chatParent)
        parent.putChild(b"models", models)
    for name, resource in mediaRoutes(door, keys).items():  # R115: embeddings, images
        root.putChild(name, resource)
        v1.putChild(name, resource)
    v1.putChild(b"messages", MessagesResource(door, keys, anthropic))  # R115
    root.putChild(b"v1", v1)
    backend = JSONRoot()
    codex = JSONRoot()
    codex.putChild(b"responses", responses)
    # Codex signed in to the backend (its built-in provider) asks here for its
    # models manifest (protocol.md 5, 7): the same answer as /v1/models.
    codex.putChild(b"models", models)
    backend.putChild(b"codex", codex)
    root.putChild(b"backend-api", backend)
    usage = getattr(runner, "keyUsage", None)
    if usage is not None:
        # R114: Codex's account usage, answered for the key (protocol.md 7.3a),
        # and who the key is, for Codex signed in with it as a personal
        # access token (then it reads the usage route for /status).
        wham, codexApi = JSONRoot(), JSONRoot()
        for parent in (wham, codexApi):
            parent.putChild(b"usage", KeyUsageResource(keys, usage))
            accounts = JSONRoot()
            accounts.putChild(b"check", KeyIdentityResource(keys, accountsCheckBody))
            parent.putChild(b"accounts", accounts)
        backend.putChild(b"wham", wham)
        api = JSONRoot()
        api.putChild(b"codex", codexApi)
        root.putChild(b"api", api)
        credential = JSONRoot()
        credential.putChild(b"whoami", KeyIdentityResource(keys, whoamiBody))
        v1.putChild(b"user-auth-credential", credential)
    root.putChild(b"healthz", HealthResource())
    return root
