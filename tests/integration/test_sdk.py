"""
The official C{openai} Python SDK (3.57, protocol.md 6) through a real relay
to the emulator: Responses and Chat Completions, streaming and not, and
issue 5 end to end (HTTP chaining with C{previous_response_id} stays on the
owning API-key account).

The SDK is synchronous here; every call runs in a thread
(L{deferToThread}) so the reactor keeps serving the relay and the emulator.
"""

from __future__ import annotations

import openai
import pytest_twisted
from twisted.internet.threads import deferToThread
from twisted.logger import globalLogPublisher

from tests.integration.harness import RELAY_KEY, startStack

MODEL = "gpt-5.5"
DECISION = "openai.account_schedule_decision"


def client(stack) -> openai.OpenAI:
    """
    A sync SDK client for the relay: no SDK retries (the relay owns every
    retry) and a short timeout.
    """
    return openai.OpenAI(
        base_url=stack.url + "/v1", api_key=RELAY_KEY, max_retries=0, timeout=10.0
    )


class DecisionLog:
    """
    Capture C{openai.account_schedule_decision} events from the global log
    publisher while in use (a context manager).
    """

    def __init__(self):
        self.events = []

    def __call__(self, event):
        if event.get("event") == DECISION:
            self.events.append(event)

    def __enter__(self):
        globalLogPublisher.addObserver(self)
        return self

    def __exit__(self, *exc):
        globalLogPublisher.removeObserver(self)
        return False


@pytest_twisted.ensureDeferred
async def test_responses_non_streaming():
    """
    C{responses.create} returns a completed typed L{Response} with text.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:

        def call():
            with client(stack) as c:
                return c.responses.create(model=MODEL, input="Say hi")

        response = await deferToThread(call)
        assert response.object == "response"
        assert response.status == "completed"
        assert response.output_text
        assert len(stack.emulator.requestsFor("sk-emu-a1")) == 1
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_responses_streaming():
    """
    C{responses.create(stream=True)} yields typed events from
    C{response.created} to C{response.completed}, with text deltas.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:

        def call():
            with client(stack) as c:
                stream = c.responses.create(model=MODEL, input="Say hi", stream=True)
                return [event for event in stream]

        events = await deferToThread(call)
        types = [e.type for e in events]
        assert types[0] == "response.created"
        assert types[-1] == "response.completed"
        assert "response.output_text.delta" in types
        assert events[-1].response.status == "completed"
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chat_non_streaming():
    """
    C{chat.completions.create} returns a typed completion with an assistant
    message.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:

        def call():
            with client(stack) as c:
                return c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Say hi"}]
                )

        completion = await deferToThread(call)
        assert completion.object == "chat.completion"
        assert completion.choices[0].message.role == "assistant"
        assert completion.choices[0].message.content
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chat_streaming():
    """
    C{chat.completions.create(stream=True)} yields chunks whose deltas make
    up the text, ending with a finish reason.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:

        def call():
            with client(stack) as c:
                stream = c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Say hi"}], stream=True
                )
                return [chunk for chunk in stream]

        chunks = await deferToThread(call)
        assert chunks
        assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] is not None
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_previous_response_id_chain_stays_on_owner():
    """
    Issue 5 end to end: with three API-key accounts, a chain of HTTP
    requests with C{store=True} and C{previous_response_id} lands on the
    account that owns the previous response every time, and each chained
    decision is logged with layer C{previous_response_id}.
    """
    credentials = {"k1": "sk-emu-k1", "k2": "sk-emu-k2", "k3": "sk-emu-k3"}
    stack = await startStack(
        [{"id": name, "credential": cred, "concurrency": 4} for name, cred in credentials.items()]
    )
    try:
        with DecisionLog() as log:

            def chain():
                ids = []
                with client(stack) as c:
                    previous = None
                    for turn in range(5):
                        kwargs = {"previous_response_id": previous} if previous else {}
                        response = c.responses.create(
                            model=MODEL, input=f"turn {turn}", store=True, **kwargs
                        )
                        assert response.status == "completed"
                        ids.append(response.id)
                        previous = response.id
                return ids

            ids = await deferToThread(chain)
        assert len(set(ids)) == 5

        served = {name: stack.emulator.requestsFor(cred) for name, cred in credentials.items()}
        owners = [name for name, records in served.items() if records]
        assert len(owners) == 1, {name: len(records) for name, records in served.items()}
        [owner] = owners
        records = served[owner]
        assert len(records) == 5
        assert [r.body.get("previous_response_id") for r in records] == [None] + ids[:-1]
        assert all(r.body.get("store") is True for r in records)

        assert len(log.events) == 5, log.events
        assert all(e["selected_account_id"] == owner for e in log.events)
        layers = [e["layer"] for e in log.events]
        assert layers[0] != "previous_response_id"
        assert layers[1:] == ["previous_response_id"] * 4, layers
        assert all(e["sticky_previous_hit"] for e in log.events[1:])
    finally:
        await stack.stop()
