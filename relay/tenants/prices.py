# -*- test-case-name: tests.test_tenants_prices -*-
"""
Cost in money (issue 22 item 3): a price per model and the cost of a turn.

Prices are US dollars per 1M tokens: C{input}, C{cached_input}, C{output}
and C{reasoning}. Cached input tokens are part of the input and reasoning
tokens part of the output, as upstream counts them
(L{relay.usage.tokens.TokenCounts}), so a turn costs::

    (input - cached) * input + cached * cached_input
      + (output - reasoning) * output + reasoning * reasoning

C{cached_input} defaults to C{input} (no discount) and C{reasoning} to
C{output} (OpenAI bills reasoning tokens as output). Costs are kept as whole
nano-dollars (1e-9 USD) so sums are exact integers.

A model without a price is I{unpriced}: its turns are counted as unpriced,
never as free (L{PriceTable.cost} returns L{None}); a key with a money
budget may not use it (L{relay.tenants.policy}).

The shipped table (L{DEFAULT_PRICES}) covers the models relay knows, at
OpenAI's published standard-tier rates for prompts up to 272K input tokens
(the long-context tier above that is not modelled: such turns are costed at
the standard rate). Sources, read in 2026-06: OpenAI's pricing page as
mirrored in github/docs C{data/tables/copilot/models-and-pricing.yml}
(GPT-5.5, 5.4, 5.4 mini/nano, 5.3-Codex, 5 mini) and OpenAI's 2025 text
token table (GPT-5, 5 nano, 4.1 family, 4o family, o3, o4-mini). Prices
change: the C{prices:} section of the file overrides any of them, and
C{PUT /admin/prices} overrides both (L{relay.control.prices}).
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

from attrs import frozen

__all__ = ["DEFAULT_PRICES", "NANOS_PER_USD", "Price", "PriceTable", "usd"]

NANOS_PER_USD = 1_000_000_000


@frozen
class Price:
    """
    One model's price, US dollars per 1M tokens.

    @ivar input: uncached input tokens.
    @ivar output: output tokens other than reasoning.
    @ivar cached_input: cached input tokens; L{None} means C{input}.
    @ivar reasoning: reasoning tokens; L{None} means C{output}.
    """

    input: float
    output: float
    cached_input: Optional[float] = None
    reasoning: Optional[float] = None

    def nanos(self, counts) -> int:
        """
        The cost of C{counts} in nano-dollars.

        @param counts: a L{relay.usage.tokens.TokenCounts}.
        @rtype: L{int}
        """
        cached = min(counts.cached, counts.input)
        reasoning = min(counts.reasoning, counts.output)
        cachedPrice = self.input if self.cached_input is None else self.cached_input
        reasoningPrice = self.output if self.reasoning is None else self.reasoning
        # USD per 1M tokens = 1000 nano-dollars per token.
        total = (
            (counts.input - cached) * self.input
            + cached * cachedPrice
            + (counts.output - reasoning) * self.output
            + reasoning * reasoningPrice
        )
        return int(round(total * 1000))

    def asDict(self) -> dict:
        """
        @return: C{input}, C{cached_input}, C{output}, C{reasoning} with
            the defaults filled in (USD per 1M tokens).
        """
        return {
            "input": self.input,
            "cached_input": self.input if self.cached_input is None else self.cached_input,
            "output": self.output,
            "reasoning": self.output if self.reasoning is None else self.reasoning,
        }


def _p(input, cached, output) -> Price:
    return Price(input=input, cached_input=cached, output=output)


DEFAULT_PRICES: Mapping[str, Price] = {
    # GPT-5.5 / 5.4 family (standard tier, <= 272K input tokens).
    "gpt-5.5": _p(5.00, 0.50, 30.00),
    "gpt-5.4": _p(2.50, 0.25, 15.00),
    "gpt-5.4-mini": _p(0.75, 0.075, 4.50),
    "gpt-5.4-nano": _p(0.20, 0.02, 1.25),
    "gpt-5.3-codex": _p(1.75, 0.175, 14.00),
    "gpt-5.2": _p(1.75, 0.175, 14.00),
    "gpt-5.2-codex": _p(1.75, 0.175, 14.00),
    # GPT-5 family.
    "gpt-5": _p(1.25, 0.125, 10.00),
    "gpt-5-codex": _p(1.25, 0.125, 10.00),
    "gpt-5.1": _p(1.25, 0.125, 10.00),
    "gpt-5.1-codex": _p(1.25, 0.125, 10.00),
    "gpt-5-mini": _p(0.25, 0.025, 2.00),
    "gpt-5-nano": _p(0.05, 0.005, 0.40),
    # GPT-4.1 / 4o and the o-series.
    "gpt-4.1": _p(2.00, 0.50, 8.00),
    "gpt-4.1-mini": _p(0.40, 0.10, 1.60),
    "gpt-4.1-nano": _p(0.10, 0.025, 0.40),
    "gpt-4o": _p(2.50, 1.25, 10.00),
    "gpt-4o-mini": _p(0.15, 0.075, 0.60),
    "o3": _p(2.00, 0.50, 8.00),
    "o4-mini": _p(1.10, 0.275, 4.40),
}
"""The shipped prices (USD per 1M tokens); see the module docstring."""

_SNAPSHOT = re.compile(r"-\d{4}-\d{2}-\d{2}$")
"""A dated snapshot suffix (C{gpt-4.1-2025-04-14}) priced as its model."""


def usd(nanos: Optional[int]) -> Optional[float]:
    """
    @param nanos: nano-dollars, or L{None}.
    @return: dollars (a float rounded to 9 places), or L{None}.
    """
    if nanos is None:
        return None
    return round(nanos / NANOS_PER_USD, 9)


class PriceTable:
    """
    The prices in force: the shipped table, the file's C{prices:} on top,
    and the admin API's on top of both. A live reload replaces the file's
    (L{replace}), the control plane the admin's (L{setAdmin}).
    """

    def __init__(self, overrides: Optional[Mapping[str, Price]] = None,
                 defaults: Mapping[str, Price] = DEFAULT_PRICES):
        """
        @param overrides: model -> L{Price} from the configuration.
        @param defaults: the shipped table.
        """
        self._defaults = dict(defaults)
        self._table: dict = {}
        self._admin: dict = {}
        self.replace(overrides or {})

    def replace(self, overrides: Mapping[str, Price]) -> None:
        """
        Put the file's new overrides in force (a reload); the admin API's
        stay on top.

        @param overrides: model -> L{Price}.
        """
        self._overrides = dict(overrides)
        self._build()

    def setAdmin(self, prices: Mapping[str, Price]) -> None:
        """
        Put the prices set through the admin API in force (issue 22,
        L{relay.control.prices}): they win over the file's and the
        shipped ones.

        @param prices: model -> L{Price}.
        """
        self._admin = dict(prices)
        self._build()

    def _build(self) -> None:
        table = dict(self._defaults)
        table.update(self._overrides)
        table.update(self._admin)
        self._table = table

    def lookup(self, model: Optional[str]) -> Optional[Price]:
        """
        The price of C{model}: exact name, else its undated name.

        @param model: a model name (upstream or client), or L{None}.
        @return: the L{Price}, or L{None} when unpriced.
        """
        if not model:
            return None
        found = self._table.get(model)
        if found is None:
            base = _SNAPSHOT.sub("", model)
            if base != model:
                found = self._table.get(base)
        return found

    def cost(self, model: Optional[str], counts) -> Optional[int]:
        """
        The cost of one turn.

        @param model: the upstream model the turn ran on.
        @param counts: its L{relay.usage.tokens.TokenCounts}.
        @return: nano-dollars, or L{None} when the model is unpriced.
        """
        price = self.lookup(model)
        return None if price is None else price.nanos(counts)

    def priced(self, model: Optional[str], counts):
        """
        C{counts} with its cost filled in: C{cost} in nano-dollars, or
        C{unpriced} = its request count when the model has no price.

        @rtype: L{relay.usage.tokens.TokenCounts}
        """
        from relay.usage.tokens import TokenCounts

        price = self.lookup(model)
        nanos = None if price is None else price.nanos(counts)
        # (L{cost}, inline: issue 24.) Built directly: attrs.evolve costs a few microseconds per turn.
        if nanos is None:
            return TokenCounts(counts.requests, counts.input, counts.cached, counts.output,
                               counts.reasoning, 0, counts.requests, counts.estimated)
        return TokenCounts(counts.requests, counts.input, counts.cached, counts.output,
                           counts.reasoning, nanos, 0, counts.estimated)

    def view(self) -> dict:
        """
        @return: model -> the price's L{Price.asDict} plus C{source}
            (C{admin}, C{config} or C{default}: where the price in force
            comes from), for the admin API.
        """
        return {
            model: dict(price.asDict(), source="admin" if model in self._admin else (
                "config" if model in self._overrides else "default"))
            for model, price in sorted(self._table.items())
        }
