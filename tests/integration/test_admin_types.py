"""
Type-confused admin bodies (behaviour.md R99's admin surface, protocol.md
2.6): every field of every admin write route has its JSON type checked
before anything reads it (L{relay.console.fields}); a wrongly typed value
-- C{"api_key": ["..."]}, an object token, a number where a string
belongs -- is a 400 naming the field (the route's own code) in OpenAI's error
envelope, never a 500, and relay keeps serving.

Hypothesis (derandomized) draws a route, a field path of its body table
(nested objects, list items and map values included) and a JSON value of
another type; a second property throws arbitrary JSON objects at every
write route and asserts only that nothing is a 500.
"""

from __future__ import annotations

import json

import pytest_twisted
import treq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.logger import globalLogPublisher

from relay.control.accounts.records import ACCOUNT_BODY
from relay.control.groups.resource import GROUP_BODY
from relay.control.keys.resource import KEY_BODY
from relay.control.logins.resource import COMPLETE_BODY, LOGIN_BODY
from relay.control.prices.resource import PRICE_BODY, PRICES_BODY
from relay.console.admin import REFRESH_BODY, TOKENS_BODY
from relay.console.fields import REASON_BODY
from tests.integration.harness import startStack

ADMIN = "admin-types-0123456789"

ROUTES = [
    ("POST", "/admin/accounts", ACCOUNT_BODY),
    ("PATCH", "/admin/accounts/adm", ACCOUNT_BODY),
    ("POST", "/admin/accounts/a1/disable", REASON_BODY),
    ("POST", "/admin/accounts/o1/login", LOGIN_BODY),
    ("POST", "/admin/accounts/o1/refresh", REFRESH_BODY),
    ("PUT", "/admin/accounts/o1/tokens", TOKENS_BODY),
    ("POST", "/admin/logins", LOGIN_BODY),
    ("POST", "/admin/logins/login-x/complete", COMPLETE_BODY),
    ("POST", "/admin/keys", KEY_BODY),
    ("PATCH", "/admin/keys/kadm", KEY_BODY),
    ("POST", "/admin/keys/kadm/disable", REASON_BODY),
    ("PUT", "/admin/groups/g1", GROUP_BODY),
    ("PUT", "/admin/prices", PRICES_BODY),
    ("PUT", "/admin/prices/m2", PRICE_BODY),
]
"""Every admin write route that reads a body, with its body table."""

OTHER_WRITES = [
    ("PUT", "/admin/settings"),
    ("POST", "/admin/accounts/a1/clear"),
    ("POST", "/admin/accounts/a1/enable"),
    ("POST", "/admin/keys/kadm/enable"),
]
"""Write routes whose body is checked elsewhere (settings) or not read."""

SETTINGS = settings(derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**64, 2**64),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
)
jsonValues = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


@st.composite
def wrongField(draw):
    """
    @return: C{(method, path, body, field path)}: a body whose field at
        C{field path} has a JSON type its table refuses.
    """
    method, path, table = draw(st.sampled_from(ROUTES))
    name = draw(st.sampled_from(sorted(table)))
    kind, where = table[name], name

    def build(kind, where):
        descend = draw(st.booleans())
        if descend and kind.fields is not None:
            inner = draw(st.sampled_from(sorted(kind.fields)))
            value, where = build(kind.fields[inner], f"{where}.{inner}")
            return {inner: value}, where
        if descend and kind.items is not None:
            value, where = build(kind.items, f"{where}[0]")
            return [value], where
        if descend and kind.values is not None:
            value, where = build(kind.values, f"{where}.m")
            return {"m": value}, where
        bad = draw(jsonValues.filter(lambda v: v is not None and not kind.accepts(v)))
        return bad, where

    value, where = build(kind, where)
    return method, path, {name: value}, where


class _Rig:
    """
    The relay under test, and the failures it logged.
    """

    stack = None
    failures: list

    async def call(self, method: str, path: str, body) -> tuple:
        """
        @return: C{(status, body bytes)} of one admin request with the key.
        """
        base = f"http://127.0.0.1:{self.stack.port.getHost().port}"
        response = await treq.request(
            method, base + path, data=json.dumps(body).encode(),
            headers={"Authorization": [f"Bearer {ADMIN}"],
                     "Content-Type": ["application/json"]})
        return response.code, await response.content()


@pytest_twisted.async_yield_fixture(scope="module")
async def rig():
    """
    One relay for the module (an API-key and an OAuth account, an admin
    account and an admin key to change), watching its log for failures.
    """
    stack = await startStack(
        [{"id": "a1", "credential": "sk-a1"},
         {"id": "o1", "type": "oauth", "credential": "oauth-o1"}],
        extra=f"admin_key: {ADMIN}\n")
    r = _Rig()
    r.stack = stack
    r.failures = []

    def observe(event):
        """
        Keep logged failures (a 500's traceback).
        """
        if event.get("log_failure") is not None or event.get("event") == "relay.admin_failed":
            r.failures.append(event)

    globalLogPublisher.addObserver(observe)
    code, data = await r.call("POST", "/admin/accounts", {
        "id": "adm", "type": "apikey", "base_url": "http://127.0.0.1:1/v1",
        "api_key": "sk-admin-acct"})
    assert code == 201, data
    code, data = await r.call("POST", "/admin/keys", {"name": "kadm"})
    assert code == 201, data
    try:
        yield r
    finally:
        globalLogPublisher.removeObserver(observe)
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_reported_inputs(rig):
    """
    The issue's inputs: a list for C{api_key}, an object token, a number
    for a name: 400 naming the field, OpenAI's envelope.
    """
    for method, path, body, field in [
        ("POST", "/admin/accounts", {"id": "n1", "type": "apikey", "api_key": ["sk-x"],
                                     "base_url": "http://127.0.0.1:1/v1"}, "api_key"),
        ("PATCH", "/admin/accounts/adm", {"api_key": {"k": "v"}}, "api_key"),
        ("PUT", "/admin/accounts/o1/tokens", {"access_token": "at", "refresh_token": {"a": 1}},
         "refresh_token"),
        ("POST", "/admin/accounts/o1/refresh", {"retry_in_doubt": "yes"}, "retry_in_doubt"),
        ("POST", "/admin/keys", {"name": 5}, "name"),
        ("POST", "/admin/logins", {"flow": "device", "account": {"id": "n", "proxy": [1]}},
         "account.proxy"),
    ]:
        code, data = await rig.call(method, path, body)
        assert code == 400, (path, data)
        error = json.loads(data)["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", field), error
        assert error["code"].startswith("invalid_"), error
        assert error["message"].startswith(field + ": expected "), error
        assert "sk-x" not in error["message"]
    assert not rig.failures


@settings(SETTINGS, max_examples=600)
@given(example=wrongField())
@pytest_twisted.ensureDeferred
async def test_wrong_types_are_400_naming_the_field(rig, example):
    """
    Every table field of every admin write route, at any depth, with a
    value of another JSON type: 400 naming its path.
    """
    method, path, body, field = example
    code, data = await rig.call(method, path, body)
    assert code == 400, (method, path, body, data)
    error = json.loads(data)["error"]
    assert error["param"] == field and error["code"].startswith("invalid_"), (body, error)
    assert error["type"] == "invalid_request_error"
    assert not rig.failures, rig.failures[:1]


@settings(SETTINGS, max_examples=400)
@given(route=st.sampled_from([r[:2] for r in ROUTES] + OTHER_WRITES),
       body=st.dictionaries(
           st.one_of(st.sampled_from(sorted({n for r in ROUTES for n in r[2]})),
                     st.text(max_size=6)),
           jsonValues, max_size=4))
@pytest_twisted.ensureDeferred
async def test_any_json_body_is_never_a_500(rig, route, body):
    """
    Arbitrary JSON objects at every admin write route: never a 500, every
    error in OpenAI's envelope.
    """
    method, path = route
    code, data = await rig.call(method, path, body)
    assert code < 500, (method, path, body, data)
    if code >= 400:
        assert set(json.loads(data)["error"]) >= {"message", "type", "code", "param"}
    assert not rig.failures, rig.failures[:1]


@pytest_twisted.ensureDeferred
async def test_settings_wrong_types(rig):
    """
    C{PUT /admin/settings}: a list or an object (an empty one included)
    for any runtime setting, flat or nested, is a 400 naming it; nothing
    changes.
    """
    from relay.state.settings import RUNTIME_KEYS

    for name in RUNTIME_KEYS:
        head, _, tail = name.rpartition(".")
        for bad in ([], {}, [1], ["x"]):
            for body in ({name: bad}, {head: {tail: bad}} if head else {name: bad}):
                code, data = await rig.call("PUT", "/admin/settings", body)
                assert code == 400, (body, data)
                assert json.loads(data)["error"]["param"] == name, (body, data)
    assert not rig.failures


@pytest_twisted.ensureDeferred
async def test_relay_still_serves(rig):
    """
    After the properties the relay still answers its admin API and a turn.
    """
    response = await treq.get(
        f"http://127.0.0.1:{rig.stack.port.getHost().port}/admin/keys",
        headers={"Authorization": [f"Bearer {ADMIN}"]})
    assert response.code == 200
    await response.content()
    response, data = await rig.stack.postJSON(
        "/v1/responses", {"model": "gpt-5.5", "input": "still there?"})
    assert response.code == 200, data
