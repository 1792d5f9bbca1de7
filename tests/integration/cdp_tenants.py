"""
Drive a real headless Chromium through the DevTools protocol, as a person
uses a page: click at an element's place, type into the focused field,
read what the page shows, take a screenshot (issue 22's page tests).

The protocol runs over a WebSocket (autobahn, relay's own dependency) on
the Twisted reactor. Chromium is started with
C{--remote-debugging-port=0}; the port it picked is read from the
C{DevTools listening on ws://...} line it prints. Only the Chromium process
this module started is ever signalled.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import tempfile

import treq
from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater

__all__ = ["Browser"]

_LISTENING = re.compile(rb"DevTools listening on (ws://[^\s]+)")


class _Chromium(ProcessProtocol):
    def __init__(self):
        self.listening = Deferred()
        self.ended = Deferred()
        self._err = b""

    def errReceived(self, data):
        self._err += data
        found = _LISTENING.search(self._err)
        if found and not self.listening.called:
            self.listening.callback(found.group(1).decode())

    def processEnded(self, reason):
        if not self.listening.called:
            self.listening.errback(RuntimeError(
                "chromium ended before listening: " + self._err[-2000:].decode("replace")))
        self.ended.callback(None)


class _Protocol(WebSocketClientProtocol):
    def onConnect(self, response):
        self.factory.page._proto = self

    def onOpen(self):
        self.factory.page._opened.callback(None)

    def onMessage(self, payload, isBinary):
        self.factory.page._message(json.loads(payload))


class Page:
    """
    One tab.
    """

    def __init__(self):
        self._proto = None
        self._opened = Deferred()
        self._pending = {}
        self._next = 0

    def _message(self, message):
        waiter = self._pending.pop(message.get("id"), None)
        if waiter is None:
            return
        if "error" in message:
            waiter.errback(RuntimeError(json.dumps(message["error"])))
        else:
            waiter.callback(message.get("result", {}))

    def send(self, method: str, **params) -> Deferred:
        """
        One DevTools command. @return: a Deferred with its result.
        """
        self._next += 1
        d = Deferred()
        self._pending[self._next] = d
        self._proto.sendMessage(json.dumps({"id": self._next, "method": method,
                                            "params": params}).encode())
        return d.addTimeout(30, reactor)

    async def evaluate(self, expression: str):
        """
        The value of a JavaScript expression in the page.
        """
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(json.dumps(result["exceptionDetails"])[:500])
        return result["result"].get("value")

    async def waitFor(self, expression: str, timeout: float = 15.0):
        """
        Poll until C{expression} is truthy. @return: its value.
        """
        deadline = reactor.seconds() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if reactor.seconds() > deadline:
                raise AssertionError(f"timed out waiting for {expression}")
            await deferLater(reactor, 0.1, lambda: None)

    async def click(self, selector: str) -> None:
        """
        Press and release the mouse at the middle of the element, as a
        person's click does.
        """
        box = await self.evaluate(
            "(function(){var e=document.querySelector(%s); if(!e){return null;}"
            "e.scrollIntoView({block:'center'}); var r=e.getBoundingClientRect();"
            "return [r.left + r.width / 2, r.top + r.height / 2];})()" % json.dumps(selector))
        if box is None:
            raise AssertionError(f"nothing matches {selector}")
        x, y = box
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            await self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                            clickCount=1)

    async def type(self, selector: str, text: str) -> None:
        """
        Click into the field and type C{text}.
        """
        await self.click(selector)
        await self.send("Input.insertText", text=text)

    async def text(self, selector: str) -> str:
        """
        The visible text of the first element matching C{selector}.
        """
        return await self.evaluate(
            "(function(){var e=document.querySelector(%s); return e ? e.innerText : null;})()"
            % json.dumps(selector))

    async def screenshot(self, path) -> None:
        result = await self.send("Page.captureScreenshot", format="png")
        with open(path, "wb") as f:
            f.write(base64.b64decode(result["data"]))


class Browser:
    """
    A headless Chromium with its DevTools endpoint.
    """

    def __init__(self, executable: str):
        self.executable = executable
        self._profile = tempfile.mkdtemp(prefix="relay-cdp-")
        self._process = None
        self._chromium = _Chromium()
        self._pages = []

    async def start(self, width: int = 1280, height: int = 900) -> None:
        args = [self.executable, "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--remote-debugging-port=0",
                f"--window-size={width},{height}", "--user-data-dir=" + self._profile,
                "about:blank"]
        self._process = reactor.spawnProcess(self._chromium, self.executable, args, env=None)
        self.endpoint = await self._chromium.listening.addTimeout(30, reactor)
        self.http = "http://" + self.endpoint.split("/")[2]

    async def open(self, url: str) -> Page:
        """
        A new tab showing C{url}.
        """
        response = await treq.request("PUT", self.http + "/json/new?about:blank")
        target = await response.json()
        page = Page()
        wsURL = target["webSocketDebuggerUrl"]
        host, port = wsURL.split("/")[2].split(":")
        factory = WebSocketClientFactory(wsURL, reactor=reactor)
        factory.protocol = _Protocol
        factory.page = page
        factory.setProtocolOptions(maxMessagePayloadSize=0, maxFramePayloadSize=0)
        await TCP4ClientEndpoint(reactor, host, int(port), timeout=10).connect(factory)
        await page._opened.addTimeout(10, reactor)
        await page.send("Page.enable")
        await page.send("Runtime.enable")
        # Navigated here, not through /json/new: its query would drop a
        # fragment such as #key=...
        await page.send("Page.navigate", url=url)
        await page.waitFor("document.readyState === 'complete' && location.href !== 'about:blank'")
        self._pages.append(page)
        return page

    async def stop(self) -> None:
        for page in self._pages:
            if page._proto is not None:
                page._proto.dropConnection(abort=True)
        if self._process is not None and self._process.pid is not None:
            try:
                self._process.signalProcess("KILL")
            except Exception:
                pass
            await self._chromium.ended.addTimeout(10, reactor)
        shutil.rmtree(self._profile, ignore_errors=True)
