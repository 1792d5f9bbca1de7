# -*- test-case-name: tests.test_tenants_prices -*-
"""
Cost in money: a price per model and the cost of a turn.

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
budget may not use it (L{relay.tenants.keypolicy}).

The shipped table (L{DEFAULT_PRICES}) covers the models relay knows, at
OpenAI's published standard-tier rates for prompts up to 272K input tokens
(the long-context tier above that is not modelled: such turns are costed at
the standard rate). Sources, read in 2026-06: OpenAI's pricing page as
mirrored in github/docs C{data/tables/copilot/models-and-pricing.yml}
(GPT-5.5, 5.4, 5.4 mini/nano, 5.3-Codex, 5 mini) and OpenAI's 2025 text
token table (GPT-5, 5 nano, 4.1 family, 4o family, o3, o4-mini). Prices
change: the C{prices:} section of the file overrides any of them, and
C{PUT /admin/prices} overrides both (L{relay.control.prices}).

What was served (behaviour.md R109): a turn is priced by the model the
account served (after its C{model_mapping}), the response's
C{service_tier} and each hosted-tool call it reports:

  - a tier multiplies the token cost: C{default}/C{auto} (or none) 1x,
    C{priority} and C{flex} the price's own C{priority}/C{flex}
    multipliers; the shipped models have OpenAI's ratios
    (L{SHIPPED_TIERS}: priority 2x, flex 0.5x); any other tier
    (C{scale}) has no price unless the table's default gives one;
  - a hosted tool (L{HOSTED_TOOLS}: C{web_search}, C{file_search},
    C{code_interpreter}, C{image_generation}) costs C{per_call} dollars
    per call (L{ToolPrice}); shipped: web search $0.01 and file search
    $0.0025 a call, code interpreter $0.03 a session (OpenAI's 2025
    tool table); image generation has no shipped price (its cost
    depends on size and quality);
  - images (R115): an image model's price carries C{per_image} dollars
    (L{Price.per_image}; its token prices may be 0), refined by names
    C{<model>:<quality>}, C{<model>:<size>} and
    C{<model>:<quality>:<size>} (L{PriceTable.perImage}); shipped:
    C{gpt-image-1} $0.042 (C{:low} $0.011, C{:high} $0.167),
    C{dall-e-3} $0.04 (C{:hd} $0.08), C{dall-e-2} $0.02 an image, and the
    embeddings models per 1M input tokens;
  - C{prices.default} (L{PriceTable.default}): a L{Price} (which may
    carry C{per_call}) for any model, tier or tool without one; L{None}
    (the default) leaves them unpriced, and a key with a money budget
    is refused them (C{model_not_priced}, L{PriceTable.missing}).
"""

from __future__ import annotations

from typing import Mapping, Optional

from attrs import frozen
from zope.interface import implementer

from relay.interfaces import IPriceTable
from relay.base.modelname import matchKey, normalise
from relay.usage.tokens import HOSTED_TOOLS, IMAGES, TokenCounts, hostedTool

__all__ = [
    "DEFAULT_PRICES", "DEFAULT_TOOL_PRICES", "HOSTED_TOOLS", "NANOS_PER_USD", "Price",
    "PriceTable", "SHIPPED_TIERS", "ToolPrice", "hostedTool", "requestTier", "requestTools",
    "usd",
]

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
    priority: Optional[float] = None
    """R109: the multiplier of the C{priority} service tier, or L{None}."""
    flex: Optional[float] = None
    """R109: the multiplier of the C{flex} service tier, or L{None}."""
    per_call: Optional[float] = None
    """R109: on C{prices.default} only, dollars per hosted-tool call of a
    tool without its own price."""
    per_image: Optional[float] = None
    """R109, R115: dollars per image an images request made (an image
    model's price; the token prices may then be 0)."""

    def nanos(self, counts, multiplier: float = 1.0) -> int:
        """
        The cost of C{counts}' tokens in nano-dollars.

        @param counts: a L{relay.usage.tokens.TokenCounts}.
        @param multiplier: the service tier's (R109), 1 for the default tier.
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
        return int(round(total * 1000 * multiplier))

    def asDict(self) -> dict:
        """
        @return: C{input}, C{cached_input}, C{output}, C{reasoning} with
            the defaults filled in (USD per 1M tokens), and C{priority},
            C{flex}, C{per_call}, C{per_image} when set (R109).
        """
        out = {
            "input": self.input,
            "cached_input": self.input if self.cached_input is None else self.cached_input,
            "output": self.output,
            "reasoning": self.output if self.reasoning is None else self.reasoning,
        }
        for name in ("priority", "flex", "per_call", "per_image"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


@frozen
class ToolPrice:
    """
    A hosted tool's price (R109): US dollars per call the response reports.

    @ivar per_call: dollars per call.
    """

    per_call: float

    def asDict(self) -> dict:
        """
        @return: C{{"per_call": dollars}}.
        """
        return {"per_call": self.per_call}


SHIPPED_TIERS: Mapping[str, float] = {"priority": 2.0, "flex": 0.5}
"""The tier multipliers of the shipped prices (OpenAI's ratios, R109)."""

DEFAULT_TOOL_PRICES: Mapping[str, ToolPrice] = {
    "web_search": ToolPrice(0.01),
    "file_search": ToolPrice(0.0025),
    "code_interpreter": ToolPrice(0.03),
}
"""The shipped hosted-tool prices (see the module docstring)."""

_PLAIN_TIERS = frozenset({None, "", "default", "auto"})
"""Service tiers billed at the standard rate."""


def requestTier(body) -> Optional[str]:
    """
    R109: the C{service_tier} a request asks for (C{default}/C{auto}/none:
    L{None}).
    """
    tier = body.get("service_tier") if isinstance(body, dict) else None
    return tier if isinstance(tier, str) and tier not in _PLAIN_TIERS else None


def requestTools(body) -> tuple:
    """
    R109: the hosted tools (L{HOSTED_TOOLS}) a request's C{tools} offers,
    sorted, each once.
    """
    tools = body.get("tools") if isinstance(body, dict) else None
    if not isinstance(tools, list):
        return ()
    found = {hostedTool(t.get("type")) for t in tools if isinstance(t, dict)}
    return tuple(sorted(t for t in found if t is not None))


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
    # Embeddings (input only).
    "text-embedding-3-small": _p(0.02, 0.02, 0.0),
    "text-embedding-3-large": _p(0.13, 0.13, 0.0),
    "text-embedding-ada-002": _p(0.10, 0.10, 0.0),
    # Image models, per image (R115): medium (gpt-image-1) or standard
    # quality at 1024x1024; the refinements by quality and size below.
    "gpt-image-1": Price(input=0.0, output=0.0, per_image=0.042),
    "gpt-image-1:low": Price(input=0.0, output=0.0, per_image=0.011),
    "gpt-image-1:high": Price(input=0.0, output=0.0, per_image=0.167),
    "dall-e-3": Price(input=0.0, output=0.0, per_image=0.04),
    "dall-e-3:hd": Price(input=0.0, output=0.0, per_image=0.08),
    "dall-e-2": Price(input=0.0, output=0.0, per_image=0.02),
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

def usd(nanos: Optional[int]) -> Optional[float]:
    """
    @param nanos: nano-dollars, or L{None}.
    @return: dollars (a float rounded to 9 places), or L{None}.
    """
    if nanos is None:
        return None
    return round(nanos / NANOS_PER_USD, 9)


@implementer(IPriceTable)
class PriceTable:
    """
    The prices in force: the shipped table, the file's C{prices:} on top,
    and the admin API's on top of both. A live reload replaces the file's
    (L{replace}), the control plane the admin's (L{setAdmin}).
    """

    def __init__(self, overrides: Optional[Mapping[str, Price]] = None,
                 defaults: Mapping[str, Price] = DEFAULT_PRICES,
                 toolDefaults: Mapping[str, ToolPrice] = DEFAULT_TOOL_PRICES):
        """
        @param overrides: model -> L{Price} from the configuration (and
            tool -> L{ToolPrice}, C{default} -> L{Price}, R109).
        @param defaults: the shipped table.
        @param toolDefaults: the shipped hosted-tool prices.
        """
        self._defaults = dict(defaults)
        self._toolDefaults = dict(toolDefaults)
        self._tools: dict = {}
        self.default: Optional[Price] = None
        """R109: C{prices.default}, the price of anything unpriced, or
        L{None}."""
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
        Put the prices set through the admin API in force
        (L{relay.control.prices}): they win over the file's and the
        shipped ones.

        @param prices: model -> L{Price}.
        """
        self._admin = dict(prices)
        self._build()

    def _build(self) -> None:
        table = dict(self._defaults)
        tools = dict(self._toolDefaults)
        default = None
        for layer in (self._overrides, self._admin):
            for name, price in layer.items():
                if name == "default":
                    default = price
                elif isinstance(price, ToolPrice):
                    tools[name] = price
                else:
                    table[name] = price
        self._table = table
        self._tools = tools
        self.default = default
        folded: dict = {}
        for model, price in table.items():
            folded.setdefault(matchKey(model), price)
        folded.pop(None, None)
        self._folded = folded
        self._names = frozenset(folded)

    def names(self) -> frozenset:
        """
        The priced models as L{relay.base.modelname.matchKey}s (one object per
        state of the table, so a holder can tell a change by identity).
        """
        return self._names

    def lookup(self, model: Optional[str]) -> Optional[Price]:
        """
        The price of C{model}: its exact name, else the price of its
        normalised name (R110, L{relay.base.modelname.normalise}: any case,
        trimmed, a dated snapshot priced as its family).

        @param model: a model name (upstream or client), or L{None}.
        @return: the L{Price}, or L{None} when unpriced.
        """
        if not model:
            return None
        found = self._table.get(model)
        if found is None:
            found = self._folded.get(normalise(model, self._names))
        return found

    def _tier(self, model: Optional[str], price: Price, tier) -> Optional[float]:
        """
        The multiplier of C{tier} on C{price} (C{model}'s), or L{None}.
        """
        if tier in _PLAIN_TIERS:
            return 1.0
        value = getattr(price, tier, None) if tier in SHIPPED_TIERS else None
        if value is None and tier in SHIPPED_TIERS and any(
                price is shipped for shipped in self._defaults.values()):
            value = SHIPPED_TIERS[tier]
        if value is None and self.default is not None and tier in SHIPPED_TIERS:
            value = getattr(self.default, tier, None)
        return value

    def perImage(self, model: Optional[str], tool: str) -> Optional[float]:
        """
        R109, R115: dollars per image of an images turn served by
        C{model}: the C{per_image} of the most specific priced name of
        C{<model>:<quality>:<size>}, C{<model>:<quality>}, C{<model>:<size>},
        C{<model>} (then C{prices.default}'s), or L{None}.

        @param tool: the counts' name of the images
            (L{relay.usage.tokens.imagesTool}: C{images:<quality>:<size>}).
        """
        if not model:
            return None
        _, _, rest = tool.partition(":")
        quality, _, size = rest.partition(":")
        names = []
        if quality and size:
            names.append(f"{model}:{quality}:{size}")
        if quality:
            names.append(f"{model}:{quality}")
        if size:
            names.append(f"{model}:{size}")
        names.append(model)
        for name in names:
            price = self.lookup(name)
            if price is not None and price.per_image is not None:
                return price.per_image
        return None if self.default is None else self.default.per_image

    def _tool(self, tool: str) -> Optional[float]:
        """
        Dollars per call of C{tool}, or L{None}.
        """
        found = self._tools.get(tool)
        if found is not None:
            return found.per_call
        return None if self.default is None else self.default.per_call

    def served(self, model: Optional[str]) -> Optional[Price]:
        """
        R109: the price a turn served by C{model} is billed at: its own
        (L{lookup}), else C{prices.default}.
        """
        price = self.lookup(model)
        return self.default if price is None else price

    def missing(self, model: Optional[str], tier=None, tools=()) -> list:
        """
        R109: what of a turn has no price.

        @param model: the model served (after the account's mapping).
        @param tier: the C{service_tier}, or L{None}.
        @param tools: hosted tool names (L{HOSTED_TOOLS}).
        @return: a list of C{(param, text)}: C{("model", "model `x`")},
            C{("service_tier", "service_tier `scale` of model `x`")},
            C{("tools", "tool `image_generation`")}; empty when all is
            priced.
        """
        out = []
        price = self.served(model)
        if price is None:
            out.append(("model", f"model `{model}`"))
        elif self._tier(model, price, tier) is None:
            out.append(("service_tier", f"service_tier `{tier}` of model `{model}`"))
        for tool in sorted(set(tools)):
            if self._tool(tool) is None:
                out.append(("tools", f"tool `{tool}`"))
        return out

    def estimate(self, model: Optional[str], inputTokens: int, outputTokens: int,
                 tier=None, tools=()) -> Optional[int]:
        """
        R108: the cost of a turn before it runs, nano-dollars: every input
        token uncached, every output token at the output rate, the tier's
        multiplier and one call of each hosted tool the request offers.

        @return: nano-dollars, or L{None} when something is unpriced.
        """
        counts = TokenCounts(requests=1, input=inputTokens, output=outputTokens,
                             tier=tier, tools=tuple((t, 1) for t in sorted(set(tools))))
        return self.nanos(model, counts)

    def nanos(self, model: Optional[str], counts) -> Optional[int]:
        """
        R109: the cost of a served turn: its tokens at C{model}'s price
        times C{counts.tier}'s multiplier, plus C{counts.tools}' calls.

        @return: nano-dollars, or L{None} when the model, the tier or a
            tool has no price.
        """
        price = self.served(model)
        if price is None:
            return None
        multiplier = self._tier(model, price, counts.tier)
        if multiplier is None:
            return None
        nanos = price.nanos(counts, multiplier)
        for tool, calls in counts.tools:
            if tool == IMAGES or tool.startswith(IMAGES + ":"):
                perCall = self.perImage(model, tool)  # R115
            else:
                perCall = self._tool(tool)
            if perCall is None:
                return None
            nanos += int(round(calls * perCall * NANOS_PER_USD))
        return nanos

    def cost(self, model: Optional[str], counts) -> Optional[int]:
        """
        The cost of one turn.

        @param model: the upstream model the turn ran on.
        @param counts: its L{relay.usage.tokens.TokenCounts}.
        @return: nano-dollars, or L{None} when the model (or, R109, its
            tier or a tool call) is unpriced.
        """
        return self.nanos(model, counts)

    def priced(self, model: Optional[str], counts):
        """
        C{counts} with its cost filled in: C{cost} in nano-dollars, or
        C{unpriced} = its request count when the model has no price.

        @rtype: L{relay.usage.tokens.TokenCounts}
        """
        if counts.tier in _PLAIN_TIERS and not counts.tools:
            price = self.lookup(model) or self.default
            nanos = None if price is None else price.nanos(counts)
        else:
            nanos = self.nanos(model, counts)  # R109: a tier or tool calls
        # L{cost}, inlined. Built directly: attrs.evolve costs a few microseconds per turn.
        if nanos is None:
            return TokenCounts(counts.requests, counts.input, counts.cached, counts.output,
                               counts.reasoning, 0, counts.requests, counts.estimated,
                               counts.tier, counts.tools)
        return TokenCounts(counts.requests, counts.input, counts.cached, counts.output,
                           counts.reasoning, nanos, 0, counts.estimated, counts.tier, counts.tools)

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
        } | {
            # R109: hosted tools per call, and the default price.
            tool: dict(price.asDict(), source="admin" if tool in self._admin else (
                "config" if tool in self._overrides else "default"))
            for tool, price in sorted(self._tools.items())
        } | ({} if self.default is None else {"default": dict(
            self.default.asDict(), source="admin" if "default" in self._admin else "config")})
