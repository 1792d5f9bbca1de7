"""
An admin key too easy to guess is refused at start outside the demo
(behaviour.md R99; L{relay.configuration.parse.checkOperatorKeys}): one config error
line naming C{admin_key}, exit status 2, the key never printed; the demo's
configuration (C{demo: true}) starts with its published key.
"""

from __future__ import annotations

import os

import pytest_twisted

from relay.configuration.parse import loadConfig
from tests.integration.test_twistd import (
    assertOneErrorLine,
    goodConfig,
    removeConfig,
    runSeparately,
    writeConfig,
)

_ETC = os.path.join(os.path.dirname(__file__), "..", "..", "etc")


@pytest_twisted.ensureDeferred
async def test_weak_admin_key_is_one_config_error_line():
    """
    A repeated key and the demo's published key, outside the demo: exit
    status 2 and the one config error line, nothing else.
    """
    for key, bits in (("aaaaaaaaaaaaaaaaaaaa", 5), ("admin-demo-change-me", 0)):
        path = writeConfig(goodConfig() + f"admin_key: {key}\n")
        try:
            out, err, code = await runSeparately("twist", "--config", path,
                                                 cwd=os.path.dirname(path))
        finally:
            removeConfig(path)
        assertOneErrorLine(
            out, err, code,
            f"relay: config error: admin_key: too easy to guess (about {bits} bits, at least 64"
            " needed; relay's published example keys count 0): use a random key, e.g. the"
            " output of 'openssl rand -hex 24'")


def test_demo_configurations_start():
    """
    The demo's files say C{demo: true}, so their published key is taken.
    """
    for name in ("demo.yaml", "compose.yaml", "container.yaml"):
        config = loadConfig(os.path.join(_ETC, name), environ={})
        assert config.demo and config.admin_key == "admin-demo-change-me"
