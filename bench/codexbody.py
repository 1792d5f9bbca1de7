"""
Codex-shaped request bodies for the bench (issue 38): what Codex sends on
every HTTP turn -- the whole conversation so far.

  python bench/codexbody.py 262144 > body.json     # one ~256 KiB body

A body is a Responses C{POST /v1/responses} request: C{instructions}
(Codex's long system prompt), the C{tools} it declares, and C{input}: the
history of turns, each a user message, a reasoning item (a summary and
C{encrypted_content}, as Codex asks for with C{include:
["reasoning.encrypted_content"]} and C{store: false}), C{function_call}s
and their C{function_call_output}s (shell commands and what they printed:
code, unicode, escapes, newlines), and an assistant message. Deterministic
(seeded), so every run and every tree measures the same bytes.
"""

from __future__ import annotations

import base64
import json
import random
import sys

_WORDS = ("the relay turn account stream token body parse bytes upstream client key "
          "function output history item reasoning codex gateway request answer file line "
          "déjà vu — naïve café 東京 ✓ “quoted” ±").split()

_CODE = '''def handle(request):
    """Route {name!r} -> {{"ok": true}}"""
    body = json.loads(request.content.read())
    if body.get("stream"):\n        return stream(body, "\\t{name}")
    return {{"path": "C:\\\\work\\\\{name}", "size": {size}, "text": "ünïcödé ☃"}}
'''


def _sentence(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(_WORDS) for _ in range(n)).capitalize() + "."


def _output(rnd: random.Random, size: int) -> str:
    lines = []
    total = 0
    i = 0
    while total < size:
        i += 1
        if i % 4 == 0:
            line = _CODE.format(name=f"mod{i}", size=rnd.randrange(10**6))
        else:
            line = f"{i:5d}\t{_sentence(rnd, rnd.randrange(6, 16))}\n"
        lines.append(line)
        total += len(line.encode())
    return "".join(lines)


def turnItems(rnd: random.Random, turn: int, size: int = 20 * 1024) -> list:
    """
    The input items one Codex turn adds to the history, about C{size} bytes
    of JSON: a user message, reasoning with encrypted content, two
    function calls and their outputs, an assistant message.
    """
    call = [f"call_{turn:04d}_{k}_{rnd.randrange(16**12):012x}" for k in range(2)]
    encrypted = "gAAAAA" + base64.urlsafe_b64encode(rnd.randbytes(size // 8)).decode()
    out = size // 3
    return [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": _sentence(rnd, 30) + "\n" + _sentence(rnd, 20)}]},
        {"type": "reasoning", "id": f"rs_{turn:04d}{rnd.randrange(16**20):020x}",
         "summary": [{"type": "summary_text", "text": "**Planning** " + _sentence(rnd, 40)}],
         "encrypted_content": encrypted},
        {"type": "function_call", "name": "shell", "call_id": call[0],
         "arguments": json.dumps({"command": ["bash", "-lc", f"sed -n 1,200p src/mod{turn}.py"],
                                  "workdir": "/home/dev/project", "timeout_ms": 10000})},
        {"type": "function_call_output", "call_id": call[0],
         "output": json.dumps({"output": _output(rnd, out), "metadata": {"exit_code": 0,
                                                                         "duration_seconds": 0.1}})},
        {"type": "function_call", "name": "apply_patch", "call_id": call[1],
         "arguments": json.dumps({"input": "*** Begin Patch\n*** Update File: src/x.py\n@@\n-"
                                  + _output(rnd, out // 4) + "+fixed ✓\n*** End Patch\n"})},
        {"type": "function_call_output", "call_id": call[1],
         "output": "Success. Updated the following files:\nM src/x.py\n"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": _sentence(rnd, 60)}]},
    ]


INSTRUCTIONS = ("You are Codex, a coding agent based on GPT-5. You and the user share the same "
                "workspace and collaborate to achieve the user's goals.\n\n# General\n\n"
                + "\n".join(f"- {_sentence(random.Random(k), 25)}" for k in range(120)))

TOOLS = [
    {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
     "strict": False, "parameters": {"type": "object", "properties": {
         "command": {"type": "array", "items": {"type": "string"}},
         "workdir": {"type": "string"}, "timeout_ms": {"type": "number"}},
         "required": ["command"], "additionalProperties": False}},
    {"type": "function", "name": "apply_patch", "description": "Edit files with a patch.",
     "strict": False, "parameters": {"type": "object", "properties": {"input": {"type": "string"}},
                                     "required": ["input"], "additionalProperties": False}},
    {"type": "function", "name": "update_plan", "description": "Update the task plan.",
     "strict": False, "parameters": {"type": "object", "properties": {
         "plan": {"type": "array", "items": {"type": "object"}}}, "required": ["plan"]}},
]


def envelope(items: list, stream: bool = False) -> dict:
    """
    A Codex request around the C{items}.
    """
    return {"model": "gpt-5.5", "instructions": INSTRUCTIONS, "input": items, "tools": TOOLS,
            "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
            "stream": stream, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0199b1c8-3c1a-7d30-9b4e-6b1f3c2a9e10"}


def history(size: int, seed: int = 38) -> list:
    """
    Items of whole turns until their JSON is about C{size} bytes, ending
    with a new user message (the turn being asked).
    """
    rnd = random.Random(seed)
    items = []
    total = 0
    turn = 0
    while total < size - 24 * 1024:
        turn += 1
        new = turnItems(rnd, turn, min(20 * 1024, max(2048, size - total - 24 * 1024)))
        items.extend(new)
        total += len(json.dumps(new))
    items.append({"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": "Now run the tests — and fix “them”."}]})
    return items


def body(size: int, stream: bool = False, seed: int = 38) -> bytes:
    """
    One Codex-shaped request body of about C{size} bytes (within a few
    KiB), as Codex encodes it (compact JSON, non-ASCII kept as UTF-8).
    """
    return json.dumps(envelope(history(size, seed), stream), ensure_ascii=False,
                      separators=(",", ":")).encode()


if __name__ == "__main__":
    sys.stdout.buffer.write(body(int(sys.argv[1]) if len(sys.argv) > 1 else 256 * 1024))
