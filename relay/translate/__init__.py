# -*- test-case-name: tests.test_translate -*-
"""
Chat Completions on accounts that only serve the Responses API (protocol.md
3 "Upstream"), and the assembly of a Responses answer from
its stream (protocol.md 2.7).

  - L{relay.translate.chatrequest}: a chat request becomes a Responses
    request (messages, tools, limits, formats, reasoning effort);
  - L{relay.translate.assemble}: the C{output} of a finished response is
    rebuilt from C{response.output_item.done} events when the terminal
    event carries C{output: []} (the ChatGPT backend does), and a
    finished response becomes a C{chat.completion} object;
  - L{relay.translate.chatstream}: Responses stream events become
    C{chat.completion.chunk}s;
  - L{relay.translate.sink}: L{ChatCompletionsSink}, the turn sink
    adapter the engine puts in front of the client's SSE or JSON sink for a
    chat turn on an OAuth account, so the engine stages, classifies and
    fails over on Responses events exactly as for C{/v1/responses}
    (behaviour.md R22, R23, R84) and translation happens on write.

Pure data work: nothing here touches the network or the clock.
"""

from relay.translate.assemble import ResponseAssembler, chatCompletion
from relay.translate.chatrequest import chatToResponses
from relay.translate.chatstream import ChatChunkTranslator
from relay.translate.sink import ChatCompletionsSink

__all__ = [
    "ChatChunkTranslator",
    "ChatCompletionsSink",
    "ResponseAssembler",
    "chatCompletion",
    "chatToResponses",
]
