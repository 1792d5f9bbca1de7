"""
Embeddings and images, the surface's half (behaviour.md R115): the
multipart reader (L{relay.wire.multipart}), the request checks and the
translation to and from a Responses turn with the C{image_generation} tool
(L{relay.translate.media}, L{relay.translate.imagesink}), the entry
resource's refusals (L{relay.entry.media}), the capability filter
(L{relay.base.records.Account.servesEndpoint}) and the per-image prices
(L{relay.tenants.prices}, R109).
"""

from __future__ import annotations

import base64
import io
import json

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest
from zope.interface.verify import verifyObject

from relay.base.records import Account, ClientKey, Turn
from relay.configuration.parse import parsePrices
from relay.entry.media import MediaResource
from relay.interfaces import ITurnSink
from relay.tenants.prices import Price, PriceTable
from relay.translate.imagesink import NO_IMAGE_MESSAGE, ImagesSink
from relay.translate.media import (
    OAUTH_IMAGE_MODEL,
    MediaRequestError,
    checkEmbeddings,
    checkImages,
    imagesAnswer,
    imagesToResponses,
    mediaBody,
    mediaPath,
)
from relay.usage.tokens import TokenCounts, imageCalls, imagesTool, mediaCounts
from relay.wire.multipart import MAX_PARTS, FormError, Upload, encodeForm, parseForm
from relay.wire.sse import Event
from tests.test_translate import FakeRequest

KEY = ClientKey(name="k", key="sk-relay")


def _account(kind="apikey", **kw) -> Account:
    return Account(id="a", type=kind, base_url="http://u", credential="c", **kw)


def _turn(endpoint, body, upload=None, model="gpt-image-1") -> Turn:
    return Turn(entrypoint="http", endpoint=endpoint, client=KEY, model=model, body=body,
                stream=False, upload=upload)


PNG = b"\x89PNG\r\n\x1a\nfake"


class MultipartTests(SynchronousTestCase):
    """
    L{parseForm} and L{encodeForm}.
    """

    def test_roundTrip(self):
        """
        A form encoded by L{encodeForm} parses back to its fields and files,
        names with quotes and non-ASCII text kept.
        """
        files = [Upload("image[]", 'a "b".png', "image/png", PNG),
                 Upload("mask", "m.png", "image/png", b"\0\r\n--x")]
        raw, kind = encodeForm({"prompt": "un chat \u00e9", "n": "2"}, files)
        self.assertTrue(kind.startswith("multipart/form-data; boundary="))
        form = parseForm(raw, kind)
        self.assertEqual(form.fields, {"prompt": "un chat \u00e9", "n": "2"})
        self.assertEqual([(f.field, f.data) for f in form.files],
                         [("image[]", PNG), ("mask", b"\0\r\n--x")])
        self.assertEqual(form.files[1].describe(),
                         {"filename": "m.png", "content_type": "image/png", "bytes": 6})

    def test_refusals(self):
        """
        Not multipart, no boundary, cut short, a part without a name, text
        that is not UTF-8, too many parts: each a L{FormError} saying why.
        """
        raw, kind = encodeForm({"prompt": "x"}, [Upload("image", "a.png", "image/png", PNG)])
        cases = [
            (raw, "application/json", "multipart/form-data"),
            (raw, "multipart/form-data", "multipart/form-data"),
            (raw[:-12], kind, "could not be parsed"),
            (raw.replace(b'name="prompt"', b'filename="x"'), kind, "could not be parsed"),
            (encodeForm({"prompt": "x"}, [])[0].replace(b"x\r\n", b"\xff\r\n"), None,
             "not UTF-8"),
        ]
        for body, contentType, words in cases:
            if contentType is None:
                contentType = "multipart/form-data; boundary=" + body[2:body.index(b"\r")].decode()
            with self.assertRaises(FormError) as e:
                parseForm(body, contentType)
            self.assertIn(words, str(e.exception))
        many, kind = encodeForm({f"f{i}": "v" for i in range(MAX_PARTS + 1)}, [])
        self.assertRaises(FormError, parseForm, many, kind)


class CheckTests(SynchronousTestCase):
    """
    L{checkEmbeddings} and L{checkImages}.
    """

    def test_embeddings(self):
        for good in ("hi", ["a", "b"], [1, 2], [[1], [2, 3]]):
            checkEmbeddings({"input": good})
        for bad in (None, "", [], [""], ["a", 1], {"x": 1}, [[1], []]):
            with self.assertRaises(MediaRequestError) as e:
                checkEmbeddings({"input": bad})
            self.assertEqual(e.exception.param, "input")
        with self.assertRaises(MediaRequestError) as e:
            checkEmbeddings({"input": "x", "encoding_format": "int8"})
        self.assertEqual(e.exception.param, "encoding_format")

    def test_images(self):
        checkImages({"prompt": "a cat", "n": 3})
        checkImages({"prompt": "a cat", "n": "3"}, [Upload("image", "a", "image/png", PNG)])
        for body, uploads, param in [
            ({}, None, "prompt"), ({"prompt": " "}, None, "prompt"),
            ({"prompt": "x", "n": 11}, None, "n"), ({"prompt": "x", "n": True}, None, "n"),
            ({"prompt": "x", "stream": True}, None, "stream"),
            ({"prompt": "x"}, [Upload("mask", "m", "image/png", PNG)], "image"),
        ]:
            with self.assertRaises(MediaRequestError) as e:
                checkImages(body, uploads)
            self.assertEqual(e.exception.param, param)


class HostileFieldTests(SynchronousTestCase):
    """
    Integer fields a hostile key writes as text: a 400 naming the field,
    never a ValueError (a 500 at the entry, or a failed attempt after an
    account was chosen on an OAuth account).
    """

    def test_digitTexts(self):
        from relay.usage.tokens import requestedImages

        for text in ("9" * 5000, "\u00b2", "99999999999"):
            for name in ("n", "output_compression"):
                with self.assertRaises(MediaRequestError) as e:
                    checkImages({"prompt": "x", name: text})
                self.assertEqual(e.exception.param, name)
            self.assertEqual(requestedImages({"n": text}), 1)
        checkImages({"prompt": "x", "n": " 2 ", "output_compression": "0"})
        checkImages({"prompt": "x", "output_compression": 100})
        with self.assertRaises(MediaRequestError):
            checkImages({"prompt": "x", "output_compression": 101})
        tool = imagesToResponses({"prompt": "x", "output_compression": "9" * 5000}, (),
                                 None)["tools"][0]
        self.assertEqual(tool["output_compression"], "9" * 5000)  # checked before, never raises


class TranslationTests(SynchronousTestCase):
    """
    What goes upstream for each account type, and the answer back.
    """

    def test_paths(self):
        key, oauth = _account(), _account("oauth")
        self.assertEqual(mediaPath(_turn("embeddings", {}), key), "/embeddings")
        self.assertEqual(mediaPath(_turn("images", {}), key), "/images/generations")
        self.assertEqual(mediaPath(_turn("image_edits", {}), key), "/images/edits")
        self.assertEqual(mediaPath(_turn("images", {}), oauth), "/responses")
        self.assertEqual(mediaPath(_turn("image_edits", {}), oauth), "/responses")

    def test_apiKeyBodies(self):
        """
        On an API-key account the JSON goes as it is with the model mapped;
        an edit's form is encoded anew with its files.
        """
        account = _account(model_mapping={"gpt-image-1": "gpt-image-1.5"})
        body, kind = mediaBody(_turn("images", {"prompt": "x", "model": "gpt-image-1"}), account)
        self.assertEqual(kind, "application/json")
        self.assertEqual(json.loads(body), {"prompt": "x", "model": "gpt-image-1.5"})
        upload = (Upload("image", "a.png", "image/png", PNG),)
        body, kind = mediaBody(_turn("image_edits", {"prompt": "x"}, upload), account)
        form = parseForm(body, kind)
        self.assertEqual(form.fields, {"prompt": "x", "model": "gpt-image-1.5"})
        self.assertEqual(form.files, upload)

    def test_imagesToResponses(self):
        """
        The prompt and an edit's images in one user message, the tool with
        the request's settings (an unknown size left to the tool), the mask
        as C{input_image_mask}, the call forced; an image model's name runs
        on L{OAUTH_IMAGE_MODEL}, a mapped one as mapped.
        """
        uploads = [Upload("image[]", "a.png", "image/png", PNG),
                   Upload("mask", "m.png", "image/png", b"m")]
        body = imagesToResponses({"prompt": "hat", "size": "256x256", "quality": "high",
                                  "output_compression": "50", "n": "1"}, uploads,
                                 "gpt-image-1")
        self.assertEqual(body["model"], OAUTH_IMAGE_MODEL)
        self.assertEqual(body["tool_choice"], {"type": "image_generation"})
        self.assertEqual(body["tools"], [{
            "type": "image_generation", "quality": "high", "output_compression": 50,
            "input_image_mask": {"image_url": "data:image/png;base64,bQ=="}}])
        content = body["input"][0]["content"]
        self.assertEqual(content[0], {"type": "input_text", "text": "hat"})
        self.assertEqual(content[1], {"type": "input_image", "image_url":
                                      "data:image/png;base64," + base64.b64encode(PNG).decode()})
        self.assertEqual((body["stream"], body["store"]), (True, False))
        self.assertEqual(imagesToResponses({"prompt": "x"}, (), "gpt-5.5")["model"], "gpt-5.5")

    def test_imagesAnswer(self):
        items = [{"type": "message"}, {"type": "image_generation_call", "result": "QUJD",
                                       "revised_prompt": "r", "size": "1024x1024",
                                       "quality": "low"}]
        answer = imagesAnswer(items, {"usage": {"input_tokens": 3, "output_tokens": 4}}, 7)
        self.assertEqual(answer["data"], [{"b64_json": "QUJD", "revised_prompt": "r"}])
        self.assertEqual((answer["created"], answer["size"], answer["quality"]),
                         (7, "1024x1024", "low"))
        self.assertEqual(answer["usage"]["total_tokens"], 7)
        self.assertIsNone(imagesAnswer([{"type": "image_generation_call", "result": ""}], {}, 0))


def _event(kind: str, **fields) -> Event:
    return Event(kind.encode(), json.dumps(dict(fields, type=kind)).encode())


class ImagesSinkTests(SynchronousTestCase):
    """
    L{ImagesSink} around the real JSON sink.
    """

    def _sink(self):
        from relay.entry.sinks import JSONSink

        request = FakeRequest()
        turn = _turn("images", {"prompt": "x"})
        return ImagesSink(JSONSink(request, "images", "gpt-image-1"), turn, 5), request, turn

    def test_interface(self):
        self.assertTrue(verifyObject(ITurnSink, self._sink()[0]))

    def test_answer(self):
        """
        The tool's image, from its C{output_item.done}, becomes the images
        answer at C{response.completed} (whose C{output} is empty, as the
        ChatGPT backend's); the call is counted on the turn (R109).
        """
        sink, request, turn = self._sink()
        sink.commit({})
        sink.writeEvent(_event("response.created", response={}))
        sink.writeEvent(_event("response.output_item.done", item={
            "type": "image_generation_call", "result": "QUJD"}))
        sink.writeEvent(_event("response.completed", response={"output": [], "usage": {
            "input_tokens": 1, "output_tokens": 2}}))
        self.assertEqual(request.code, 200)
        body = json.loads(request.body)
        self.assertEqual(body["data"], [{"b64_json": "QUJD"}])
        self.assertEqual(body["created"], 5)
        self.assertEqual(turn.hostedCalls, {"image_generation": 1})

    def test_noImage(self):
        """
        A turn that ended without an image is a 502 in OpenAI's shape.
        """
        sink, request, _ = self._sink()
        sink.writeEvent(_event("response.completed", response={"output": [{"type": "message"}]}))
        self.assertEqual(request.code, 502)
        self.assertEqual(json.loads(request.body)["error"]["message"], NO_IMAGE_MESSAGE)

    def test_failed(self):
        """
        A failed upstream turn is the chat error envelope's status (R10).
        """
        sink, request, _ = self._sink()
        sink.writeEvent(_event("response.failed", response={"error": {
            "code": "rate_limit_exceeded", "message": "slow down"}}))
        self.assertEqual(request.code, 429)
        self.assertEqual(json.loads(request.body)["error"]["message"], "slow down")


class _Door:
    def __init__(self):
        self.turns = []

    def enter(self, turn, sink):
        self.turns.append((turn, sink))


class _Keys:
    def authenticate(self, request):
        return KEY


class ResourceTests(SynchronousTestCase):
    """
    L{MediaResource}: what it refuses before a turn, what turn it makes.
    """

    def _post(self, endpoint, raw: bytes, contentType: str, limit=None):
        door = _Door()
        resource = MediaResource(door, _Keys(), endpoint)
        request = DummyRequest([b""])
        request.method = b"POST"
        request.content = io.BytesIO(raw)
        request.requestHeaders.setRawHeaders(b"content-type", [contentType.encode()])
        if limit is not None:
            request.bodyLimit = limit
        resource.render(request)
        return request, door

    def _error(self, request):
        return json.loads(b"".join(request.written))["error"]

    def test_badForm(self):
        """
        A malformed form is OpenAI's 400 C{invalid_request_error}; no turn.
        """
        raw, kind = encodeForm({"prompt": "x"}, [Upload("image", "a", "image/png", PNG)])
        request, door = self._post("image_edits", raw[:-10], kind)
        self.assertEqual(request.responseCode, 400)
        error = self._error(request)
        self.assertEqual(error["type"], "invalid_request_error")
        self.assertIn("multipart/form-data", error["message"])
        self.assertEqual(door.turns, [])

    def test_oversize(self):
        """
        A form over the body limit is a 413; no turn.
        """
        raw, kind = encodeForm({"prompt": "x"}, [Upload("image", "a", "image/png", PNG * 100)])
        request, door = self._post("image_edits", raw, kind, limit=len(raw) - 1)
        self.assertEqual(request.responseCode, 413)
        self.assertEqual(door.turns, [])

    def test_editTurn(self):
        """
        A good form is a turn whose body holds the fields (never the
        files' bytes) and whose C{upload} holds the files.
        """
        raw, kind = encodeForm({"prompt": "x", "model": "gpt-image-1"},
                               [Upload("image", "a.png", "image/png", PNG)])
        request, door = self._post("image_edits", raw, kind)
        [(turn, _)] = door.turns
        self.assertEqual((turn.endpoint, turn.model, turn.stream),
                         ("image_edits", "gpt-image-1", False))
        self.assertEqual(turn.body, {"prompt": "x", "model": "gpt-image-1"})
        self.assertEqual(turn.upload[0].data, PNG)

    def test_embeddingsRefusals(self):
        """
        Embeddings without a model or with a bad input are 400s naming the
        field; images with a form body (not JSON) too.
        """
        for body, param in [({"input": "x"}, "model"), ({"model": "m", "input": []}, "input")]:
            request, door = self._post("embeddings", json.dumps(body).encode(),
                                       "application/json")
            self.assertEqual((request.responseCode, self._error(request)["param"]),
                             (400, param))
            self.assertEqual(door.turns, [])
        request, door = self._post("images", b"prompt=x", "application/x-www-form-urlencoded")
        self.assertEqual(request.responseCode, 400)


class CapabilityTests(SynchronousTestCase):
    """
    R115: the scheduler's capability filter.
    """

    def test_servesEndpoint(self):
        key, oauth = _account(), _account("oauth")
        self.assertTrue(key.servesEndpoint("embeddings"))
        self.assertFalse(oauth.servesEndpoint("embeddings"))
        for endpoint in ("responses", "chat", "images", "image_edits"):
            self.assertTrue(key.servesEndpoint(endpoint))
            self.assertTrue(oauth.servesEndpoint(endpoint))
        self.assertFalse(key.servesEndpoint("audio"))


class PriceTests(SynchronousTestCase):
    """
    R109, R115: images priced per image, by quality and size.
    """

    def test_counts(self):
        """
        An images answer counts its images under the request's quality and
        size; an OAuth turn's C{image_generation} calls become images.
        """
        turn = _turn("images", {"quality": "high", "size": "1024x1536"})
        counts = mediaCounts(turn, {"data": [{}, {}]}, None)
        self.assertEqual(counts.tools, (("images:high:1024x1536", 2),))
        self.assertEqual(imagesTool({"size": "auto"}), "images")
        self.assertEqual(imagesTool({"size": "256x256"}), "images::256x256")
        called = imageCalls(TokenCounts(requests=1, tools=(("image_generation", 1),)),
                            {"quality": "low"})
        self.assertEqual(called.tools, (("images:low", 1),))
        embeddings = TokenCounts(requests=1, input=5)
        self.assertIs(mediaCounts(_turn("embeddings", {}), {"data": [{}]}, embeddings),
                      embeddings)

    def test_pricedAsServed(self):
        """
        R109: a request that leaves the quality to the upstream (C{auto},
        or none) is priced at the quality and size the answer reports:
        C{quality: auto} served C{high} is a C{high} image ($0.167), not
        the family's medium ($0.042) - a budget key's 4x escape before.
        """
        for asked in ({"quality": "auto"}, {}, {"quality": "low"}):
            counts = mediaCounts(_turn("images", asked), {
                "data": [{}], "quality": "high", "size": "1536x1024"}, None)
            self.assertEqual(counts.tools, (("images:high:1536x1024", 1),), asked)
        counts = mediaCounts(_turn("images", {"quality": "low"}), {"data": [{}]}, None)
        self.assertEqual(counts.tools, (("images:low", 1),))

    def test_perImage(self):
        """
        The most specific priced name wins; a model without C{per_image}
        leaves the images unpriced (never free).
        """
        table = PriceTable(parsePrices({
            "gpt-image-1:high:1024x1536": {"per_image": 0.25},
            "my-image": {"input": 1.0, "output": 1.0},
        }))
        nanos = table.nanos("gpt-image-1", TokenCounts(
            requests=1, tools=(("images:high:1024x1536", 2),)))
        self.assertEqual(nanos, 500_000_000)
        self.assertEqual(table.perImage("gpt-image-1", "images:high:1024x1024"), 0.167)
        self.assertEqual(table.perImage("gpt-image-1", "images::1024x1024"), 0.042)
        self.assertEqual(table.perImage("dall-e-3", "images:hd"), 0.08)
        self.assertIsNone(table.nanos("my-image", TokenCounts(requests=1,
                                                               tools=(("images", 1),))))
        self.assertEqual(parsePrices({"x": {"per_image": 0.5}})["x"],
                         Price(input=0.0, output=0.0, per_image=0.5))
        self.assertEqual(table.lookup("text-embedding-3-small").input, 0.02)
