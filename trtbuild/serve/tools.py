"""OpenAI tool calls (``tools`` / ``tool_choice``) on the chat endpoint, answered under a JSON schema.

With ``tool_choice`` ``"required"`` or a named function, the reply is generated under the JSON schema of a call,
``{"name": <a declared function>, "arguments": <its parameters' schema>}`` (structured output, runtime/grammar.py),
so it always names a declared function and its arguments validate; it is answered as ``tool_calls`` with
``finish_reason`` ``"tool_calls"``. With ``"auto"`` the model generates freely and a reply that is a call (or
several, in the Hermes format) is answered as one (otherwise as text). ``"none"`` (or no tools) leaves the request
as it was. One call per choice when constrained (``parallel_tool_calls`` is accepted either way).

How the functions reach the model (``ToolFormat``, from the engine's chat template): a template that renders a
``tools`` variable and the Hermes ``<tool_call>`` tags (Qwen2.5, Qwen3, Hermes, SmolLM3) gets the tools and the
history's calls in its own format, and a constrained reply starts after a forced ``<tool_call>\n``; any other
template gets them described in a system message (``TOOLS_PROMPT``), merged into the chat's own system message when
it has one, and a call is the bare JSON object.

Streaming: a constrained call's JSON is fixed in shape (``{"name": "NAME", "arguments": ...}``, json.dumps'
separators), so ``ToolCallStream`` hands out the function's name once its text is complete, then the arguments'
text as it grows, holding back the closing brace of the wrapper, as OpenAI streams ``tool_calls`` deltas. An
``"auto"`` reply streams as text unless it starts like a call; that text is held back (``AutoCallStream``) and sent
at its end as ``tool_calls`` if it is one, as text if not.
"""

from __future__ import annotations

import contextlib
import enum
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..runtime.grammar import call_schema
from ..runtime.tokenizer import Tokenizer
from .errors import bad_request

TOOLS_PROMPT = (
    "You can call these functions. To call one, reply with only a JSON object "
    '{{"name": <function name>, "arguments": <an object of its parameters>}}.\n{functions}'
)
CALL_PREFIX = '{"name": '  # how every call's JSON starts (the grammar's fixed separators)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
HERMES_CALLS = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
CALL_OPENERS = ("{", HERMES_OPEN)  # how an "auto" reply that is a call can start (after whitespace)


class ToolFormat(enum.Enum):
    """How the functions reach the model, and how its calls are written."""

    SYSTEM_MESSAGE = "system_message"  # described in a system message (TOOLS_PROMPT); a call is its JSON object
    HERMES = "hermes"  # the chat template renders ``tools``; a call is <tool_call>\n{json}\n</tool_call>

    @classmethod
    def of(cls, tokenizer: Tokenizer | None) -> ToolFormat:
        """The format the engine's chat template takes (``SYSTEM_MESSAGE`` when it renders no ``tools``)."""
        if tokenizer is None or not tokenizer.template_takes_tools:
            return cls.SYSTEM_MESSAGE
        source = tokenizer.tool_template or tokenizer.chat_template or ""
        return cls.HERMES if HERMES_OPEN in source else cls.SYSTEM_MESSAGE


@dataclass(frozen=True)
class ChatInput:
    """One chat prompt as the engine renders it: messages, the tools handed to the template, the reply's start."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools for the template's ``tools`` variable
    reply_prefix: str = ""  # text forced at the start of the reply (rendered after the generation prompt)


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
    function: dict[str, Any]  # the request's own ``function`` object, as a chat template is handed it


@dataclass(frozen=True)
class ToolRequest:
    """The checked ``tools`` / ``tool_choice`` of a chat request (``named``: the function a NAMED choice names)."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    named: str | None = None
    format: ToolFormat = ToolFormat.SYSTEM_MESSAGE

    @property
    def constrained(self) -> bool:
        """The reply must be a call (generated under ``call_schema``)."""
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of a call of the named function, or of any declared one."""
        return call_schema({t.name: t.parameters for t in self.tools if self.named is None or t.name == self.named})

    def chat_input(self, messages: list[dict[str, Any]]) -> ChatInput:
        """The prompt of ``messages`` with the offered functions, in ``format``."""
        offered = self.tools if self.named is None else tuple(t for t in self.tools if t.name == self.named)
        if self.format is ToolFormat.HERMES:
            tools = [{"type": "function", "function": t.function} for t in offered]
            prefix = HERMES_OPEN + "\n" if self.constrained else ""
            return ChatInput([_decoded_calls(m) for m in messages], tools, prefix)
        functions = "\n".join(
            json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}) for t in offered
        )
        prompt = TOOLS_PROMPT.format(functions=functions)
        if messages and messages[0].get("role") == "system":
            return ChatInput([{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]])
        return ChatInput([{"role": "system", "content": prompt}, *messages])

    def parse_calls(self, text: str) -> list[tuple[str, str]]:
        """Each (name, arguments as JSON text) when ``text`` is nothing but calls of declared functions (one JSON
        object, or Hermes ``<tool_call>`` blocks in that format), else ``[]``."""
        if self.format is ToolFormat.HERMES and HERMES_OPEN in text:
            if HERMES_CALLS.sub("", text).strip():
                return []  # text beside the calls: answered as text
            bodies = HERMES_CALLS.findall(text)
        else:
            bodies = [text]
        calls = [self._call(body) for body in bodies]
        return [c for c in calls if c is not None] if all(c is not None for c in calls) else []

    def _call(self, text: str) -> tuple[str, str] | None:
        try:
            call = json.loads(text)
        except ValueError:
            return None
        if not isinstance(call, dict) or set(call) != {"name", "arguments"} or not isinstance(call["arguments"], dict):
            return None
        if call["name"] not in {t.name for t in self.tools}:
            return None
        return call["name"], json.dumps(call["arguments"])


def _decoded_calls(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with its ``tool_calls``' arguments as objects, as chat templates render them (OpenAI sends them
    as JSON text; vLLM decodes them alike). Arguments that are not JSON stay text."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    decoded = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            with contextlib.suppress(ValueError):
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        decoded.append(call)
    return {**message, "tool_calls": decoded}


def parse_tools(body: Mapping[str, Any], format: ToolFormat = ToolFormat.SYSTEM_MESSAGE) -> ToolRequest | None:
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
        parsed.append(Tool(fn["name"], str(fn.get("description") or ""), params, fn))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    if choice is None or choice in ("auto", "none", "required"):
        kind = ToolChoice(choice or "auto")
        return None if kind is ToolChoice.NONE else ToolRequest(tuple(parsed), kind, format=format)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in names:
        raise bad_request(f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
    return ToolRequest(tuple(parsed), ToolChoice.NAMED, name, format)


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


class AutoCallStream:
    """Streams an ``"auto"`` reply: text as it comes, unless it starts (after whitespace) like a call; that text is
    held back until the reply ends and handed out as ``tool_calls`` deltas when it is calls, else as text."""

    def __init__(self, tools: ToolRequest) -> None:
        self.tools = tools
        self.held = ""
        self.passing = False  # the reply is text: deltas pass through
        self.called = False  # the reply was answered as calls

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(text to send now, ``tool_calls`` deltas to send now) for the reply's next ``delta``."""
        if self.passing:
            return delta, []
        self.held += delta
        head = self.held.lstrip()
        if head and not any(head.startswith(o) or o.startswith(head) for o in CALL_OPENERS):
            self.passing = True
            return self.held, []
        if not finished:
            return "", []
        calls = self.tools.parse_calls(self.held)
        if not calls:
            return self.held, []
        self.called = True
        return "", [{"index": j, **tool_call(name, args)} for j, (name, args) in enumerate(calls)]
