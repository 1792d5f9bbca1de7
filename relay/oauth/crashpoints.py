# -*- test-case-name: tests.test_oauth -*-
"""
A test-only crash hook for the OAuth kill tests: relay kills itself
(SIGKILL, like C{kill -9}) at a named step of a token refresh, so a test
can restart it and check that no rotated refresh token was lost or reused.

Inert unless the environment variable C{RELAY_TEST_CRASH_AT} names the
step; the steps are L{STEPS}. Never set it in production.
"""

from __future__ import annotations

import os
import signal

ENV = "RELAY_TEST_CRASH_AT"
"""The environment variable naming the step to die at."""

STEPS = ("before_mark", "before_request", "after_response", "after_persist")
"""
The steps of a refresh, in order: before the in-flight marker is written;
after it is written, before the token request is sent; after the endpoint
answered, before the new tokens are persisted; after they are persisted,
before they are used.
"""


def crashPoint(step: str) -> None:
    """
    Die at once with SIGKILL when C{RELAY_TEST_CRASH_AT} is C{step}.

    @param step: one of L{STEPS}.
    """
    if os.environ.get(ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)
