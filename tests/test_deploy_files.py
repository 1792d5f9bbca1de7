"""
The deployment files hold together (issue 23): C{compose.yaml}'s stack
(relay with workers on Redis with AOF, the emulator profile, readiness for
compose's health, a stop grace above the drain), the configurations it and
the image mount parse as relay configurations, and the C{Dockerfile}'s
contract (a base chosen by a build argument, a non-root user, C{twistd -n
relay}, the volume, the liveness health check). The image itself is built
and run by L{tests.integration.test_container}.
"""

from __future__ import annotations

import os
import re

import yaml
from twisted.trial.unittest import SynchronousTestCase

from relay.configuration.parse import loadConfig
from relay.base.records import GatewaySettings
from relay.tap import SUPERVISOR_GRACE_MARGIN_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)s", value)
    assert m, value
    return float(m.group(1))


class ComposeTests(SynchronousTestCase):
    def setUp(self):
        self.compose = yaml.safe_load(_read("compose.yaml"))
        self.services = self.compose["services"]

    def test_services(self):
        self.assertEqual(set(self.services), {"redis", "relay", "emulator"})
        self.assertEqual(self.services["emulator"]["profiles"], ["emulator"])
        self.assertIn("COMPOSE_PROFILES=emulator", _read(".env"))
        redis = " ".join(self.services["redis"]["command"])
        self.assertIn("--appendonly yes", redis)
        relay = self.services["relay"]
        self.assertEqual(relay["depends_on"]["redis"]["condition"], "service_healthy")
        self.assertTrue(relay["environment"]["RELAY_HEALTH_URL"].endswith("/readyz"))
        grace = GatewaySettings().shutdown_grace_seconds + SUPERVISOR_GRACE_MARGIN_SECONDS
        self.assertGreater(_seconds(relay["stop_grace_period"]), grace)
        self.assertEqual(relay["build"]["args"]["BASE"].split(":-")[0], "${RELAY_BASE")

    def test_redisImage(self):
        """
        Redis is the public image unless C{RELAY_REDIS_IMAGE} names another
        (Debian's redis-server on the base made without a registry:
        C{etc/redis/Dockerfile}, built by C{scripts/container-images.sh});
        both take the same command line, which turns protected mode off
        (the public image's default; Debian's is on) and publishes no port.
        """
        redis = self.services["redis"]
        self.assertEqual(redis["image"],
                         "${RELAY_REDIS_IMAGE:-docker.io/library/redis:7-bookworm}")
        self.assertIn("--protected-mode no", " ".join(redis["command"]))
        self.assertNotIn("ports", redis)
        text = _read("etc/redis/Dockerfile")
        self.assertRegex(text, r"(?m)^FROM \$\{BASE\}$")
        self.assertIn("redis-server", text)
        self.assertRegex(text, r"(?m)^USER redis$")
        script = _read("scripts/container-images.sh")
        for name in ("RELAY_BASE", "RELAY_IMAGE", "RELAY_REDIS_IMAGE"):
            self.assertIn(name, script)

    def test_mountedFilesExistAndParse(self):
        """
        Every bind-mounted file exists; the relay configuration is valid,
        with workers on the Redis backend (compose's redis service).
        """
        for service in self.services.values():
            for volume in service.get("volumes", []):
                source = volume.split(":")[0]
                if source.startswith("./"):
                    self.assertTrue(os.path.exists(os.path.join(ROOT, source)), source)
        config = loadConfig(os.path.join(ROOT, "etc", "compose.yaml"))
        self.assertEqual(config.workers, 2)
        self.assertEqual(config.state.backend, "redis")
        self.assertEqual(config.state.redis_url, "redis://redis:6379/0")
        self.assertTrue(config.listen.startswith("tcp:8080"))
        image = loadConfig(os.path.join(ROOT, "etc", "container.yaml"))
        self.assertEqual(image.database, "/var/lib/relay/relay.sqlite")
        self.assertEqual(image.listen, "tcp:8080")


class DockerfileTests(SynchronousTestCase):
    def test_contract(self):
        text = _read("Dockerfile")
        self.assertRegex(text, r"(?m)^ARG BASE=")
        self.assertRegex(text, r"(?m)^FROM \$\{BASE\}$")
        self.assertRegex(text, r"(?m)^USER relay$")
        self.assertIn('VOLUME ["/var/lib/relay"]', text)
        self.assertIn('ENTRYPOINT ["twistd", "-n", "--pidfile=", "relay"]', text)
        self.assertIn('CMD ["--config", "/etc/relay/relay.yaml"]', text)
        self.assertRegex(text, r"HEALTHCHECK .*\n.*/healthz")
        self.assertIn("STOPSIGNAL SIGTERM", text)
