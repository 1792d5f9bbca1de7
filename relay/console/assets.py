# -*- test-case-name: tests.test_console_assets -*-
"""
The console's static files (C{relay/console/static/}): the page's HTML
shell, its style sheet, its script modules and the vendored charting
library, served under C{/admin/} without the admin key (they hold no data:
every data fetch carries the key).

  - C{GET /admin/} - C{static/index.html}, uncached, with a strict content
    security policy (scripts and styles from this origin only);
  - C{GET /admin/static/<path>} - one file, its content type from its
    extension, an C{ETag} (a hash of its bytes) and C{304} to a matching
    C{If-None-Match}; the vendored library (C{static/vendor/<name>-<version>/})
    is cached for a year (its path changes with its version), the page's own
    files are revalidated on every load (C{no-cache}).

The files are read once, when the resource is built (an installed relay
ships them through C{setup.cfg}'s C{package_data}).
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Optional

from twisted.web.resource import Resource

__all__ = ["CONTENT_TYPES", "PAGE_CSP", "ConsoleAssets", "StaticFiles", "loadAssets"]

CONTENT_TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".svg": b"image/svg+xml",
    ".png": b"image/png",
    ".txt": b"text/plain; charset=utf-8",
}
"""Content type by file extension; a file of another extension is not served."""

PAGE_CSP = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; "
    b"connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    b"frame-ancestors 'none'"
)
"""The page's content security policy: no inline script or style, no other origin."""

_LONG = b"public, max-age=31536000, immutable"
_REVALIDATE = b"no-cache"


class ConsoleAssets:
    """
    The static files in memory.

    @ivar files: C{{relative path: (bytes, content type, etag)}}, paths
        like C{js/app.js} (relative to C{static/}).
    """

    def __init__(self, files: dict):
        self.files = files

    def get(self, path: str) -> Optional[tuple]:
        """
        @return: C{(bytes, content type, etag)} of C{path}, or L{None}.
        """
        return self.files.get(path)


def loadAssets(package: str = "relay.console") -> ConsoleAssets:
    """
    Read every servable file under C{static/} of C{package}.

    @return: a L{ConsoleAssets}.
    """
    root = resources.files(package).joinpath("static")
    files = {}

    def walk(node, prefix):
        for child in node.iterdir():
            name = prefix + child.name
            if child.is_dir():
                walk(child, name + "/")
                continue
            dot = child.name.rfind(".")
            kind = CONTENT_TYPES.get(child.name[dot:]) if dot >= 0 else None
            if kind is None:
                # LICENSE and the like: served as text.
                kind = CONTENT_TYPES[".txt"]
            data = child.read_bytes()
            etag = b'"' + hashlib.sha256(data).hexdigest()[:20].encode("ascii") + b'"'
            files[name] = (data, kind, etag)

    walk(root, "")
    return ConsoleAssets(files)


def _secure(request) -> None:
    request.setHeader(b"x-content-type-options", b"nosniff")
    request.setHeader(b"referrer-policy", b"no-referrer")


def serveFile(request, asset: tuple, cache: bytes) -> bytes:
    """
    Answer C{request} with one file: 200 with its bytes, or 304 when the
    client's C{If-None-Match} names its C{ETag}.
    """
    data, kind, etag = asset
    _secure(request)
    request.setHeader(b"cache-control", cache)
    request.setHeader(b"etag", etag)
    match = request.getHeader(b"if-none-match") or b""
    if isinstance(match, str):
        match = match.encode("latin-1")
    if etag in [m.strip() for m in match.split(b",")]:
        request.setResponseCode(304)
        return b""
    request.setResponseCode(200)
    request.setHeader(b"content-type", kind)
    if request.method == b"HEAD":
        request.setHeader(b"content-length", str(len(data)).encode("ascii"))
        return b""
    return data


class StaticFiles(Resource):
    """
    C{/admin/static/<path>}: one file of L{ConsoleAssets}, or a JSON 404.
    """

    isLeaf = True

    def __init__(self, assets: ConsoleAssets, notFound):
        super().__init__()
        self.assets = assets
        self.notFound = notFound

    def render(self, request):
        if request.method not in (b"GET", b"HEAD"):
            return self.notFound(request)
        try:
            path = "/".join(p.decode("utf-8") for p in request.postpath)
        except UnicodeDecodeError:
            return self.notFound(request)
        if ".." in path.split("/") or path == "index.html":
            return self.notFound(request)
        asset = self.assets.get(path)
        if asset is None:
            return self.notFound(request)
        return serveFile(request, asset, _LONG if path.startswith("vendor/") else _REVALIDATE)
