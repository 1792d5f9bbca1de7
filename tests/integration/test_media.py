"""
Embeddings and images through the one engine (behaviour.md R115), end to
end against the emulator, with the official C{openai} SDK (3.57):
C{embeddings.create}, C{images.generate}, C{images.edit} (a file upload) on
API-key accounts; images through the Responses C{image_generation} tool on
OAuth accounts; an OAuth-only pool refuses embeddings (a capability, never
dialled); failover on an upstream fault as on chat; usage, cost and the
request log.

The SDK is synchronous; every call runs in a thread (L{deferToThread}).
"""

from __future__ import annotations

import base64
import json

import openai
import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread

from relay.emulator.media import PNG
from relay.wire.multipart import Upload, encodeForm
from tests.integration.harness import RELAY_KEY, startStack

EMBED = "text-embedding-3-small"
IMAGE = "gpt-image-1"


def apikey(id="a1", credential="sk-a1", **extra):
    return {"id": id, "credential": credential, **extra}


def oauth(id="o1", credential="oauth-o1", **extra):
    return {"id": id, "type": "oauth", "credential": credential, **extra}


ADMIN = "media-admin-key-0123456789"


async def start(accounts, extra="", **kw):
    known = [{"name": a["credential"], "credential": a["credential"]} for a in accounts]
    return await startStack(accounts, emulatorConfig={"accounts": known},
                            extra=f"admin_key: {ADMIN}\n{extra}", **kw)


async def admin(relay, path: str):
    response = await treq.get(relay.url + path, headers={"Authorization": [f"Bearer {ADMIN}"]})
    body = await response.json()
    assert response.code == 200, body
    return body


async def sdk(relay, fn):
    def call():
        with openai.OpenAI(base_url=relay.url + "/v1", api_key=RELAY_KEY, max_retries=0,
                           timeout=10.0) as c:
            return fn(c)

    return await deferToThread(call)


def requests(relay, credential, path):
    return [r for r in relay.emulator.requestsFor(credential) if r.path == path]


@pytest_twisted.ensureDeferred
async def test_sdk_embeddings_float_and_base64():
    """
    C{embeddings.create} through relay on an API-key account: the SDK's
    default (base64, decoded by the SDK) and C{float}; the upstream got
    C{/v1/embeddings}; usage is counted as input tokens.
    """
    relay = await start([apikey()])
    try:
        got = await sdk(relay, lambda c: c.embeddings.create(model=EMBED, input=["hi", "there"]))
        assert [d.index for d in got.data] == [0, 1]
        assert len(got.data[0].embedding) == 1536
        assert got.usage.prompt_tokens > 0
        floats = await sdk(relay, lambda c: c.embeddings.create(
            model=EMBED, input="hi", encoding_format="float"))
        assert floats.data[0].embedding == pytest.approx(got.data[0].embedding, abs=1e-5)
        assert len(requests(relay, "sk-a1", "/v1/embeddings")) == 2
        rows = (await admin(relay, "/admin/requests?limit=10"))["requests"]
        assert [r["endpoint"] for r in rows] == ["embeddings", "embeddings"]
        row = rows[0]
        assert row["input_tokens"] > 0 and row["output_tokens"] == 0
        assert row["cost_usd"] == pytest.approx(row["input_tokens"] * 0.02 / 1e6)
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_embeddings_refused_on_an_oauth_only_pool():
    """
    R115: an OAuth account never serves embeddings: with only OAuth
    accounts the answer is a clear 400 and nothing is dialled.
    """
    relay = await start([oauth()])
    try:
        with pytest.raises(openai.BadRequestError) as e:
            await sdk(relay, lambda c: c.embeddings.create(model=EMBED, input="hi"))
        assert "API-key account" in e.value.body["message"]
        assert e.value.body["code"] == "endpoint_not_served"
        assert relay.emulator.requestsFor("oauth-o1") == []
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_embeddings_skip_the_preferred_oauth_account():
    """
    R115: in a mixed pool the OAuth account, though preferred, is not
    eligible for embeddings (a scheduling filter, not an error after
    dialling); the API-key account serves, and C{/admin/explain} says why.
    """
    relay = await start([oauth(priority=1), apikey(priority=50)])
    try:
        got = await sdk(relay, lambda c: c.embeddings.create(model=EMBED, input="hi"))
        assert len(got.data) == 1
        assert relay.emulator.requestsFor("oauth-o1") == []
        explained = await admin(relay, f"/admin/explain?key=test&model={EMBED}"
                                       "&endpoint=embeddings")
        verdicts = {a["id"]: a["verdict"] for a in explained["accounts"]}
        assert verdicts == {"o1": "endpoint_not_served", "a1": "chosen"}
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_embeddings_fail_over_on_a_5xx():
    """
    R115, R86: the same upstream fault gets the same treatment as on chat:
    a 503 from the preferred account fails over to the next.
    """
    relay = await start([apikey("bad", "sk-bad", priority=1),
                         apikey("good", "sk-good", priority=50)])
    relay.emulator.setFault("sk-bad", {"kind": "status", "code": 503})
    try:
        got = await sdk(relay, lambda c: c.embeddings.create(model=EMBED, input="hi"))
        assert len(got.data) == 1
        assert len(requests(relay, "sk-bad", "/v1/embeddings")) >= 1
        assert len(requests(relay, "sk-good", "/v1/embeddings")) == 1
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_sdk_images_generate_on_an_api_key_account():
    """
    C{images.generate} on an API-key account: the upstream's
    C{/v1/images/generations} answer (b64_json, usage) reaches the SDK.
    """
    relay = await start([apikey()])
    try:
        got = await sdk(relay, lambda c: c.images.generate(model=IMAGE, prompt="a cat", n=2))
        assert len(got.data) == 2
        assert base64.b64decode(got.data[0].b64_json) == PNG
        assert got.usage.total_tokens > 0
        [request] = requests(relay, "sk-a1", "/v1/images/generations")
        assert request.body["prompt"] == "a cat" and request.body["n"] == 2
        high = await sdk(relay, lambda c: c.images.generate(model=IMAGE, prompt="a cat",
                                                            quality="high"))
        assert len(high.data) == 1
        # R109, R115: priced per image, by quality where the table says
        rows = (await admin(relay, "/admin/requests?limit=10"))["requests"]
        assert [r["endpoint"] for r in rows] == ["images", "images"]
        byCost = sorted(r["cost_usd"] for r in rows)
        assert byCost == [pytest.approx(2 * 0.042), pytest.approx(0.167)]
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_sdk_images_edit_uploads_a_file():
    """
    C{images.edit} with a file upload: relay parses the form after the
    key and encodes it again for the upstream's C{/v1/images/edits}.
    """
    relay = await start([apikey()])
    try:
        got = await sdk(relay, lambda c: c.images.edit(
            model=IMAGE, image=("cat.png", PNG, "image/png"), prompt="add a hat"))
        assert base64.b64decode(got.data[0].b64_json) == PNG
        [request] = requests(relay, "sk-a1", "/v1/images/edits")
        assert request.body["prompt"] == "add a hat"
        assert request.body["model"] == IMAGE
        assert request.body["image"] == [
            {"filename": "cat.png", "content_type": "image/png", "bytes": len(PNG)}]
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_images_through_the_tool_on_oauth():
    """
    R115: on an OAuth account an images request is a Responses turn that
    must call the C{image_generation} tool; the tool's result comes back
    in the images API's shape.
    """
    relay = await start([oauth()])
    try:
        got = await sdk(relay, lambda c: c.images.generate(
            model=IMAGE, prompt="a red fox", size="1024x1024", quality="high"))
        assert base64.b64decode(got.data[0].b64_json) == PNG
        assert got.data[0].revised_prompt == "a red fox"
        assert got.size == "1024x1024" and got.quality == "high"
        [request] = requests(relay, "oauth-o1", "/backend-api/codex/responses")
        body = request.body
        assert body["tool_choice"] == {"type": "image_generation"}
        assert body["tools"] == [{"type": "image_generation", "size": "1024x1024",
                                  "quality": "high"}]
        assert body["stream"] is True and body["store"] is False
        edited = await sdk(relay, lambda c: c.images.edit(
            model=IMAGE, image=("cat.png", PNG, "image/png"), prompt="add a hat"))
        assert base64.b64decode(edited.data[0].b64_json) == PNG
        edit = requests(relay, "oauth-o1", "/backend-api/codex/responses")[-1].body
        parts = edit["input"][0]["content"]
        assert parts[1]["type"] == "input_image"
        assert parts[1]["image_url"].startswith("data:image/png;base64,")
        # R109, R115: the tool's one image is priced per image (high, then
        # the model's own price)
        rows = (await admin(relay, "/admin/requests?limit=10"))["requests"]
        assert sorted(r["endpoint"] for r in rows) == ["image_edits", "images"]
        assert sorted(r["cost_usd"] for r in rows) == [pytest.approx(0.042),
                                                       pytest.approx(0.167)]
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_images_fail_over_on_oauth_and_api_key():
    """
    R115, R86: a 503 from the preferred OAuth account fails the images
    turn over to the API-key account, which serves it on its own route.
    """
    relay = await start([oauth(priority=1), apikey(priority=50)])
    relay.emulator.setFault("oauth-o1", {"kind": "status", "code": 503})
    try:
        got = await sdk(relay, lambda c: c.images.generate(model=IMAGE, prompt="a cat"))
        assert base64.b64decode(got.data[0].b64_json) == PNG
        assert len(requests(relay, "oauth-o1", "/backend-api/codex/responses")) >= 1
        assert len(requests(relay, "sk-a1", "/v1/images/generations")) == 1
    finally:
        await relay.stop()


async def _postForm(relay, body: bytes, contentType: str, key=RELAY_KEY):
    response = await treq.post(relay.url + "/v1/images/edits", body, headers={
        "Authorization": [f"Bearer {key}"], "Content-Type": [contentType]})
    return response, json.loads(await response.content())


@pytest_twisted.ensureDeferred
async def test_edits_bad_form_and_oversize():
    """
    A malformed form is OpenAI's 400; a body over
    C{gateway.max_request_body_bytes} a 413; no key, a 401 before any
    byte is parsed (R103); nothing reaches the upstream.
    """
    relay = await start([apikey()], gateway="{max_request_body_bytes: 65536}")
    try:
        form, kind = encodeForm({"prompt": "x", "model": IMAGE},
                                [Upload("image", "a.png", "image/png", PNG)])
        response, body = await _postForm(relay, form[:-20], kind)
        assert response.code == 400 and body["error"]["type"] == "invalid_request_error"
        assert "multipart" in body["error"]["message"]
        response, body = await _postForm(relay, form, "application/json")
        assert response.code == 400
        big, kind = encodeForm({"prompt": "x"}, [Upload("image", "a.png", "image/png",
                                                        b"\0" * 70000)])
        response, body = await _postForm(relay, big, kind)
        assert response.code == 413
        response, body = await _postForm(relay, form, kind, key="sk-wrong")
        assert response.code == 401
        assert requests(relay, "sk-a1", "/v1/images/edits") == []
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_key_policy_applies_to_embeddings_and_images():
    """
    R102, R110, R115: a key's model allow-list holds on these routes as on
    every other, matched on the normalised name: C{TEXT-EMBEDDING-3-SMALL }
    is the listed family; an image model off the list is refused 403
    before any account is dialled.
    """
    keys = json.dumps([{"name": "test", "key": RELAY_KEY, "concurrency": 0,
                        "models": ["text-embedding-3-small"]}])
    relay = await start([apikey()], keys=keys)
    try:
        got = await sdk(relay, lambda c: c.embeddings.create(
            model="TEXT-EMBEDDING-3-SMALL ", input="hi"))
        assert len(got.data) == 1
        with pytest.raises(openai.PermissionDeniedError):
            await sdk(relay, lambda c: c.images.generate(model=IMAGE, prompt="a cat"))
        assert requests(relay, "sk-a1", "/v1/images/generations") == []
    finally:
        await relay.stop()


@pytest_twisted.ensureDeferred
async def test_money_budget_holds_images():
    """
    R108, R109, R115: a key's money budget reserves images at their
    per-image price before they are dialled: with $0.05 a day, three
    $0.042 images asked for at once serve two (the second is admitted while
    budget minus the first's hold remains), the third is refused 429
    without a dial; the spend settles to the two images.
    """
    keys = json.dumps([{"name": "test", "key": RELAY_KEY, "concurrency": 0, "daily_usd": 0.05}])
    relay = await start([apikey()], keys=keys)
    relay.emulator.setScript("sk-a1", {"delay": 1.0})
    try:
        async def one():
            response, data = await relay.postJSON("/v1/images/generations",
                                                  {"model": IMAGE, "prompt": "a cat"})
            return len(json.loads(data)["data"]) if response.code == 200 else response.code

        first = ensureDeferred(one())
        await deferLater(reactor, 0.1, lambda: None)
        second = ensureDeferred(one())
        await deferLater(reactor, 0.1, lambda: None)
        third = ensureDeferred(one())
        assert [await first, await second, await third] == [1, 1, 429]
        assert len(requests(relay, "sk-a1", "/v1/images/generations")) == 2
        usage = await admin(relay, "/admin/usage?group_by=key")
        assert "0.084" in json.dumps(usage), usage
    finally:
        await relay.stop()
