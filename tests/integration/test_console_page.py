"""
The console (issue 40) as a person uses it, in headless Chromium at
1280 px over the DevTools protocol (L{tests.integration.cdp}): its
sections (Overview, Accounts, Keys, Requests, Usage & cost, Settings,
Audit) opened from the bar at the top; search, filter, sort and CSV of a
table; a bulk action with its confirmation kept across re-renders;
charts (the vendored uPlot) with real data after traffic; a failing
account shown as failing, never "ok"; settings, groups and prices changed
in the page; explain in the page; the test action; a key's budget as
progress with what is left.

The relay is real (in this process, on loopback) over the bundled
emulator. Screenshots are kept in C{artifacts/console-*.png}.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq

from tests.integration.cdp import CHROMIUM, Session
from tests.integration.harness import closedPort, sseEvents, startStack
from tests.integration.oauthstack import sleep
from tests.integration.test_status_page import ARTIFACTS

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")

ADMIN = "console-page-admin-key-0123"

SHORT_COOLDOWN = '{"transport_error_cooldown_seconds": 1, "breaker": {"enabled": false}}'
"""A cooldown that lapses between turns, and no breaker (a failing account
schedulable again)."""

KEYS = json.dumps([
    {"name": "alice", "key": "sk-alice-console-0001", "daily_usd": 0.001},
    {"name": "bob", "key": "sk-bob-console-0002"},
])


async def _stack(gateway="{}"):
    """
    A relay with a refusing account (priority 1: every turn tries it first
    and fails over) and two good ones; a few turns of each key.
    """
    stack = await startStack(
        [
            {"id": "acct-down", "credential": "sk-down",
             "base_url": f"http://127.0.0.1:{closedPort()}/v1", "priority": 1},
            {"id": "acct-a", "credential": "sk-a", "priority": 50},
            {"id": "acct-b", "credential": "sk-b", "priority": 50},
        ],
        keys=KEYS, extra=f"admin_key: {ADMIN}\n", gateway=gateway,
    )
    for n, key in enumerate(["sk-alice-console-0001", "sk-bob-console-0002",
                             "sk-bob-console-0002"]):
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": f"turn {n}", "stream": True},
            key=key)
        assert response.code == 200 and sseEvents(data)[-1][0] == "response.completed", data
    return stack


async def _admin(stack, method, path, body=None):
    r = await treq.request(method, stack.url + "/admin/" + path,
                           data=json.dumps(body).encode() if body is not None else None,
                           headers={"Authorization": [f"Bearer {ADMIN}"],
                                    "Content-Type": ["application/json"]}, persistent=False)
    raw = await r.content()
    return r.code, json.loads(raw) if raw else None


async def _shot(page, name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    data = await page.screenshot(str(ARTIFACTS / f"console-{name}.png"))
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


@pytest_twisted.ensureDeferred
async def test_every_section_opens_with_its_data():
    """
    Each section of the bar opens and shows what the relay holds, without
    a script error; a screenshot of each is kept.
    """
    stack = await _stack()
    session = Session()
    try:
        page = await session.start(1280, 900)
        await page.goto(stack.url + "/admin/#key=" + ADMIN)
        await page.waitFor("document.body.getAttribute('data-overview-loaded') === '1'")
        assert ADMIN not in await page.url()
        # The overview's chart of requests and failures per minute has the
        # traffic; the failover is listed, and exports as CSV.
        chart = "document.getElementById('overview-chart')"
        await page.waitFor(f"Number({chart}.dataset.points) >= 1", what="the per-minute chart")
        assert await page.evaluate(f"{chart}.dataset.series") == "requests|failures"
        failovers = await _csv(page, "failovers")
        assert "acct-down" in failovers and failovers.startswith("When,Entry,From,To"), failovers
        await _shot(page, "overview")
        for name, loaded in [("accounts", "manage-loaded"), ("keys", "keys-loaded"),
                             ("requests", "requests-loaded"), ("usage", "usage-loaded"),
                             ("settings", "settings-loaded"), ("audit", "audit-loaded")]:
            await page.section(name, loaded)
            assert await page.evaluate(
                "document.documentElement.scrollWidth <= document.documentElement.clientWidth"
            ), f"{name} scrolls sideways at 1280 px"
            await _shot(page, name)
        # Sign out: the data is gone from the page; the form signs in again.
        await page.click("#logout")
        await page.waitFor("!document.getElementById('login').classList.contains('hidden')")
        assert "acct-down" not in await page.html()
        await page.type("#admin-key", ADMIN)
        await page.click("#login-form button[type=submit]")
        await page.waitFor("document.body.getAttribute('data-section') === 'audit' && "
                           "!!document.querySelector('#audit-body tr')",
                           what="signed in again")
        assert ADMIN not in await page.html()
        assert page.exceptions() == []
    finally:
        await session.stop()
        await stack.stop()


CSV_HOOK = (
    "(function(){ if (window.__csv) return; window.__csv = [];"
    " var made = URL.createObjectURL.bind(URL);"
    " URL.createObjectURL = function (blob) { blob.text().then(function (t) {"
    " window.__csv.push(t); }); return made(blob); }; })()"
)
"""Keeps the text of each CSV the page hands the browser to download."""


async def _csv(page, table, button=None):
    """
    Click a table's CSV button (or C{button}), as a person does, and
    return the file.
    """
    await page.evaluate(CSV_HOOK)
    before = await page.evaluate("window.__csv.length")
    await page.click(button or f"#{table}-csv")
    await page.waitFor(f"window.__csv.length > {before}", what=f"the CSV of {table}")
    return await page.evaluate("window.__csv[window.__csv.length - 1]")


def _row(kind, key, value):
    return f'tr.{kind}[data-{key}="{value}"]'


async def _rowText(page, selector):
    return await page.evaluate(
        "(function(){var r=document.querySelector(%s); return r ? r.innerText : null;})()"
        % json.dumps(selector))


async def _visibleIds(page):
    return await page.evaluate(
        "Array.from(document.querySelectorAll('#accounts-body tr.account'))"
        ".map(function (r) { return r.dataset.accountId; })")


@pytest_twisted.ensureDeferred
async def test_accounts_health_search_sort_bulk_and_test():
    """
    The accounts section: the account whose every attempt failed is shown
    failing -- also once its cooldown is cleared, never a plain "ok";
    search, filter and sort narrow and order the rows; a bulk pause (with
    a reason) and resume of two accounts; a bulk delete whose confirmation
    outlives the table's refreshes; the Test action's answer for a good
    and a refusing account; the table as CSV.
    """
    stack = await _stack(SHORT_COOLDOWN)
    session = Session()
    try:
        for n in range(2):
            code, body = await _admin(stack, "POST", "accounts", {
                "id": f"extra-{n}", "type": "apikey", "api_key": f"sk-extra-{n}-0000",
                "base_url": stack.emulator.baseURL("apikey"), "priority": 90})
            assert code == 201, body
        # Its cooldown lifted after each failure: three attempts, all failed;
        # then schedulable again, but failing.
        # A short cooldown (and no breaker): it lapses between turns, each of
        # which tries acct-down first and fails over.
        for n in range(3):
            await sleep(1.2)
            response, data = await stack.postJSON(
                "/v1/responses", {"model": "gpt-5.5", "input": f"again {n}", "stream": True},
                key="sk-bob-console-0002")
            assert response.code == 200
        await sleep(1.2)
        page = await session.start(1280, 900)
        await page.goto(stack.url + "/admin/#key=" + ADMIN)
        await page.section("accounts", "manage-loaded")
        down = _row("account", "account-id", "acct-down")
        await page.waitFor(f"document.querySelector('{down}').dataset.state === 'failing'",
                           what="acct-down shown failing")
        text = await _rowText(page, down)
        assert "failing" in text and "4 failed" in text, text
        assert "\tok\t" not in text and not text.startswith("ok"), text
        await _shot(page, "accounts-failing")
        # The overview says so too.
        await page.section("overview", "overview-loaded")
        attention = await page.text("#attention")
        assert "acct-down: failing" in attention, attention
        await page.section("accounts")

        # Search, filter, sort.
        await page.type("#accounts-search", "extra")
        await page.waitFor("document.querySelectorAll('#accounts-body tr.account').length === 2")
        await page.type("#accounts-search", "")
        await page.select("#accounts-filter-state", "failing")
        assert await _visibleIds(page) == ["acct-down"]
        await page.select("#accounts-filter-state", "")
        await page.click('#accounts th[data-col="id"]')
        ids = await _visibleIds(page)
        assert ids == sorted(ids), ids
        await page.click('#accounts th[data-col="id"]')
        assert await _visibleIds(page) == sorted(ids, reverse=True)

        # Bulk pause with a reason, then bulk resume.
        for n in range(2):
            await page.click(f'{_row("account", "account-id", f"extra-{n}")} input.select')
        await page.waitFor("document.getElementById('accounts-bulk').innerText"
                           ".indexOf('2 selected') >= 0", what="2 selected")
        await page.click("#accounts-bulk button.bulk-pause")
        await page.type("#pause-reason", "quota review")
        await page.click("#pause-submit")
        await page.waitFor("document.getElementById('manage-msg').innerText"
                           ".indexOf('2 accounts paused (quota review)') >= 0",
                           what="the bulk pause")
        code, view = await _admin(stack, "GET", "accounts")
        byId = {a["id"]: a for a in view["accounts"]}
        assert [byId[f"extra-{n}"]["paused"] for n in range(2)] == [True, True]
        assert byId["extra-0"]["paused_reason"] == "quota review"
        await _shot(page, "accounts-bulk-paused")
        for n in range(2):
            await page.click(f'{_row("account", "account-id", f"extra-{n}")} input.select')
        await page.click("#accounts-bulk button.bulk-resume")
        await page.waitFor("document.getElementById('manage-msg').innerText"
                           ".indexOf('resumed') >= 0", what="the bulk resume")
        code, view = await _admin(stack, "GET", "accounts")
        assert not any(a["paused"] for a in view["accounts"])

        # Bulk delete: armed, the table refreshes (every 3 s), still armed.
        for n in range(2):
            await page.click(f'{_row("account", "account-id", f"extra-{n}")} input.select')
        await page.click("#accounts-bulk button.bulk-delete")
        armed = ("(function(){var b=document.querySelector('#accounts-bulk button.bulk-delete');"
                 " return b && b.innerText === 'Confirm delete (2)';})()")
        await page.waitFor(armed, what="the armed bulk delete")
        await page.evaluate("document.querySelector('#accounts-body tr').dataset.old = '1'")
        await page.waitFor("!document.querySelector('#accounts-body tr[data-old]')",
                           what="a refresh of the table")
        assert await page.evaluate(armed), "the confirmation did not survive the refresh"
        await page.click("#accounts-bulk button.bulk-delete")
        await page.waitFor("document.querySelectorAll('#accounts-body tr.account').length === 3",
                           what="the two accounts deleted")
        code, view = await _admin(stack, "GET", "accounts")
        assert sorted(a["id"] for a in view["accounts"]) == ["acct-a", "acct-b", "acct-down"]

        # Test: the good account's credential lists models; the refusing one fails.
        await page.click(f'{_row("account", "account-id", "acct-a")} button.test')
        await page.waitFor("document.getElementById('test-panel').dataset.testStatus === 'ok'",
                           what="the test of acct-a")
        result = await page.text("#test-result")
        assert "OK" in result and "list models" in result, result
        await _shot(page, "accounts-test")
        await page.click(f'{down} button.test')
        await page.waitFor("['failed','error'].indexOf(document.getElementById('test-panel')"
                           ".dataset.testStatus) >= 0", what="the test of acct-down")
        assert "Failed" in await page.text("#test-result")

        # A client's own fault (an upstream 400 for its request) is not the
        # account's error.
        stack.emulator.setFault("sk-b", {"kind": "status", "code": 400, "times": 1})
        code, body = await _admin(stack, "POST", "accounts/acct-a/disable", {})
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "a bad request", "stream": False},
            key="sk-bob-console-0002")
        assert response.code == 400, data
        await _admin(stack, "POST", "accounts/acct-a/enable", {})
        acctB = _row("account", "account-id", "acct-b")
        await page.waitFor(f"document.querySelector('{acctB}').innerText"
                           ".indexOf('client fault') >= 0", what="the client fault counted")
        assert await page.text(f"{acctB} .lasterror") == ""
        assert await page.evaluate(f"document.querySelector('{acctB}').dataset.state") == "ok"

        csv = await _csv(page, "accounts")
        lines = csv.strip().splitlines()
        assert lines[0].startswith("Account,State,"), lines
        assert len(lines) == 4 and any(line.startswith("acct-down,failing") for line in lines)
        assert page.exceptions() == []
    finally:
        await session.stop()
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_usage_charts_budgets_and_requests_refresh():
    """
    After traffic (and two failed turns) the usage section charts cost
    per key with the real numbers (drawn by the vendored uPlot), per model
    on request, and failures by kind; its totals export as CSV; a $0.001
    budget shows as such with what is left, never as $0.00; the request
    view lists a new turn by itself.
    """
    stack = await _stack()
    session = Session()
    try:
        for key in ("sk-a", "sk-b"):
            stack.emulator.setFault(key, {"kind": "status", "code": 500, "times": 20})
        for n in range(2):
            response, data = await stack.postJSON(
                "/v1/responses", {"model": "gpt-5.5", "input": f"fails {n}", "stream": False},
                key="sk-bob-console-0002")
            assert response.code >= 500, data
        for key in ("sk-a", "sk-b"):
            stack.emulator.setFault(key, None)
        await stack.app.runner.requestLog.flush()
        page = await session.start(1280, 900)
        await page.goto(stack.url + "/admin/#usage&key=" + ADMIN)
        await page.waitFor("document.body.getAttribute('data-usage-loaded') === '1'")
        chart = "document.getElementById('usage-chart')"
        await page.waitFor(f"{chart}.dataset.series === 'bob|alice'", what="cost per key")
        assert int(await page.evaluate(f"{chart}.dataset.points")) >= 2
        assert await page.evaluate(f"!!{chart}.querySelector('canvas')")
        fails = "document.getElementById('failure-chart')"
        await page.waitFor(f"Number({fails}.dataset.points) >= 1", what="failures by kind")
        assert "failures" not in await page.evaluate(f"{fails}.dataset.series")
        bob = await _rowText(page, _row("usage-row", "group", "bob"))
        assert "$" in bob and "2" in bob, bob
        await _shot(page, "usage-cost")
        await page.select("#usage-group", "model")
        await page.waitFor(f"{chart}.dataset.series === 'gpt-5.5'", what="cost per model")
        await page.select("#usage-metric", "total_tokens")
        await page.select("#usage-range", "7d")
        await page.waitFor(f"Number({chart}.dataset.points) >= 1 && "
                           "document.querySelector('#usage-chart-card h3').innerText"
                           ".indexOf('Tokens per model') === 0", what="tokens per model, 7 d")
        csv = await _csv(page, "usage")
        assert csv.splitlines()[0].startswith("Group,Served,Failed,Input"), csv
        assert csv.splitlines()[1].startswith("gpt-5.5,"), csv
        await _shot(page, "usage-tokens-7d")

        # The $0.001 budget of alice: spent, of what, what is left.
        await page.section("keys", "keys-loaded")
        alice = _row("key-row", "key", "alice")
        text = await _rowText(page, alice)
        assert "$0.00100/day" in text and "$0.00/day" not in text, text
        assert "of $0.00100" in text and "left" in text, text
        percent = await page.evaluate(
            f"document.querySelector('{alice} .meter-box').dataset.percent")
        assert 0 < int(percent) <= 100, percent
        await _shot(page, "keys-budgets")

        # A bulk revoke of two keys issued through the API.
        for name in ("carol", "dave"):
            code, body = await _admin(stack, "POST", "keys", {"name": name})
            assert code == 201, body
        for name in ("carol", "dave"):
            await page.waitFor(f"!!document.querySelector('{_row('key-row', 'key', name)}')",
                               what=f"key {name}")
            await page.click(f"{_row('key-row', 'key', name)} input.select")
        await page.click("#keys-table-bulk button.bulk-revoke")
        await page.waitFor("document.querySelector('#keys-table-bulk button.bulk-revoke')"
                           ".innerText === 'Confirm revoke (2)'", what="the armed revoke")
        await page.click("#keys-table-bulk button.bulk-revoke")
        await page.waitFor("document.querySelectorAll('tr.key-row').length === 2",
                           what="the two keys revoked")
        assert "2 keys (carol, dave) revoked" in await page.text("#keys-msg")
        code, keys = await _admin(stack, "GET", "keys")
        assert sorted(k["name"] for k in keys["keys"]) == ["alice", "bob"]

        # The request view refreshes itself.
        await page.section("requests", "requests-loaded")
        before = int(await page.evaluate("document.body.dataset.requestsCount"))
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "one more", "stream": True},
            key="sk-alice-console-0001")
        await stack.app.runner.requestLog.flush()
        await page.waitFor(f"Number(document.body.dataset.requestsCount) > {before}",
                           timeout=10, what="the new turn listed without a click")
        await page.select("#requests-filter-outcome", "failed")
        shown = await page.evaluate(
            "Array.from(document.querySelectorAll('tr.request')).map(function (r) {"
            " return r.className; })")
        assert len(shown) >= 2 and not any("outcome-completed" in c for c in shown), shown
        assert page.exceptions() == []
    finally:
        await session.stop()
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_request_entry_names_the_surface():
    """
    The requests table's Entry names the surface a turn came in on when it
    is not a Responses request (R115): a Claude Code turn reads C{http
    messages}, an embedding C{http embeddings}; a Responses turn stays
    C{http}.
    """
    stack = await _stack()
    session = Session()
    try:
        response, data = await stack.postJSON(
            "/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 64,
                             "messages": [{"role": "user", "content": "hi"}]},
            key="sk-alice-console-0001")
        assert response.code == 200, data
        response, data = await stack.postJSON(
            "/v1/embeddings", {"model": "text-embedding-3-small", "input": "hi"},
            key="sk-alice-console-0001")
        assert response.code == 200, data
        await stack.app.runner.requestLog.flush()
        code, log = await _admin(stack, "GET", "requests?limit=50")
        ids = {r["endpoint"]: r["request_id"] for r in log["requests"]}
        page = await session.start(1280, 900)
        await page.goto(stack.url + "/admin/#requests&key=" + ADMIN)
        await page.waitFor("document.body.getAttribute('data-requests-loaded') === '1'")
        for endpoint, shown in (("messages", "http messages"), ("embeddings", "http embeddings"),
                                ("responses", "http")):
            row = _row("request", "request-id", ids[endpoint])
            await page.waitFor(f"!!document.querySelector('{row}')", what=endpoint)
            cells = await page.evaluate(
                "Array.from(document.querySelector(%s).children).map(function (c) {"
                " return c.innerText; })" % json.dumps(row))
            assert shown in cells, (endpoint, cells)
        assert page.exceptions() == []
    finally:
        await session.stop()
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_image_price_shown_and_kept_on_edit():
    """
    An image model's price per image (R115: C{gpt-image-1} $0.042 by
    default) is shown in the prices table, and editing that model's token
    prices in the page keeps it: the console's own form never drops the
    price a turn's images are charged at.
    """
    stack = await _stack()
    session = Session()
    try:
        page = await session.start(1280, 900)
        await page.goto(stack.url + "/admin/#settings&key=" + ADMIN)
        await page.waitFor("document.body.getAttribute('data-settings-loaded') === '1'")
        price = _row("price-row", "model", "gpt-image-1")
        await page.waitFor(f"!!document.querySelector('{price}')", what="the image price row")
        assert "0.042 / image" in await _rowText(page, price)
        await page.click(f"{price} button.price-edit")
        assert await page.value("#price-per-image") == "0.042"
        await page.type("#price-input", "5")
        await page.click("#price-save")
        await page.waitFor("document.getElementById('settings-msg').innerText"
                           ".indexOf('gpt-image-1') >= 0", what="the price saved")
        assert "saved" in await page.text("#settings-msg"), await page.text("#settings-msg")
        code, prices = await _admin(stack, "GET", "prices")
        assert prices["prices"]["gpt-image-1"]["input"] == 5, prices["prices"]["gpt-image-1"]
        assert prices["prices"]["gpt-image-1"]["per_image"] == 0.042, prices["prices"]["gpt-image-1"]
        assert page.exceptions() == []
    finally:
        await session.stop()
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_settings_groups_prices_explain_and_audit():
    """
    The settings section: a runtime setting changed in the page is in
    force; an account group and a model's price are added, shown and
    deleted (with a confirmation). Explain, in the accounts section, says
    which account a key's next turn gets and why not the others; the audit
    section lists those changes and filters them; the usage series and the
    request log export as CSV from the API.
    """
    stack = await _stack()
    session = Session()
    try:
        page = await session.start(1280, 900)
        await page.goto(stack.url + "/admin/#settings&key=" + ADMIN)
        await page.waitFor("document.body.getAttribute('data-settings-loaded') === '1'")
        await page.type("#settings-table-search", "max_account")
        await page.waitFor("document.querySelectorAll('#settings-table-body tr.setting-row')"
                           ".length === 1", what="the searched setting")
        await page.type("#setting-max-account-switches", "7")
        await page.click("#settings-save")
        await page.waitFor("document.getElementById('settings-msg').innerText"
                           ".indexOf('max_account_switches') >= 0", what="settings saved")
        code, settings = await _admin(stack, "GET", "settings")
        assert settings["max_account_switches"] == 7, settings

        # A group.
        await page.click("#group-open")
        await page.type("#group-name", "staff")
        await page.type("#group-accounts", "acct-a, acct-b")
        await page.click("#group-save")
        group = _row("group-row", "group", "staff")
        await page.waitFor(f"!!document.querySelector('{group}')", what="the group row")
        assert "acct-a, acct-b" in await _rowText(page, group)
        code, groups = await _admin(stack, "GET", "groups")
        assert [g["accounts"] for g in groups["groups"] if g["name"] == "staff"] == [
            ["acct-a", "acct-b"]]

        # A price.
        await page.click("#price-open")
        await page.type("#price-model", "gpt-test-model")
        await page.type("#price-input", "2")
        await page.type("#price-output", "8")
        await page.click("#price-save")
        price = _row("price-row", "model", "gpt-test-model")
        await page.waitFor(f"!!document.querySelector('{price}')", what="the price row")
        assert "admin" in await _rowText(page, price)
        code, prices = await _admin(stack, "GET", "prices")
        assert prices["prices"]["gpt-test-model"]["output"] == 8
        await _shot(page, "settings")
        await page.click(f"{price} button.price-delete")
        await page.waitFor(f"document.querySelector('{price} button.price-delete')"
                           ".innerText === 'Confirm delete'", what="the armed delete")
        await page.click(f"{price} button.price-delete")
        await page.waitFor(f"!document.querySelector('{price}')", what="the price deleted")
        await page.click(f"{group} button.group-delete")
        await page.waitFor(f"document.querySelector('{group} button.group-delete')"
                           ".innerText === 'Confirm delete'", what="the armed delete")
        await page.click(f"{group} button.group-delete")
        await page.waitFor(f"!document.querySelector('{group}')", what="the group deleted")

        # Explain (in the accounts section): the next turn of bob.
        await page.section("accounts", "manage-loaded")
        await page.type("#explain-key", "bob")
        await page.click("#explain-run")
        await page.waitFor("document.body.getAttribute('data-explained') === '1'")
        decision = await page.text("#explain-decision")
        assert "Next turn goes to acct-" in decision, decision
        rows = await page.evaluate(
            "Array.from(document.querySelectorAll('tr.explain-row')).map(function (r) {"
            " return r.innerText; })")
        assert len(rows) == 3 and any(r.startswith("acct-down") for r in rows), rows
        down = next(r for r in rows if r.startswith("acct-down"))
        assert "transport" in down or "cool" in down, down
        await _shot(page, "explain")

        await page.section("audit", "audit-loaded")
        actions = await page.evaluate(
            "Array.from(document.querySelectorAll('#audit-body tr.audit-row'))"
            ".map(function (r) { return r.dataset.action; })")
        for action in ("settings.update", "group.put", "prices.set", "prices.delete",
                       "group.delete"):
            assert any(a.startswith(action.split(".")[0]) for a in actions), (action, actions)
        await page.select("#audit-filter-kind", "prices")
        kinds = await page.evaluate(
            "Array.from(document.querySelectorAll('#audit-body tr.audit-row'))"
            ".map(function (r) { return r.dataset.action; })")
        assert kinds and all(k.startswith("prices") for k in kinds), kinds
        await _shot(page, "audit")

        # The API's own CSV of every bucket, and of the request log.
        await page.section("usage", "usage-loaded")
        csv = await _csv(page, "usage", "#usage-export")
        assert csv.startswith("time_iso,time,group,requests"), csv[:200]
        assert ",bob," in csv, csv[:400]
        await page.section("requests", "requests-loaded")
        csv = await _csv(page, "requests", "#rq-export")
        assert csv.startswith("time_iso,time,request_id"), csv[:200]
        assert len(csv.strip().splitlines()) == 4, csv
        assert page.exceptions() == []
    finally:
        await session.stop()
        await stack.stop()
