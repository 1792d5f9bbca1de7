"""
The emulator shapes issue 13 items 4-5 rehearse: silence after K events
(C{stall_after_events}), pinned usage numbers, and C{response.incomplete}
when C{max_output_tokens} is reached.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.emulator.state import (
    ReplyScript,
    buildTurn,
    chatChunks,
    chooseReply,
    parseFault,
    parseScript,
)
from relay.emulator.stream import EventPump, stallOf

PINNED = {"input_tokens": 120, "cached_tokens": 100, "output_tokens": 30, "reasoning_tokens": 12}


class StallTests(SynchronousTestCase):
    """
    C{stall_after_events}: send K events, nothing for N seconds, the rest.
    """

    def test_parse(self):
        """
        The fault needs C{events} and C{seconds}.
        """
        fault = parseFault({"kind": "stall_after_events", "events": 4, "seconds": 40})
        self.assertEqual(stallOf(fault), {"stallAt": 4, "stallFor": 40.0})
        self.assertEqual(stallOf(None), {})
        self.assertEqual(stallOf(parseFault({"kind": "delay_first_output", "seconds": 1})), {})
        for spec in ({"kind": "stall_after_events", "events": 4},
                     {"kind": "stall_after_events", "seconds": 4}):
            self.assertRaises(ValueError, parseFault, spec)

    def test_pump_pauses_after_k_events(self):
        """
        The pump sends K events at once, then waits N seconds.
        """
        clock = Clock()
        sent = []
        pump = EventPump(clock=clock, events=list(range(6)), send=sent.append,
                         **stallOf(parseFault({"kind": "stall_after_events", "events": 4,
                                               "seconds": 40})))
        pump.start()
        self.assertEqual(sent, [0, 1, 2, 3])
        clock.advance(39)
        self.assertEqual(sent, [0, 1, 2, 3])
        clock.advance(1)
        self.assertEqual(sent, list(range(6)))


class UsageShapeTests(SynchronousTestCase):
    """
    Pinned usage and C{response.incomplete} (protocol.md 2.5, 2.7, 3).
    """

    def test_pinned_responses_usage(self):
        """
        A script's C{usage} numbers appear in the terminal usage object.
        """
        script = parseScript({"usage": PINNED})
        turn = buildTurn({"input": "hi"}, chooseReply(script, [], "a1", "m"), 0.0,
                         usage=script.usage)
        usage = turn.final["usage"]
        self.assertEqual(usage, {
            "input_tokens": 120, "input_tokens_details": {"cached_tokens": 100},
            "output_tokens": 30, "output_tokens_details": {"reasoning_tokens": 12},
            "total_tokens": 150,
        })

    def test_pinned_chat_usage(self):
        """
        Chat usage carries prompt/completion tokens and their details.
        """
        script = parseScript({"usage": PINNED})
        chunks, completion = chatChunks({"messages": []}, chooseReply(script, [], "a", "m"), 0.0,
                                        True, usage=script.usage)
        self.assertEqual(chunks[-1]["usage"]["prompt_tokens_details"], {"cached_tokens": 100})
        self.assertEqual(completion["usage"]["completion_tokens"], 30)
        self.assertEqual(
            completion["usage"]["completion_tokens_details"], {"reasoning_tokens": 12}
        )

    def test_bad_usage_script(self):
        """
        Unknown usage keys or non-integer numbers are refused.
        """
        for usage in ({"tokens": 1}, {"input_tokens": -1}, {"input_tokens": "7"}, [1]):
            self.assertRaises(ValueError, parseScript, {"usage": usage})

    def test_max_output_tokens_is_incomplete(self):
        """
        A reply longer than C{max_output_tokens} ends with
        C{response.incomplete}, reason C{max_output_tokens}, text cut.
        """
        reply = chooseReply(ReplyScript(text="x" * 400), [], "a1", "m")
        turn = buildTurn({"input": "hi", "max_output_tokens": 16}, reply, 0.0)
        last = turn.events[-1]
        self.assertEqual(last["type"], "response.incomplete")
        self.assertEqual(last["response"]["status"], "incomplete")
        self.assertEqual(last["response"]["incomplete_details"], {"reason": "max_output_tokens"})
        self.assertEqual(last["response"]["output"][0]["content"][0]["text"], "x" * 64)
        whole = buildTurn({"input": "hi", "max_output_tokens": 1000}, reply, 0.0)
        self.assertEqual(whole.events[-1]["type"], "response.completed")
