"""
Tests for L{relay.configuration.parse}: the YAML contract of config.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import textwrap

from twisted.trial.unittest import SynchronousTestCase

from relay.configuration.parse import (
    APIKEY_BASE_URL,
    OAUTH_BASE_URL,
    PUBLISHED_KEYS,
    loadConfig,
    secretsOf,
    settingsFromString,
)
from relay.base.records import (
    Account,
    ClientKey,
    ConfigError,
    GatewaySettings,
    ProxySpec,
    RelayConfig,
    StateSettings,
)

# Paths relative to this file, never to the working directory (trap T3:
# trial runs inside _trial_temp/).
_ETC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "etc")

_EXAMPLE_ENV = {
    "RELAY_ADMIN_KEY": "admin-example-secret-0000",
    "RELAY_KEY_ALICE": "sk-relay-alice-secret",
    "RELAY_PROXY_EGRESS_1": "socks5h://proxyuser:proxy-pass-secret@proxy.example:1080",
    "OPENAI_API_KEY_A1": "sk-upstream-a1-secret",
    "OPENAI_ACCESS_TOKEN_O1": "oauth-token-o1-secret",
    "OPENAI_REFRESH_TOKEN_O1": "oauth-refresh-o1-secret",
}

_MINIMAL = """\
keys:
  - {name: alice, key: sk-relay-alice}
accounts:
  - {id: a1, type: apikey, api_key: sk-up-a1}
"""


def parse(text: str, environ=None) -> RelayConfig:
    """
    Parse dedented YAML text with an explicit (default empty) environment.
    """
    return settingsFromString(textwrap.dedent(text), environ=environ or {})


class ConfigErrorAssertions:
    """
    Mixin: assert a one-line L{ConfigError} naming a key path.
    """

    def tempPath(self):
        """
        A path in a fresh temporary directory removed after the test (not
        C{mktemp}, which writes into the working directory under pytest).
        """
        directory = tempfile.mkdtemp(prefix="relay-test-config-")
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        return os.path.join(directory, "relay.yaml")

    def assertConfigError(self, text, *fragments, environ=None):
        """
        Parsing C{text} raises a one-line L{ConfigError} containing every
        fragment; return its message.
        """
        e = self.assertRaises(ConfigError, parse, text, environ)
        message = str(e)
        self.assertNotIn("\n", message)
        for fragment in fragments:
            self.assertIn(fragment, message)
        return message


class GoodFileTests(SynchronousTestCase):
    """
    The bundled example files parse.
    """

    def test_exampleFile(self):
        """
        etc/relay.example.yaml parses with its C{*_env} secrets supplied and
        listens on loopback.
        """
        config = loadConfig(os.path.join(_ETC, "relay.example.yaml"), environ=_EXAMPLE_ENV)
        self.assertEqual(config.listen, "tcp:8080:interface=127.0.0.1")
        self.assertEqual(config.admin_key, "admin-example-secret-0000")
        self.assertEqual(config.keys, (ClientKey("alice", "sk-relay-alice-secret", 5),))
        a1, o1 = config.accounts
        self.assertEqual(a1.credential, "sk-upstream-a1-secret")
        self.assertEqual(a1.models, ("gpt-5.5",))
        self.assertEqual(a1.upstreamModel("gpt-5"), "gpt-5.5")
        self.assertEqual(o1.type, "oauth")
        self.assertEqual(o1.base_url, OAUTH_BASE_URL)
        self.assertEqual(o1.credential, "oauth-token-o1-secret")
        self.assertEqual(
            o1.proxy,
            ProxySpec(
                "egress-1", "socks5h", "proxy.example", 1080, "proxyuser", "proxy-pass-secret"
            ),
        )
        self.assertEqual(config.proxies, (o1.proxy,))
        self.assertEqual(config.gateway, GatewaySettings())
        self.assertEqual(config.state, StateSettings())

    def test_exampleShowsEveryKey(self):
        """
        C{etc/relay.example.yaml} shows every key the parser takes, as the
        README and C{docs/running.md} promise (commented out where it has no
        default in force: alerts, operators, Sentinel): every name of
        L{relay.configuration.parse}'s key tables and of the alerts' numbers
        appears in it. C{demo} (the offline demo's own flag) is left out.
        """
        import types

        from relay.configuration import alerts, parse

        names = set(alerts._NUMBERS)
        for value in vars(parse).values():
            if (isinstance(value, dict) and value
                    and all(isinstance(v, types.FunctionType) for v in value.values())):
                names.update(value)
        names.discard("demo")
        with open(os.path.join(_ETC, "relay.example.yaml"), encoding="utf-8") as f:
            text = f.read()
        missing = sorted(n for n in names if not re.search(rf"\b{re.escape(n)}\b", text))
        self.assertEqual(missing, [])
        self.assertGreater(len(names), 100)

    def test_exampleFileNeedsEnvironment(self):
        """
        Without its environment variables the example file fails, naming the
        key and the variable.
        """
        e = self.assertRaises(
            ConfigError, loadConfig, os.path.join(_ETC, "relay.example.yaml"), environ={}
        )
        self.assertEqual(str(e), "admin_key_env: environment variable RELAY_ADMIN_KEY is not set")

    def test_readmeSetsTheExampleEnvironment(self):
        """
        The "Running relay for real" guide's block (C{docs/running.md}, once
        the README's) sets every variable C{etc/relay.example.yaml} needs
        before the command that runs it: with exactly the C{export}s shown,
        the file loads.
        """
        readme = os.path.join(os.path.dirname(_ETC), "docs", "running.md")
        with open(readme, encoding="utf-8") as f:
            text = f.read()
        command = "python3 -m twisted relay --config etc/relay.example.yaml"
        blocks = [b for b in text.split("```sh\n")[1:] if command in b.split("```")[0]]
        self.assertEqual(len(blocks), 1, "docs/running.md: no single sh block runs the example config")
        block = blocks[0].split("```")[0]
        # The exports run in bash, as a reader runs them (the admin key is a
        # command substitution: a fresh random key, never one printed here).
        exports = block[: block.index(command)]
        names = re.findall(r"^export (\w+)=", exports, re.M)
        script = exports + "".join(f'printf "%s\\0" "${name}"\n' for name in names)
        done = subprocess.run(["bash", "-c", script], capture_output=True, check=True,
                              env={"PATH": os.environ.get("PATH", os.defpath)})
        environ = dict(zip(names, done.stdout.decode("utf-8").split("\0")))
        config = loadConfig(os.path.join(_ETC, "relay.example.yaml"), environ=environ)
        self.assertEqual(config.admin_key, environ["RELAY_ADMIN_KEY"])
        self.assertEqual(set(environ), set(_EXAMPLE_ENV))
        self.assertNotIn(config.admin_key, PUBLISHED_KEYS)

    def test_demoFile(self):
        """
        etc/demo.yaml describes the offline demo: one key, three accounts on
        the emulator, the faulty a2 preferred.
        """
        config = loadConfig(os.path.join(_ETC, "demo.yaml"), environ={})
        self.assertEqual(config.listen, "tcp:8080:interface=127.0.0.1")
        self.assertEqual(config.keys, (ClientKey("demo", "sk-relay-demo", 5),))
        self.assertEqual(config.admin_key, "admin-demo-change-me")
        self.assertEqual(config.state.backend, "memory")
        self.assertEqual(config.database, "relay-demo.sqlite")
        byId = {a.id: a for a in config.accounts}
        self.assertEqual(sorted(byId), ["a1", "a2", "a3"])
        self.assertEqual(byId["a1"].base_url, "http://127.0.0.1:9090/v1")
        self.assertEqual(byId["a1"].credential, "sk-emu-a1")
        self.assertEqual(byId["a2"].credential, "sk-emu-a2")
        self.assertEqual(byId["a3"].type, "oauth")
        self.assertEqual(byId["a3"].base_url, "http://127.0.0.1:9090/backend-api/codex")
        self.assertEqual(byId["a3"].credential, "oauth-emu-a3")
        self.assertEqual(byId["a3"].chatgpt_account_id, "acct-demo")
        self.assertEqual({a.concurrency for a in config.accounts}, {3})
        preferred = min(config.accounts, key=lambda a: a.priority)
        self.assertEqual((preferred.id, preferred.priority), ("a2", 10))


class DefaultsTests(SynchronousTestCase):
    """
    Missing keys take the defaults held by L{relay.base.records}.
    """

    def test_minimal(self):
        """
        A file with one key and one account gets every other default.
        """
        config = parse(_MINIMAL)
        self.assertEqual(config.listen, "tcp:8080:interface=127.0.0.1")
        self.assertIsNone(config.admin_key)
        self.assertEqual(config.log_format, "text")
        self.assertEqual(config.gateway, GatewaySettings())
        self.assertEqual(config.state, StateSettings())
        self.assertEqual(config.database, "relay.sqlite")
        self.assertEqual(config.keys, (ClientKey("alice", "sk-relay-alice", 5),))
        self.assertEqual(
            config.accounts,
            (Account(id="a1", type="apikey", base_url=APIKEY_BASE_URL, credential="sk-up-a1"),),
        )
        account = config.accounts[0]
        self.assertEqual((account.concurrency, account.priority), (3, 50))
        self.assertEqual(account.pool_mode_retry_status_codes, (401, 403, 429))

    def test_nullSections(self):
        """
        A section given as an empty value (YAML null) counts as empty.
        """
        config = parse("gateway:\nstate:\nkeys:\naccounts:\ncomponents:\nlog:\n")
        self.assertEqual(config.gateway, GatewaySettings())
        self.assertEqual((config.keys, config.accounts), ((), ()))

    def test_oauthDefaults(self):
        """
        An oauth account defaults to the ChatGPT Codex base URL.
        """
        config = parse(
            """
            accounts:
              - {id: o1, type: oauth, access_token: tok-o1, chatgpt_account_id: acct-1}
            """
        )
        self.assertEqual(config.accounts[0].base_url, "https://chatgpt.com/backend-api/codex")
        self.assertEqual(config.accounts[0].chatgpt_account_id, "acct-1")

    def test_trailingSlashStripped(self):
        """
        A trailing C{/} on base_url is removed.
        """
        config = parse(
            """
            accounts:
              - {id: a1, type: apikey, api_key: k-a1, base_url: "http://127.0.0.1:9090/v1/"}
            """
        )
        self.assertEqual(config.accounts[0].base_url, "http://127.0.0.1:9090/v1")

    def test_nestedGatewayPartial(self):
        """
        Nested gateway sections take defaults for the keys they leave out.
        """
        config = parse(
            """
            gateway:
              max_account_switches: 4
              first_output_timeout_seconds: 45
              retry_interval_ms: 250
              transport_retry_policy: sticky
              breaker: {failures: 5}
              scheduling: {ping_interval: 5}
              websocket: {mode_default: passthrough}
              upstream: {connect_timeout_seconds: 3.5}
            log: {format: json}
            state: {backend: redis, on_redis_error: fail_closed}
            components: {classifier: mypkg.mod.Classifier}
            """
        )
        gateway = config.gateway
        self.assertEqual(gateway.max_account_switches, 4)
        self.assertEqual(gateway.first_output_timeout_seconds, 45)
        self.assertEqual(gateway.retry_interval_ms, 250)
        self.assertEqual(gateway.transport_retry_policy, "sticky")
        self.assertEqual((gateway.breaker.failures, gateway.breaker.open_seconds), (5, 120))
        self.assertEqual(gateway.scheduling.ping_interval, 5)
        self.assertEqual(gateway.scheduling.user_max_waiting, 20)
        self.assertEqual(gateway.websocket.mode_default, "passthrough")
        self.assertEqual(gateway.upstream.connect_timeout_seconds, 3.5)
        self.assertEqual(gateway.upstream.header_timeout_seconds, 120)
        self.assertEqual(config.log_format, "json")
        self.assertEqual(config.state.backend, "redis")
        self.assertEqual(config.state.on_redis_error, "fail_closed")
        self.assertEqual(config.components.classifier, "mypkg.mod.Classifier")
        self.assertIsNone(config.components.dialer)

    def test_bareOffIsOff(self):
        """
        YAML 1.1 reads a bare C{off} as false; ws_mode and mode_default
        accept it as C{off}.
        """
        config = parse(
            """
            gateway: {websocket: {mode_default: off}}
            accounts:
              - {id: a1, type: apikey, api_key: k-a1, ws_mode: off}
            """
        )
        self.assertEqual(config.gateway.websocket.mode_default, "off")
        self.assertEqual(config.accounts[0].ws_mode, "off")

    def test_accountOptions(self):
        """
        models, model_mapping, pool mode and priorities are read as given.
        """
        config = parse(
            """
            accounts:
              - id: a1
                type: apikey
                api_key: k-a1
                models: [gpt-5.5, gpt-5.4]
                model_mapping: {gpt-5: gpt-5.5}
                pool_mode: true
                pool_mode_retry_count: 0
                pool_mode_retry_status_codes: []
                concurrency: 0
                priority: 7
                ws_mode: http_bridge
            """
        )
        account = config.accounts[0]
        self.assertEqual(account.models, ("gpt-5.5", "gpt-5.4"))
        self.assertEqual(account.model_mapping, {"gpt-5": "gpt-5.5"})
        self.assertTrue(account.pool_mode)
        self.assertEqual(account.pool_mode_retry_count, 0)
        self.assertEqual(account.pool_mode_retry_status_codes, ())
        self.assertEqual((account.concurrency, account.priority), (0, 7))
        self.assertEqual(account.ws_mode, "http_bridge")


class EnvironmentTests(SynchronousTestCase, ConfigErrorAssertions):
    """
    C{*_env} keys read secrets from the environment.
    """

    def test_envSecrets(self):
        """
        key_env, api_key_env, access_token_env, admin_key_env and proxy_env
        are resolved from the given environment.
        """
        env = {
            "K": "sk-relay-from-env",
            "A": "sk-up-from-env",
            "T": "token-from-env",
            "ADM": "admin-from-env-0123456789",
            "P": "http://u:pw-from-env@10.0.0.1:3128",
        }
        config = parse(
            """
            admin_key_env: ADM
            keys: [{name: k, key_env: K}]
            accounts:
              - {id: a1, type: apikey, api_key_env: A, proxy_env: P}
              - {id: o1, type: oauth, access_token_env: T, chatgpt_account_id: c}
            """,
            env,
        )
        self.assertEqual(config.admin_key, "admin-from-env-0123456789")
        self.assertEqual(config.keys[0].key, "sk-relay-from-env")
        self.assertEqual(config.accounts[0].credential, "sk-up-from-env")
        self.assertEqual(
            config.accounts[0].proxy,
            ProxySpec("acct-a1", "http", "10.0.0.1", 3128, "u", "pw-from-env"),
        )
        self.assertEqual(config.accounts[1].credential, "token-from-env")

    def test_missingVariable(self):
        """
        An unset variable is an error naming the key and the variable.
        """
        self.assertConfigError(
            "accounts: [{id: a1, type: apikey, api_key_env: NOPE_VAR}]",
            "accounts[0].api_key_env",
            "NOPE_VAR",
            "not set",
        )
        self.assertConfigError(
            "keys: [{name: k, key_env: NOPE_KEY}]", "keys[0].key_env", "NOPE_KEY"
        )

    def test_emptyVariable(self):
        """
        An empty variable is an error, and its (empty) value is not shown.
        """
        self.assertConfigError(
            "admin_key_env: ADM", "admin_key_env", "ADM", "empty", environ={"ADM": " "}
        )

    def test_bothGiven(self):
        """
        A secret given both directly and through the environment is refused.
        """
        message = self.assertConfigError(
            "keys: [{name: k, key: sk-relay-direct, key_env: K}]",
            "keys[0] (k)",
            "key or key_env",
            environ={"K": "sk-relay-env"},
        )
        self.assertNotIn("sk-relay", message)


class StructureErrorTests(SynchronousTestCase, ConfigErrorAssertions):
    """
    Unknown keys, YAML problems and empty files.
    """

    def test_unknownTopLevelKey(self):
        """
        An unknown top-level key is named.
        """
        self.assertConfigError("listen: 'tcp:1'\nlisten_port: 3\n", "unknown key listen_port")

    def test_unknownAccountKey(self):
        """
        An unknown key inside a list entry is named with its index.
        """
        message = self.assertConfigError(
            _MINIMAL + "  - {id: a2, type: apikey, api_key: k2, foo: 1}\n",
            "unknown key accounts[1].foo",
        )
        self.assertEqual(message, "unknown key accounts[1].foo")

    def test_unknownNestedKey(self):
        """
        An unknown key in a nested gateway section is named with its full
        path, with a suggestion for a near miss.
        """
        self.assertConfigError(
            "gateway: {breaker: {failure: 3}}",
            "unknown key gateway.breaker.failure",
            "did you mean failures?",
        )
        self.assertConfigError(
            "gateway: {upstream: {bogus: 1}}", "unknown key gateway.upstream.bogus"
        )
        self.assertConfigError("state: {bogus: 1}", "unknown key state.bogus")
        self.assertConfigError("components: {router: x.y}", "unknown key components.router")
        self.assertConfigError("log: {level: info}", "unknown key log.level")
        self.assertConfigError("keys: [{name: k, key: kk12, x: 1}]", "unknown key keys[0].x")
        self.assertConfigError(
            "proxies: [{id: p, url: 'http://h:1', x: 1}]", "unknown key proxies[0].x"
        )

    def test_wrongSectionType(self):
        """
        A section of the wrong shape is named.
        """
        self.assertConfigError("gateway: [1, 2]", "gateway: expected a mapping, got a list")
        self.assertConfigError("accounts: {id: a1}", "accounts: expected a list")
        self.assertConfigError("accounts: [a1]", "accounts[0]: expected a mapping, got 'a1'")
        self.assertConfigError("- 1\n- 2\n", "top level: expected a mapping")

    def test_yamlSyntaxError(self):
        """
        A YAML syntax error gives one line with the file and the line number.
        """
        path = self.tempPath()
        with open(path, "w") as f:
            f.write("listen: 'tcp:8080'\ngateway:\n  max_account_switches: [1, 2\n")
        e = self.assertRaises(ConfigError, loadConfig, path, {})
        self.assertNotIn("\n", str(e))
        self.assertIn(path + ":", str(e))
        self.assertIn("YAML syntax error", str(e))
        self.assertRegex(str(e), r":\d+:\d+: ")

    def test_duplicateYamlKey(self):
        """
        A mapping key given twice is an error rather than silently kept last.
        """
        self.assertConfigError(
            "listen: 'tcp:1'\nlisten: 'tcp:2'\n", "<string>:2:", "duplicate key 'listen'"
        )

    def test_emptyFile(self):
        """
        An empty (or comment-only) file is an error.
        """
        path = self.tempPath()
        with open(path, "w") as f:
            f.write("# nothing here\n")
        e = self.assertRaises(ConfigError, loadConfig, path, {})
        self.assertEqual(str(e), f"{path}: the configuration is empty")

    def test_missingFile(self):
        """
        A file that cannot be read is a L{ConfigError} naming it.
        """
        path = self.tempPath()
        e = self.assertRaises(ConfigError, loadConfig, path, {})
        self.assertIn(path, str(e))
        self.assertIn("cannot read", str(e))
        self.assertNotIn("\n", str(e))


class ValueErrorTests(SynchronousTestCase, ConfigErrorAssertions):
    """
    Wrong types, bad enums and out-of-range values are errors, not clamps.
    """

    def test_wrongType(self):
        """
        A wrong type is named with the expected type and the given value.
        """
        message = self.assertConfigError("gateway: {max_account_switches: ten}")
        self.assertEqual(message, "gateway.max_account_switches: expected an integer, got 'ten'")
        self.assertConfigError(
            "gateway: {breaker: {enabled: 'yes'}}",
            "gateway.breaker.enabled: expected true or false",
        )
        self.assertConfigError(
            "gateway: {retry_interval_ms: true}", "gateway.retry_interval_ms: expected an integer"
        )
        self.assertConfigError(
            "gateway: {scheduling: {user_wait_timeout: soon}}",
            "gateway.scheduling.user_wait_timeout: expected a number",
        )
        self.assertConfigError("database: 3", "database: expected a string, got 3")
        self.assertConfigError(
            "accounts: [{id: a1, type: apikey, api_key: k1, models: gpt-5}]",
            "accounts[0].models: expected a list",
        )
        self.assertConfigError(
            "accounts: [{id: a1, type: apikey, api_key: k1, model_mapping: {a: 1}}]",
            "accounts[0].model_mapping.a: expected a string",
        )

    def test_secretTypeErrorHidesValue(self):
        """
        A secret of the wrong type is described by kind, never by value.
        """
        message = self.assertConfigError(
            "keys: [{name: k, key: 123456789}]", "keys[0].key: expected a string, got an integer"
        )
        self.assertNotIn("123456789", message)

    def test_enums(self):
        """
        Every enumerated key rejects values outside its set.
        """
        cases = [
            ("accounts: [{id: a1, type: cookie, api_key: k1}]", "accounts[0].type"),
            (
                "accounts: [{id: a1, type: apikey, api_key: k1, ws_mode: fast}]",
                "accounts[0].ws_mode",
            ),
            ("gateway: {transport_retry_policy: random}", "gateway.transport_retry_policy"),
            ("state: {backend: etcd}", "state.backend"),
            ("state: {on_redis_error: ignore}", "state.on_redis_error"),
            ("log: {format: xml}", "log.format"),
            ("gateway: {websocket: {mode_default: turbo}}", "gateway.websocket.mode_default"),
        ]
        for text, key in cases:
            message = self.assertConfigError(text, key + ": expected ")
            self.assertIn(" or ", message)

    def test_ranges(self):
        """
        Out-of-range values are errors naming the key.
        """
        cases = [
            ("gateway: {first_output_timeout_seconds: 10}", "gateway.first_output_timeout_seconds"),
            (
                "gateway: {first_output_timeout_seconds: 601}",
                "gateway.first_output_timeout_seconds",
            ),
            ("gateway: {retry_interval_ms: -1}", "gateway.retry_interval_ms"),
            ("gateway: {retry_interval_ms: 30001}", "gateway.retry_interval_ms"),
            ("gateway: {max_account_switches: -1}", "gateway.max_account_switches"),
            ("gateway: {retry_budget_percent: 101}", "gateway.retry_budget_percent"),
            ("gateway: {scheduling: {ping_interval: 4}}", "gateway.scheduling.ping_interval"),
            ("gateway: {scheduling: {ping_interval: 31}}", "gateway.scheduling.ping_interval"),
            (
                "gateway: {scheduling: {user_max_waiting: -2}}",
                "gateway.scheduling.user_max_waiting",
            ),
            ("gateway: {breaker: {failures: 0}}", "gateway.breaker.failures"),
            ("gateway: {breaker: {open_seconds: 700}}", "gateway.breaker.max_open_seconds"),
            (
                "gateway: {upstream: {connect_timeout_seconds: 0}}",
                "gateway.upstream.connect_timeout_seconds",
            ),
            (
                "gateway: {websocket: {pool_capacity_factor: 0}}",
                "gateway.websocket.pool_capacity_factor",
            ),
            ("state: {concurrency_slot_ttl_minutes: 0}", "state.concurrency_slot_ttl_minutes"),
            ("keys: [{name: k, key: kkkk1, concurrency: -1}]", "keys[0].concurrency"),
            (
                "accounts: [{id: a1, type: apikey, api_key: k1, concurrency: -1}]",
                "accounts[0].concurrency",
            ),
            (
                "accounts: [{id: a1, type: apikey, api_key: k1, pool_mode_retry_count: -1}]",
                "accounts[0].pool_mode_retry_count",
            ),
            (
                "accounts: [{id: a1, type: apikey, api_key: k1, pool_mode_retry_count: 11}]",
                "accounts[0].pool_mode_retry_count",
            ),
            (
                "accounts: [{id: a1, type: apikey, api_key: k1,"
                " pool_mode_retry_status_codes: [429, 42]}]",
                "accounts[0].pool_mode_retry_status_codes[1]",
            ),
        ]
        for text, key in cases:
            self.assertConfigError(text, key + ": ")

    def test_firstOutputTimeoutBounds(self):
        """
        R20: 0, 30 and 600 are accepted.
        """
        for value in (0, 30, 600):
            config = parse(f"gateway: {{first_output_timeout_seconds: {value}}}")
            self.assertEqual(config.gateway.first_output_timeout_seconds, value)

    def test_listen(self):
        """
        listen must be a Twisted server endpoint string.
        """
        self.assertConfigError("listen: 'bogus:8080'", "listen: invalid Twisted server endpoint")
        self.assertConfigError("listen: 'tcp:port'", "listen: invalid Twisted server endpoint")
        self.assertEqual(
            parse("listen: 'tcp:0:interface=127.0.0.1'").listen, "tcp:0:interface=127.0.0.1"
        )

    def test_badURLs(self):
        """
        base_url must be http(s); redis_url must be redis://.
        """
        self.assertConfigError(
            "accounts: [{id: a1, type: apikey, api_key: k1, base_url: 'ftp://x'}]",
            "accounts[0].base_url: expected an http:// or https:// URL",
        )
        message = self.assertConfigError(
            "state: {redis_url: 'http://user:redis-pass@h:6379'}", "state.redis_url"
        )
        self.assertNotIn("redis-pass", message)

    def test_unusableURLs(self):
        """
        A URL that parses but cannot be dialled (a space, port 0 or above
        65535, a bad host, a C{?query} or C{#fragment} where the request
        path is appended) is a one-line error naming the key, for every
        URL-valued key: not a transport failure on every turn later.
        """
        bad = [
            ("http://exa mple.com/v1", "space"),
            ("https://host:0/v1", "bad port 0"),
            ("https://host:99999/v1", "bad port"),
            ("https://host:abc/v1", "bad port"),
            ("https://ho<st>/v1", "bad character in the host"),
            ("https://[::zz]/v1", "bad IPv6 address"),
            ("https://host/v1?api-version=1", "?query is not allowed"),
            ("https://host/v1#frag", "#fragment is not allowed"),
        ]
        for url, problem in bad:
            self.assertConfigError(
                f"accounts: [{{id: a1, type: apikey, api_key: k1, base_url: '{url}'}}]",
                "accounts[0].base_url: invalid URL", problem)
            self.assertConfigError(
                f"accounts: [{{id: o1, type: oauth, access_token: t1, chatgpt_account_id: c,"
                f" auth_base_url: '{url}'}}]", "accounts[0].auth_base_url: invalid URL", problem)
            self.assertConfigError(
                f"gateway: {{oauth: {{auth_base_url: '{url}'}}}}",
                "gateway.oauth.auth_base_url: invalid URL", problem)
            self.assertConfigError(
                f"tracing: {{exporter: otlp, endpoint: '{url}'}}",
                "tracing.endpoint: invalid URL", problem)
        good = parse("accounts: [{id: a1, type: apikey, api_key: k1,"
                     " base_url: 'https://[::1]:8443/v1/'}, {id: a2, type: apikey, api_key: k2,"
                     " base_url: 'http://relay_emulator.local:9090/v1'}]")
        self.assertEqual([a.base_url for a in good.accounts],
                         ["https://[::1]:8443/v1", "http://relay_emulator.local:9090/v1"])

    def test_unusableProxyAndRedisURLs(self):
        """
        Proxy URLs (top-level and an account's own) and C{state.redis_url}
        share the check, and their messages never echo the URL (it may
        carry a password, R100); a password may still hold a space.
        """
        for url, problem in (("socks5://u:proxy-pass@h:0", "bad port 0"),
                             ("socks5://u:proxy-pass@exa mple:1080", "space"),
                             ("http://u:proxy-pass@h%41:3128", "bad character in the host")):
            message = self.assertConfigError(
                f"proxies: [{{id: p1, url: '{url}'}}]", "proxies[0].url: invalid proxy URL",
                problem)
            self.assertNotIn("proxy-pass", message)
            message = self.assertConfigError(
                f"accounts: [{{id: a1, type: apikey, api_key: k1, proxy: '{url}'}}]",
                "accounts[0].proxy: invalid proxy URL", problem)
            self.assertNotIn("proxy-pass", message)
        spec = parse("proxies: [{id: p1, url: 'socks5://u:pa%20ss@h:1080'}]").proxies[0]
        self.assertEqual((spec.host, spec.port, spec.password), ("h", 1080, "pa ss"))
        for url, problem in (("redis://:redis-pass@h:0/0", "bad port 0"),
                             ("redis://:redis-pass@exa mple:6379/0", "space"),
                             ("redis://:redis-pass@h:6379/0#x", "#fragment is not allowed")):
            message = self.assertConfigError(
                f"state: {{backend: redis, redis_url: '{url}'}}", "state.redis_url: invalid URL",
                problem)
            self.assertNotIn("redis-pass", message)
        self.assertEqual(parse("state: {redis_url: 'unix:///run/redis/redis.sock?db=2'}")
                         .state.redis_url, "unix:///run/redis/redis.sock?db=2")

    def test_componentName(self):
        """
        Component names must look like dotted Python names.
        """
        self.assertConfigError(
            "components: {dialer: 'not a name'}", "components.dialer: expected a dotted name"
        )


class CredentialErrorTests(SynchronousTestCase, ConfigErrorAssertions):
    """
    Missing and duplicate credentials and identities.
    """

    def test_missingApiKey(self):
        """
        An apikey account without api_key(_env) names the account.
        """
        message = self.assertConfigError("accounts: [{id: a1, type: apikey}]")
        self.assertEqual(message, "accounts[0] (a1): api_key or api_key_env is required")

    def test_missingAccessToken(self):
        """
        An oauth account needs access_token(_env) and chatgpt_account_id.
        """
        self.assertConfigError(
            "accounts: [{id: o1, type: oauth, chatgpt_account_id: c}]",
            "accounts[0] (o1): access_token or access_token_env is required",
        )
        self.assertConfigError(
            "accounts: [{id: o1, type: oauth, access_token: tok1}]",
            "accounts[0] (o1): chatgpt_account_id is required",
        )

    def test_crossTypeCredential(self):
        """
        An oauth credential on an apikey account (and vice versa) is named.
        """
        self.assertConfigError(
            "accounts: [{id: a1, type: apikey, api_key: k1, access_token: t1}]",
            "accounts[0].access_token: only allowed on an oauth account",
        )
        self.assertConfigError(
            "accounts: [{id: o1, type: oauth, access_token: t1, chatgpt_account_id: c,"
            " api_key: k}]",
            "accounts[0].api_key: only allowed on an apikey account",
        )

    def test_autoRedeemResets(self):
        """
        C{accounts[].auto_redeem_resets} (protocol.md 7.3a) is off by
        default, a boolean, and only for an oauth account.
        """
        config = parse(
            """
            accounts:
              - {id: o1, type: oauth, access_token: t1, chatgpt_account_id: c}
              - {id: o2, type: oauth, access_token: t2, chatgpt_account_id: c,
                 auto_redeem_resets: true}
            """
        )
        self.assertEqual([a.auto_redeem_resets for a in config.accounts], [False, True])
        self.assertConfigError(
            "accounts: [{id: o1, type: oauth, access_token: t1, chatgpt_account_id: c,"
            " auto_redeem_resets: sometimes}]",
            "accounts[0].auto_redeem_resets: expected true or false",
        )
        self.assertConfigError(
            "accounts: [{id: a1, type: apikey, api_key: k1, auto_redeem_resets: true}]",
            "accounts[0].auto_redeem_resets: only allowed on an oauth account",
        )

    def test_missingIdentity(self):
        """
        id, type and name are required.
        """
        self.assertConfigError(
            "accounts: [{type: apikey, api_key: k1}]", "accounts[0]: id is required"
        )
        self.assertConfigError(
            "accounts: [{id: a1, api_key: k1}]", "accounts[0] (a1): type is required"
        )
        self.assertConfigError("keys: [{key: kkkk1}]", "keys[0]: name is required")
        self.assertConfigError("keys: [{name: k}]", "keys[0] (k): key or key_env is required")

    def test_duplicateAccountId(self):
        """
        Two accounts with one id are refused.
        """
        self.assertConfigError(
            "accounts: [{id: a1, type: apikey, api_key: k1}, {id: a1, type: apikey, api_key: k2}]",
            "accounts[1].id: duplicate account id 'a1'",
        )

    def test_duplicateKeyName(self):
        """
        Two client keys with one name are refused.
        """
        self.assertConfigError(
            "keys: [{name: k, key: sk-relay-one}, {name: k, key: sk-relay-two}]",
            "keys[1].name: duplicate key name 'k'",
        )

    def test_duplicateKeyValue(self):
        """
        Two client keys with one value are refused, without printing it.
        """
        message = self.assertConfigError(
            "keys: [{name: a, key: sk-relay-same}, {name: b, key: sk-relay-same}]",
            "keys[1] (b): duplicate key value",
            "keys[0]",
        )
        self.assertNotIn("sk-relay-same", message)


class ProxyTests(SynchronousTestCase, ConfigErrorAssertions):
    """
    Account proxies: inline URLs, C{proxy_env} and C{proxy_id}.
    """

    def test_inlineProxy(self):
        """
        An inline proxy URL becomes a L{ProxySpec} with id C{acct-<id>}.
        """
        config = parse(
            """
            accounts:
              - {id: a1, type: apikey, api_key: k1, proxy: "socks5://us%40er:p%3Ass@127.0.0.1:1080"}
              - {id: a2, type: apikey, api_key: k2, proxy: "http://proxy.local:8080"}
              - {id: a3, type: apikey, api_key: k3, proxy: null}
            """
        )
        a1, a2, a3 = config.accounts
        self.assertEqual(
            a1.proxy, ProxySpec("acct-a1", "socks5", "127.0.0.1", 1080, "us@er", "p:ss")
        )
        self.assertEqual(a2.proxy, ProxySpec("acct-a2", "http", "proxy.local", 8080))
        self.assertIsNone(a3.proxy)

    def test_proxyId(self):
        """
        proxy_id refers to a top-level proxies entry, from url or url_env.
        """
        config = parse(
            """
            proxies:
              - {id: p1, url: "socks5h://h1:1080"}
              - {id: p2, url_env: P2}
            accounts:
              - {id: a1, type: apikey, api_key: k1, proxy_id: p2}
            """,
            {"P2": "http://u:pw@h2:3128"},
        )
        self.assertEqual(config.proxies[0], ProxySpec("p1", "socks5h", "h1", 1080))
        self.assertEqual(config.accounts[0].proxy, ProxySpec("p2", "http", "h2", 3128, "u", "pw"))

    def test_unknownProxyId(self):
        """
        An unknown proxy_id is named.
        """
        self.assertConfigError(
            "accounts: [{id: a1, type: apikey, api_key: k1, proxy_id: nope}]",
            "accounts[0].proxy_id: unknown proxy id 'nope'",
        )

    def test_badProxyURL(self):
        """
        A malformed proxy URL is named without echoing it (it may hold a
        password).
        """
        for url, problem in [
            ("ftp://u:secretpw@h:21", "scheme"),
            ("socks5://u:secretpw@h", "port is missing"),
            ("socks5://u:secretpw@:1080", "host is missing"),
            ("socks5://u:secretpw@h:notaport", "invalid proxy URL"),
        ]:
            message = self.assertConfigError(
                f"accounts: [{{id: a1, type: apikey, api_key: k1, proxy: '{url}'}}]",
                "accounts[0].proxy: ",
                problem,
            )
            self.assertNotIn("secretpw", message)

    def test_twoProxySources(self):
        """
        proxy and proxy_id together are refused.
        """
        self.assertConfigError(
            "proxies: [{id: p, url: 'http://h:1'}]\n"
            "accounts: [{id: a1, type: apikey, api_key: k1, proxy: 'http://h:2', proxy_id: p}]",
            "accounts[0] (a1): give only one of proxy, proxy_id",
        )

    def test_duplicateProxyId(self):
        """
        Two proxies with one id are refused.
        """
        self.assertConfigError(
            "proxies: [{id: p, url: 'http://h:1'}, {id: p, url: 'http://h:2'}]",
            "proxies[1].id: duplicate proxy id 'p'",
        )


class SecretTests(SynchronousTestCase):
    """
    Secrets never appear in reprs; L{secretsOf} lists them all.
    """

    def test_reprHasNoSecrets(self):
        """
        The repr of a fully loaded configuration contains no secret.
        """
        config = loadConfig(os.path.join(_ETC, "relay.example.yaml"), environ=_EXAMPLE_ENV)
        text = repr(config)
        for secret in _EXAMPLE_ENV.values():
            if "://" in secret:
                secret = "proxy-pass-secret"
            self.assertNotIn(secret, text)
        self.assertIn("alice", text)

    def test_secretsOf(self):
        """
        L{secretsOf} returns every credential, key, admin key and proxy
        password.
        """
        config = loadConfig(os.path.join(_ETC, "relay.example.yaml"), environ=_EXAMPLE_ENV)
        self.assertEqual(
            secretsOf(config),
            {
                "admin-example-secret-0000",
                "sk-relay-alice-secret",
                "sk-upstream-a1-secret",
                "oauth-token-o1-secret",
                "oauth-refresh-o1-secret",
                "proxy-pass-secret",
            },
        )


class OAuthConfigTests(SynchronousTestCase, ConfigErrorAssertions):
    """
    Issue 12: OAuth accounts with refresh tokens or a Codex C{auth.json},
    C{auth_base_url}, and the C{gateway.oauth} / quota settings.
    """

    def test_refreshTokenOnly(self):
        """
        A refresh token alone is enough (relay refreshes before the first
        request); C{id_token} is optional; the account id comes from the
        config.
        """
        config = parse(
            "accounts: [{id: o1, type: oauth, refresh_token_env: RT, id_token: idt,"
            " chatgpt_account_id: c1, auth_base_url: 'http://127.0.0.1:9/'}]",
            environ={"RT": "rt-secret"},
        )
        [acct] = config.accounts
        self.assertEqual((acct.credential, acct.refresh_token, acct.id_token),
                         ("", "rt-secret", "idt"))
        self.assertEqual(acct.auth_base_url, "http://127.0.0.1:9")
        self.assertEqual(acct.token_source, "env")
        self.assertNotIn("rt-secret", repr(acct))

    def test_accountIdFromClaim(self):
        """
        Without C{chatgpt_account_id} the access token's account claim
        gives it; without a claim it is required.
        """
        import jwt

        access = jwt.encode({"https://api.openai.com/auth": {"chatgpt_account_id": "acct-j"}},
                            b"k" * 32, algorithm="HS256")
        config = parse(f"accounts: [{{id: o1, type: oauth, access_token: '{access}'}}]")
        self.assertEqual(config.accounts[0].chatgpt_account_id, "acct-j")
        self.assertConfigError(
            "accounts: [{id: o1, type: oauth, refresh_token: rt}]",
            "accounts[0] (o1): chatgpt_account_id is required",
        )

    def test_authFile(self):
        """
        C{auth_file} reads a Codex C{auth.json}: tokens, account id and
        last refresh; giving tokens as well is an error; an unreadable file
        names the key.
        """
        path = self.mktemp()
        with open(path, "w") as f:
            json.dump({"tokens": {"refresh_token": "rt-file", "account_id": "acct-file"},
                       "last_refresh": "2027-01-01T00:00:00Z"}, f)
        config = parse(f"accounts: [{{id: o1, type: oauth, auth_file: '{path}'}}]")
        [acct] = config.accounts
        self.assertEqual((acct.refresh_token, acct.chatgpt_account_id),
                         ("rt-file", "acct-file"))
        self.assertEqual(acct.token_source, "auth_file:" + path)
        self.assertIsNotNone(acct.last_refresh)
        self.assertConfigError(
            f"accounts: [{{id: o1, type: oauth, auth_file: '{path}', refresh_token: x}}]",
            "give auth_file or tokens",
        )
        self.assertConfigError(
            "accounts: [{id: o1, type: oauth, auth_file: /nonexistent/auth.json}]",
            "accounts[0].auth_file: cannot read /nonexistent/auth.json",
        )
        self.assertConfigError(
            "accounts: [{id: a1, type: apikey, api_key: k, refresh_token: x}]",
            "accounts[0].refresh_token: only allowed on an oauth account",
        )

    def test_gatewaySettings(self):
        """
        C{gateway.oauth} and the quota settings parse; unknown keys and
        out-of-range values are one-line errors.
        """
        config = parse(
            "gateway: {oauth: {auth_base_url: 'http://127.0.0.1:1', refresh_margin_seconds: 60,"
            " client_id: x}, scheduling: {quota_aware: false, quota_threshold_percent: 90}}"
        )
        self.assertEqual(config.gateway.oauth.refresh_margin_seconds, 60)
        self.assertFalse(config.gateway.scheduling.quota_aware)
        self.assertEqual(config.gateway.scheduling.quota_threshold_percent, 90)
        self.assertConfigError("gateway: {oauth: {margin: 1}}", "unknown key gateway.oauth.margin")
        self.assertConfigError("gateway: {scheduling: {quota_threshold_percent: 101}}",
                               "gateway.scheduling.quota_threshold_percent")

    def test_secrets(self):
        """
        Refresh and ID tokens are registered for log redaction.
        """
        from relay.configuration.parse import secretsOf

        config = parse("accounts: [{id: o1, type: oauth, refresh_token: rt-abcdef,"
                       " id_token: id-abcdef, chatgpt_account_id: c}]")
        self.assertTrue({"rt-abcdef", "id-abcdef"} <= secretsOf(config))


class SentinelConfigTests(SynchronousTestCase, ConfigErrorAssertions):
    """
    C{state.redis_sentinels} and C{state.redis_master_name} (config.md,
    issue 23).
    """

    def test_parsed(self):
        """
        Both keys together; C{redis_url} still gives the database.
        """
        config = parse(
            "state: {backend: redis, redis_url: 'redis://:pw@ignored:1/2',"
            " redis_sentinels: ['10.0.0.1:26379', 'sentinel-b', '[::1]:26380'],"
            " redis_master_name: mymaster}"
        )
        self.assertEqual(
            config.state.redis_sentinels, ("10.0.0.1:26379", "sentinel-b", "[::1]:26380")
        )
        self.assertEqual(config.state.redis_master_name, "mymaster")
        self.assertEqual(parse("{}").state.redis_sentinels, ())
        self.assertIsNone(parse("{}").state.redis_master_name)

    def test_errors(self):
        """
        One key without the other, a bad address, an empty list: one line
        naming the key.
        """
        self.assertConfigError(
            "state: {redis_sentinels: ['h:1']}", "state.redis_master_name", "required"
        )
        self.assertConfigError(
            "state: {redis_master_name: m}", "state.redis_sentinels", "required"
        )
        self.assertConfigError(
            "state: {redis_sentinels: ['h:notaport'], redis_master_name: m}",
            "state.redis_sentinels[0]",
        )
        self.assertConfigError(
            "state: {redis_sentinels: [], redis_master_name: m}", "state.redis_sentinels"
        )
        self.assertConfigError(
            "state: {redis_sentinels: 'h:1', redis_master_name: m}", "state.redis_sentinels"
        )


class RedisURLConfigTests(SynchronousTestCase, ConfigErrorAssertions):
    """
    C{state.redis_url} takes what the client honours (issue 23):
    C{redis://}, C{rediss://} (TLS, with redis-py's C{ssl_*} parameters) and
    C{unix://}; anything else is one line naming the key, never the URL's
    password. The real connections: L{tests.integration.test_redis_url}.
    """

    def test_accepted(self):
        for url in ("redis://:pw@h:6380/2", "rediss://h/0", "unix:///run/redis/redis.sock",
                    "unix://:pw@/run/redis/redis.sock?db=4"):
            self.assertEqual(parse(f"state: {{redis_url: '{url}'}}").state.redis_url, url)

    def test_tlsFiles(self):
        """
        A C{rediss://} URL's certificate files are loaded with the
        configuration: a missing or unparsable file is a config error.
        """
        self.assertConfigError("state: {redis_url: 'rediss://:pw@h/0?ssl_ca_certs=/nonexistent'}",
                               "state.redis_url", "ssl_ca_certs", "/nonexistent")
        path = self.mktemp()
        with open(path, "w") as f:
            f.write("not a certificate\n")
        message = self.assertConfigError(
            f"state: {{redis_url: 'rediss://:secret-pw@h/0?ssl_ca_certs={path}'}}",
            "state.redis_url", "no PEM certificate")
        self.assertNotIn("secret-pw", message)
        self.assertConfigError(f"state: {{redis_url: 'rediss://h/0?ssl_keyfile={path}'}}",
                               "state.redis_url", "ssl_keyfile needs ssl_certfile")

    def test_clientKeyMatchesCertificate(self):
        """
        A client key that is not the certificate's is refused at load, not
        at the first TLS handshake.
        """
        from tests.integration.tlsca import TestCA

        one, other = TestCA.create(), TestCA.create()
        paths = {}
        for name, data in (("cert", one.leafCertPEM), ("key", one.leafKeyPEM),
                           ("otherkey", other.leafKeyPEM)):
            paths[name] = self.mktemp()
            with open(paths[name], "wb") as f:
                f.write(data)
        good = f"rediss://h/0?ssl_certfile={paths['cert']}&ssl_keyfile={paths['key']}"
        self.assertEqual(parse(f"state: {{redis_url: '{good}'}}").state.redis_url, good)
        bad = f"rediss://h/0?ssl_certfile={paths['cert']}&ssl_keyfile={paths['otherkey']}"
        self.assertConfigError(f"state: {{redis_url: '{bad}'}}", "state.redis_url",
                               "is not ssl_certfile's")

    def test_refused(self):
        cases = [
            ("http://u:redis-pass@h:6379", "unsupported scheme 'http'"),
            ("redis://:redis-pass@h:6379/x", "bad database"),
            ("redis://:redis-pass@h:6379/0?ssl_ca_certs=/x", "unknown parameter 'ssl_ca_certs'"),
            ("rediss://:redis-pass@h/0?verify=no", "unknown parameter 'verify'"),
            ("unix://:redis-pass@", "needs the socket's path"),
            ("unix:///r.sock?db=one", "bad database"),
            ("redis://:redis-pass@h:99999/0", "bad port"),
        ]
        for url, fragment in cases:
            message = self.assertConfigError(f"state: {{redis_url: '{url}'}}",
                                             "state.redis_url", fragment)
            self.assertNotIn("redis-pass", message)

    def test_sentinelsTakeRedisOnly(self):
        """
        txredisapi's Sentinel support connects without TLS or unix sockets,
        so with C{redis_sentinels} the URL must be C{redis://}.
        """
        for scheme in ("rediss://unused/0", "unix:///r.sock"):
            self.assertConfigError(
                f"state: {{backend: redis, redis_url: '{scheme}',"
                " redis_sentinels: ['h:26379'], redis_master_name: m}",
                "state.redis_url", "redis_sentinels")
