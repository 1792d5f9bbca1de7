# -*- test-case-name: tests.test_anthropic -*-
"""
L{AnthropicModelsService}: the Messages surface's model table over the
admin API (config.md C{anthropic_models}, behaviour.md R115).

The table in force is, from the bottom up: relay's defaults
(L{relay.translate.anthropic.models.DEFAULT_ANTHROPIC_MODELS}), the file's
C{anthropic_models}, and the families set here, which win over both and
survive restarts and reloads (they are in the control store, shared by
every process on one Redis):

  - C{GET /admin/anthropic_models}: every family's model with its
    C{source} (C{admin}, C{config}, C{default});
  - C{PUT /admin/anthropic_models} C{{"anthropic_models": {family:
    model}}}: replace the admin API's families (C{{}} removes them; the
    file's and the defaults show again).

Validated with the file's own rules (one 400 naming the entry) and audited
(C{anthropic_models.update}). The next request maps with the new table.

B{Kind C{anthropic_models}}: one record, id C{admin}, data
C{{"anthropic_models": {family: model}, "updated_at", "updated_from"}}.
"""

from __future__ import annotations

from typing import Optional

from attrs import define

from relay.control.service import PlaneService
from relay.control.web import ControlError
from relay.translate.anthropic.models import checkTable

__all__ = ["ANTHROPIC_MODELS", "ANTHROPIC_MODELS_ID", "AnthropicModelsService", "tableOf"]

ANTHROPIC_MODELS = "anthropic_models"
"""The store kind of the admin API's table."""

ANTHROPIC_MODELS_ID = "admin"
"""The id of its one record."""


def tableOf(record) -> dict:
    """
    @param record: the C{anthropic_models} record, or L{None}.
    @return: family -> model.
    @raise ValueError: a stored table that no longer validates.
    """
    if record is None:
        return {}
    return checkTable((record.data or {}).get(ANTHROPIC_MODELS) or {})


@define(eq=False)
class AnthropicModelsService(PlaneService):
    """
    See the module docstring (plane, clock and store: L{PlaneService};
    the plane's C{anthropicModels} table is read here).
    """

    def view(self) -> tuple:
        """
        @return: C{(200, {"anthropic_models": {family: {model, source}},
            "now"})}.
        """
        table = self.plane.anthropicModels
        return 200, {ANTHROPIC_MODELS: table.view() if table is not None else {},
                     "now": self._clock.seconds()}

    async def replace(self, body: dict, address: Optional[str], note: dict) -> tuple:
        """
        Replace the admin API's families.

        @param body: C{{"anthropic_models": {family: model}}}.
        @raise ControlError: 400 naming the entry.
        """
        for name in body:
            if name != ANTHROPIC_MODELS:
                raise ControlError(400, "invalid_anthropic_models", f"unknown field {name}", name)
        try:
            table = checkTable(body.get(ANTHROPIC_MODELS))
        except ValueError as e:
            raise ControlError(400, "invalid_anthropic_models", str(e), ANTHROPIC_MODELS)
        note.update(action="anthropic_models.update", detail={"families": sorted(table)})
        record = await self.store.get(ANTHROPIC_MODELS, ANTHROPIC_MODELS_ID)
        data = {ANTHROPIC_MODELS: table, "updated_at": self._clock.seconds(),
                "updated_from": address}
        await self.store.put(ANTHROPIC_MODELS, ANTHROPIC_MODELS_ID, data,
                             record.version if record is not None else None)
        await self.plane.refresh()
        return self.view()
