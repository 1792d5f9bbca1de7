"""
Issue 24: L{RedisService.execute} sends a script as C{EVALSHA} with its
SHA1 computed once per script text (txredisapi's C{eval} encodes and
hashes the whole script on every call), and as C{EVAL} when Redis does
not know it (C{NOSCRIPT}).
"""

from __future__ import annotations

import hashlib

import txredisapi
from twisted.trial.unittest import SynchronousTestCase

from tests.test_redisclient import _result, _service

SCRIPT = "return redis.call('GET', KEYS[1])"
SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()


class EvalShaTests(SynchronousTestCase):

    def test_scriptGoesAsEvalSha(self):
        """
        A script is sent by its SHA1 (no C{eval} call that would hash it
        again); its reply is the command's.
        """
        service, clock = _service()
        d = service.execute(2, "eval", SCRIPT, ["k"], ["a"])
        [(name, args, reply)] = service.pool.calls
        self.assertEqual((name, args), ("evalsha", (SHA, ["k"], ["a"])))
        reply.callback("v")
        self.assertEqual(_result(d), "v")

    def test_noScriptFallsBackToEval(self):
        """
        C{NOSCRIPT} (a restarted or failed-over Redis): the script is sent
        whole, and that reply is the command's.
        """
        service, clock = _service()
        d = service.execute(2, "eval", SCRIPT, ["k"], [])
        service.pool.calls[0][2].errback(txredisapi.ScriptDoesNotExist("No script"))
        [(name, args, reply)] = service.pool.calls[1:]
        self.assertEqual((name, args), ("eval", (SCRIPT, ["k"], [])))
        reply.callback("v")
        self.assertEqual(_result(d), "v")
        self.assertTrue(service.reachable)

    def test_otherErrorsAreNotRetried(self):
        """
        Any other error reply is the command's error, as before.
        """
        service, clock = _service()
        d = service.execute(2, "eval", SCRIPT, ["k"], [])
        service.pool.calls[0][2].errback(txredisapi.ResponseError("ERR syntax"))
        self.assertEqual(len(service.pool.calls), 1)
        self.assertTrue(_result(d).check(Exception))
