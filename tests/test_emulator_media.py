"""
The emulator's embeddings and images routes (L{relay.emulator.media}) and
the ChatGPT backend's C{image_generation} tool result
(L{relay.emulator.pictures}), through L{treq.testing.StubTreq} and a
L{Clock}: OpenAI's shapes, and the faults they share with the Responses
routes (a status, a stall before the body, a cut body, C{stream_error}).
"""

from __future__ import annotations

import base64
import json
import struct

from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.emulator import Emulator
from relay.emulator.pictures import PNG
from relay.emulator.state import buildTurn, chooseReply, parseScript
from relay.wire.multipart import Upload, encodeForm


class MediaRouteTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_800_000_000)
        self.emulator = Emulator(reactor=self.clock, config={
            "accept_any": False, "accounts": [{"name": "a1", "credential": "sk-a1"}]})
        self.treq = StubTreq(self.emulator.site.resource)

    def _post(self, path: str, body, contentType="application/json"):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        d = self.treq.post("http://emulator" + path, raw, headers={
            "Authorization": "Bearer sk-a1", "Content-Type": contentType})
        self.treq.flush()
        response = self.successResultOf(d)
        content = response.content()
        self.treq.flush()
        self.clock.advance(5)
        self.treq.flush()
        return response, self.successResultOf(content)

    def test_embeddings(self) -> None:
        """
        Float vectors by default, little-endian float32 in base64 on
        request, the same numbers for the same text; usage in prompt tokens.
        """
        response, data = self._post("/v1/embeddings", {
            "model": "text-embedding-3-small", "input": ["a", "b"], "dimensions": 8})
        self.assertEqual(response.code, 200)
        body = json.loads(data)
        self.assertEqual(body["object"], "list")
        self.assertEqual([d["index"] for d in body["data"]], [0, 1])
        floats = body["data"][0]["embedding"]
        self.assertEqual(len(floats), 8)
        self.assertEqual(body["usage"]["prompt_tokens"], body["usage"]["total_tokens"])
        _, data = self._post("/v1/embeddings", {
            "model": "text-embedding-3-small", "input": "a", "dimensions": 8,
            "encoding_format": "base64"})
        packed = base64.b64decode(json.loads(data)["data"][0]["embedding"])
        for got, want in zip(struct.unpack("<8f", packed), floats):
            self.assertAlmostEqual(got, want, places=5)
        response, data = self._post("/v1/embeddings", {"model": "m"})
        self.assertEqual((response.code, json.loads(data)["error"]["param"]), (400, "input"))

    def test_images(self) -> None:
        """
        C{gpt-image-1}: b64_json images with usage and the served settings;
        C{dall-e-2} with C{response_format: url}: URLs, no usage.
        """
        _, data = self._post("/v1/images/generations", {
            "model": "gpt-image-1", "prompt": "cat", "n": 2, "quality": "high"})
        body = json.loads(data)
        self.assertEqual([base64.b64decode(d["b64_json"]) for d in body["data"]], [PNG, PNG])
        self.assertEqual((body["quality"], body["size"]), ("high", "1024x1024"))
        self.assertGreater(body["usage"]["output_tokens"], 0)
        _, data = self._post("/v1/images/generations", {
            "model": "dall-e-2", "prompt": "cat", "response_format": "url"})
        body = json.loads(data)
        self.assertTrue(body["data"][0]["url"].startswith("https://"))
        self.assertNotIn("usage", body)

    def test_edits(self) -> None:
        """
        An edit's form is parsed; without an image file it is OpenAI's 400;
        the recorded request lists the files, never their bytes.
        """
        form, kind = encodeForm({"prompt": "hat", "model": "gpt-image-1"},
                                [Upload("image", "a.png", "image/png", PNG)])
        response, data = self._post("/v1/images/edits", form, kind)
        self.assertEqual(response.code, 200)
        self.assertEqual(base64.b64decode(json.loads(data)["data"][0]["b64_json"]), PNG)
        [recorded] = self.emulator.requestsFor("sk-a1")
        self.assertEqual(recorded.body["image"], [
            {"filename": "a.png", "content_type": "image/png", "bytes": len(PNG)}])
        form, kind = encodeForm({"prompt": "hat"}, [])
        response, data = self._post("/v1/images/edits", form, kind)
        self.assertEqual((response.code, json.loads(data)["error"]["param"]), (400, "image"))

    def test_faults(self) -> None:
        """
        The Responses routes' faults: a scripted status, C{stream_error} as
        a 500, a cut body.
        """
        body = {"model": "text-embedding-3-small", "input": "a"}
        self.emulator.setFault("a1", {"kind": "status", "code": 503, "times": 1})
        response, _ = self._post("/v1/embeddings", body)
        self.assertEqual(response.code, 503)
        self.emulator.setFault("a1", {"kind": "stream_error", "times": 1})
        response, _ = self._post("/v1/images/generations", {"prompt": "x"})
        self.assertEqual(response.code, 500)
        self.emulator.setFault("a1", {"kind": "cut_after_events", "events": 0, "times": 1})
        d = self.treq.post("http://emulator/v1/embeddings", json.dumps(body).encode(), headers={
            "Authorization": "Bearer sk-a1", "Content-Type": "application/json"})
        self.treq.flush()
        response = self.successResultOf(d)
        content = response.content()
        self.treq.flush()
        self.failureResultOf(content)
        response, _ = self._post("/v1/embeddings", body)
        self.assertEqual(response.code, 200)


class ImageToolTests(SynchronousTestCase):
    def test_imageGenerationCall(self) -> None:
        """
        The C{image_generation} tool, when the request makes the model call
        it, reports an image: a PNG, the prompt as revised, the settings.
        """
        body = {"model": "gpt-5.4-mini", "input": "a red fox",
                "tools": [{"type": "image_generation", "quality": "low"}],
                "tool_choice": {"type": "image_generation"}}
        reply = chooseReply(parseScript(None), [{"role": "user", "content": "a red fox"}], "a",
                            "gpt-5.4-mini")
        turn = buildTurn(body, reply, 0.0)
        [call] = [i for i in turn.final["output"] if i["type"] == "image_generation_call"]
        self.assertEqual(base64.b64decode(call["result"]), PNG)
        self.assertEqual((call["revised_prompt"], call["quality"], call["size"]),
                         ("a red fox", "low", "1024x1024"))
