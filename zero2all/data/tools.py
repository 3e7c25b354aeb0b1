"""Tool calls in our chat template: how tools, a model's calls and their results become ChatML messages.

One written form, shared by the SFT data (``data/chat.py``) and the server (``infer/server.py``), so that a model
fine-tuned on it is served with exactly what it learned:

* the tools offered go at the end of the system message (a system message is added when there is none)::

      <|im_start|>system
      {system text}

      # Tools

      To call a function, reply with only <tool_call>{"name": NAME, "arguments": {...}}</tool_call> (one block
      per call) and nothing else. The functions:
      {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
      ...<|im_end|>

* an assistant turn that calls tools is its text (usually none) followed by one block per call, the arguments as a
  JSON object (compact, ``json.dumps``' separators): ``<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>``;
* a tool's result is a turn of its own with the role ``tool``: ``<|im_start|>tool\\n{result}<|im_end|>``, in the
  order of the calls.

The blocks are plain text (no special tokens: every vocabulary can write them, and a user who types them in a message
only writes text). A reply is read as tool calls (:func:`parse_tool_calls`) when it consists of such blocks only
(whitespace around them allowed), each holding a JSON object with a string ``name`` and an object ``arguments``.
"""

from __future__ import annotations

import json
import re

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_BLOCK = re.compile(r"\s*<tool_call>(.*?)</tool_call>\s*", re.S)


def tools_preamble(tools: list[dict]) -> str:
    """The text that offers ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``)."""
    lines = ["# Tools", "", f'To call a function, reply with only {OPEN}{{"name": NAME, "arguments": {{...}}}}{CLOSE} '
             "(one block per call) and nothing else. The functions:"]
    lines += [json.dumps(t, ensure_ascii=False) for t in tools]
    return "\n".join(lines)


def tool_call_text(name: str, arguments: dict) -> str:
    """One call as the model writes it."""
    return OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CLOSE


def call_arguments(call: dict) -> tuple[str, dict]:
    """An OpenAI tool call ``{"type": "function", "function": {"name", "arguments": JSON text or object}}`` ->
    (name, arguments object); ValueError naming what is wrong."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not TOOL_NAME.fullmatch(fn["name"]):
        raise ValueError("a tool call needs 'function': {'name': letters, digits, _ or - (1-64), 'arguments'}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise ValueError(f"function.arguments is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError("function.arguments must be a JSON object")
    return fn["name"], args


def template_messages(messages: list[dict], tools: list[dict] | None = None) -> list[dict]:
    """Messages with tool calls and tool results, and the tools offered, as the plain ``{"role", "content"}``
    messages the chat template renders (see the module docstring). ``messages``: OpenAI's shapes, already checked
    (assistant ``tool_calls``; ``role: "tool"`` with ``content``); raises ValueError for a malformed call."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            content += "".join(tool_call_text(*call_arguments(c)) for c in m["tool_calls"])
        out.append({"role": m["role"], "content": content})
    if tools:
        preamble = tools_preamble(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def parse_tool_calls(text: str) -> list[tuple[str, dict]] | None:
    """The calls of a reply made of tool-call blocks only, as (name, arguments); None when it is anything else."""
    pos, calls = 0, []
    while pos < len(text):
        m = _BLOCK.match(text, pos)
        if m is None:
            return None
        try:
            call = json.loads(m.group(1))
        except ValueError:
            return None
        if not isinstance(call, dict) or set(call) - {"name", "arguments"} or not isinstance(call.get("name"), str):
            return None
        if not isinstance(call.get("arguments", {}), dict):
            return None
        calls.append((call["name"], call.get("arguments", {})))
        pos = m.end()
    return calls or None


def may_be_tool_call(text: str) -> bool:
    """Whether a reply that begins with ``text`` may still turn out to be tool calls (a stream holds it back)."""
    head = text.lstrip()
    return head.startswith(OPEN) or OPEN.startswith(head)
