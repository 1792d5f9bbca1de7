"""
Budgets under parallel load and prices of what was served (behaviour.md
R108, R109), through the turn engine on a L{Clock} with memory state
(L{tests.tenantsrig.TenantsRig}).
"""

from __future__ import annotations

import json

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from relay.tenants.prices import Price, PriceTable, ToolPrice
from relay.usage.tokens import TokenCounts, fromBody
from tests.tenantsrig import TenantsRig, account, key
from tests.test_runner import CREATED, DELTA, IN_PROGRESS, ITEM_ADDED, frame, sse, status

DAY = 86400

# gpt-5.5 shipped: $5 input, $30 output per 1M tokens = 5,000 and 30,000
# nano-dollars per token.
ONE_TURN = 5_000 + 30_000
"""What the upstream's turn below costs (1 input, 1 output token)."""


def completed(tier=None, output=(), usage=None):
    """
    A C{response.completed} frame with C{service_tier} and output items.
    """
    response = {
        "id": "resp_1", "status": "completed",
        "output": [{"type": "message", "content": []}, *output],
        "usage": usage or {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2},
    }
    if tier is not None:
        response["service_tier"] = tier
    return frame("response.completed", response=response)


def slow(tier=None, output=(), delay=1.0):
    """
    A stream that takes C{delay} seconds before its first byte.
    """
    return sse(CREATED, IN_PROGRESS, ITEM_ADDED, DELTA, completed(tier, output), delay=delay)


class ReservationTests(SynchronousTestCase):
    """
    R108: a turn reserves its estimate before it is dialled; parallel turns
    see each other's reservations.
    """

    def parallel(self, client, n=40, body=None):
        rig = TenantsRig([account("a", concurrency=0)], keys=[client])
        rig.script("a", slow())
        sinks = []
        for i in range(n):
            turn = rig.turn(client, requestId=f"req{i}")
            turn.body.update(body or {}, input=[])  # 1 input token estimated
            sinks.append(rig.go(turn))
        rig.clock.advance(5)
        return rig, sinks

    def test_money_budget_holds_under_parallel_load(self):
        """
        40 turns start at once on a $0.0005 budget, each allowing 2 output
        tokens (an estimate of 65,000 nano-dollars): only those that find
        room after the others' reservations reach the upstream, and the
        spend ends within the budget plus one turn's cost. (Checked before
        and charged after, all 40 ran: $0.0014.)
        """
        client = key(daily_usd=0.0005)
        rig, sinks = self.parallel(client, body={"max_output_tokens": 2})
        outcomes = [outcome for _, outcome in sinks]
        served = outcomes.count(["completed"])
        self.assertEqual(len(rig.dialer.calls), served)
        self.assertEqual(served, 8)
        spent, _ = rig.ledger.spent("bob", rig.clock.seconds())
        self.assertLessEqual(spent, 500_000 + ONE_TURN)
        refused = [s.errors[0] for s, o in sinks if o == ["failed"]]
        self.assertEqual({(e.status, e.code) for e in refused}, {(429, "insufficient_quota")})
        self.assertIn("daily_usd", refused[0].message)
        self.assertEqual(self.successResultOf(rig.holds.outstanding("bob")), (0, 0))

    def test_token_budget_holds_under_parallel_load(self):
        """
        The same for C{daily_tokens}: 20 tokens, each turn holding 3
        (1 input, 2 output): 7 turns run, 14 tokens used.
        """
        client = key(daily_tokens=20)
        rig, sinks = self.parallel(client, body={"max_output_tokens": 2})
        self.assertEqual([o for _, o in sinks].count(["completed"]), 7)
        used, _ = rig.ledger.used("bob", rig.clock.seconds())
        self.assertLessEqual(used, 20 + 2)

    def test_key_cap_is_the_output_estimate(self):
        """
        Without C{max_output_tokens} the key's C{max_turn_output_tokens} is
        the output a turn holds: a cap of 32,000 output tokens ($0.96)
        leaves room for one turn at a time on a $0.90 budget.
        """
        client = key(daily_usd=0.9)
        rig, sinks = self.parallel(client, n=3)
        self.assertEqual([o for _, o in sinks], [["completed"], ["failed"], ["failed"]])
        small = key(daily_usd=0.9, max_turn_output_tokens=1000)
        rig, sinks = self.parallel(small, n=3)
        self.assertEqual([o for _, o in sinks], [["completed"]] * 3)

    def test_limit_an_oauth_account_drops_is_not_the_estimate(self):
        """
        The ChatGPT backend takes no C{max_output_tokens} (relay leaves it
        out of every OAuth request), so where the key may reach an OAuth
        account serving the model the key's C{max_turn_output_tokens} is the
        output a turn holds, not the body's limit: of 20 turns at once
        asking for 2 output tokens on a $0.0005 budget one runs (holding 2
        tokens each, 8 ran, each unbounded on the backend). An API-key pool
        honours the limit: the body's 2 tokens are held.
        """
        client = key(daily_usd=0.0005, max_turn_output_tokens=100)
        for kind, held, served in (("oauth", 100, 1), ("apikey", 2, 8)):
            rig = TenantsRig([account("a", type=kind, concurrency=0)], keys=[client])
            rig.script("a", slow())
            sinks = []
            for i in range(20):
                turn = rig.turn(client, requestId=f"req{i}")
                turn.body.update(max_output_tokens=2, input=[])
                sinks.append(rig.go(turn))
            self.assertEqual(self.successResultOf(rig.holds.outstanding("bob")),
                             (served * (1 + held), served * (5_000 + held * 30_000)), kind)
            rig.clock.advance(5)
            self.assertEqual([o for _, o in sinks].count(["completed"]), served, kind)

    def test_held_while_running_settled_at_the_end(self):
        """
        While the turn runs its estimate is held; its end settles the real
        cost and drops the hold.
        """
        client = key(daily_usd=5.0)
        rig = TenantsRig([account("a")], keys=[client])
        rig.script("a", slow())
        turn = rig.turn(client)
        turn.body.update(max_output_tokens=10, input=[])
        rig.go(turn)
        tokens, nanos = self.successResultOf(rig.holds.outstanding("bob"))
        self.assertEqual((tokens, nanos), (11, 5_000 + 10 * 30_000))
        rig.clock.advance(2)
        self.assertEqual(self.successResultOf(rig.holds.outstanding("bob")), (0, 0))
        self.assertEqual(rig.ledger.spent("bob", rig.clock.seconds())[0], ONE_TURN)

    def test_released_on_failure_before_output(self):
        """
        A turn that fails before output (the upstream's 400) gives its
        reservation back; so does a client that leaves while waiting.
        """
        client = key(daily_usd=5.0)
        rig = TenantsRig([account("a")], keys=[client])
        rig.script("a", status(400, {"error": {"message": "bad", "type": "invalid_request_error"}}))
        _, outcome = rig.go(rig.turn(client))
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(self.successResultOf(rig.holds.outstanding("bob")), (0, 0))
        rig.script("a", slow(delay=10))
        turn = rig.turn(client)
        _, outcome = rig.go(turn)
        self.assertNotEqual(self.successResultOf(rig.holds.outstanding("bob")), (0, 0))
        turn.cancel.cancel("client_gone")
        rig.clock.advance(1)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(self.successResultOf(rig.holds.outstanding("bob")), (0, 0))
        self.assertEqual(rig.ledger.spent("bob", rig.clock.seconds()), (0, 0))

    def test_chained_turn_holds_the_chain(self):
        """
        A turn chained by C{previous_response_id} also holds the chain's
        last input + output (a long conversation's next turn costs more).
        """
        client = key(daily_tokens=10_000_000)
        rig = TenantsRig([account("a")], keys=[client])
        big = {"input_tokens": 5000, "output_tokens": 1000, "total_tokens": 6000}
        rig.script("a", sse(CREATED, IN_PROGRESS, ITEM_ADDED, DELTA,
                            frame("response.completed", response={
                                "id": "resp_1", "status": "completed", "output": [],
                                "usage": big})),
                   slow())
        first = rig.turn(client)
        first.body.update(max_output_tokens=10, input=[])
        rig.go(first)
        second = rig.turn(client, previousResponseId="resp_1")
        second.body.update(max_output_tokens=10, previous_response_id="resp_1", input=[])
        rig.go(second)
        tokens, _ = self.successResultOf(rig.holds.outstanding("bob"))
        self.assertEqual(tokens, 1 + 6000 + 10)


class HoldStoreTests(SynchronousTestCase):
    """
    The ledger's side of R108: a store that fails, and a usage learnt
    after the hold was given back.
    """

    def test_store_down(self):
        """
        A hold store that fails admits the turn without a hold
        (C{fail_open}, checked against the known spend) or refuses it with
        a 503 (C{fail_closed}, R35).
        """
        from twisted.internet.defer import fail

        client = key(daily_usd=5.0)
        rig = TenantsRig([account("a")], keys=[client])

        class Down:
            def reserve(self, *args):
                return fail(RuntimeError("down"))

            def release(self, *args):
                return fail(RuntimeError("down"))

            def settle(self, *args):
                return fail(RuntimeError("down"))

            def chainTokens(self, *args):
                return fail(RuntimeError("down"))

            def rememberChain(self, *args):
                return fail(RuntimeError("down"))

        rig.ledger.holds = Down()
        _, outcome = rig.go(rig.turn(client))
        self.assertEqual(outcome, ["completed"])
        rig.ledger.onHoldError = "fail_closed"
        sink, outcome = rig.go(rig.turn(client))
        self.assertEqual((outcome, sink.errors[0].status), (["failed"], 503))
        self.flushLoggedErrors(RuntimeError)

    def test_settle_after_release(self):
        """
        A usage learnt after the turn gave its hold back (a background
        response, a drained stream) still counts at once.
        """
        client = key(daily_usd=5.0)
        rig = TenantsRig([account("a")], keys=[client])
        error, hold = self.successResultOf(Deferred.fromCoroutine(
            rig.ledger.reserve("bob", 10, 1000)))
        self.assertIsNone(error)
        rig.ledger.release(hold)
        rig.ledger.release(hold)
        rig.ledger.settle(hold, TokenCounts(requests=1, input=5, output=5, cost=700))
        rig.ledger.settle(hold, TokenCounts(requests=1, input=5, output=5, cost=700))
        now = rig.clock.seconds()
        settled = rig.holds._settled[("bob", f"d:{int(now // DAY) * DAY}")]
        self.assertEqual(settled[:2], (10, 700))


class ServedPriceTests(SynchronousTestCase):
    """
    R109: cost follows the served model, the response's service tier and
    its hosted-tool calls; what has no price is refused under a money
    budget before dialling, unless the table has a default.
    """

    def refused(self, rig, turn):
        sink, outcome = rig.go(turn)
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(rig.dialer.ids(), [], "an upstream request was made")
        [error] = sink.errors
        self.assertEqual((error.status, error.code), (403, "model_not_priced"))
        # R108: the refused turn gave its reservation back.
        self.assertEqual(self.successResultOf(rig.holds.outstanding("bob")), (0, 0))
        return error

    def test_mapped_unpriced_model_refused(self):
        """
        The client's model has a price, but the account serves it as an
        unpriced fine-tune: refused, naming the served model.
        """
        client = key(daily_usd=0.00001)
        rig = TenantsRig([account("a", model_mapping={"gpt-5.4-nano": "ft:gpt-x:org::1"})],
                         keys=[client])
        error = self.refused(rig, rig.turn(client, "gpt-5.4-nano"))
        self.assertIn("ft:gpt-x:org::1", error.message)

    def test_refused_when_the_account_is_chosen(self):
        """
        Of two accounts, the preferred one serves the model unpriced: the
        turn is refused when it is chosen, before any dial.
        """
        client = key(daily_usd=5.0)
        rig = TenantsRig([account("a", priority=1, model_mapping={"gpt-5.5": "ft:x"}),
                          account("b", priority=9)], keys=[client])
        error = self.refused(rig, rig.turn(client))
        self.assertEqual(error.param, "model")
        self.assertIn("ft:x", error.message)

    def test_default_price(self):
        """
        With C{prices.default} the unpriced served model is billed at it.
        """
        client = key(daily_usd=5.0)
        rig = TenantsRig([account("a", model_mapping={"gpt-5.5": "ft:x"})], keys=[client],
                         prices={"default": Price(input=1000.0, output=1000.0)})
        _, outcome = rig.go(rig.turn(client))
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.ledger.spent("bob", rig.clock.seconds())[0], 2_000_000)

    def test_served_model_price(self):
        """
        The cost is the served model's price, not the client's model's.
        """
        client = key(daily_usd=5.0)
        rig = TenantsRig([account("a", model_mapping={"gpt-5.5": "gpt-5-nano"})],
                         keys=[client])
        rig.go(rig.turn(client))
        # gpt-5-nano: $0.05 input, $0.40 output.
        self.assertEqual(rig.ledger.spent("bob", rig.clock.seconds())[0], 50 + 400)

    def test_tier_from_the_response(self):
        """
        A response served at C{priority} costs the tier's multiple (2x
        shipped), C{flex} half.
        """
        for tier, cost in (("priority", 2 * ONE_TURN), ("flex", ONE_TURN // 2),
                           ("default", ONE_TURN)):
            client = key(daily_usd=5.0)
            rig = TenantsRig([account("a")], keys=[client])
            rig.script("a", slow(tier=tier))
            turn = rig.turn(client)
            turn.body["service_tier"] = tier
            rig.go(turn)
            rig.clock.advance(2)
            self.assertEqual(rig.ledger.spent("bob", rig.clock.seconds())[0], cost, tier)

    def test_unpriced_tier_refused(self):
        """
        A tier without a price (C{scale}), asked in the request: refused,
        naming it.
        """
        client = key(daily_usd=5.0)
        rig = TenantsRig([account("a")], keys=[client])
        turn = rig.turn(client)
        turn.body["service_tier"] = "scale"
        error = self.refused(rig, turn)
        self.assertEqual(error.param, "service_tier")
        self.assertIn("`scale`", error.message)

    def test_unpriced_tier_served_settles_the_estimate(self):
        """
        A response served at a tier without a price though the request did
        not ask for it: the turn settles at its reservation (never free).
        """
        client = key(daily_usd=5.0)
        rig = TenantsRig([account("a")], keys=[client])
        rig.script("a", slow(tier="scale"))
        turn = rig.turn(client)
        turn.body.update(max_output_tokens=10, input=[])
        rig.go(turn)
        rig.clock.advance(2)
        self.assertEqual(self.successResultOf(rig.holds.outstanding("bob")), (0, 0))
        day = rig.holds._settled[("bob", f"d:{int(rig.clock.seconds() // DAY) * DAY}")]
        self.assertEqual(day[1], 5_000 + 10 * 30_000)

    def test_hosted_tool_calls(self):
        """
        Each hosted-tool call the response reports costs its per-call
        price (web search $0.01); a requested tool without a price
        (image generation ships none) is refused, naming it.
        """
        client = key(daily_usd=5.0)
        rig = TenantsRig([account("a")], keys=[client])
        calls = [{"type": "web_search_call", "id": f"ws_{i}", "status": "completed"}
                 for i in range(2)]
        rig.script("a", slow(output=calls))
        turn = rig.turn(client)
        turn.body["tools"] = [{"type": "web_search"}]
        rig.go(turn)
        rig.clock.advance(2)
        self.assertEqual(rig.ledger.spent("bob", rig.clock.seconds())[0],
                         ONE_TURN + 2 * 10_000_000)
        rig = TenantsRig([account("a")], keys=[client])
        turn = rig.turn(client)
        turn.body["tools"] = [{"type": "function", "name": "f"}, {"type": "image_generation"}]
        error = self.refused(rig, turn)
        self.assertEqual(error.param, "tools")
        self.assertIn("image_generation", error.message)

    def test_hosted_tool_calls_only_in_items(self):
        """
        The ChatGPT backend's terminal event lists no output: the calls
        are counted from the C{response.output_item.done} events.
        """
        client = key(daily_usd=5.0)
        rig = TenantsRig([account("a", type="oauth")], keys=[client])
        done = frame("response.output_item.done", output_index=0,
                     item={"type": "web_search_call", "id": "ws_1", "status": "completed"})
        rig.script("a", sse(CREATED, IN_PROGRESS, done, ITEM_ADDED, DELTA,
                            completed(output=()).replace(
                                b'"output": [{"type": "message", "content": []}]',
                                b'"output": []')))
        turn = rig.turn(client)
        turn.body["tools"] = [{"type": "web_search_preview"}]
        _, outcome = rig.go(turn)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.ledger.spent("bob", rig.clock.seconds())[0],
                         ONE_TURN + 10_000_000)

    def test_no_money_budget_no_refusal(self):
        """
        A key without a money budget is served on an unpriced model (its
        turns are counted unpriced).
        """
        client = key()
        rig = TenantsRig([account("a", model_mapping={"gpt-5.5": "ft:x"})], keys=[client])
        turn = rig.turn(client)
        turn.body["service_tier"] = "scale"
        _, outcome = rig.go(turn)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(turn.usage.unpriced, 1)


class PriceTableTests(SynchronousTestCase):
    """
    The price table's R109 entries.
    """

    def test_missing_and_default(self):
        table = PriceTable({"web_search": ToolPrice(0.02),
                            "ft:x": Price(input=1.0, output=2.0, priority=3.0)})
        self.assertEqual(table.missing("ft:x", "priority", ("web_search",)), [])
        self.assertEqual(table.missing("ft:x", "flex", ()),
                         [("service_tier", "service_tier `flex` of model `ft:x`")])
        self.assertEqual(table.missing("nope", None, ("image_generation",)),
                         [("model", "model `nope`"), ("tools", "tool `image_generation`")])
        table = PriceTable({"default": Price(input=1.0, output=1.0, flex=0.5, per_call=0.1)})
        self.assertEqual(table.missing("nope", "flex", ("image_generation",)), [])
        counts = TokenCounts(requests=1, input=1_000_000, tier="flex",
                             tools=(("image_generation", 2),))
        self.assertEqual(table.cost("nope", counts), 500_000_000 + 200_000_000)

    def test_read_from_a_response(self):
        """
        The tier and the hosted-tool calls are read from the response
        (C{default} is no tier).
        """
        body = {"service_tier": "priority", "usage": {"input_tokens": 3, "output_tokens": 4},
                "output": [{"type": "web_search_call"}, {"type": "file_search_call"},
                           {"type": "web_search_call"}, {"type": "function_call"}]}
        counts = fromBody(json.loads(json.dumps(body)))
        self.assertEqual((counts.tier, counts.tools),
                         ("priority", (("file_search", 1), ("web_search", 2))))
        self.assertIsNone(fromBody({"service_tier": "default", "usage": {
            "input_tokens": 1}}).tier)

    def test_config(self):
        """
        C{prices:} takes tier multipliers, hosted tools per call and
        C{default}; a tool without C{per_call}, or C{per_call} on a model,
        is one line naming the key.
        """
        from relay.configuration.parse import settingsFromString
        from relay.base.records import ConfigError

        config = settingsFromString(
            "prices:\n"
            "  gpt-5.5: {input: 1.25, output: 10.0, priority: 2.0, flex: 0.5}\n"
            "  web_search: {per_call: 0.01}\n"
            "  default: null\n"
            "keys: [{name: b, key: sk-b, daily_usd: 1, max_turn_output_tokens: 500}]\n")
        self.assertEqual(config.prices["gpt-5.5"].priority, 2.0)
        self.assertEqual(config.prices["web_search"], ToolPrice(0.01))
        self.assertNotIn("default", config.prices)
        self.assertEqual(config.keys[0].max_turn_output_tokens, 500)
        with self.assertRaises(ConfigError) as e:
            settingsFromString("prices: {web_search: {input: 1}}\n")
        self.assertIn("prices.web_search", str(e.exception))
        with self.assertRaises(ConfigError) as e:
            settingsFromString("prices: {gpt-5.5: {input: 1, output: 1, per_call: 1}}\n")
        self.assertIn("per_call", str(e.exception))
        with self.assertRaises(ConfigError) as e:
            settingsFromString("keys: [{name: b, key: sk-b, max_turn_output_tokens: x}]\n")
        self.assertIn("max_turn_output_tokens", str(e.exception))
