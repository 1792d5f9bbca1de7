"""
Tests for L{relay.base.modelname} (behaviour.md R110): one normalised model name
for key allow/deny lists, account C{models}, prices and metric labels,
while the name sent upstream is the client's (or the mapping's) unaltered.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from relay.base.records import Account
from relay.base.modelname import OTHER, ModelCatalogue, listed, mapped, matchKey, normalise
from relay.console.metrics import RelayMetrics
from relay.tenants.prices import DEFAULT_PRICES, PriceTable
from relay.usage.tokens import TokenCounts
from tests.tenantsrig import TenantsRig, account, key

FAMILIES = ("gpt-5.5", "gpt-5.4-mini", "o3", "gpt-4.1")


def acct(**kw) -> Account:
    return Account(id="a", type="apikey", base_url="http://u/v1", credential="c", **kw)


@st.composite
def variants(draw, family: str) -> str:
    """
    C{family} in any casing, with blanks around it and perhaps a dated
    snapshot suffix.
    """
    cased = "".join(c.upper() if draw(st.booleans()) else c for c in family)
    if draw(st.booleans()):
        year = draw(st.integers(2000, 2099))
        month = draw(st.integers(1, 12))
        day = draw(st.integers(1, 31))
        cased += f"-{year:04d}-{month:02d}-{day:02d}"
    blanks = st.text(alphabet=" \t\n", max_size=3)
    return draw(blanks) + cased + draw(blanks)


familyAndVariant = st.sampled_from(FAMILIES).flatmap(
    lambda f: st.tuples(st.just(f), variants(f)))


class NormaliseTests(SynchronousTestCase):
    """
    L{normalise}: trim, lower-case, a snapshot folded into a known family,
    a mapping applied.
    """

    def test_trim_and_case(self):
        self.assertEqual(matchKey("  GPT-5.5\t"), "gpt-5.5")
        self.assertIsNone(matchKey("   "))
        self.assertIsNone(matchKey(None))
        self.assertIsNone(matchKey(["gpt-5.5"]))
        self.assertEqual(normalise(" GPT-5.5 "), "gpt-5.5")

    def test_snapshot_folded_only_into_a_known_family(self):
        """
        A dated snapshot is its family when the family is known; an unknown
        family, or a snapshot known by its own name, stays as it is.
        """
        self.assertEqual(normalise("GPT-5.5-2026-04-23", {"gpt-5.5"}), "gpt-5.5")
        self.assertEqual(normalise("gpt-9-2026-04-23", {"gpt-5.5"}), "gpt-9-2026-04-23")
        self.assertEqual(normalise("gpt-5.5-2026-04-23"), "gpt-5.5-2026-04-23")
        self.assertEqual(
            normalise("gpt-5.5-2026-04-23", {"gpt-5.5", "gpt-5.5-2026-04-23"}),
            "gpt-5.5-2026-04-23")

    def test_mapping_applied(self):
        """
        The mapping's exact key, else its key equal after trimming and
        lower-casing; its value is given unaltered; a snapshot of a mapped
        name is not mapped.
        """
        mapping = {"Fast": "ft:gpt-4o-mini:Org::AbC"}
        self.assertEqual(mapped("Fast", mapping), "ft:gpt-4o-mini:Org::AbC")
        self.assertEqual(mapped(" FAST ", mapping), "ft:gpt-4o-mini:Org::AbC")
        self.assertIsNone(mapped("fast-2026-01-01", mapping))
        self.assertEqual(normalise("fast", mapping=mapping), "ft:gpt-4o-mini:org::abc")

    def test_lists(self):
        """
        R110's list match: the entry or its family, any case, trimmed; an
        entry that is a snapshot matches only that snapshot.
        """
        for name in ("gpt-5.5", "GPT-5.5", "gpt-5.5 ", "gpt-5.5-2026-04-23"):
            self.assertTrue(listed(name, ("gpt-5.5",)), name)
        self.assertFalse(listed("gpt-5.5-mini", ("gpt-5.5",)))
        self.assertFalse(listed("gpt-5.5", ("gpt-5.5-2026-04-23",)))
        self.assertTrue(listed("GPT-5.5-2026-04-23", ("gpt-5.5-2026-04-23",)))
        self.assertFalse(listed("gpt-5.5", None))
        self.assertFalse(listed(None, ("gpt-5.5",)))

    @settings(max_examples=300)
    @given(familyAndVariant, st.sampled_from([("http", "responses"), ("http", "chat"),
                                              ("ws", "responses")]))
    def test_property_a_denied_family_is_denied_in_every_spelling(self, pair, entry):
        """
        Property: any casing, blanks and snapshot suffix of a denied family
        is denied by the key policy (a turn on HTTP, chat or the WebSocket
        is refused with no upstream request), and an account serving the
        family serves it, while what it would send upstream is the client's
        name, byte for byte.
        """
        family, variant = pair
        self.assertTrue(listed(variant, (family,)))
        rig = TenantsRig([account("a1", models=(family,))])
        self.assertFalse(rig.policy.modelAllowed(key(deny_models=(family,)), variant))
        sink, outcome = rig.go(rig.turn(key(deny_models=(family,)), variant,
                                        entrypoint=entry[0], endpoint=entry[1]))
        self.assertEqual((outcome, sink.errors[0].code), (["failed"], "model_not_found"))
        self.assertEqual(rig.dialer.ids(), [])
        self.assertTrue(rig.policy.modelAllowed(key(models=(family,)), variant))
        served = acct(models=(family.upper(),))
        self.assertTrue(served.servesModel(variant))
        self.assertEqual(served.upstreamModel(variant), variant)

    @settings(max_examples=300)
    @given(st.text(max_size=40), st.dictionaries(st.text(max_size=10), st.text(max_size=20),
                                                 max_size=4))
    def test_property_the_upstream_name_is_never_altered(self, name, mapping):
        """
        Property: what an account sends upstream is the client's name or a
        value of its mapping, exactly; normalisation never changes it.
        """
        sent = acct(model_mapping=mapping).upstreamModel(name)
        self.assertTrue(sent == name or sent in mapping.values(), (name, sent))
        if name not in mapping and matchKey(name) not in {matchKey(k) for k in mapping}:
            self.assertEqual(sent, name)


class PriceTests(SynchronousTestCase):
    """
    Prices look the model up through the same normalisation.
    """

    def test_snapshot_costs_its_family(self):
        """
        A snapshot (and any case or blanks) is priced as its family, and
        the price found is the one under L{normalise}'s name for the
        table's names.
        """
        table = PriceTable()
        counts = TokenCounts(1, 1000, 100, 500, 50)
        family = table.cost("gpt-5.5", counts)
        self.assertEqual(normalise("gpt-5.5-2026-04-23", table.names()), "gpt-5.5")
        for name in ("gpt-5.5-2026-04-23", "GPT-5.5", " gpt-5.5 ", "Gpt-5.5-2026-04-23"):
            self.assertEqual(table.lookup(name), DEFAULT_PRICES["gpt-5.5"], name)
            self.assertEqual(table.cost(name, counts), family, name)
        self.assertIsNone(table.lookup("gpt-9"))

    def test_configured_names_fold_too(self):
        """
        A configured price named in another case prices every spelling.
        """
        from relay.tenants.prices import Price

        table = PriceTable({"My-FT": Price(input=1.0, output=2.0)})
        self.assertEqual(table.lookup("my-ft").input, 1.0)
        self.assertEqual(table.lookup("MY-FT-2026-01-02").input, 1.0)


class CatalogueTests(SynchronousTestCase):
    """
    L{ModelCatalogue}: what relay knows, and the metric label.
    """

    def test_label(self):
        accounts = [acct(models=("gpt-5.5",), model_mapping={"fast": "my-ft"})]
        catalogue = ModelCatalogue(lambda: accounts, PriceTable())
        self.assertEqual(catalogue.label("GPT-5.5-2026-04-23"), "gpt-5.5")
        self.assertEqual(catalogue.label("gpt-4.1"), "gpt-4.1")
        self.assertEqual(catalogue.label("FAST"), "fast")
        self.assertEqual(catalogue.label("my-ft"), "my-ft")
        self.assertEqual(catalogue.label("made-up-" + "x" * 50), OTHER)
        self.assertEqual(catalogue.label(None), OTHER)
        accounts.append(acct(models=("new-model",)))
        self.assertEqual(catalogue.label("new-model"), "new-model")

    def test_remembered_labels_follow_every_change(self):
        """
        R110: a label remembered per name is never stale: a model an
        account or the price table gains or loses changes the next label
        (the remembered names are forgotten with the set they were read
        against), and at most C{CANONICAL_MEMO} names are kept.
        """
        from relay.base import modelname

        accounts = (acct(models=("alpha",)),)
        holder = [accounts]
        prices = PriceTable()
        catalogue = ModelCatalogue(lambda: holder[0], prices)
        self.assertEqual(catalogue.label("beta-2026-01-02"), OTHER)
        self.assertEqual(catalogue.label("ALPHA-2026-01-02"), "alpha")
        holder[0] = (acct(models=("beta",)),)
        self.assertEqual(catalogue.label("beta-2026-01-02"), "beta")
        self.assertEqual(catalogue.label("ALPHA-2026-01-02"), OTHER)
        holder[0] = (acct(models=("beta", "beta-2026-01-02")),)
        self.assertEqual(catalogue.label("beta-2026-01-02"), "beta-2026-01-02")
        holder[0] = accounts
        self.assertEqual(catalogue.label("ALPHA-2026-01-02"), "alpha")
        for i in range(3 * modelname.CANONICAL_MEMO):
            catalogue.label(f"client-name-{i}")
        self.assertLessEqual(len(catalogue._canonical[1]), modelname.CANONICAL_MEMO)
        self.assertEqual(catalogue.label("ALPHA"), "alpha")

    def test_metrics_labels_are_bounded(self):
        """
        R110: C{relay_tokens_total}'s C{model} label is the known
        normalised name or C{other}: a thousand client-chosen names add
        one series.
        """
        metrics = RelayMetrics(multiprocessDir=None)
        metrics.models = ModelCatalogue(lambda: (), PriceTable())
        counts = TokenCounts(1, 10, 0, 5, 0)
        for i in range(1000):
            metrics.tokens("k", "a", f"client-name-{i}", counts)
        metrics.tokens("k", "a", "GPT-5.5-2026-04-23", counts)
        models = {s.labels["model"] for m in metrics.registry.collect()
                  if m.name == "relay_tokens" for s in m.samples}
        self.assertEqual(models, {"other", "gpt-5.5"})


class PolicyTests(SynchronousTestCase):
    """
    The key policy and selection use the normalised name on a real
    runner (HTTP, chat and WebSocket turns alike go through it).
    """

    def capture(self, rig):
        sent = []
        request = rig.dialer.request

        def recording(account, method, path, body, headers, timeouts):
            sent.append(json.loads(body)["model"])
            return request(account, method, path, body, headers, timeouts)

        rig.dialer.request = recording
        return sent

    def test_deny_list_denies_every_spelling(self):
        """
        C{deny_models: [gpt-5.5]} refuses C{gpt-5.5-2026-04-23},
        C{GPT-5.5} and C{"gpt-5.5 "} with a 403 before any upstream
        request, on every entrypoint.
        """
        for entrypoint, endpoint in (("http", "responses"), ("http", "chat"),
                                     ("ws", "responses")):
            rig = TenantsRig([account("a1")])
            client = key(deny_models=("gpt-5.5",))
            for name in ("gpt-5.5-2026-04-23", "GPT-5.5", "gpt-5.5 "):
                sink, outcome = rig.go(rig.turn(client, name, entrypoint=entrypoint,
                                                endpoint=endpoint))
                self.assertEqual(outcome, ["failed"], (entrypoint, endpoint, name))
                [error] = sink.errors
                self.assertEqual((error.status, error.code), (403, "model_not_found"))
            self.assertEqual(rig.dialer.ids(), [])
            _, outcome = rig.go(rig.turn(client, "gpt-5.4", entrypoint=entrypoint,
                                         endpoint=endpoint))
            self.assertEqual(outcome, ["completed"])

    def test_alias_of_a_denied_model_is_denied(self):
        """
        An operator alias (C{model_mapping}) mapped to a denied model is
        denied too; the same alias on an account mapping it elsewhere is
        not.
        """
        rig = TenantsRig([account("a1", model_mapping={"fast": "GPT-5.5-2026-04-23"})])
        sink, outcome = rig.go(rig.turn(key(deny_models=("gpt-5.5",)), "Fast"))
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(sink.errors[0].code, "model_not_found")
        self.assertIn("maps it", sink.errors[0].message)
        self.assertEqual(rig.dialer.ids(), [])
        rig = TenantsRig([account("a1", model_mapping={"fast": "gpt-5.4-mini"})])
        _, outcome = rig.go(rig.turn(key(deny_models=("gpt-5.5",)), "fast"))
        self.assertEqual(outcome, ["completed"])

    def test_allow_list_allows_snapshots_sent_unaltered(self):
        """
        Allowing C{gpt-5.5} allows its snapshot; an account whose
        C{models} lists C{gpt-5.5} serves it; upstream gets the client's
        name exactly; the turn is priced as the family.
        """
        rig = TenantsRig([account("a1", models=("gpt-5.5",))])
        sent = self.capture(rig)
        client = key(models=("gpt-5.5",))
        _, outcome = rig.go(rig.turn(client, "gpt-5.5-2026-04-23"))
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(sent, ["gpt-5.5-2026-04-23"])
        [record] = rig.records()
        self.assertFalse(record.unpriced)

    def test_mapping_applies_whatever_the_case(self):
        """
        An alias in another case is mapped; the mapping's value goes
        upstream unaltered.
        """
        rig = TenantsRig([account("a1", models=("ft:gpt-4o:Org::X",),
                                  model_mapping={"fast": "ft:gpt-4o:Org::X"})])
        sent = self.capture(rig)
        _, outcome = rig.go(rig.turn(key(), " FAST"))
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(sent, ["ft:gpt-4o:Org::X"])

    def test_unknown_model_refused_before_an_account(self):
        """
        When every account has a C{models} list, a name that normalises
        to none of them is refused (404 C{model_not_found}) before an
        account is chosen; any spelling of a served name is served.
        """
        rig = TenantsRig([account("a1", models=("gpt-5.5",)),
                          account("a2", models=("gpt-4.1",))])
        sink, outcome = rig.go(rig.turn(key(), "gpt-5.6"))
        self.assertEqual(outcome, ["failed"])
        [error] = sink.errors
        self.assertEqual((error.status, error.code), (404, "model_not_found"))
        self.assertEqual(rig.dialer.ids(), [])
        _, outcome = rig.go(rig.turn(key(), "GPT-4.1-2025-04-14 "))
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.ids(), ["a2"])


