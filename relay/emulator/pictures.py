# -*- test-case-name: tests.test_emulator_media -*-
"""
The image the emulator makes (L{PNG}): the C{b64_json} of its images
answers (L{relay.emulator.media}) and the C{result} of the ChatGPT
backend's C{image_generation_call} items (L{relay.emulator.state}).
"""

from __future__ import annotations

import base64
import struct
import zlib


def _png(width: int = 1, height: int = 1) -> bytes:
    """
    A valid grey PNG of the given size.
    """
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    rows = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0,
                                                               0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


PNG = _png()
"""The image the emulator makes (a 1x1 grey PNG)."""


def pngImage() -> str:
    """
    @return: L{PNG} in base64 (an C{image_generation_call}'s C{result},
        an images answer's C{b64_json}).
    """
    return base64.b64encode(PNG).decode("ascii")
