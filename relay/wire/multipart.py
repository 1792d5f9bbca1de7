# -*- test-case-name: tests.test_media -*-
"""
The one non-JSON body relay reads: C{multipart/form-data} of
C{POST /v1/images/edits} (behaviour.md R103, R115), parsed and encoded.

It is read like every body: held raw while it arrives, bounded by
C{gateway.max_request_body_bytes} and the bytes in flight (413 / 429 before a
byte is parsed), and parsed only after the key was checked and its slot
admitted (L{relay.entry.body.LimitedBodyRequest}); this module parses the held
bytes once, with the C{multipart} library's push parser (bounded: part count,
header size), into text fields and files (L{MultipartForm}), and encodes a
form again for the upstream (L{encodeForm}). A body that is not well-formed
C{multipart/form-data} raises L{FormError}, which the entry answers with
OpenAI's 400 (L{relay.entry.media}).
"""

from __future__ import annotations

import secrets
from typing import Optional

from attrs import frozen



class FormError(ValueError):
    """
    A body that is not well-formed C{multipart/form-data} (its message
    says why, for the client's 400).

    @ivar param: the form field at fault, or L{None}.
    """

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param

MAX_PARTS = 64
"""The most parts a form may have (16 images, a mask and the fields fit
with room to spare)."""

MAX_HEADER_BYTES = 4096
"""The largest header block of one part, bytes."""

NOT_MULTIPART = ("This route takes multipart/form-data: send the image(s) as files"
                 " and the other parameters as form fields.")


@frozen
class Upload:
    """
    One file of a form.

    @ivar field: the form field's name (C{image}, C{image[]}, C{mask}).
    @ivar filename: the file name the client gave (or C{"file"}).
    @ivar contentType: its C{Content-Type} (C{application/octet-stream}
        when none was given).
    @ivar data: its bytes.
    """

    field: str
    filename: str
    contentType: str
    data: bytes = b""

    def describe(self) -> dict:
        """
        What a turn's body (and so the request log) keeps of the file:
        C{{"filename", "content_type", "bytes"}}, never its contents.
        """
        return {"filename": self.filename, "content_type": self.contentType,
                "bytes": len(self.data)}


@frozen
class MultipartForm:
    """
    A parsed form.

    @ivar fields: field name -> text value (the last one of a repeated
        name), in the order sent.
    @ivar files: the L{Upload}s, in the order sent.
    """

    fields: dict
    files: tuple


def boundaryOf(contentType: Optional[str]) -> Optional[str]:
    """
    The boundary of a C{multipart/form-data} content type, or L{None} when
    the type is another one or names no boundary.

    @param contentType: the request's C{Content-Type} header value.
    """
    from multipart import parse_options_header

    if not contentType:
        return None
    kind, options = parse_options_header(contentType)
    if kind.lower() != "multipart/form-data":
        return None
    boundary = options.get("boundary")
    return boundary or None


def parseForm(raw: bytes, contentType: Optional[str]) -> MultipartForm:
    """
    Parse a held C{multipart/form-data} body (see the module docstring).

    @param raw: the whole decoded body.
    @param contentType: the request's C{Content-Type}.
    @return: the L{MultipartForm}.
    @raise FormError: when the type is not
        C{multipart/form-data} with a boundary, the body is not well-formed
        (unterminated, a part without C{Content-Disposition: form-data;
        name=...}), has more than L{MAX_PARTS} parts, or a text field is not
        UTF-8.
    """
    from multipart import MultipartError, PushMultipartParser

    boundary = boundaryOf(contentType)
    if boundary is None:
        raise FormError(NOT_MULTIPART)
    fields: dict = {}
    files: list = []
    try:
        parser = PushMultipartParser(boundary, content_length=len(raw),
                                     max_header_size=MAX_HEADER_BYTES,
                                     max_segment_count=MAX_PARTS, strict=True)
        current, chunks = None, []
        # events: a segment (headers), its body's chunks, then None (R103:
        # the whole body is held, so one chunk and the end of input)
        for event in list(parser.parse(raw)) + list(parser.parse(b"")):
            if event is None:
                if current is not None:
                    _keep(current, b"".join(chunks), fields, files)
                current, chunks = None, []
            elif isinstance(event, (bytes, bytearray, memoryview)):
                chunks.append(bytes(event))
            else:
                current, chunks = event, []
        if not parser.closed:
            raise MultipartError("the body ended before the closing boundary")
    except MultipartError as e:
        raise FormError(f"The multipart/form-data body could not be parsed: {e}") from None
    return MultipartForm(fields=fields, files=tuple(files))


def _keep(segment, data: bytes, fields: dict, files: list) -> None:
    """
    Put one finished part into C{fields} or C{files}.
    """
    name = segment.name
    if not name:
        raise FormError("The multipart/form-data body has a part without a field name.")
    if segment.filename is not None:
        files.append(Upload(field=name, filename=segment.filename or "file",
                            contentType=segment.content_type or "application/octet-stream",
                            data=data))
        return
    try:
        fields[name] = data.decode("utf-8")
    except UnicodeDecodeError:
        raise FormError(f"The form field '{name}' is not UTF-8 text.", name) from None


def _quoted(value: str) -> str:
    """
    A header parameter's value, quoted (quotes, backslashes and line
    breaks escaped as browsers do, RFC 7578 4.2).
    """
    return '"' + value.replace("\\", "\\\\").replace('"', "%22").replace(
        "\r", "%0D").replace("\n", "%0A") + '"'


def encodeForm(fields: dict, files, boundary: Optional[str] = None) -> tuple:
    """
    Encode a form as C{multipart/form-data} for the upstream.

    @param fields: name -> text (values that are not text are written as
        their C{str}).
    @param files: L{Upload}s.
    @param boundary: the boundary (a fresh random one when L{None}).
    @return: C{(body bytes, content type header value)}.
    """
    boundary = boundary or ("relay" + secrets.token_hex(16))
    out = []
    dash = b"--" + boundary.encode("ascii")
    for name, value in fields.items():
        out.append(dash + b"\r\nContent-Disposition: form-data; name="
                   + _quoted(name).encode("utf-8") + b"\r\n\r\n"
                   + str(value).encode("utf-8") + b"\r\n")
    for upload in files:
        out.append(dash + b"\r\nContent-Disposition: form-data; name="
                   + _quoted(upload.field).encode("utf-8") + b"; filename="
                   + _quoted(upload.filename).encode("utf-8")
                   + b"\r\nContent-Type: " + upload.contentType.encode("latin-1", "replace")
                   + b"\r\n\r\n" + upload.data + b"\r\n")
    out.append(dash + b"--\r\n")
    return b"".join(out), "multipart/form-data; boundary=" + boundary
