"""Tool calls with ``tool_choice="required"`` on SmolLM2's CPU engine: do 20 of 20 name a declared function with
arguments that validate?

    .venv/bin/python benchmarks/tool_calls.py [--engine artifacts/demo/smollm2-engine] [--threads 2]

The requests are built as ``trtbuild serve`` builds them (``serve/protocol.parse_request`` on OpenAI chat bodies:
the functions in the system message, the reply under the call's JSON schema) and run in one ``LLM.generate`` call;
each reply is parsed as the server parses it (``ToolRequest.parse_call``) and its arguments validated with
``jsonschema`` against the function's parameters. 20 questions, temperature 0.7, seeds 0-19.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jsonschema

from trtbuild import LLM
from trtbuild.serve.protocol import Endpoint, parse_request

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 60},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
                },
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
]
QUESTIONS = [
    "What is the weather in Paris?",
    "How much is 17 plus 25?",
    "Find recent news about solar panels.",
    "Is it cold in Oslo right now, in fahrenheit?",
    "Add 3 and 4.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Path, default=Path("artifacts/demo/smollm2-engine"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.engine, num_threads=args.threads)
    parsed = [
        parse_request(
            {
                "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                "tools": TOOLS,
                "tool_choice": "required",
                "temperature": 0.7,
                "seed": i,
                "max_tokens": 128,
            },
            Endpoint.CHAT,
        )
        for i in range(20)
    ]
    prompts = [llm.chat_prompt(p.prompts[0]) for p in parsed]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [p.params for p in parsed])
    wall = time.perf_counter() - t0
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    good = 0
    for i, (p, out) in enumerate(zip(parsed, outs, strict=True)):
        assert p.tools is not None
        call = p.tools.parse_call(out.text)
        ok = call is not None
        if call is not None:
            try:
                jsonschema.validate(json.loads(call[1]), parameters[call[0]])
            except jsonschema.ValidationError:
                ok = False
        good += ok
        print(f"{i:2d} {'ok ' if ok else 'BAD'} {QUESTIONS[i % len(QUESTIONS)]!r:45} -> {out.text}")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{good}/20 calls name a declared function with arguments that validate ({wall:.1f} s; load {load})")


if __name__ == "__main__":
    main()
