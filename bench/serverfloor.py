"""
The floor of the HTTP server path (issue 24 phase 2): instructions per
request of a minimal twisted.web C{Site} answering C{POST /v1/responses}
with a fixed JSON body, beside a minimal C{httptools}-parsed protocol doing
the same, both under callgrind (relay's own turns cost ~2 M instructions;
see C{bench/turncost.py}).

  python bench/serverfloor.py            # prints both figures
  python bench/serverfloor.py serve web|httptools PORT   # one server (used by the above)

Not a test; an estimate of what a lean server protocol for the turn routes
could save.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import time

BODY = json.dumps({"id": "resp_1", "object": "response", "status": "completed",
                   "output": []}).encode()


def serve(mode: str, port: int) -> None:
    """
    Run one minimal server on 127.0.0.1:C{port} until killed.
    """
    from twisted.internet import protocol, reactor

    if mode == "web":
        from twisted.web import resource, server

        class Responses(resource.Resource):
            isLeaf = True

            def render_POST(self, request):
                request.content.read()
                request.getHeader(b"authorization")
                request.setHeader(b"content-type", b"application/json")
                request.setHeader(b"content-length", b"%d" % len(BODY))
                return BODY

        root = resource.Resource()
        v1 = resource.Resource()
        root.putChild(b"v1", v1)
        v1.putChild(b"responses", Responses())
        site = server.Site(root)
        site.log = lambda request: None
        reactor.listenTCP(port, site, interface="127.0.0.1")
    else:
        import httptools

        class Plain(protocol.Protocol):
            def connectionMade(self):
                self.parser = httptools.HttpRequestParser(self)
                self.headers = {}
                self.body = []

            def on_url(self, url):
                self.url = url

            def on_header(self, name, value):
                self.headers[name.lower()] = value

            def on_body(self, body):
                self.body.append(body)

            def on_message_complete(self):
                self.headers.get(b"authorization")
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))
                self.headers = {}
                self.body = []

            def dataReceived(self, data):
                self.parser.feed_data(data)

        factory = protocol.Factory()
        factory.protocol = Plain
        reactor.listenTCP(port, factory, interface="127.0.0.1")
    reactor.run()


def measure(requests: int = 500) -> dict:
    """
    @return: mode -> instructions per request.
    """
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compare
    import turncost

    out = {}
    tmp = os.path.join("/tmp", f"relay-serverfloor-{os.getpid()}")
    os.makedirs(tmp, exist_ok=True)
    for mode in ("web", "httptools"):
        port = compare.free()
        dump = os.path.join(tmp, mode + ".cg")
        p = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                              f"--callgrind-out-file={dump}", sys.executable,
                              os.path.abspath(__file__), "serve", mode, str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            compare.waitPort(port, 120)
            conn = http.client.HTTPConnection("127.0.0.1", port)
            body = json.dumps({"model": "gpt-5.5", "input": "hi"})
            headers = {"Authorization": "Bearer sk", "Content-Type": "application/json"}

            def turns(n, conn=conn, body=body, headers=headers):
                for _ in range(n):
                    conn.request("POST", "/v1/responses", body, headers)
                    r = conn.getresponse()
                    r.read()
                    assert r.status == 200

            turns(30)
            turncost._control(p.pid, "-i", "on")
            turns(requests)
            turncost._control(p.pid, "-i", "off")
            turncost._control(p.pid, "-d")
            time.sleep(0.5)
            out[mode] = turncost._totals(dump) / requests
        finally:
            p.terminate()
            p.wait()
    shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        for mode, n in measure().items():
            print(f"{mode}: {n / 1e3:,.0f} k instructions per request")
