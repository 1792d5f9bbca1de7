"""
Tests for L{relay.scheduling.session}: the sticky session seed and hash (R37).
"""

from __future__ import annotations

import re

import xxhash
from twisted.trial.unittest import SynchronousTestCase

from relay.scheduling.session import (
    CONTENT_SEED_PREFIX,
    SESSION_HEADERS,
    contentSeed,
    sessionHash,
    sessionSeed,
    wsFallbackSeed,
)


class SessionSeedTests(SynchronousTestCase):
    """
    L{sessionSeed} picks the first non-empty R37 source.
    """

    def test_headerOrder(self):
        """
        R37 items 1-8: each header wins over every header after it, and
        over the body.
        """
        body = {"prompt_cache_key": "pck", "model": "m"}
        for index, name in enumerate(SESSION_HEADERS):
            headers = {later: f"v-{later}" for later in SESSION_HEADERS[index:]}
            self.assertEqual(sessionSeed(headers, body, "m"), f"v-{name}")

    def test_headerNamesAndOrder(self):
        """
        R37: the exact header list, with the relay's hyphen additions
        after their underscore forms.
        """
        self.assertEqual(
            SESSION_HEADERS,
            (
                "session_id", "session-id", "conversation_id", "conversation-id",
                "x-session-affinity", "x-session-id", "x-opencode-session",
                "x-conversation-id",
            ),
        )

    def test_emptyHeaderSkipped(self):
        """
        R37: a blank header is not a signal; the next source wins.
        """
        headers = {"session_id": "  ", "session-id": "codex-thread"}
        self.assertEqual(sessionSeed(headers, {}, None), "codex-thread")

    def test_listHeaderValue(self):
        """
        R37: a header given as a list of values uses the first.
        """
        self.assertEqual(sessionSeed({"x-session-id": ["a", "b"]}, {}, None), "a")

    def test_promptCacheKey(self):
        """
        R37 item 9: the body's C{prompt_cache_key} follows the headers.
        """
        self.assertEqual(
            sessionSeed({}, {"prompt_cache_key": "thread-1", "input": "hi"}, "m"), "thread-1"
        )

    def test_wsNestedResponse(self):
        """
        R37 item 9: a WebSocket frame of type C{response.*} reads the
        nested C{response} object.
        """
        frame = {
            "type": "response.create",
            "prompt_cache_key": "outer",
            "response": {"prompt_cache_key": "inner"},
        }
        self.assertEqual(sessionSeed({}, frame, "m"), "inner")
        frame = {"type": "response.create", "prompt_cache_key": "flat"}
        self.assertEqual(sessionSeed({}, frame, "m"), "flat")
        frame = {"type": "other", "prompt_cache_key": "outer",
                 "response": {"prompt_cache_key": "inner"}}
        self.assertEqual(sessionSeed({}, frame, "m"), "outer")

    def test_contentSeedChat(self):
        """
        R37 item 10: the content seed for chat C{messages} holds model,
        tools, functions, leading system/developer messages and the first
        user message, not later turns.
        """
        body = {
            "model": "gpt-5",
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [
                {"role": "system", "content": "be nice"},
                {"role": "developer", "content": "dev"},
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "answer"},
                {"role": "user", "content": "second"},
            ],
        }
        seed = sessionSeed({}, body, None)
        self.assertTrue(seed.startswith(CONTENT_SEED_PREFIX + "model=gpt-5"))
        self.assertIn("|tools=", seed)
        self.assertIn('|system="be nice"', seed)
        self.assertIn('|system="dev"', seed)
        self.assertIn('|first_user="first"', seed)
        self.assertNotIn("second", seed)
        self.assertNotIn("answer", seed)
        later = dict(body, messages=body["messages"] + [{"role": "user", "content": "third"}])
        self.assertEqual(sessionSeed({}, later, None), seed)

    def test_contentSeedResponses(self):
        """
        R37 item 10: the content seed works for Responses C{input} and
        C{instructions}, and key order in JSON does not change it.
        """
        body = {
            "model": "gpt-5",
            "instructions": "sys",
            "functions": [{"name": "a", "parameters": {"x": 1, "y": 2}}],
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        }
        seed = sessionSeed({}, body, None)
        self.assertIn("|instructions=sys", seed)
        self.assertIn("|functions=", seed)
        self.assertIn("|first_user=", seed)
        reordered = dict(body, functions=[{"parameters": {"y": 2, "x": 1}, "name": "a"}])
        self.assertEqual(sessionSeed({}, reordered, None), seed)
        self.assertEqual(
            contentSeed({"input": "hello"}, "m"), CONTENT_SEED_PREFIX + "model=m|first_user=hello"
        )

    def test_contentSeedModelArgument(self):
        """
        R37 item 10: the requested model argument is the seed's model.
        """
        self.assertEqual(
            sessionSeed({}, {"model": "body"}, "given"), CONTENT_SEED_PREFIX + "model=given"
        )

    def test_noSignal(self):
        """
        R37: no header, key or content gives no seed.
        """
        self.assertIsNone(sessionSeed({}, {}, None))
        self.assertIsNone(sessionSeed({}, None, None))


class SessionHashTests(SynchronousTestCase):
    """
    L{sessionHash} and L{wsFallbackSeed}.
    """

    def test_sixteenHexDigits(self):
        """
        R37: the hash is xxhash64 as 16 hex digits.
        """
        for seed in ("a", "session", "x" * 1000):
            self.assertRegex(sessionHash(seed, "key"), re.compile(r"^[0-9a-f]{16}$"))

    def test_xxhash64(self):
        """
        R37: the hash is xxhash64 of C{"{keyName}:{seed}"}.
        """
        self.assertEqual(
            sessionHash("abc", "alice"), xxhash.xxh64_hexdigest(b"alice:abc")
        )

    def test_scopedPerKey(self):
        """
        R37: two client keys sending the same session id get different
        hashes; the same key gets the same hash every time.
        """
        self.assertNotEqual(sessionHash("s", "alice"), sessionHash("s", "bob"))
        self.assertEqual(sessionHash("s", "alice"), sessionHash("s", "alice"))

    def test_noSeed(self):
        """
        R37: no seed means no hash.
        """
        self.assertIsNone(sessionHash(None, "alice"))
        self.assertIsNone(sessionHash("", "alice"))

    def test_wsFallbackSeed(self):
        """
        R37: the WebSocket fallback seed is
        C{openai_ws_ingress:{groupID}:{userID}:{apiKeyID}}.
        """
        self.assertEqual(wsFallbackSeed("alice"), "openai_ws_ingress:0:alice:alice")
        self.assertNotEqual(
            sessionHash(wsFallbackSeed("alice"), "alice"),
            sessionHash(wsFallbackSeed("bob"), "bob"),
        )
