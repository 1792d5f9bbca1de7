# -*- test-case-name: tests.test_anthropic -*-
"""
The Anthropic Messages API as a surface of the one turn engine
(protocol.md 10, behaviour.md R115): a Messages request becomes a Responses
turn on either account type, and the answer becomes a Messages answer.

  - L{relay.translate.anthropic.request}: the request, checked and
    translated (system, messages, tools, tool choice, limits, thinking,
    caching);
  - L{relay.translate.anthropic.models}: C{claude-*} names mapped by family
    (C{anthropic_models});
  - L{relay.translate.anthropic.stream}: Responses events -> Messages
    stream events, stop sequences applied, and the non-streaming message
    folded from them;
  - L{relay.translate.anthropic.sink}: L{MessagesSink}, the per-attempt
    adapter the engine puts in front of the client's sink;
  - L{relay.translate.anthropic.errors}: relay's errors in Anthropic's
    shape and statuses.

Pure data work: nothing here touches the network or the clock.
"""

from relay.translate.anthropic.errors import anthropicBody, anthropicStatus, anthropicStreamError
from relay.translate.anthropic.models import AnthropicModels, checkTable, familyOf
from relay.translate.anthropic.request import (
    MessagesContext,
    MessagesRequestError,
    checkMessagesRequest,
    contextOf,
    messagesToResponses,
)
from relay.translate.anthropic.sink import MessagesSink
from relay.translate.anthropic.stream import MessagesTranslator, foldMessage

__all__ = [
    "AnthropicModels",
    "MessagesContext",
    "MessagesRequestError",
    "MessagesSink",
    "MessagesTranslator",
    "anthropicBody",
    "anthropicStatus",
    "anthropicStreamError",
    "checkMessagesRequest",
    "checkTable",
    "contextOf",
    "familyOf",
    "foldMessage",
    "messagesToResponses",
]
