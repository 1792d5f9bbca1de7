"""
Headless Chromium driven over the Chrome DevTools Protocol, for page tests
that click and type as a person does (issue 21). The same Debian
C{chromium} the status page tests run (tests/integration/test_status_page.py),
started with C{--remote-debugging-port=0}; the protocol's WebSocket is
spoken with autobahn (relay's own WebSocket library), on the running
reactor.

Clicks are real mouse events at an element's centre
(C{Input.dispatchMouseEvent}), typing is C{Input.insertText} into the
focused element, reading is C{Runtime.evaluate}; screenshots are
C{Page.captureScreenshot}.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import signal
import tempfile

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater

CHROMIUM = next((p for p in (shutil.which(n) for n in (
    "chromium", "chromium-browser", "google-chrome")) if p), None)

_LISTENING = re.compile(rb"DevTools listening on (ws://[^\s]+)")


class _Browser(ProcessProtocol):
    def __init__(self):
        self.found = Deferred()
        self.output = b""
        self.ended = Deferred()

    def errReceived(self, data):
        self.output += data
        match = _LISTENING.search(self.output)
        if match and not self.found.called:
            self.found.callback(match.group(1).decode())

    outReceived = errReceived

    def processEnded(self, reason):
        if not self.found.called:
            self.found.errback(RuntimeError("chromium exited: " + self.output[-2000:].decode(
                "utf-8", "replace")))
        self.ended.callback(None)


class _DevTools(WebSocketClientProtocol):
    def onOpen(self):
        self.factory.session.opened.callback(self)

    def onMessage(self, payload, isBinary):
        self.factory.session.received(json.loads(payload))

    def onClose(self, wasClean, code, reason):
        self.factory.session.closed()


class Session:
    """
    One browser and one page (more with L{newPage}).
    """

    def __init__(self):
        self.opened = Deferred()
        self._ids = itertools.count(1)
        self._pending = {}
        self._events = []
        self._waiters = []
        self.protocol = None
        self.process = None
        self.browser = None
        self.profile = None

    # -- protocol ---------------------------------------------------------------------

    def received(self, message):
        if "id" in message and message["id"] in self._pending:
            d = self._pending.pop(message["id"])
            if "error" in message:
                d.errback(RuntimeError(f"CDP error: {message['error']}"))
            else:
                d.callback(message.get("result", {}))
            return
        self._events.append(message)
        for waiter in list(self._waiters):
            predicate, d = waiter
            if predicate(message):
                self._waiters.remove(waiter)
                d.callback(message)

    def closed(self):
        for d in self._pending.values():
            if not d.called:
                d.errback(RuntimeError("devtools connection closed"))
        self._pending.clear()

    def send(self, method, params=None, sessionId=None, timeout=20):
        """
        @return: a Deferred with the command's result.
        """
        id = next(self._ids)
        message = {"id": id, "method": method, "params": params or {}}
        if sessionId is not None:
            message["sessionId"] = sessionId
        d = Deferred()
        self._pending[id] = d
        self.protocol.sendMessage(json.dumps(message).encode())
        return d.addTimeout(timeout, reactor)

    # -- life ---------------------------------------------------------------------------

    async def start(self, width=1280, height=900):
        """
        Start Chromium and open its first page at C{width} x C{height}.

        @return: the first L{Page}.
        """
        self.profile = tempfile.mkdtemp(prefix="relay-cdp-")
        self.browser = _Browser()
        args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
                f"--window-size={width},{height}", "--user-data-dir=" + self.profile,
                "about:blank"]
        self.process = reactor.spawnProcess(self.browser, CHROMIUM, args, env=dict(os.environ))
        url = await self.browser.found.addTimeout(30, reactor)
        match = re.match(r"ws://([^:/]+):(\d+)(/.*)", url)
        factory = WebSocketClientFactory(url, reactor=reactor)
        factory.protocol = _DevTools
        factory.session = self
        factory.setProtocolOptions(maxMessagePayloadSize=0, maxFramePayloadSize=0)
        endpoint = TCP4ClientEndpoint(reactor, match.group(1), int(match.group(2)), timeout=10)
        await endpoint.connect(factory)
        self.protocol = await self.opened.addTimeout(10, reactor)
        return await self.newPage(width, height)

    async def newPage(self, width=1280, height=900, url="about:blank"):
        """
        @return: a new L{Page} (a tab), attached.
        """
        target = await self.send("Target.createTarget", {"url": url})
        attached = await self.send("Target.attachToTarget",
                                   {"targetId": target["targetId"], "flatten": True})
        page = Page(self, attached["sessionId"], target["targetId"])
        await page.send("Page.enable")
        await page.send("Runtime.enable")
        await page.send("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        return page

    async def grant(self, origin, permissions=("clipboardReadWrite", "clipboardSanitizedWrite")):
        """
        Grant C{origin} browser permissions (e.g. the clipboard, so a page's
        Copy button can be checked by reading the clipboard back).
        """
        await self.send("Browser.grantPermissions", {"origin": origin,
                                                     "permissions": list(permissions)})

    async def stop(self):
        if self.protocol is not None:
            try:
                await self.send("Browser.close", timeout=5)
            except Exception:
                pass
        if self.process is not None and self.process.pid is not None:
            try:
                await self.browser.ended.addTimeout(10, reactor)
            except Exception:
                try:
                    self.process.signalProcess(signal.SIGKILL)
                except Exception:
                    pass
        if self.profile:
            shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    """
    One tab: navigate, click, type, read, screenshot.
    """

    def __init__(self, session, sessionId, targetId):
        self.session = session
        self.sessionId = sessionId
        self.targetId = targetId

    def send(self, method, params=None, timeout=20):
        return self.session.send(method, params, self.sessionId, timeout)

    async def goto(self, url):
        await self.send("Page.navigate", {"url": url})
        await self.waitFor("document.readyState === 'complete'")

    async def evaluate(self, expression):
        """
        @return: the expression's JSON value.
        """
        result = await self.send("Runtime.evaluate", {
            "expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise AssertionError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def waitFor(self, expression, timeout=15.0, what=None):
        """
        Wait until C{expression} is truthy in the page.

        @return: its value.
        """
        deadline = reactor.seconds() + timeout
        while True:
            try:
                value = await self.evaluate(expression)
            except AssertionError:
                value = None
            if value:
                return value
            if reactor.seconds() > deadline:
                text = await self.evaluate("document.body ? document.body.innerText : ''")
                raise AssertionError(f"timed out waiting for {what or expression}; page: "
                                     f"{str(text)[-1500:]}")
            await deferLater(reactor, 0.1, lambda: None)

    async def click(self, selector, hold=0.0):
        """
        A real click at the centre of the (visible) element C{selector}.

        @param hold: seconds between pressing the button and releasing it
            (a slow click: a person's takes ~0.1 s).
        """
        # The element must be the one under its centre (not covered, and the
        # layout settled: the page re-renders its tables every few seconds).
        target = json.dumps(selector)
        hitTest = ("var hit=document.elementFromPoint(x, y);"
                   " return !!hit && (hit===e || e.contains(hit));")
        under = ("(function(){var e=document.querySelector(%s); if(!e) return false;"
                 " var x=%%s, y=%%s; %s})()" % (target, hitTest))
        for _ in range(3):
            box = await self.waitFor(
                "(function(){var e=document.querySelector(%s); if(!e) return null;"
                " e.scrollIntoView({block:'center'}); var r=e.getBoundingClientRect();"
                " if(!r.width||!r.height) return null; var x=r.left+r.width/2,"
                " y=r.top+r.height/2; return (function(){%s})() ? [x, y] : null;"
                "})()" % (target, hitTest), what=f"clickable {selector}")
            x, y = box
            for kind in ("mouseMoved", "mousePressed"):
                await self.send("Input.dispatchMouseEvent", {
                    "type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})
            # A re-render between the measure and the press moves what is
            # under the pointer; once pressed, the page holds its renders
            # (relayPage.settled). A press that missed is released away from
            # any control and the click starts over, as a person clicks
            # again when a table jumped under the pointer.
            if await self.evaluate(under % (x, y)):
                break
            await self.send("Input.dispatchMouseEvent", {
                "type": "mouseReleased", "x": 0, "y": 0, "button": "left", "clickCount": 1})
        else:
            raise AssertionError(f"{selector} kept moving under the pointer")
        if hold:
            await deferLater(reactor, hold, lambda: None)
        await self.send("Input.dispatchMouseEvent", {
            "type": "mouseReleased", "x": x, "y": y, "button": "left", "clickCount": 1})

    async def type(self, selector, text, clear=True):
        """
        Focus C{selector} (by clicking it) and type C{text}.
        """
        for attempt in range(3):
            await self.click(selector)
            # The click focuses the field; make sure (a re-render may have
            # moved it), and empty it as select-all and delete would.
            await self.evaluate(
                "(function(){var e=document.querySelector(%s); e.focus(); if(%s){e.value='';"
                " e.dispatchEvent(new Event('input',{bubbles:true}));}})()"
                % (json.dumps(selector), "true" if clear else "false"))
            before = await self.evaluate("document.querySelector(%s).value" % json.dumps(selector))
            await self.send("Input.insertText", {"text": text})
            value = await self.evaluate("document.querySelector(%s).value" % json.dumps(selector))
            if value == before + text:
                return
        raise AssertionError(f"typing into {selector} gave {value!r}")

    async def select(self, selector, value):
        """
        Choose an option of a C{<select>} as a person would (change event).
        """
        await self.click(selector)
        await self.evaluate(
            "(function(){var e=document.querySelector(%s); e.value=%s;"
            " e.dispatchEvent(new Event('change',{bubbles:true}));})()"
            % (json.dumps(selector), json.dumps(value)))

    async def value(self, selector):
        """
        The current value of a form field (what a person sees in it).
        """
        return await self.evaluate(
            "(function(){var e=document.querySelector(%s); return e ? e.value : null;})()"
            % json.dumps(selector))

    async def focus(self):
        """
        Make the page the focused window, as a person's is (the clipboard
        API works only in a focused document).
        """
        await self.send("Page.bringToFront")
        await self.send("Emulation.setFocusEmulationEnabled", {"enabled": True})

    async def clipboard(self):
        """
        What the clipboard holds (needs L{Session.grant} for the page's
        origin).
        """
        await self.focus()
        return await self.evaluate("navigator.clipboard.readText()")

    async def text(self, selector):
        return await self.evaluate(
            "(function(){var e=document.querySelector(%s); return e ? e.innerText : null;})()"
            % json.dumps(selector))

    async def url(self):
        """
        The address of the current history entry (also of a page that
        failed to load, e.g. the login redirect to C{localhost:1455}).
        """
        history = await self.send("Page.getNavigationHistory")
        return history["entries"][history["currentIndex"]]["url"]

    async def html(self):
        return await self.evaluate("document.documentElement.outerHTML")

    async def section(self, name, loaded=None):
        """
        Open a section of the console by clicking its name in the bar at
        the top, as a person does (issue 40), and wait until it shows
        (and, with C{loaded}, until C{document.body} has
        C{data-<loaded>="1"}).
        """
        await self.click(f"#nav-{name}")
        await self.waitFor(f"document.body.getAttribute('data-section') === {json.dumps(name)}"
                           f" && !document.getElementById('section-{name}')"
                           ".classList.contains('hidden')", what=f"section {name}")
        if loaded:
            await self.waitFor(f"document.body.getAttribute('data-{loaded}') === '1'",
                               what=f"{name} loaded")

    def exceptions(self):
        """
        The page's uncaught script errors so far (C{Runtime.exceptionThrown}),
        as text.
        """
        return [e["params"]["exceptionDetails"].get("exception", {}).get("description")
                or e["params"]["exceptionDetails"].get("text")
                for e in self.session._events
                if e.get("method") == "Runtime.exceptionThrown"
                and e.get("sessionId") == self.sessionId]

    async def screenshot(self, path):
        """
        Save a PNG of the page.
        """
        shot = await self.send("Page.captureScreenshot", {"format": "png",
                                                          "captureBeyondViewport": True})
        data = base64.b64decode(shot["data"])
        with open(path, "wb") as f:
            f.write(data)
        return data

    async def close(self):
        await self.session.send("Target.closeTarget", {"targetId": self.targetId})
