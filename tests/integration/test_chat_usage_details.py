"""
Chat usage keeps its details (issue 20; behaviour.md R94): a chat turn
relay translates for an OAuth account carries
C{prompt_tokens_details.cached_tokens} and
C{completion_tokens_details.reasoning_tokens} from the Responses usage, in
the JSON body and in the C{include_usage} chunk; an API-key account's own
chat usage passes as it came.
"""

import json

import pytest
import pytest_twisted

from tests.integration.harness import startStack

PINNED = {"input_tokens": 120, "cached_tokens": 100, "output_tokens": 30, "reasoning_tokens": 12}
EXPECTED = {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150,
            "prompt_tokens_details": {"cached_tokens": 100},
            "completion_tokens_details": {"reasoning_tokens": 12}}


def chunks(data: bytes) -> list:
    out = []
    for line in data.decode().split("\n"):
        if line.startswith("data: {"):
            out.append(json.loads(line[6:]))
    return out


@pytest.mark.parametrize("kind", ["oauth", "apikey"])
@pytest.mark.parametrize("stream", [False, True])
@pytest_twisted.ensureDeferred
async def test_chat_usage_details(kind, stream):
    stack = await startStack([{"id": "x1", "type": kind, "credential": f"{kind}-x1"}],
                             emulatorConfig={"default_script": {"usage": PINNED}})
    try:
        body = {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}],
                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        response, data = await stack.postJSON("/v1/chat/completions", body)
        assert response.code == 200, data
        if stream:
            usage = [c["usage"] for c in chunks(data) if c.get("usage")]
            assert len(usage) == 1, data
            usage = usage[0]
        else:
            usage = json.loads(data)["usage"]
        for name, value in EXPECTED.items():
            assert usage[name] == value, (name, usage)
    finally:
        await stack.stop()
