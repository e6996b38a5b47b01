"""OpenAI request bodies -> a checked ``ParsedRequest`` (prompts + ``SamplingParams``), or a 400 ``APIError``.

Field types are checked here (``param`` names the field); value ranges are ``SamplingParams``' own checks, whose
messages are passed on. A chat message's role must be one of OpenAI's (``CHAT_ROLES``; OpenAI's 400 otherwise,
whatever the chat template would accept). Fields the runner cannot honour are refused when set to anything but their
neutral value (completions take ``echo``, chat only ``false``);
``user``, ``metadata``, ``store`` and ``service_tier`` are accepted and ignored; any other field is refused.
``response_format`` (text, json_object, json_schema) becomes ``SamplingParams.json_schema`` (structured output).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import RequestError
from ..runtime.grammar import JSON_OBJECT_SCHEMA
from ..runtime.sampling import SamplingParams
from .errors import bad_request
from .tools import ChatInput, ToolFormat, ToolRequest, parse_tools

MAX_N = 128  # completions per request
MAX_PROMPTS = 128  # prompts in one /v1/completions request
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's chat limit)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context's end


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(frozen=True)
class ParsedRequest:
    """One checked request: its prompts (strings, token-id lists, or chats) and how to sample them."""

    endpoint: Endpoint
    model: str | None
    prompts: list[Any]
    params: SamplingParams
    stream: bool
    include_usage: bool
    tools: ToolRequest | None = None  # chat: the functions the reply may (or must) call
    # Completions' ``echo``: each choice's text (and logprobs) starts with its prompt's; with ``logprobs`` the
    # prompt tokens' logprobs come from SamplingParams.prompt_logprobs (lm-evaluation-harness's loglikelihood).
    echo: bool = False
    # ``max_tokens: 0`` with ``echo`` (scoring the prompt only): one token is generated (the runner needs one) and
    # left out of the response.
    prompt_only: bool = False


NUMBER = (int, float)
SAMPLING_FIELDS = {  # OpenAI / vLLM name -> (accepted types, SamplingParams field)
    "temperature": (NUMBER, "temperature"),
    "top_p": (NUMBER, "top_p"),
    "top_k": (int, "top_k"),
    "min_p": (NUMBER, "min_p"),
    "n": (int, "n"),
    "seed": (int, "seed"),
    "presence_penalty": (NUMBER, "presence_penalty"),
    "frequency_penalty": (NUMBER, "frequency_penalty"),
    "repetition_penalty": (NUMBER, "repetition_penalty"),
    "ignore_eos": (bool, "ignore_eos"),
}
IGNORED = {"user", "metadata", "store", "service_tier", "model", "stream", "stream_options", "stop", "stop_token_ids"}
NEUTRAL = {  # accepted only at these values (what the runner does anyway)
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (False, True),
    "modalities": (["text"],),
}
CHAT_ROLES = ("system", "assistant", "user", "function", "tool", "developer")  # OpenAI's; others get its 400
COMPLETION_FIELDS = {"prompt", "max_tokens", "logprobs", "best_of", "response_format", "echo"}
CHAT_FIELDS = {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "response_format"}
CHAT_TOOL_FIELDS = {"tools", "tool_choice"}  # chat takes them (serve/tools.py); completions only at neutral values


def parse_request(body: Any, endpoint: Endpoint, tool_format: ToolFormat = ToolFormat.SYSTEM_MESSAGE) -> ParsedRequest:
    """Check ``body`` (decoded JSON) for ``endpoint``; raises a 400 ``APIError`` naming the offending field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    own = COMPLETION_FIELDS if endpoint is Endpoint.COMPLETIONS else CHAT_FIELDS
    for key in body:
        if key not in own and key not in SAMPLING_FIELDS and key not in IGNORED and key not in NEUTRAL:
            raise bad_request(f"unrecognized request argument: {key}", param=key)
    for key, allowed in NEUTRAL.items():
        if (endpoint is Endpoint.CHAT and key in CHAT_TOOL_FIELDS) or (key in own and key in NEUTRAL):
            continue
        if body.get(key) is not None and body[key] not in allowed:
            raise bad_request(f"'{key}' is not supported by this server", param=key)
    model = _typed(body, "model", str)
    stream = bool(_typed(body, "stream", bool))
    options = _typed(body, "stream_options", dict)
    if options is not None and not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", param="stream_options")
    include_usage = bool(_typed(options or {}, "include_usage", bool, "stream_options.include_usage"))
    values: dict[str, Any] = {}
    for name, (types, field) in SAMPLING_FIELDS.items():
        value = _typed(body, name, types)
        if value is not None:
            values[field] = value
    if values.get("n", 1) > MAX_N:
        raise bad_request(f"n must be <= {MAX_N}", param="n")
    values["stop"] = _stop(body)
    values["stop_token_ids"] = _int_list(body, "stop_token_ids")
    values["json_schema"] = _response_format(body)
    echo = prompt_only = False
    if endpoint is Endpoint.COMPLETIONS:
        prompts = _completion_prompts(body)
        tokens = _typed(body, "max_tokens", int)
        values["max_tokens"] = COMPLETION_DEFAULT_MAX_TOKENS if tokens is None else tokens
        values["logprobs"] = _logprobs(body, "logprobs")
        echo = bool(_typed(body, "echo", bool))
        if echo and stream:
            raise bad_request("'echo' with 'stream' is not supported by this server", param="echo")
        if echo and values["logprobs"] is not None:
            values["prompt_logprobs"] = values["logprobs"]
        prompt_only = echo and tokens == 0
        if prompt_only:
            values["max_tokens"] = 1
        best_of = _typed(body, "best_of", int)
        if best_of is not None and best_of != values.get("n", 1):
            raise bad_request("best_of other than n is not supported", param="best_of")
        tools = None
    else:
        tools = parse_tools(body, tool_format)
        messages = _messages(body)
        prompts = [ChatInput(messages) if tools is None else tools.chat_input(messages)]
        if tools is not None and tools.constrained:
            if values["json_schema"] is not None:
                raise bad_request("response_format cannot be combined with a required tool call", param="tool_choice")
            values["json_schema"] = tools.call_schema()
        tokens = _typed(body, "max_completion_tokens", int)
        values["max_tokens"] = tokens if tokens is not None else _typed(body, "max_tokens", int)
        top = _logprobs(body, "top_logprobs")
        if _typed(body, "logprobs", bool):
            values["logprobs"] = top or 0
        elif top is not None:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    try:
        params = SamplingParams(**values)
    except RequestError as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        if field == "json_schema":  # the grammar library refused the response_format's schema
            where = "tools" if tools is not None and tools.constrained else "response_format"
            message, field = f"{where}: {message}", where
        raise bad_request(message, param=field if field in body or field == "max_tokens" else None) from None
    return ParsedRequest(endpoint, model, prompts, params, stream, include_usage, tools, echo, prompt_only)


def _typed(body: Mapping[str, Any], key: str, types: Any, name: str | None = None) -> Any:
    """``body[key]`` when it has one of ``types`` (None when absent or null); bools are never numbers."""
    value = body.get(key)
    if value is None:
        return None
    is_bool = isinstance(value, bool)
    ok = isinstance(value, types) and (not is_bool or types is bool or (isinstance(types, tuple) and bool in types))
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if not ok:
        kinds = {bool: "a boolean", int: "an integer", str: "a string", dict: "an object", NUMBER: "a number"}
        raise bad_request(f"'{name or key}' must be {kinds.get(types, 'valid')}", param=name or key)
    return value


def _response_format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as the JSON schema the output must follow: None for ``{"type": "text"}``, any
    JSON object for ``{"type": "json_object"}``, ``json_schema.schema`` for ``{"type": "json_schema", ...}`` (always
    enforced: ``strict`` is accepted either way; a missing schema allows any JSON value)."""
    fmt = _typed(body, "response_format", dict)
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return dict(JSON_OBJECT_SCHEMA)
    if fmt.get("type") != "json_schema":
        raise bad_request(
            "response_format.type must be 'text', 'json_object' or 'json_schema'", param="response_format"
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_request("response_format.json_schema must be an object with a 'name'", param="response_format")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be an object", param="response_format")
    return schema


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of them", param="stop")
    return tuple(stop)


def _int_list(body: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = body.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise bad_request(f"'{key}' must be a list of integers", param=key)
    return tuple(value)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _logprobs(body: Mapping[str, Any], key: str) -> int | None:
    value = _typed(body, key, int)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{key} must be in [0, {MAX_LOGPROBS}]", param=key)
    return value


def _completion_prompts(body: Mapping[str, Any]) -> list[str | list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids, or a list of token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(
            isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt
        ):
            if len(prompt) > MAX_PROMPTS:
                raise bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
            return list(prompt)
    raise bad_request(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists", param="prompt"
    )


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``messages``, with list-of-parts contents joined into one string (text parts only)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a 'role' string", param=f"messages[{i}]")
        if m["role"] not in CHAT_ROLES:
            supported = ", ".join(f"'{r}'" for r in CHAT_ROLES[:-1]) + f", and '{CHAT_ROLES[-1]}'"
            raise bad_request(f"Invalid value: '{m['role']}'. Supported values are: {supported}.",
                              param=f"messages[{i}].role", code="invalid_value")  # fmt: skip
        content = m.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise bad_request(f"messages[{i}].content: only text parts are supported", param=f"messages[{i}]")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}]")
        out.append({**m, "content": content})
    return out
