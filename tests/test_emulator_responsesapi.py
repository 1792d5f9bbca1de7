"""
Unit tests for the emulator's Responses routes beyond the turn (issue 20; protocol.md 1, 2.8;
behaviour.md R87-R92): compaction turns and the compact endpoint, account-bound encrypted
content, stored and background responses, input token counts, the models manifest with its
ETag, and the turn-state header. Through L{treq.testing.StubTreq} on a L{Clock}.
"""

from __future__ import annotations

import json

from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.emulator import Emulator
from relay.emulator.sealing import seal, sealedFor
from relay.emulator.state import misplacedTrigger

TRIGGER = {"type": "compaction_trigger"}


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def sse(data: bytes) -> list:
    out = []
    for block in data.decode().split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
    return out


class _Base(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_800_000_000)
        self.emulator = Emulator(reactor=self.clock, config={
            "accept_any": False,
            "accounts": [{"name": "a1", "credential": "sk-a1"},
                         {"name": "a2", "credential": "sk-a2"}]})
        self.treq = StubTreq(self.emulator.site.resource)

    def request(self, method: str, path: str, body=None, credential: str = "sk-a1",
                headers=None):
        hdrs = {"Authorization": "Bearer " + credential, "Content-Type": "application/json"}
        hdrs.update(headers or {})
        data = json.dumps(body).encode() if body is not None else None
        d = self.treq.request(method, "http://emulator" + path, data=data, headers=hdrs)
        self.treq.flush()
        response = self.successResultOf(d)
        content = response.content()
        self.treq.flush()
        return response, self.successResultOf(content)

    def post(self, path, body, **kw):
        response, data = self.request("POST", path, body, **kw)
        return response.code, (json.loads(data) if data.startswith(b"{") else data)


class CompactionTurnTests(_Base):
    """
    protocol.md 2.8: a turn ending in C{compaction_trigger} answers one compaction item bound
    to the account; a misplaced trigger and another account's item are refused.
    """

    def test_httpCompactionTurn(self) -> None:
        """
        Non-stream on the API-key route: the output is exactly one compaction item sealed for
        the serving account; its usage is reported.
        """
        code, body = self.post("/v1/responses",
                               {"model": "gpt-5.5", "input": [user("hi"), TRIGGER]})
        self.assertEqual(code, 200)
        self.assertEqual([i["type"] for i in body["output"]], ["compaction"])
        self.assertEqual(sealedFor(body["output"][0]["encrypted_content"]), "a1")
        self.assertGreater(body["usage"]["input_tokens"], 0)

    def test_oauthStreamDeliversItemInItemDone(self) -> None:
        """
        On the OAuth route the item is in C{response.output_item.done} and
        C{response.completed} carries C{output: []}, as the ChatGPT backend does.
        """
        code, data = self.post("/backend-api/codex/responses", {
            "model": "gpt-5.5", "stream": True, "store": False,
            "input": [user("hi"), {"type": "function_call_output", "call_id": "c",
                                   "output": "x"}, TRIGGER]})
        self.assertEqual(code, 200)
        events = sse(data)
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        self.assertEqual([i["type"] for i in done], ["compaction"])
        self.assertEqual(events[-1]["type"], "response.completed")
        self.assertEqual(events[-1]["response"]["output"], [])

    def test_misplacedTrigger(self) -> None:
        """
        R89: a trigger that is not the last item (a replayed transcript) is refused with 400.
        """
        for items in ([user("a"), TRIGGER, user("b")], [TRIGGER, user("a"), TRIGGER]):
            code, body = self.post("/v1/responses", {"model": "gpt-5.5", "input": items})
            self.assertEqual(code, 400)
            self.assertEqual(body["error"]["code"], "invalid_compaction_trigger")
        self.assertFalse(misplacedTrigger([user("a"), TRIGGER]))
        self.assertFalse(misplacedTrigger([user("a")]))

    def test_accountBoundItems(self) -> None:
        """
        R89, R7: a compaction or reasoning item sealed by another account is refused with
        C{invalid_encrypted_content}; the producing account accepts it; content the emulator
        did not seal is accepted as is.
        """
        _, body = self.post("/v1/responses", {"model": "gpt-5.5", "input": [user("a"), TRIGGER]})
        item = body["output"][0]
        later = {"model": "gpt-5.5", "input": [item, user("next")]}
        code, other = self.post("/v1/responses", later, credential="sk-a2")
        self.assertEqual(code, 400)
        self.assertEqual(other["error"]["code"], "invalid_encrypted_content")
        self.assertEqual(self.post("/v1/responses", later)[0], 200)
        reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                     "encrypted_content": seal("a1", "reasoning")}
        self.assertEqual(self.post("/v1/responses", {"model": "m", "input": [reasoning]},
                                   credential="sk-a2")[0], 400)
        fixture = dict(reasoning, encrypted_content="gAAA-anything")
        self.assertEqual(self.post("/v1/responses", {"model": "m", "input": [fixture]},
                                   credential="sk-a2")[0], 200)

    def test_reasoningScript(self) -> None:
        """
        A script's C{reasoning: true} starts answers with an encrypted reasoning item, only
        when C{include} asks for it.
        """
        self.emulator.setScript("a1", {"reasoning": True})
        _, body = self.post("/v1/responses", {"model": "m", "input": "hi",
                                              "include": ["reasoning.encrypted_content"]})
        self.assertEqual([i["type"] for i in body["output"]], ["reasoning", "message"])
        self.assertEqual(sealedFor(body["output"][0]["encrypted_content"]), "a1")
        _, body = self.post("/v1/responses", {"model": "m", "input": "hi"})
        self.assertEqual([i["type"] for i in body["output"]], ["message"])


class CompactEndpointTests(_Base):
    """
    C{POST /v1/responses/compact} (protocol.md 1) on the API-key route; retired on OAuth.
    """

    def test_compact(self) -> None:
        """
        The compacted window: the user messages, then one sealed compaction item, with usage;
        not a generation.
        """
        code, body = self.post("/v1/responses/compact", {"model": "gpt-5.5", "input": [
            user("one"), {"type": "message", "role": "assistant", "content": "x"}, user("two")]})
        self.assertEqual(code, 200)
        self.assertEqual(body["object"], "response.compaction")
        self.assertEqual([(i["type"], i.get("role")) for i in body["output"]],
                         [("message", "user"), ("message", "user"), ("compaction", None)])
        self.assertEqual(sealedFor(body["output"][-1]["encrypted_content"]), "a1")
        self.assertGreater(body["usage"]["total_tokens"], 0)
        self.assertEqual(self.emulator.generationCount(), 0)

    def test_oauthRetired(self) -> None:
        """
        The ChatGPT backend answers 404 on C{/codex/responses/compact} (protocol.md 2.8).
        """
        code, _ = self.post("/backend-api/codex/responses/compact",
                            {"model": "gpt-5.5", "input": "hi"})
        self.assertEqual(code, 404)

    def test_faultsApply(self) -> None:
        """
        Scripted faults act on the compact endpoint too (so relay's failover can be shown).
        """
        self.emulator.setFault("a1", {"kind": "status", "code": 503, "times": 1})
        self.assertEqual(self.post("/v1/responses/compact", {"model": "m", "input": "x"})[0], 503)
        self.assertEqual(self.post("/v1/responses/compact", {"model": "m", "input": "x"})[0], 200)


class InputTokensTests(_Base):
    def test_count(self) -> None:
        """
        C{POST /v1/responses/input_tokens} answers what a turn with that body reports as its
        input tokens, and generates nothing; the OAuth route has no such route.
        """
        body = {"model": "gpt-5.5", "input": "count me please", "instructions": "be brief"}
        code, counted = self.post("/v1/responses/input_tokens", body)
        self.assertEqual(code, 200)
        self.assertEqual(counted["object"], "response.input_tokens")
        _, turn = self.post("/v1/responses", body)
        self.assertEqual(counted["input_tokens"], turn["usage"]["input_tokens"])
        self.assertEqual(self.emulator.generationCount(), 1)
        self.assertEqual(self.post("/backend-api/codex/responses/input_tokens", body)[0], 404)


class StoredResponseTests(_Base):
    """
    Retrieve, delete and input items of stored responses, for the owning account only.
    """

    def test_retrieveDeleteItems(self) -> None:
        _, created = self.post("/v1/responses", {"model": "m", "input": [user("a"), user("b")]})
        rid = created["id"]
        response, data = self.request("GET", f"/v1/responses/{rid}")
        self.assertEqual(response.code, 200)
        self.assertEqual(json.loads(data)["output"], created["output"])
        response, data = self.request("GET", f"/v1/responses/{rid}", credential="sk-a2")
        self.assertEqual(response.code, 404)
        response, data = self.request("GET", f"/v1/responses/{rid}/input_items")
        page = json.loads(data)
        self.assertEqual(page["object"], "list")
        self.assertEqual([i["content"][0]["text"] for i in page["data"]], ["b", "a"])
        self.assertTrue(all(i["id"] for i in page["data"]))
        response, data = self.request("GET", f"/v1/responses/{rid}/input_items?order=asc&limit=1")
        page = json.loads(data)
        self.assertEqual(([i["content"][0]["text"] for i in page["data"]], page["has_more"]),
                         (["a"], True))
        response, data = self.request("DELETE", f"/v1/responses/{rid}")
        self.assertEqual(json.loads(data), {"id": rid, "object": "response", "deleted": True})
        self.assertEqual(self.request("GET", f"/v1/responses/{rid}")[0].code, 404)
        self.assertEqual(self.emulator.generationCount(), 1)

    def test_storeFalseAndOAuth(self) -> None:
        """
        C{store: false} keeps nothing; the OAuth route knows no response id.
        """
        _, created = self.post("/v1/responses", {"model": "m", "input": "x", "store": False})
        self.assertEqual(self.request("GET", f"/v1/responses/{created['id']}")[0].code, 404)
        _, created = self.post("/v1/responses", {"model": "m", "input": "x"})
        path = f"/backend-api/codex/responses/{created['id']}"
        self.assertEqual(self.request("GET", path)[0].code, 404)

    def test_unknownSubPath(self) -> None:
        self.assertEqual(self.request("GET", "/v1/responses/r/x/y")[0].code, 404)
        self.assertEqual(self.request("PUT", "/v1/responses/compact")[0].code, 405)


class BackgroundTests(_Base):
    """
    R88: C{background: true} is answered C{queued}; the run goes on on the clock; polling,
    stream resume and cancel follow it; only the run's whole delivery is a generation.
    """

    def setUp(self) -> None:
        super().setUp()
        self.emulator.setScript("a1", {"delay": 1.0, "deltas": 3})

    def advance(self, seconds: float) -> None:
        """
        Move the clock in half-second steps (each event is scheduled from the last).
        """
        for _ in range(int(seconds / 0.5)):
            self.clock.advance(0.5)

    def test_pollToCompletion(self) -> None:
        _, created = self.post("/v1/responses", {"model": "m", "input": "x", "background": True})
        self.assertEqual((created["status"], created["background"]), ("queued", True))
        rid = created["id"]
        statuses = []
        for _ in range(15):
            _, data = self.request("GET", f"/v1/responses/{rid}")
            statuses.append(json.loads(data)["status"])
            self.clock.advance(1.0)
        self.assertEqual(statuses[0], "queued")
        self.assertIn("in_progress", statuses)
        self.assertEqual(statuses[-1], "completed")
        _, data = self.request("GET", f"/v1/responses/{rid}")
        final = json.loads(data)
        self.assertTrue(final["output"])
        self.assertTrue(final["usage"])
        self.assertEqual(self.emulator.generationCount(), 1)

    def test_cancel(self) -> None:
        _, created = self.post("/v1/responses", {"model": "m", "input": "x", "background": True})
        rid = created["id"]
        self.advance(3.5)
        code, cancelled = self.post(f"/v1/responses/{rid}/cancel", None)
        self.assertEqual((code, cancelled["status"]), (200, "cancelled"))
        self.assertEqual(self.post(f"/v1/responses/{rid}/cancel", None)[1]["status"], "cancelled")
        self.advance(60)
        self.assertEqual(self.emulator.generationCount(), 0)
        self.emulator.setScript("a1", None)
        _, plain = self.post("/v1/responses", {"model": "m", "input": "x"})
        self.assertEqual(self.post(f"/v1/responses/{plain['id']}/cancel", None)[0], 400)

    def test_streamResume(self) -> None:
        """
        C{?stream=true&starting_after=N} replays the events after N and follows the run live
        to its terminal event.
        """
        _, created = self.post("/v1/responses", {"model": "m", "input": "x", "background": True})
        rid = created["id"]
        self.advance(3.5)
        d = self.treq.get(f"http://emulator/v1/responses/{rid}?stream=true&starting_after=1",
                          headers={"Authorization": "Bearer sk-a1"})
        self.treq.flush()
        response = self.successResultOf(d)
        content = response.content()
        for _ in range(20):
            self.clock.advance(1.0)
            self.treq.flush()
        events = sse(self.successResultOf(content))
        self.assertEqual(events[0]["sequence_number"], 2)
        self.assertEqual([e["sequence_number"] for e in events],
                         list(range(2, 2 + len(events))))
        self.assertEqual(events[-1]["type"], "response.completed")
        self.assertEqual(self.emulator.generationCount(), 1)

    def test_backgroundStream(self) -> None:
        """
        C{background} with C{stream}: the events start with C{response.created} (status
        C{queued}) and C{response.queued}.
        """
        self.emulator.setScript("a1", {"delay": 0.0})
        d = self.treq.post("http://emulator/v1/responses", json.dumps(
            {"model": "m", "input": "x", "background": True, "stream": True}).encode(),
            headers={"Authorization": "Bearer sk-a1"})
        self.treq.flush()
        response = self.successResultOf(d)
        content = response.content()
        self.clock.advance(0)
        self.treq.flush()
        events = sse(self.successResultOf(content))
        self.assertEqual([e["type"] for e in events[:2]], ["response.created", "response.queued"])
        self.assertEqual(events[0]["response"]["status"], "queued")
        self.assertEqual(events[-1]["type"], "response.completed")


class ManifestAndTurnStateTests(_Base):
    def test_manifestETag(self) -> None:
        """
        R92: the OAuth route's manifest carries an ETag and answers a matching
        If-None-Match with 304 and no body.
        """
        response, data = self.request("GET", "/backend-api/codex/models?client_version=0.171.0")
        self.assertEqual(response.code, 200)
        manifest = json.loads(data)
        self.assertEqual(manifest["models"][0]["slug"], "gpt-5.5")
        etag = response.headers.getRawHeaders(b"etag")[0]
        response, data = self.request("GET", "/backend-api/codex/models?client_version=0.171.0",
                                      headers={"If-None-Match": etag})
        self.assertEqual((response.code, data), (304, b""))

    def test_turnState(self) -> None:
        """
        R90: the OAuth route answers with C{x-codex-turn-state}, the client's own when it sent
        one.
        """
        response, _ = self.request("POST", "/backend-api/codex/responses",
                                   {"model": "m", "input": "x", "stream": True})
        minted = response.headers.getRawHeaders(b"x-codex-turn-state")[0]
        self.assertTrue(minted.startswith(b"ts_"))
        response, _ = self.request("POST", "/backend-api/codex/responses",
                                   {"model": "m", "input": "x", "stream": True},
                                   headers={"x-codex-turn-state": "ts_mine"})
        self.assertEqual(response.headers.getRawHeaders(b"x-codex-turn-state"), [b"ts_mine"])

    def test_generationsEndpoint(self) -> None:
        """
        C{GET /_emulator/generations}: the counts, and (R107) every generation with the
        usage its answer reported, a Responses or a chat answer alike.
        """
        _, created = self.post("/v1/responses", {"model": "m", "input": "x"})
        _, chat = self.post("/v1/chat/completions",
                            {"model": "m", "messages": [{"role": "user", "content": "x"}]})
        response, data = self.request("GET", "/_emulator/generations")
        body = json.loads(data)
        self.assertEqual((body["total"], body["by_account"]), (2, {"a1": 2}))
        first, second = body["generations"]
        usage = created["usage"]
        self.assertEqual(first, {
            "time": first["time"], "account": "a1", "response_id": created["id"], "model": "m",
            "input_tokens": usage["input_tokens"], "cached_tokens": 0,
            "output_tokens": usage["output_tokens"], "reasoning_tokens": 0})
        self.assertEqual((second["response_id"], second["input_tokens"], second["output_tokens"]),
                         (chat["id"], chat["usage"]["prompt_tokens"],
                          chat["usage"]["completion_tokens"]))
        self.request("DELETE", "/_emulator/turns")
        _, data = self.request("GET", "/_emulator/generations")
        self.assertEqual(json.loads(data)["generations"], [])


class ItemReferenceTests(_Base):
    """
    Input items given by id (an C{item_reference}, an id-only item, a reasoning item without
    its encrypted content) are resolved from the account's stored responses, as the API does;
    one the account does not hold is OpenAI's 404 for an unknown item.
    """

    def stored(self) -> dict:
        code, created = self.post("/v1/responses", {"model": "m", "input": [user("remember")]})
        self.assertEqual(code, 200)
        return created

    def test_resolvedForTheAccount(self) -> None:
        created = self.stored()
        msg = created["output"][-1]["id"]
        _, data = self.request("GET", f"/v1/responses/{created['id']}/input_items")
        inputId = json.loads(data)["data"][0]["id"]
        for item in ({"type": "item_reference", "id": msg}, {"id": msg},
                     {"type": "item_reference", "id": inputId}):
            code, body = self.post("/v1/responses", {"model": "m", "input": [item, user("go")]})
            self.assertEqual(code, 200, body)

    def test_otherAccountUnknownDeleted(self) -> None:
        created = self.stored()
        msg = created["output"][-1]["id"]
        expected = {"message": f"Item with id '{msg}' not found.",
                    "type": "invalid_request_error", "param": "input", "code": None}
        body = {"model": "m", "input": [{"type": "item_reference", "id": msg}]}
        self.assertEqual(self.post("/v1/responses", body, credential="sk-a2"),
                         (404, {"error": expected}))
        code, answer = self.post("/v1/responses", dict(body, store=False), credential="sk-a2")
        self.assertEqual(code, 404)
        self.assertIn("Items are not persisted when `store` is set to false",
                      answer["error"]["message"])
        code, _ = self.post("/v1/responses", {"model": "m", "input": [
            {"type": "reasoning", "id": "rs_unknown", "summary": []}]})
        self.assertEqual(code, 404)
        self.request("DELETE", f"/v1/responses/{created['id']}")
        self.assertEqual(self.post("/v1/responses", body)[0], 404)

    def test_oauthStoresNothing(self) -> None:
        msg = self.stored()["output"][-1]["id"]
        code, answer = self.post("/backend-api/codex/responses", {
            "model": "m", "stream": True, "input": [{"type": "item_reference", "id": msg}]})
        self.assertEqual(code, 404)
        self.assertEqual(answer["error"]["param"], "input")

    def test_compactAndInputTokens(self) -> None:
        msg = self.stored()["output"][-1]["id"]
        for path in ("/v1/responses/compact", "/v1/responses/input_tokens"):
            for credential, expected in (("sk-a1", 200), ("sk-a2", 404)):
                code, _ = self.post(path, {"model": "m", "input": [
                    {"type": "item_reference", "id": msg}]}, credential=credential)
                self.assertEqual(code, expected, (path, credential))
