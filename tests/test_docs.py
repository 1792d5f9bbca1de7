"""
The README and the guides under C{docs/}: a README that fits on a screen and
points at the guides, links that lead somewhere, and the places where the
docs and the repository's own files must say the same thing (the Codex
configuration C{scripts/demo.sh} prints, Podman's runtime, C{relay.yaml}
kept out of git).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
import tomllib

from twisted.trial.unittest import SynchronousTestCase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")

README_MAX_LINES = 300

GUIDES = ("clients.md", "running.md", "deploying.md", "accounts.md", "keys.md", "security.md",
          "operating.md", "benchmarks.md", "developing.md")

_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.DOTALL | re.MULTILINE)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def markdownFiles() -> list[str]:
    """
    README.md and the guides directly under C{docs/} (not C{docs/reference/},
    a mirror of the spec).
    """
    return [README] + sorted(
        os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md")
    )


def slug(heading: str) -> str:
    """
    GitHub's anchor for a heading's text: lower case, backticks and
    punctuation dropped, spaces as hyphens.
    """
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """
    Every heading anchor of a markdown text (repeats get C{-1}, C{-2}, ...).
    """
    found: set[str] = set()
    for match in re.finditer(r"^#{1,6} +(.+?) *#*$", _FENCE.sub("", text), re.MULTILINE):
        base = slug(match.group(1))
        name, n = base, 0
        while name in found:
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def relativeLinks(text: str) -> list[str]:
    """
    The targets of a markdown text's links that are not URLs, outside code.
    """
    prose = _CODE.sub("", _FENCE.sub("", text))
    return [t for t in _LINK.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def fencedBlocks(text: str, language: str) -> list[str]:
    """
    The bodies of a markdown text's fenced blocks of one language.
    """
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.DOTALL | re.MULTILINE)


class ReadmeTests(SynchronousTestCase):
    """
    The README fits on a screen and sends the reader on to the guides.
    """

    def test_fitsOnAScreen(self):
        """
        C{wc -l README.md} is at most 300.
        """
        with open(README, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        self.assertLessEqual(lines, README_MAX_LINES)

    def test_theTwoCommandsComeFirst(self):
        """
        The README's first two C{sh} blocks are the offline demo and the
        tests.
        """
        blocks = fencedBlocks(_read(README), "sh")
        self.assertIn("scripts/demo.sh", blocks[0])
        self.assertEqual(blocks[1].strip(), "bash .ci/run")

    def test_pointsToEveryGuide(self):
        """
        Every guide under C{docs/} is linked from the README, and each
        starts with what its reader wants to do.
        """
        links = set(relativeLinks(_read(README)))
        present = sorted(n for n in os.listdir(DOCS) if n.endswith(".md"))
        self.assertEqual(present, sorted(GUIDES))
        for name in GUIDES:
            self.assertIn("docs/" + name, links)
            text = _read(os.path.join(DOCS, name))
            title, _, rest = text.partition("\n\n")
            self.assertTrue(title.startswith("# "), name)
            self.assertTrue(rest.startswith("You want to"), name)


class LinkTests(SynchronousTestCase):
    """
    Every relative link of the README and the guides leads to a file that
    exists, and to a heading of it when it names one.
    """

    def test_slug(self):
        """
        L{slug} makes GitHub's anchors.
        """
        self.assertEqual(slug("1. Containers: `docker compose up`"),
                         "1-containers-docker-compose-up")
        self.assertEqual(slug("Redis: persistence, Sentinel, outages"),
                         "redis-persistence-sentinel-outages")
        self.assertEqual(slug("Traces (OpenTelemetry, optional)"),
                         "traces-opentelemetry-optional")

    def test_linksResolve(self):
        """
        No relative link of README.md or docs/*.md is broken.
        """
        broken = []
        checked = 0
        for path in markdownFiles():
            for target in relativeLinks(_read(path)):
                checked += 1
                file, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
                where = f"{os.path.relpath(path, ROOT)}: {target}"
                if not os.path.exists(dest):
                    broken.append(where + " (no such file)")
                elif anchor and anchor not in anchors(_read(dest)):
                    broken.append(where + " (no such heading)")
        self.assertEqual(broken, [])
        self.assertGreater(checked, 20)


class CodexInstructionsTests(SynchronousTestCase):
    """
    C{scripts/demo.sh} and the README tell a user the same thing about Codex
    CLI: the configuration is C{etc/codex.toml}, the command is the README's.
    """

    def setUp(self):
        if shutil.which("bash") is None:
            raise self.skipTest("needs bash")

    def demoCodex(self) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("RELAY_PORT", "RELAY_KEY")}
        result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--codex"],
                                env=env, capture_output=True, text=True, timeout=30, check=False)
        self.assertEqual(result.returncode, 0, result.stderr)
        return result.stdout

    def test_readmeShowsTheConfigFile(self):
        """
        The README's C{toml} block is C{etc/codex.toml} (its comments aside),
        and a valid Codex provider table for the demo.
        """
        source = _read(os.path.join(ROOT, "etc", "codex.toml"))
        body = "".join(line for line in source.splitlines(True) if not line.startswith("#"))
        (block,) = fencedBlocks(_read(README), "toml")
        self.assertEqual(block, body)
        config = tomllib.loads(block)
        self.assertEqual(config["model_providers"]["relay"]["base_url"],
                         "http://127.0.0.1:8080/v1")

    def test_demoPrintsWhatTheReadmeSays(self):
        """
        C{demo.sh --codex} (what the interactive demo prints too) shows the
        README's configuration and the README's command, for the default
        port and key.
        """
        output = self.demoCodex()
        (block,) = fencedBlocks(_read(README), "toml")
        self.assertIn(textwrap.indent(block, "  "), output)
        (command,) = [b for b in fencedBlocks(_read(README), "sh") if "codex exec" in b]
        self.assertIn("  " + command, output)

    def test_oneCopyOfTheConfig(self):
        """
        demo.sh holds no copy of the configuration of its own: it prints
        C{etc/codex.toml}, also in its interactive mode.
        """
        script = _read(os.path.join(ROOT, "scripts", "demo.sh"))
        self.assertNotIn("model_provider", script)
        self.assertIn("etc/codex.toml", script)
        self.assertEqual(script.count("\ncodexInstructions\n"), 1)


class DeployingTests(SynchronousTestCase):
    """
    What a new user of the container instructions tripped on.
    """

    def test_podmanLineInstallsTheConfiguredRuntime(self):
        """
        The guide's Podman install line installs the runtime that
        C{.ci/containers.conf} selects (Debian's podman would bring crun),
        as C{.ci/run} does.
        """
        conf = tomllib.loads(_read(os.path.join(ROOT, ".ci", "containers.conf")))
        runtime = conf["engine"]["runtime"]
        lines = [b for b in fencedBlocks(_read(os.path.join(DOCS, "deploying.md")), "sh")
                 if "apt-get install" in b and "podman" in b]
        self.assertEqual(len(lines), 1)
        self.assertIn(runtime, lines[0].replace("\\\n", " ").split())
        ci = _read(os.path.join(ROOT, ".ci", "run"))
        self.assertRegex(ci, rf"apt-get install[^\n]*(\\\n[^\n]*)*\b{runtime}\b")

    def test_cleanUpAfterDown(self):
        """
        After C{podman-compose down} the guide removes the volumes, the
        network and the images.
        """
        guide = _read(os.path.join(DOCS, "deploying.md"))
        cleanUp = [b for b in fencedBlocks(guide, "sh") if "podman network rm" in b]
        self.assertEqual(len(cleanUp), 1)
        self.assertIn("down -t 45 -v", cleanUp[0])
        self.assertIn("podman rmi", cleanUp[0])

    def test_copyTargetIgnored(self):
        """
        C{relay.yaml}, where the guide copies C{etc/container.yaml} to put
        keys in, is ignored by git.
        """
        self.assertIn("cp etc/container.yaml relay.yaml", _read(os.path.join(DOCS, "deploying.md")))
        if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
            raise self.skipTest("needs git and a checkout")
        result = subprocess.run(["git", "-C", ROOT, "check-ignore", "-q", "relay.yaml"],
                                capture_output=True, text=True, timeout=30, check=False)
        self.assertEqual(result.returncode, 0, result.stderr)
