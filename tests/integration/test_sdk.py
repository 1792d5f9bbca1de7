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


# -- issue 20: the rest of the Responses API, with the SDK's own calls -----------------------


def inputTokensCounted(stack) -> float:
    """
    The input tokens relay counted (C{relay_tokens_total{type="input"}}).
    """
    total = 0.0
    for metric in stack.app.extras["metrics"].registry.collect():
        for sample in metric.samples:
            if sample.name == "relay_tokens_total" and sample.labels.get("type") == "input":
                total += sample.value
    return total


@pytest_twisted.ensureDeferred
async def test_background_create_poll_and_cancel():
    """
    R88 with C{client.responses.create(background=True)}, C{.retrieve} and
    C{.cancel}: the create answers C{queued} at once; polling reaches
    C{completed} on the owning account; the run is the only generation and
    its usage is counted once, however often it is polled; a cancelled run
    is never a generation.
    """
    stack = await startStack(
        [{"id": "a1", "credential": "sk-emu-a1", "priority": 1},
         {"id": "o1", "type": "oauth", "credential": "oauth-1", "priority": 0}],
        emulatorConfig={"default_script": {"delay": 0.05}},
    )
    try:

        def poll():
            import time

            with client(stack) as c:
                created = c.responses.create(model=MODEL, input="Say hi", background=True)
                statuses = [created.status]
                current = created
                for _ in range(200):
                    if current.status not in ("queued", "in_progress"):
                        break
                    time.sleep(0.05)
                    current = c.responses.retrieve(created.id)
                    statuses.append(current.status)
                again = c.responses.retrieve(created.id)
                return created, statuses, current, again

        created, statuses, final, again = await deferToThread(poll)
        assert created.status == "queued" and created.background is True
        assert final.status == "completed", statuses
        assert final.output_text and again.output_text == final.output_text
        assert stack.emulator.generationCount() == 1
        assert stack.emulator.requestsFor("oauth-1") == []  # R88: API-key accounts only
        counted = inputTokensCounted(stack)
        assert counted == final.usage.input_tokens  # once, not once per poll

        stack.emulator.setScript("sk-emu-a1", {"delay": 0.5})

        def cancel():
            with client(stack) as c:
                created = c.responses.create(model=MODEL, input="A long one", background=True)
                cancelled = c.responses.cancel(created.id)
                twice = c.responses.cancel(created.id)
                return cancelled, twice

        cancelled, twice = await deferToThread(cancel)
        assert (cancelled.status, twice.status) == ("cancelled", "cancelled")
        assert stack.emulator.generationCount() == 1
        assert inputTokensCounted(stack) == counted
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_background_stream_resume():
    """
    R88: C{create(background=True, stream=True)} streams from
    C{response.created} (queued); after the client dropped the stream,
    C{client.responses.stream(response_id=..., starting_after=N)} (which
    replays the stream and skips to event N) resumes on the owning account
    and ends with the completed response; C{retrieve(stream=True,
    starting_after=N)} asks upstream for the rest only. The usage is
    counted once.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}],
                             emulatorConfig={"default_script": {"delay": 0.05, "deltas": 6}})
    try:

        def run():
            with client(stack) as c:
                stream = c.responses.create(model=MODEL, input="Stream it", background=True,
                                            stream=True)
                seen = []
                for event in stream:
                    seen.append(event)
                    if event.type == "response.output_text.delta":
                        break
                stream.close()  # the client drops the stream mid-answer
                last = seen[-1].sequence_number
                responseId = seen[0].response.id
                with c.responses.stream(response_id=responseId, starting_after=last) as resumed:
                    rest = list(resumed)
                    final = resumed.get_final_response()
                tail = list(c.responses.retrieve(responseId, stream=True, starting_after=last))
                return seen, last, rest, final, tail

        seen, last, rest, final, tail = await deferToThread(run)
        assert [e.type for e in seen[:2]] == ["response.created", "response.queued"]
        assert rest[0].sequence_number == last + 1
        assert [e.sequence_number for e in tail] == [e.sequence_number for e in rest]
        assert rest[-1].type == "response.completed"
        assert final.status == "completed" and final.output_text
        assert stack.emulator.generationCount() == 1
        assert inputTokensCounted(stack) == final.usage.input_tokens
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_compact_input_tokens_items_delete_with_the_sdk():
    """
    R87 with the SDK's own calls: C{responses.compact}, C{input_tokens.count},
    C{input_items.list} and C{delete}; none is a generation.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-emu-a1"}])
    try:

        def run():
            with client(stack) as c:
                created = c.responses.create(model=MODEL, input="Remember otters")
                compacted = c.responses.compact(model=MODEL, input=[
                    {"role": "user", "content": "Remember otters"}])
                counted = c.responses.input_tokens.count(model=MODEL, input="Remember otters")
                items = list(c.responses.input_items.list(created.id))
                c.responses.delete(created.id)
                try:
                    c.responses.retrieve(created.id)
                    gone = False
                except openai.NotFoundError:
                    gone = True
                return created, compacted, counted, items, gone

        created, compacted, counted, items, gone = await deferToThread(run)
        assert compacted.object == "response.compaction"
        assert compacted.output[-1].type == "compaction"
        assert counted.input_tokens == created.usage.input_tokens
        assert [i.type for i in items] == ["message"]
        assert gone
        assert stack.emulator.generationCount() == 1
    finally:
        await stack.stop()
