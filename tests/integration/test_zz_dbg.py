import pytest_twisted
from tests.integration.cdp import Session
from tests.integration.test_console_page import _stack, ADMIN
import treq

@pytest_twisted.ensureDeferred
async def test_dbg():
    stack = await _stack()
    session = Session()
    try:
        for p in ["static/js/app.js", "static/js/sections/overview.js", "static/vendor/uplot-1.6.32/uPlot.min.css", ""]:
            r = await treq.get(stack.url + "/admin/" + p)
            print(p, r.code, r.headers.getRawHeaders(b"content-type"), r.headers.getRawHeaders(b"cache-control"))
            await r.content()
        page = await session.start(1280, 900)
        await page.send("Log.enable")
        await page.goto(stack.url + "/admin/#key=" + ADMIN)
        from twisted.internet.task import deferLater
        from twisted.internet import reactor
        await deferLater(reactor, 2, lambda: None)
        for sec in ["accounts", "keys", "requests", "usage", "settings", "audit"]:
            try:
                await page.section(sec)
            except AssertionError:
                print("FAILED", sec, await page.evaluate("[document.body.getAttribute('data-section'), location.hash, document.activeElement && document.activeElement.id, JSON.stringify(document.getElementById('nav-requests').getBoundingClientRect()), window.scrollY]"))
                print(page.exceptions())
                raise
            await deferLater(reactor, 2, lambda: None)
        print("EXC", page.exceptions())
        for e in session._events:
            if e.get("method") in ("Log.entryAdded", "Runtime.consoleAPICalled"):
                print(e["params"])
        print(await page.evaluate("document.body.innerText.slice(0, 300)"))
    finally:
        await session.stop()
        await stack.stop()
