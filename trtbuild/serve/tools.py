"""OpenAI tool calls (``tools`` / ``tool_choice``) on the chat endpoint, answered under a JSON schema.

With ``tool_choice`` ``"required"`` or a named function, the reply is generated under the JSON schema of a call,
``{"name": <a declared function>, "arguments": <its parameters' schema>}`` (structured output, runtime/grammar.py),
so it always names a declared function and its arguments validate; it is answered as ``tool_calls`` with
``finish_reason`` ``"tool_calls"``. With ``"auto"`` the model generates freely and a reply that is such a call is
answered as one (otherwise as text). ``"none"`` (or no tools) leaves the request as it was. The functions are
described to the model in a system message (``TOOLS_PROMPT``), merged into the chat's own system message when it
has one. One call per choice (``parallel_tool_calls`` is accepted either way).

Streaming: the call's JSON is fixed in shape (``{"name": "NAME", "arguments": ...}``, json.dumps' separators), so
``ToolCallStream`` hands out the function's name once its text is complete, then the arguments' text as it grows,
holding back the closing brace of the wrapper, as OpenAI streams ``tool_calls`` deltas.
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import bad_request

TOOLS_PROMPT = (
    "You can call these functions. To call one, reply with only a JSON object "
    '{{"name": <function name>, "arguments": <an object of its parameters>}}.\n{functions}'
)
CALL_PREFIX = '{"name": '  # how every call's JSON starts (the grammar's fixed separators)


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object


@dataclass(frozen=True)
class ToolRequest:
    """The checked ``tools`` / ``tool_choice`` of a chat request (``named``: the function a NAMED choice names)."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    named: str | None = None

    @property
    def constrained(self) -> bool:
        """The reply must be a call (generated under ``call_schema``)."""
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of a call of the named function, or of any declared one."""
        calls = [_call_schema(t) for t in self.tools if self.named is None or t.name == self.named]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with the functions described in the system message (the first message, made if absent)."""
        tools = self.tools if self.named is None else tuple(t for t in self.tools if t.name == self.named)
        functions = "\n".join(
            json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}) for t in tools
        )
        prompt = TOOLS_PROMPT.format(functions=functions)
        if messages and messages[0].get("role") == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    def parse_call(self, text: str) -> tuple[str, str] | None:
        """(name, arguments as JSON text) when ``text`` is a call of a declared function, else None."""
        try:
            call = json.loads(text)
        except ValueError:
            return None
        if not isinstance(call, dict) or set(call) != {"name", "arguments"} or not isinstance(call["arguments"], dict):
            return None
        if call["name"] not in {t.name for t in self.tools}:
            return None
        return call["name"], json.dumps(call["arguments"])


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """The request's tools, or None when it has none or ``tool_choice`` is ``"none"``; a 400 for bad values."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools", param="tools")
    parsed = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        parsed.append(Tool(fn["name"], str(fn.get("description") or ""), params))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    if choice is None or choice in ("auto", "none", "required"):
        kind = ToolChoice(choice or "auto")
        return None if kind is ToolChoice.NONE else ToolRequest(tuple(parsed), kind)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in names:
        raise bad_request(f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
    return ToolRequest(tuple(parsed), ToolChoice.NAMED, name)


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of a message's ``tool_calls``."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ToolCallStream:
    """Splits a constrained call's growing JSON text into OpenAI's ``tool_calls`` stream deltas."""

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self.sent = 0  # characters of the arguments handed out
        self._args_start = 0

    def feed(self, delta: str, finished: bool) -> list[dict[str, Any]]:
        """The ``tool_calls`` deltas ``delta`` completes (the first one carries the id, type and name)."""
        self.text += delta
        out: list[dict[str, Any]] = []
        if self.name is None:
            head = self.text[len(CALL_PREFIX) :]
            end = head.find('", "arguments": ') if head.startswith('"') else -1
            if end < 0:
                return out
            self.name = json.loads(head[: end + 1])
            self._args_start = len(CALL_PREFIX) + end + len('", "arguments": ')
            call = tool_call(self.name, "")
            out.append({"index": 0, **call})
        args = self.text[self._args_start :]
        # The last character may be the wrapper's closing brace (it is, once a finished call is whole): held back.
        end = len(args) if finished and not args.endswith("}") else len(args) - 1
        if end > self.sent:
            out.append({"index": 0, "function": {"arguments": args[self.sent : end]}})
            self.sent = end
        return out
