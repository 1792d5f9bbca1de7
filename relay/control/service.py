# -*- test-case-name: tests.test_control -*-
"""
L{PlaneService}: what every admin-API service of the control plane is
built on: the plane it reads and writes through, the clock
that stamps its records, and the plane's store. The accounts, logins,
keys, groups and prices services each add their own rules on top.
"""

from __future__ import annotations

from typing import Any

from attrs import define
from twisted.internet.interfaces import IReactorTime

__all__ = ["PlaneService"]


@define(eq=False)
class PlaneService:
    """
    The base of the control plane's services.

    @ivar plane: the L{relay.control.plane.ControlPlane}.
    @ivar _clock: stamps records (C{seconds()}, seconds since the epoch).
    """

    plane: Any
    _clock: IReactorTime

    @property
    def store(self):
        """
        @return: the plane's L{relay.interfaces.IControlStore}.
        """
        return self.plane.store
