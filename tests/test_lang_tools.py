"""Tools in ``trtbuild.lang`` programs (``call_tool`` / ``tool``, trtbuild/lang/tools.py) on a tiny random engine with
test_grammar's JSON tokenizer: the call is what ``LLM.chat`` generates under the same JSON schema (the reference),
it always parses and validates, the Python function runs with its arguments, and the tool message carries its
result into the rest of the program."""

from __future__ import annotations

import enum
import json
import shutil
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from test_grammar import HERMES_TEMPLATE, tool_engine  # noqa: F401  (tool_engine: a fixture)

from trtbuild.errors import RequestError
from trtbuild.lang import ToolCall, assistant, call_tool, function, gen, tool, user
from trtbuild.lang.tools import Function
from trtbuild.runtime.llm import LLM, SamplingParams

ANY_ROLE_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


class Unit(enum.Enum):
    C = "c"
    F = "f"


CALLS: list[tuple[str, dict]] = []  # what the tools below were called with, in order


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Longer text that is not part of the description."""
    CALLS.append(("add", {"a": a, "b": b}))
    return a + b


def weather(city: Literal["paris", "rome"], unit: Unit) -> dict:
    """Weather now."""
    CALLS.append(("weather", {"city": city, "unit": unit}))
    return {"city": city, "temp": 21}


def engine_with(tool_engine: Path, dst: Path, template: str) -> Path:  # noqa: F811
    shutil.copytree(tool_engine, dst)
    (dst / "chat_template.jinja").write_text(template)
    return dst


def test_functions_are_described_by_their_signatures():
    f = Function.of(add)
    assert (f.name, f.description) == ("add", "Add two integers.")
    assert f.parameters == {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    assert Function.of(weather).parameters["properties"] == {
        "city": {"enum": ["paris", "rome"]},
        "unit": {"enum": ["c", "f"]},
    }

    def rich(xs: list[float], tags: dict[str, bool], maybe: int | None = None, anything=None) -> None:
        pass

    assert Function.of(rich).parameters["properties"] == {
        "xs": {"type": "array", "items": {"type": "number"}},
        "tags": {"type": "object", "additionalProperties": {"type": "boolean"}},
        "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "anything": {},
    }
    assert Function.of(rich).parameters["required"] == ["xs", "tags"]

    def odd(x: set[int]) -> None:
        pass

    def star(*xs: int) -> None:
        pass

    with pytest.raises(RequestError, match=r"parameter x: type .* has no JSON schema"):
        call_tool("c", [odd])
    with pytest.raises(RequestError, match="parameter xs must be passable by keyword"):
        call_tool("c", [star])
    with pytest.raises(RequestError, match="list of Python functions"):
        call_tool("c", [])


def test_program_calls_a_tool_and_continues_with_its_result(tool_engine, tmp_path):  # noqa: F811
    engine = engine_with(tool_engine, tmp_path / "engine", ANY_ROLE_TEMPLATE)
    llm = LLM(engine)

    @function
    def agent(s, question):
        s += user(question)
        s += assistant(call_tool("call", [add, weather], max_tokens=80))
        s += tool(s["call"].content)
        s += assistant(gen("answer", max_tokens=6))

    CALLS.clear()
    state = agent.run(llm, question="1 + 2 or weather?")
    call = state["call"]
    assert isinstance(call, ToolCall) and call.name in ("add", "weather")
    function_ = Function.of({"add": add, "weather": weather}[call.name])
    jsonschema.validate(call.arguments, function_.parameters)
    assert len(CALLS) == 1 and CALLS[0][0] == call.name  # the function ran once, with the call's arguments
    assert call.result == {"add": add, "weather": weather}[call.name](**call.arguments)
    [first, said, result, answer] = state.messages()
    assert said == {"role": "assistant", "content": json.dumps({"name": call.name, "arguments": call.arguments})}
    assert result == {"role": "tool", "content": call.content} and answer["content"] == state["answer"]
    # The reference: LLM.chat under the same schema gives the call's text; the answer follows the tool message.
    params = SamplingParams(
        temperature=0.0, max_tokens=80, json_schema=call_tool("c", [add, weather]).params.json_schema
    )
    assert llm.chat([first], params)[0].text == said["content"]
    expected = llm.chat([first, said, result], SamplingParams(temperature=0.0, max_tokens=6))[0].text
    assert state["answer"] == expected


def test_template_that_renders_tools_is_handed_them(tool_engine, tmp_path):  # noqa: F811
    # A Hermes template gets the functions for the call's request (as LLM.chat(tools=...) renders them).
    engine = engine_with(tool_engine, tmp_path / "hermes", HERMES_TEMPLATE)
    llm = LLM(engine)

    @function
    def agent(s):
        s += user("1 + 2")
        s += assistant(call_tool("call", [add], max_tokens=60))

    state = agent.run(llm)
    params = call_tool("c", [add], max_tokens=60).params
    expected = llm.chat([{"role": "user", "content": "1 + 2"}], params, tools=[Function.of(add).openai()])[0].text
    assert state.messages()[-1]["content"] == expected and state["call"].name == "add"


def test_call_tool_outside_an_assistant_block_is_an_error(tool_engine, tmp_path):  # noqa: F811
    llm = LLM(engine_with(tool_engine, tmp_path / "engine", ANY_ROLE_TEMPLATE))

    @function
    def bad(s):
        s += user("x", call_tool("call", [add]))

    with pytest.raises(RequestError, match="inside a user block"):
        bad.run(llm)
