"""
The container images of the integration tests (issue 23), built once per
test session and shared by L{tests.integration.test_container} (the image
alone) and L{tests.integration.test_compose} (compose.yaml's stack).

No registry is reachable from CI, so L{containerImages} runs
C{scripts/container-images.sh} (docs/deploying.md's way without a registry): the
base from Debian packages (C{scripts/container-base.sh}: mmdebstrap, then
C{podman import}), relay's image on it (C{Dockerfile}) and Debian's
redis-server on it (C{etc/redis/Dockerfile}). Under CI (C{CI} set) all
three are built from scratch (C{FRESH=1}: a new base, no layer cache), once
per run: the fixture is session-scoped, so the second test reuses them. A
developer's machine reuses the base and podman's layer cache. Podman runs
with L{.ci/containers.conf} (runc; no default ulimits).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = "localhost/relay-base:bookworm"
IMAGE = "localhost/relay:test"
REDIS_IMAGE = "localhost/relay-redis:bookworm"
RELAY_UID = 10001


def containerEnv() -> dict:
    """
    The environment of podman (and podman-compose) commands: the machine's,
    with L{.ci/containers.conf} unless C{CONTAINERS_CONF} names another.
    """
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", os.path.join(ROOT, ".ci", "containers.conf"))
    return env


def podman(*args, check=True, timeout=600) -> subprocess.CompletedProcess:
    """
    Run one podman command (blocking).

    @raise AssertionError: when C{check} and it exits non-zero (with its
        output).
    """
    result = subprocess.run(["podman", *args], check=False, capture_output=True, text=True,
                            env=containerEnv(), timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {result.returncode}\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def _exists(image: str) -> bool:
    return podman("image", "exists", image, check=False).returncode == 0


_BUILT: dict = {}
"""What L{containerImages} built in this process: test modules import the
fixture, and pytest makes each import a fixture of its own, so the session
scope alone would build once per module."""


@pytest.fixture(scope="session")
def containerImages():
    """
    The base, relay and Redis images, built once per test session (from
    scratch under CI).

    @return: C{{"relay": name, "redis": name, "base": name, "seconds":
        build seconds (0 when an earlier test of the session built them)}}.
    """
    if _BUILT:
        return dict(_BUILT, seconds=0.0)
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (.ci/run installs it): "
                    "the container tests build and run the images with podman")
    fresh = bool(os.environ.get("CI"))
    if (fresh or not _exists(BASE)) and shutil.which("mmdebstrap") is None:
        pytest.fail("mmdebstrap is not installed (.ci/run installs it): it makes the base image")
    env = containerEnv()
    env.update(RELAY_BASE=BASE, RELAY_IMAGE=IMAGE, RELAY_REDIS_IMAGE=REDIS_IMAGE)
    env.pop("FRESH", None)
    if fresh:
        env["FRESH"] = "1"
    started = time.monotonic()
    result = subprocess.run([os.path.join(ROOT, "scripts", "container-images.sh")],
                            check=False, capture_output=True, text=True, env=env,
                            timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    seconds = time.monotonic() - started
    steps = [line.split(": ", 1)[1] for line in result.stdout.splitlines()
             if line.startswith("container-images.sh: ") and " in " in line]
    print(f"\ncontainer images ({'from scratch' if fresh else 'cached'}): "
          f"{'; '.join(steps)}; {seconds:.1f}s in all")
    _BUILT.update(relay=IMAGE, redis=REDIS_IMAGE, base=BASE, seconds=seconds)
    return dict(_BUILT)
