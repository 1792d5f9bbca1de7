# -*- test-case-name: tests.test_control_keys -*-
"""
L{PriceService}: the price table over the admin API.

Prices in force are, from the bottom up: the shipped table
(L{relay.tenants.prices.DEFAULT_PRICES}), the file's C{prices:}, and the
prices set here, which win over both and survive restarts and reloads
(they are in the control store, shared by every process on one Redis):

  - C{GET /admin/prices}: every model's price in force with its C{source}
    (C{admin}, C{config}, C{default}), US dollars per 1M tokens;
  - C{PUT /admin/prices} C{{"prices": {model: {input, output,
    cached_input?, reasoning?}}}}: replace the admin API's prices (C{{}}
    removes them all; the file's and the shipped ones show again);
  - C{PUT /admin/prices/{model}} C{{input, output, ...}}: set one;
  - C{DELETE /admin/prices/{model}}: remove one admin price.

Each is validated with the file's own rules (C{prices:} in config.md: one
400 naming the field) and audited (C{prices.update}, C{prices.set},
C{prices.delete}). Costs already counted keep the price of their turn.

B{Kind C{prices}}: one record, id C{admin}, data C{{"prices": {model:
{...}}, "updated_at", "updated_from"}}: one record, so a whole-table PUT
is one compare-and-set write.
"""

from __future__ import annotations

from typing import Optional

from attrs import define

from relay.control.service import PlaneService
from relay.control.web import ControlError
from relay.base.records import ConfigError

__all__ = ["PRICES", "PRICES_ID", "PriceService", "pricesOf"]

PRICES = "prices"
"""The store kind of the admin API's prices."""

PRICES_ID = "admin"
"""The id of its one record."""


def _parse(raw) -> dict:
    """
    @return: model -> L{relay.tenants.prices.Price}.
    @raise ConfigError: naming the field (C{prices.<model>.input: ...}).
    """
    from relay.configuration.parse import parsePrices

    return parsePrices(raw)


def pricesOf(record) -> dict:
    """
    @param record: the C{prices} record, or L{None}.
    @return: model -> L{relay.tenants.prices.Price}.
    @raise ConfigError: a stored table that no longer validates.
    """
    if record is None:
        return {}
    return _parse((record.data or {}).get("prices") or {})


def _stored(prices: dict) -> dict:
    return {model: {k: v for k, v in price.asDict().items()} for model, price in prices.items()}


def _invalid(error: ConfigError) -> ControlError:
    text = str(error)
    param = text.split(":", 1)[0] if text.startswith("prices") else None
    return ControlError(400, "invalid_price", text, param)


@define(eq=False)
class PriceService(PlaneService):
    """
    See the module docstring (plane, clock and store: L{PlaneService};
    the plane's C{prices} table and C{priceRecord} are read here).
    """

    def view(self) -> tuple:
        """
        @return: C{(200, {"prices": {model: price and source}, "now"})}.
        """
        table = self.plane.prices
        return 200, {"prices": table.view() if table is not None else {},
                     "now": self._clock.seconds()}

    async def _write(self, change, address: Optional[str]) -> tuple:
        record = await self.store.get(PRICES, PRICES_ID)
        current = dict((record.data or {}).get("prices") or {}) if record is not None else {}
        table = change(current)
        try:
            parsed = _parse(table)
        except ConfigError as e:
            raise _invalid(e)
        data = {"prices": _stored(parsed), "updated_at": self._clock.seconds(),
                "updated_from": address}
        await self.store.put(PRICES, PRICES_ID, data,
                             record.version if record is not None else None)
        await self.plane.refresh()
        return self.view()

    async def replace(self, body: dict, address: Optional[str], note: dict) -> tuple:
        """
        Replace the admin API's prices.

        @param body: C{{"prices": {model: {...}}}}.
        @raise ControlError: 400 naming the field.
        """
        for name in body:
            if name != "prices":
                raise ControlError(400, "invalid_price", f"unknown field {name}", name)
        prices = body.get("prices")
        if not isinstance(prices, dict):
            raise ControlError(400, "invalid_price",
                               "prices: required, an object of model -> price", "prices")
        note.update(action="prices.update", detail={"models": sorted(prices)[:50]})
        return await self._write(lambda current: prices, address)

    async def setOne(self, model: str, body: dict, address: Optional[str], note: dict) -> tuple:
        """
        Set one model's admin price.

        @raise ControlError: 400 naming the field.
        """
        note.update(action="prices.set", target=model, detail={"fields": sorted(body)})

        def change(current):
            return dict(current, **{model: body})

        return await self._write(change, address)

    async def deleteOne(self, model: str, address: Optional[str], note: dict) -> tuple:
        """
        Remove one model's admin price (the file's or the shipped one shows
        again).

        @raise ControlError: 404 when the admin API has no price for it.
        """
        note.update(action="prices.delete", target=model)
        record = await self.store.get(PRICES, PRICES_ID)
        current = dict((record.data or {}).get("prices") or {}) if record is not None else {}
        if model not in current:
            raise ControlError(
                404, "price_not_found",
                f"the admin API sets no price for {model!r} (a file or shipped price cannot be"
                " removed here; override it with PUT)", "model")

        def change(current):
            return {k: v for k, v in current.items() if k != model}

        return await self._write(change, address)
