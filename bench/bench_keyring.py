"""
Issue 22's key ring, measured (not a test: it prints figures).

  python bench/bench_keyring.py

Authenticating one request among N keys: the ring hashes the presented
secret once (SHA-256) and looks the digest up (L{relay.entry.http.KeyRing}),
so its cost does not grow with N; beside it, the scan the ring did before
(one constant-time compare per key) for the same N.
"""

from __future__ import annotations

import hmac
import os
import sys
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class _Request:
    def __init__(self, secret: bytes):
        self._headers = {b"authorization": b"Bearer " + secret}

    def getHeader(self, name):
        return self._headers.get(name)


def main() -> None:
    from relay.entry.http import KeyRing
    from relay.base.records import ClientKey

    print(f"{'keys':>7} {'ring (us)':>10} {'scan (us)':>10}")
    for count in (10, 1000, 10000):
        keys = [ClientKey(name=f"k{i}", key=f"sk-relay-bench-{i:08d}-{'x' * 30}")
                for i in range(count)]
        ring = KeyRing(keys)
        request = _Request(keys[count // 2].key.encode())
        assert ring.authenticate(request).name == keys[count // 2].name
        secret = keys[count // 2].key.encode()

        def scan():
            found = None
            for key in keys:
                if hmac.compare_digest(key.key.encode(), secret):
                    found = key
            return found

        n = 20000 if count <= 1000 else 2000
        ringUs = min(timeit.repeat(lambda: ring.authenticate(request), number=n, repeat=5)) / n
        scanN = max(20, n // max(1, count // 10))
        scanUs = min(timeit.repeat(scan, number=scanN, repeat=3)) / scanN
        print(f"{count:>7} {ringUs * 1e6:>10.2f} {scanUs * 1e6:>10.1f}")


if __name__ == "__main__":
    main()
