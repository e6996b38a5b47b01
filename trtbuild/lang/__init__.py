"""``trtbuild.lang``: SGLang-style programs on one ``LLM``: ``gen``, ``select``, ``fork`` / ``join`` and chat roles.

::

    from trtbuild import LLM
    from trtbuild.lang import assistant, function, gen, select, system, user

    @function
    def review(s, product):
        s += system("You are a terse reviewer.")
        s += user(f"Rate {product} and say why.")
        s += assistant("Verdict: " + select("verdict", ["good", "bad"]) + ". " + gen("why", max_tokens=40))

    state = review.run(LLM("artifacts/demo/smollm2-engine"), product="a kettle")
    state["verdict"], state["why"]

Tools: ``call_tool(name, [python_function, ...])`` in an assistant block, then ``tool(s[name].content)``
(``tools.py``). The guide is docs/lang.md.
"""

from .choices import ChoicesMethod, SelectScores
from .interpreter import ForkGroup, Program, ProgramState, function
from .ir import assistant, gen, select, system, tool, user
from .tools import ToolCall, call_tool

__all__ = [
    "ChoicesMethod",
    "ForkGroup",
    "Program",
    "ProgramState",
    "SelectScores",
    "ToolCall",
    "assistant",
    "call_tool",
    "function",
    "gen",
    "select",
    "system",
    "tool",
    "user",
]
