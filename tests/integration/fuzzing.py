"""
Building blocks of the fuzz tests (issue 14): hypothesis strategies for
raw HTTP requests and client WebSocket frames, a minimal HTTP/1.1 response
parser and WebSocket frame codec, and the checks every answer and every
upstream request must pass.

Everything here is pure (bytes in, bytes or verdicts out), so the same
strategies drive the in-process bulk run (L{tests.integration.test_fuzz})
and the subprocess batch.
"""

from __future__ import annotations

import gzip
import json
import os
import struct
import zlib

from hypothesis import strategies as st

GOOD_KEY = "sk-relay-fuzz-0123456789"
ADMIN_KEY = "sk-relay-fuzz-admin-0123456789"
MODEL = "gpt-5.5"
BODY_LIMIT = 65536
"""C{gateway.max_request_body_bytes} and C{websocket.max_frame_bytes} of
the fuzzed relay: small, so "too large" is cheap to reach."""

ROUTES = [
    "/v1/responses", "/responses", "/backend-api/codex/responses",
    "/v1/chat/completions", "/chat/completions", "/v1/models", "/models",
    "/healthz", "/", "/v1", "/v1/", "/v1/chat", "/admin", "/admin/", "/admin/settings",
    "/admin/accounts", "/admin/accounts/a1/clear", "/admin/reload", "/admin/metrics",
    "/metrics", "/v1/responses/resp_1", "/v1/responses?x=1", "/nope", "//v1//responses",
    "/v1/%00", "/v1/responses/../models", "/backend-api/codex",
]
"""Paths relay serves, their neighbours, and odd spellings."""

POST_ROUTES = ROUTES[:5]

# -- JSON values of every type, for "wrong type" fields ------------------------
#
# Kept cheap to draw (hypothesis' generation, not relay, dominated the run
# time with richer strategies): interesting fixed values plus short text.

_ODD_VALUES = [
    None, True, False, 0, -1, 1, 2**31, 2**63, -2**63, 1.5, -0.0, 1e308, "", " ", "x",
    MODEL, "resp_x1", "msg_x1", "\u0000", "\ud800", "\u202e", "null", "true", "0", "[]", "{}",
    "a" * 300,
]
_scalar = st.one_of(st.sampled_from(_ODD_VALUES), st.sampled_from(_ODD_VALUES), st.text(max_size=6))
anyJSON = st.one_of(
    _scalar,
    _scalar,
    st.lists(_scalar, max_size=3),
    st.dictionaries(st.sampled_from(["type", "model", "input", "role", "text", "x"]), _scalar,
                    max_size=3),
    st.just({"a": [{"b": [None, {"c": "\ud800"}]}]}),
)
"""Any small JSON value (including lone surrogates, huge and odd numbers)."""


def _orWrong(good):
    """
    Mostly a plausible value, sometimes any JSON value of another type.
    """
    return st.one_of(good, good, anyJSON)


_text = st.one_of(st.sampled_from(["hi", "", "x" * 40, "\u00e9\u4e2d"]), st.text(max_size=8))


def _some(fields: dict, most: int = 4):
    """
    A dict holding up to C{most} of C{fields} (name -> value strategy).
    """
    names = sorted(fields)
    return st.lists(st.sampled_from(names), unique=True, max_size=most).flatmap(
        lambda chosen: st.fixed_dictionaries({n: fields[n] for n in chosen})
    )


_message = _some({
    "role": _orWrong(st.sampled_from(["user", "system", "assistant", "developer", "tool"])),
    "content": _orWrong(st.one_of(_text, st.lists(_some({
        "type": _orWrong(st.sampled_from(["text", "input_text", "image_url"])),
        "text": _orWrong(_text),
    }), max_size=2))),
    "name": _orWrong(_text),
    "tool_call_id": _orWrong(_text),
    "tool_calls": _orWrong(st.lists(_some({
        "id": _orWrong(_text),
        "type": _orWrong(st.sampled_from(["function", "custom"])),
        "function": _orWrong(_some({"name": _orWrong(_text), "arguments": _orWrong(_text)})),
        "custom": _orWrong(_some({"name": _orWrong(_text), "input": _orWrong(_text)})),
    }), max_size=2)),
    "function_call": anyJSON,
})
_inputItem = _some({
    "type": _orWrong(st.sampled_from(["message", "function_call_output", "reasoning", "x"])),
    "role": _orWrong(st.sampled_from(["user", "assistant", "developer"])),
    "content": _orWrong(st.one_of(_text, st.lists(_some({
        "type": _orWrong(st.sampled_from(["input_text", "output_text"])),
        "text": _orWrong(_text),
    }), max_size=2))),
    "call_id": _orWrong(_text),
    "output": _orWrong(_text),
})
_model = st.one_of(
    st.just(MODEL), st.just(MODEL), st.just("gpt-4.1"), st.just(""), st.just("no-such-model"),
    anyJSON,
)
_previous = st.one_of(st.sampled_from(["resp_unknown0001", "msg_abc", ""]), anyJSON)

_RESPONSES_FIELDS = {
    "input": _orWrong(st.one_of(_text, st.lists(_inputItem, max_size=2))),
    "stream": _orWrong(st.booleans()),
    "previous_response_id": _previous,
    "instructions": _orWrong(_text),
    "tools": _orWrong(st.lists(_some({"type": st.just("function"), "name": _text}),
                               max_size=2)),
    "tool_choice": anyJSON,
    "store": _orWrong(st.booleans()),
    "prompt_cache_key": _orWrong(_text),
    "reasoning": anyJSON,
    "text": anyJSON,
    "include": anyJSON,
    "max_output_tokens": _orWrong(st.integers(1, 4096)),
    "metadata": anyJSON,
    "background": _orWrong(st.booleans()),
    "generate": _orWrong(st.booleans()),
    "type": anyJSON,
}
_CHAT_FIELDS = {
    "messages": _orWrong(st.lists(_message, max_size=2)),
    "stream": _orWrong(st.booleans()),
    "stream_options": anyJSON,
    "max_tokens": _orWrong(st.integers(1, 4096)),
    "tools": _orWrong(st.lists(_some({
        "type": _orWrong(st.sampled_from(["function", "custom"])),
        "function": _orWrong(_some({"name": _orWrong(_text), "parameters": anyJSON,
                                    "strict": anyJSON})),
    }), max_size=2)),
    "functions": anyJSON,
    "tool_choice": anyJSON,
    "response_format": anyJSON,
    "reasoning_effort": anyJSON,
    "max_completion_tokens": anyJSON,
    "n": _orWrong(st.integers(1, 3)),
    "temperature": anyJSON,
}


def _body(fields):
    """
    A request body: usually with a model, plus up to four other fields.
    """
    return st.tuples(st.one_of(_model, st.none()), _some(fields)).map(
        lambda mb: {**({"model": mb[0]} if mb[0] is not None else {}), **mb[1]}
    )


responsesBody = _body(_RESPONSES_FIELDS)
chatBody = _body(_CHAT_FIELDS)


def _dumps(value) -> bytes:
    return json.dumps(value).encode()


bodyBytes = st.one_of(
    responsesBody.map(_dumps),
    responsesBody.map(_dumps),
    chatBody.map(_dumps),
    anyJSON.map(_dumps),
    st.binary(max_size=64),
    responsesBody.map(_dumps).flatmap(
        lambda raw: st.integers(0, max(len(raw) - 1, 0)).map(lambda n: raw[:n])
    ),
    st.sampled_from([b"", b"{", b"null", b"[]", b'{"model": "gpt-5.5"', b"\xff\xfe{}",
                     b'{"model": "gpt-5.5", "input": "\\ud800"}', b"{}" * 3]),
    st.builds(lambda n: b'{"model":"gpt-5.5","input":"' + b"x" * n + b'"}',
              st.sampled_from([BODY_LIMIT - 40, BODY_LIMIT + 10])),
)
"""Request bodies: plausible, wrong-typed, non-object, binary, truncated,
at and just above the size limit."""

# -- headers ------------------------------------------------------------------

_auth = st.sampled_from([
    None, "good", "good", "good", "wrong", "empty", "basic", "admin", "x-api-key", "both",
    "lowercase", "huge",
])
_contentType = st.sampled_from([
    None, "application/json", "application/json", "application/json; charset=utf-8",
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/jsonx", "", "\u00e9/\u00e9",
])
_encoding = st.sampled_from([
    None, None, None, "gzip", "deflate", "zstd", "identity", "gzip, gzip", "br", "x-gzip",
    "gzip-but-wrong", "compress", "", ",", "identity, deflate",
])
_length = st.sampled_from([
    "correct", "correct", "correct", "none", "short", "long", "negative", "junk", "double",
    "chunked", "chunked-bad", "huge",
])
_headerName = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"),
    min_size=1, max_size=20,
)
_headerValue = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
    st.binary(max_size=20).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").decode(
        "latin-1")),
    st.sampled_from(["x" * 9000, "y" * 20000]),
)
_extraHeaders = st.lists(st.tuples(
    st.one_of(_headerName, st.sampled_from([
        "session_id", "conversation_id", "x-codex-turn-state", "openai-beta", "originator",
        "chatgpt-account-id", "x-openai-subagent", "cookie", "host", "expect", "upgrade",
        "connection", "sec-websocket-key", "sec-websocket-version", "accept-encoding",
        "content-encoding", "content-length", "transfer-encoding",
    ])),
    _headerValue,
), max_size=4)


@st.composite
def httpRequests(draw):
    """
    One raw HTTP/1.1 request (bytes) and its method.

    @return: C{(method bytes, request bytes)}.
    """
    method = draw(st.one_of(
        st.sampled_from([b"POST"] * 6 + [b"GET"] * 2 + [b"PUT", b"DELETE", b"PATCH", b"HEAD",
                                                       b"OPTIONS", b"TRACE", b"CONNECT"]),
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=12).map(str.encode),
        st.sampled_from([b"get", b"P O S T", b"\x00", b"POST\t"]),
    ))
    path = draw(st.one_of(
        st.sampled_from(POST_ROUTES * 4 + ROUTES),
        st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126),
                max_size=30).map(lambda p: "/" + p),
    )).encode("utf-8", "surrogatepass")
    version = draw(st.sampled_from([b"HTTP/1.1"] * 8 + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/x",
                                                         b""]))
    body = draw(bodyBytes) if draw(st.integers(0, 9)) else b""
    encoding = draw(_encoding)
    if encoding in ("gzip", "x-gzip"):
        body = gzip.compress(body) if draw(st.booleans()) else body
    elif encoding == "deflate":
        body = zlib.compress(body) if draw(st.booleans()) else body
    elif encoding == "zstd":
        import zstandard

        body = zstandard.ZstdCompressor().compress(body) if draw(st.booleans()) else body
    elif encoding == "gzip, gzip":
        body = gzip.compress(gzip.compress(body))
    headers = [(b"Host", b"relay.test")]
    auth = draw(_auth)
    if auth == "good":
        headers.append((b"Authorization", f"Bearer {GOOD_KEY}".encode()))
    elif auth == "wrong":
        headers.append((b"Authorization", b"Bearer sk-relay-wrong"))
    elif auth == "empty":
        headers.append((b"Authorization", b"Bearer "))
    elif auth == "basic":
        headers.append((b"Authorization", b"Basic dXNlcjpwYXNz"))
    elif auth == "admin":
        headers.append((b"Authorization", b"Bearer sk-relay-not-the-admin-key"))
    elif auth == "x-api-key":
        headers.append((b"x-api-key", GOOD_KEY.encode()))
    elif auth == "both":
        headers.append((b"Authorization", b"Bearer sk-relay-wrong"))
        headers.append((b"x-api-key", GOOD_KEY.encode()))
    elif auth == "lowercase":
        headers.append((b"authorization", f"bearer {GOOD_KEY}".encode()))
    elif auth == "huge":
        headers.append((b"Authorization", b"Bearer " + b"k" * 12000))
    contentType = draw(_contentType)
    if contentType is not None:
        headers.append((b"Content-Type", contentType.encode("utf-8")))
    if encoding is not None:
        headers.append((b"Content-Encoding", encoding.encode()))
    length = draw(_length)
    payload = body
    if length == "correct":
        headers.append((b"Content-Length", str(len(body)).encode()))
    elif length == "short":
        headers.append((b"Content-Length", str(max(len(body) - 3, 0)).encode()))
    elif length == "long":
        headers.append((b"Content-Length", str(len(body) + 5).encode()))
    elif length == "negative":
        headers.append((b"Content-Length", b"-1"))
    elif length == "junk":
        headers.append((b"Content-Length", b"12abc"))
    elif length == "double":
        headers.append((b"Content-Length", str(len(body)).encode()))
        headers.append((b"Content-Length", str(len(body) + 1).encode()))
    elif length == "huge":
        headers.append((b"Content-Length", b"99999999999999"))
    elif length in ("chunked", "chunked-bad"):
        headers.append((b"Transfer-Encoding", b"chunked"))
        cut = len(body) // 2
        pieces = [p for p in (body[:cut], body[cut:]) if p]
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        if length == "chunked-bad":
            payload = b"zz\r\n" + payload
    if path.startswith(b"/v1/responses") and method == b"GET" and draw(st.booleans()):
        headers.append((b"Upgrade", draw(st.sampled_from([b"websocket", b"WebSocket", b"h2c"]))))
        headers.append((b"Connection", b"Upgrade"))
        if draw(st.booleans()):
            headers.append((b"Sec-WebSocket-Key", b"dGhlIHNhbXBsZSBub25jZQ=="))
            headers.append((b"Sec-WebSocket-Version",
                            draw(st.sampled_from([b"13", b"8", b"x"]))))
    extra = draw(_extraHeaders)
    for name, value in extra:
        headers.append((name.encode("latin-1", "replace"), value.encode("latin-1", "replace")))
    if draw(st.booleans()):
        headers = draw(st.permutations(headers))
    head = method + b" " + path + (b" " + version if version else b"") + b"\r\n"
    head += b"".join(n + b": " + v + b"\r\n" for n, v in headers) + b"\r\n"
    return method, head + payload


# -- WebSocket frames -------------------------------------------------------------

_frameType = st.one_of(
    st.just("response.create"), st.just("response.create"), st.just("response.create"),
    st.sampled_from(["response.append", "response.processed", "response.cancel", "session.update",
                     "", None]),
    anyJSON,
)
wsFrameBody = st.tuples(
    _frameType, st.one_of(_model, st.none()), _some(_RESPONSES_FIELDS, 3)
).map(lambda t: {
    **({"type": t[0]} if t[0] != "" else {}),
    **({"model": t[1]} if t[1] is not None else {}),
    **{k: v for k, v in t[2].items() if k != "type"},
})
"""A client frame: a C{type} (mostly C{response.create}; absent when
drawn as the empty string), usually a model, up to three other fields."""


@st.composite
def wsFrames(draw):
    """
    A list of client frames: C{(opcode, payload bytes, fin)}.
    """
    frames = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(
            ["json"] * 6 + ["nonjson", "array", "binary", "oversized", "badutf8", "ping",
                            "fragmented", "empty"]
        ))
        if kind == "json":
            frames.append((1, _dumps(draw(wsFrameBody)), True))
        elif kind == "nonjson":
            frames.append((1, draw(st.text(max_size=30)).encode("utf-8", "surrogatepass"), True))
        elif kind == "array":
            frames.append((1, _dumps(draw(anyJSON)), True))
        elif kind == "binary":
            frames.append((2, draw(st.binary(max_size=40)), True))
        elif kind == "oversized":
            frames.append((1, b'{"type":"response.create","input":"' + b"x" * BODY_LIMIT + b'"}',
                           True))
        elif kind == "badutf8":
            frames.append((1, b'{"type":"\xff\xfe"}', True))
        elif kind == "ping":
            frames.append((9, b"ping", True))
        elif kind == "fragmented":
            raw = _dumps(draw(wsFrameBody))
            frames.append((1, raw[: len(raw) // 2], False))
            frames.append((0, raw[len(raw) // 2:], True))
        else:
            frames.append((1, b"", True))
    return frames


def clientFrame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    """
    One masked client frame (RFC 6455 5.2).
    """
    head = bytes([(0x80 if fin else 0) | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 65536:
        head += bytes([0x80 | 126]) + struct.pack("!H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", n)
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return head + mask + masked


def serverFrames(data: bytes) -> list:
    """
    Parse unmasked server frames.

    @return: C{[(opcode, payload)]}; a trailing partial frame is ignored.
    """
    frames, i = [], 0
    while i + 2 <= len(data):
        opcode = data[i] & 0x0F
        n = data[i + 1] & 0x7F
        j = i + 2
        if n == 126:
            if j + 2 > len(data):
                break
            n = struct.unpack("!H", data[j:j + 2])[0]
            j += 2
        elif n == 127:
            if j + 8 > len(data):
                break
            n = struct.unpack("!Q", data[j:j + 8])[0]
            j += 8
        if j + n > len(data):
            break
        frames.append((opcode, data[j:j + n]))
        i = j + n
    return frames


WS_HANDSHAKE = (
    b"GET /v1/responses HTTP/1.1\r\nHost: relay.test\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer " + GOOD_KEY.encode() + b"\r\n\r\n"
)


# -- HTTP responses -----------------------------------------------------------------


def parseResponses(data: bytes, methods: list) -> list:
    """
    Split HTTP/1.1 responses out of C{data}.

    @param methods: the request methods, in order (HEAD answers have no body).
    @return: C{[(status, {lower-case name: [values]}, body)]}; a response
        whose body runs to the end of the connection takes the rest.
    @raise ValueError: for bytes that are not HTTP responses.
    """
    out, i = [], 0
    methods = list(methods)
    while i < len(data):
        end = data.find(b"\r\n\r\n", i)
        if end < 0:
            raise ValueError(f"incomplete response head: {data[i:i + 200]!r}")
        lines = data[i:end].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ValueError(f"not a status line: {lines[0]!r}")
        status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers.setdefault(name.strip().lower(), []).append(value.strip())
        i = end + 4
        if 100 <= status < 200 and status != 101:
            continue
        method = methods.pop(0) if methods else b"GET"
        if status == 101:
            out.append((status, headers, data[i:]))
            return out
        headAnswered = method == b"HEAD" and not data.startswith(b"{", i)
        if headAnswered or status in (204, 304):
            # (A HEAD relay could not even parse is answered with a body.)
            body = b""
        elif b"content-length" in headers:
            n = int(headers[b"content-length"][0])
            body = data[i:i + n]
            i += n
        elif headers.get(b"transfer-encoding", [b""])[0].lower() == b"chunked":
            body = b""
            while True:
                eol = data.find(b"\r\n", i)
                if eol < 0:
                    raise ValueError("incomplete chunked body")
                size = int(data[i:eol].split(b";")[0], 16)
                i = eol + 2
                if size == 0:
                    i = data.find(b"\r\n", i) + 2 if data.find(b"\r\n", i) >= 0 else len(data)
                    break
                body += data[i:i + size]
                i += size + 2
        else:
            body, i = data[i:], len(data)
        out.append((status, headers, body))
    return out


def errorEnvelopeProblem(status: int, headers: dict, body: bytes):
    """
    Why a 4xx answer is not OpenAI's error format, or L{None} when it is.
    """
    try:
        parsed = json.loads(body)
    except ValueError:
        return f"{status} body is not JSON: {body[:120]!r}"
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict):
        return f"{status} body has no error object: {body[:120]!r}"
    if not isinstance(error.get("message"), str) or not isinstance(error.get("type"), str):
        return f"{status} error lacks message/type: {body[:120]!r}"
    return None


def upstreamProblem(record, credentials: set):
    """
    Why an upstream request the emulator recorded is malformed, or
    L{None}: its body must be a JSON object with a non-empty string
    C{model} (and a boolean C{stream} when present, a list of messages for
    chat), and it must carry an account credential, never the client's.
    """
    if record.credential not in credentials:
        return f"upstream got credential {record.credential!r}"
    if record.kind == "handshake" or record.method in ("GET", "DELETE"):
        return None  # no body: an upgrade, a model list, a retrieve (issue 20)
    body = record.body
    if not isinstance(body, dict):
        return f"upstream {record.kind} body is not an object: {body!r}"[:300]
    if not isinstance(body.get("model"), str) or not body["model"]:
        return f"upstream {record.kind} without a model: {body!r}"[:300]
    if "stream" in body and not isinstance(body["stream"], bool):
        return f"upstream {record.kind} with stream {body['stream']!r}"
    if record.kind == "frame" and body.get("type") != "response.create":
        return f"upstream frame of type {body.get('type')!r}"
    if record.path.endswith("/chat/completions") and not isinstance(body.get("messages"), list):
        return f"upstream chat without messages: {body!r}"[:300]
    prev = body.get("previous_response_id")
    if prev is not None and not (isinstance(prev, str) and prev):
        return f"upstream previous_response_id {prev!r}"
    return None


@st.composite
def plausibleRequests(draw):
    """
    A well-formed request on a POST route with the right key and a JSON
    body whose model is served, its other fields fuzzed: these reach
    relay's engine and upstream, so the upstream checks have work.

    @return: C{(method bytes, request bytes)}.
    """
    path = draw(st.sampled_from(POST_ROUTES))
    chat = "chat" in path
    body = dict(draw(chatBody if chat else responsesBody))
    body["model"] = MODEL
    if chat and draw(st.booleans()):
        body["messages"] = [{"role": "user", "content": draw(_text)}]
    raw = _dumps(body)
    head = (
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: relay.test\r\n"
        b"Authorization: Bearer " + GOOD_KEY.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(raw)).encode()
        + b"\r\n\r\n"
    )
    return b"POST", head + raw
