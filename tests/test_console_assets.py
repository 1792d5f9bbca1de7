"""
The console's static files (L{relay.console.assets}, issue 40): served
under C{/admin/static/} with their content types and caching, without the
admin key (R99: the page's shell and its files hold no data), and kept as
small modules with no hand-drawn chart code.
"""

from __future__ import annotations

import re
from importlib import resources

from twisted.trial.unittest import SynchronousTestCase

from relay.console.assets import loadAssets
from relay.entry.intake import ROUTE_ADMIN, ROUTE_OPEN, routeClass
from tests.test_admin import AdminFixture, makeRequest, render

STATIC = resources.files("relay.console").joinpath("static")


def _ownFiles():
    """
    @return: C{{relative path: text}} of the page's own files (not the
        vendored library).
    """
    return {path: data.decode("utf-8") for path, (data, _, _) in loadAssets().files.items()
            if not path.startswith("vendor/")}


class StaticFilesTests(AdminFixture, SynchronousTestCase):
    """
    C{GET /admin/static/<path>}.
    """

    def test_contentTypesAndCaching(self):
        """
        Each kind of file has its content type; the page's own files are
        revalidated on each load (an C{ETag}), the vendored library (its
        path holds its version) is cached for a year; no key is needed.
        """
        for path, kind, cache in [
            ("static/js/app.js", b"text/javascript; charset=utf-8", b"no-cache"),
            ("static/css/console.css", b"text/css; charset=utf-8", b"no-cache"),
            ("static/vendor/uplot-1.6.32/uPlot.iife.min.js", b"text/javascript; charset=utf-8",
             b"public, max-age=31536000, immutable"),
            ("static/vendor/uplot-1.6.32/uPlot.min.css", b"text/css; charset=utf-8",
             b"public, max-age=31536000, immutable"),
            ("static/vendor/uplot-1.6.32/LICENSE", b"text/plain; charset=utf-8",
             b"public, max-age=31536000, immutable"),
        ]:
            request = render(self.root, makeRequest(path, key=None))
            self.assertEqual(request.responseCode, 200, path)
            headers = request.responseHeaders
            self.assertEqual(headers.getRawHeaders(b"content-type"), [kind], path)
            self.assertEqual(headers.getRawHeaders(b"cache-control"), [cache], path)
            self.assertEqual(headers.getRawHeaders(b"x-content-type-options"), [b"nosniff"])
            self.assertTrue(b"".join(request.written), path)

    def test_notModified(self):
        """
        A request naming the file's C{ETag} is answered 304 without a body.
        """
        first = render(self.root, makeRequest("static/js/app.js", key=None))
        etag = first.responseHeaders.getRawHeaders(b"etag")[0]
        request = makeRequest("static/js/app.js", key=None)
        request.requestHeaders.setRawHeaders(b"if-none-match", [etag])
        render(self.root, request)
        self.assertEqual(request.responseCode, 304)
        self.assertEqual(b"".join(request.written), b"")

    def test_unknownAndEscapingPathsAre404(self):
        """
        A file that is not there, a path out of C{static/} and the shell
        under another name answer 404; so does a write.
        """
        for path in ("static/js/nothing.js", "static/../admin.py", "static/index.html",
                     "static/", "static/js"):
            request = render(self.root, makeRequest(path, key=None))
            self.assertEqual(request.responseCode, 404, path)
        request = render(self.root, makeRequest("static/js/app.js", b"POST", key=None))
        self.assertEqual(request.responseCode, 404)

    def test_disabledIs404(self):
        """
        Without an admin key configured the files are not served either.
        """
        request = render(self.build(None), makeRequest("static/js/app.js", key=None))
        self.assertEqual(request.responseCode, 404)


class RouteClassTests(SynchronousTestCase):
    """
    The intake opens the shell's files to a request without credentials
    (R99) and nothing else under C{/admin}.
    """

    def test_staticIsOpen(self):
        self.assertEqual(routeClass(b"/admin/static/js/app.js", b"GET"), ROUTE_OPEN)
        self.assertEqual(routeClass(b"/admin/static/css/console.css?v=1", b"HEAD"), ROUTE_OPEN)
        self.assertEqual(routeClass(b"/admin/", b"GET"), ROUTE_OPEN)

    def test_restIsAdmin(self):
        for path, method in [(b"/admin/static/js/app.js", b"POST"), (b"/admin/static", b"GET"),
                             (b"/admin/accounts", b"GET"), (b"/admin/staticx/a.js", b"GET"),
                             (b"/admin/%73tatic/../accounts", b"GET")]:
            self.assertEqual(routeClass(path, method), ROUTE_ADMIN, path)


class ModuleTests(SynchronousTestCase):
    """
    The page is static files, each small, with its charts drawn by the
    vendored library.
    """

    def test_eachFileSmall(self):
        """
        Every file of the page is under 600 lines.
        """
        files = _ownFiles()
        self.assertIn("js/app.js", files)
        for path, text in files.items():
            self.assertLess(text.count("\n"), 600, path)

    def test_noHandDrawnCharts(self):
        """
        No SVG or canvas drawing of the page's own: charts are uPlot's.
        """
        for path, text in _ownFiles().items():
            for drawn in ("createElementNS", "<svg", "getContext(", "barsPath", "linePath"):
                self.assertNotIn(drawn, text, path)
        self.assertIn("new U(", _ownFiles()["js/charts.js"])

    def test_vendoredWithLicense(self):
        """
        The charting library ships with its licence, and the shell loads
        it from the package (works offline: no other origin).
        """
        base = STATIC.joinpath("vendor", "uplot-1.6.32")
        self.assertIn("MIT License", base.joinpath("LICENSE").read_text("utf-8"))
        self.assertIn("uPlot", base.joinpath("uPlot.iife.min.js").read_text("utf-8")[:200])
        shell = STATIC.joinpath("index.html").read_text("utf-8")
        for ref in re.findall(r'(?:src|href)="([^"]+)"', shell):
            self.assertTrue(ref.startswith("static/"), ref)
            self.assertIn(ref[len("static/"):], loadAssets().files, ref)

    def test_sectionsAreOneList(self):
        """
        The sections are one list in C{app.js} (adding one is one entry),
        and the credential is handled in C{auth.js} alone.
        """
        files = _ownFiles()
        found = re.search(r"export const SECTIONS = \[([^\]]*)\]", files["js/app.js"])
        self.assertEqual([s.strip() for s in found.group(1).split(",")],
                         ["overview", "accounts", "keys", "requests", "usage", "settings",
                          "audit", "operators"])
        for path, text in files.items():
            if path != "js/auth.js":
                self.assertNotIn("sessionStorage", text, path)
                self.assertNotIn("Authorization", text, path)
