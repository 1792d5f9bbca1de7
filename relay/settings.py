# -*- test-case-name: tests.test_settings -*-
"""
The runtime settings object read on every attempt (behaviour.md R74).
"""

from __future__ import annotations

from attrs import define

from relay.model import GatewaySettings


@define(eq=False)
class RuntimeSettings:
    """
    Holds the current L{GatewaySettings}. The turn engine reads
    L{current} on every attempt, so a change applies without a restart.

    @ivar current: the settings in force.
    """

    current: GatewaySettings = GatewaySettings()
