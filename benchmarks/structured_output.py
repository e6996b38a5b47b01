"""Structured output on SmolLM2's CPU engine: do constrained outputs validate, and what does the grammar cost?

    .venv/bin/python benchmarks/structured_output.py [--engine artifacts/demo/smollm2-engine] [--rounds 3]
        [--threads 2] [--out benchmarks/results/DATE-structured-output.md]

Issue 37's targets: 100% of 50 generations over 10 schemas (nested objects, arrays, enums, bounded numbers,
required / optional fields) parse and validate; decode speed constrained >= 0.8x unconstrained at batch 1 and 16.

1. Validity: 5 chat requests per schema (temperature 0.7, seeds 0-4, ``max_tokens`` 256), all 50 in one
   ``generate`` call; each output is parsed with ``json.loads`` and validated with ``jsonschema`` (else by hand:
   types, required keys, enums and bounds).
2. Speed, in the same process, constrained and unconstrained alternating round by round (medians over rounds):
   the unconstrained twin of each constrained request has the same prompt and ``max_tokens`` = the constrained
   output's length with EOS ignored, so both generate the same number of tokens in the same batch shapes.
   Batch 1: ``RequestMetrics.decode_tokens_per_s`` (tokens after the first / their time) of 4 requests one at a
   time; batch 16: 16 requests submitted together, output tokens / wall time after the first step.
3. The grammar's own cost from ``LLM.grammars.times``: mask computation on the worker thread (overlapping the
   engine step), the engine loop's wait for it, and masking + advancing the matchers.

The machine is shared: ``uptime``'s load average is printed beside the figures. Takes about 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from trtbuild import LLM, SamplingParams
from trtbuild.runtime.grammar import GrammarTimes

STR = {"type": "string", "maxLength": 40}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "a fictional person",
        {
            "type": "object",
            "properties": {
                "name": STR,
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": STR,
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    (
        "a postal address",
        {
            "type": "object",
            "properties": {
                "street": STR,
                "city": STR,
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "UK", "FR", "DE", "JP"]},
            },
            "required": ["street", "city", "zip", "country"],
            "additionalProperties": False,
        },
    ),
    (
        "a product in a shop",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1},
                "name": STR,
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 5},
                "in_stock": {"type": "boolean"},
            },
            "required": ["id", "name", "price", "in_stock"],
            "additionalProperties": False,
        },
    ),
    (
        "the weather in a city with a three-day forecast",
        {
            "type": "object",
            "properties": {
                "city": STR,
                "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                "forecast": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                            "high": {"type": "number", "minimum": -50, "maximum": 60},
                            "low": {"type": "number", "minimum": -50, "maximum": 60},
                        },
                        "required": ["day", "high", "low"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["city", "temperature_c", "conditions"],
            "additionalProperties": False,
        },
    ),
    (
        "an online order",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": {
                        "type": "object",
                        "properties": {"sku": STR, "qty": {"type": "integer", "minimum": 1, "maximum": 10}},
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                },
                "total": {"type": "number", "minimum": 0},
                "notes": STR,
            },
            "required": ["order_id", "items", "total"],
            "additionalProperties": False,
        },
    ),
    (
        "a book",
        {
            "type": "object",
            "properties": {
                "title": STR,
                "author": {
                    "type": "object",
                    "properties": {"first": STR, "last": STR},
                    "required": ["first", "last"],
                    "additionalProperties": False,
                },
                "year": {"type": "integer", "minimum": 1450, "maximum": 2026},
                "genres": {
                    "type": "array",
                    "items": {"enum": ["fiction", "history", "science", "poetry", "mystery"]},
                    "maxItems": 3,
                },
            },
            "required": ["title", "author", "year"],
            "additionalProperties": False,
        },
    ),
    (
        "a conference event",
        {
            "type": "object",
            "properties": {
                "name": STR,
                "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                "attendees": {"type": "integer", "minimum": 0, "maximum": 1000},
                "online": {"type": "boolean"},
                "location": {
                    "type": "object",
                    "properties": {"city": STR, "venue": STR},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "date", "attendees", "online"],
            "additionalProperties": False,
        },
    ),
    (
        "a movie review",
        {
            "type": "object",
            "properties": {
                "movie": STR,
                "score": {"type": "integer", "minimum": 1, "maximum": 10},
                "pros": {"type": "array", "items": STR, "maxItems": 3},
                "cons": {"type": "array", "items": STR, "maxItems": 3},
                "recommend": {"type": "boolean"},
            },
            "required": ["movie", "score", "recommend"],
            "additionalProperties": False,
        },
    ),
    (
        "a service configuration",
        {
            "type": "object",
            "properties": {
                "version": {"enum": ["1.0", "2.0"]},
                "debug": {"type": "boolean"},
                "retries": {"type": "integer", "minimum": 0, "maximum": 5},
                "timeout_s": {"type": "number", "minimum": 0.1, "maximum": 60},
                "servers": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {"host": STR, "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
                        "required": ["host", "port"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["version", "debug", "retries", "servers"],
            "additionalProperties": False,
        },
    ),
    (
        "a multiple-choice quiz question",
        {
            "type": "object",
            "properties": {
                "question": {"type": "string", "maxLength": 80},
                "options": {"type": "array", "items": STR, "minItems": 2, "maxItems": 4},
                "answer_index": {"type": "integer", "minimum": 0, "maximum": 3},
                "difficulty": {"enum": ["easy", "medium", "hard"]},
            },
            "required": ["question", "options", "answer_index", "difficulty"],
            "additionalProperties": False,
        },
    ),
]
PER_SCHEMA = 5
MAX_TOKENS = 256


def validate(value: Any, schema: dict[str, Any]) -> None:
    """``jsonschema.validate`` when installed; else a hand check of the keywords SCHEMAS use (raises ValueError)."""
    try:
        import jsonschema
    except ImportError:
        _check(value, schema, "$")
        return
    jsonschema.validate(value, schema)


def _check(value: Any, schema: dict[str, Any], where: str) -> None:
    def fail(why: str) -> None:
        raise ValueError(f"{where}: {why}")

    if "enum" in schema and value not in schema["enum"]:
        fail(f"{value!r} not in {schema['enum']}")
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}
    if kind is not None and (not isinstance(value, types[kind]) or (kind in ("integer", "number") and value is True)):
        fail(f"not {kind}")
    if ("minimum" in schema and value < schema["minimum"]) or ("maximum" in schema and value > schema["maximum"]):
        fail(f"{value} out of bounds")
    if kind == "string" and len(value) > schema.get("maxLength", len(value)):
        fail("too long")
    if kind == "array":
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            fail("wrong length")
        for i, item in enumerate(value):
            _check(item, schema.get("items", {}), f"{where}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        missing = [k for k in schema.get("required", []) if k not in value]
        extra = [k for k in value if k not in props] if schema.get("additionalProperties") is False else []
        if missing or extra:
            fail(f"missing {missing}, extra {extra}")
        for k, v in value.items():
            if k in props:
                _check(v, props[k], f"{where}.{k}")


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Path, default=Path("artifacts/demo/smollm2-engine"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_start = load()

    llm = LLM(args.engine, num_threads=args.threads)
    prompts, params = [], []
    for what, schema in SCHEMAS:
        message = f"Describe {what} as a JSON object with these fields: {', '.join(schema['properties'])}."
        prompt = llm.chat_prompt([{"role": "user", "content": message}])
        for seed in range(PER_SCHEMA):
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0.7, seed=seed, max_tokens=MAX_TOKENS, json_schema=schema))
    log(f"[validity] {len(prompts)} generations over {len(SCHEMAS)} schemas ({load()})")
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    validity_s = time.perf_counter() - t0
    failures = []
    for i, (out, p) in enumerate(zip(outs, params, strict=True)):
        try:
            validate(json.loads(out.text), p.json_schema)
        except Exception as e:  # JSONDecodeError, jsonschema.ValidationError, ValueError
            failures.append(f"{i} ({SCHEMAS[i // PER_SCHEMA][0]}, {out.finish_reason.value}): {str(e)[:120]!r}")
    valid = len(outs) - len(failures)
    lengths = [len(o.token_ids) for o in outs]
    log(f"  {valid}/{len(outs)} valid in {validity_s:.1f}s; output tokens median {statistics.median(lengths)}")
    for f in failures:
        log("  invalid:", f)
    examples = [outs[i * PER_SCHEMA].text for i in range(3)]

    # Speed: constrained requests and their unconstrained twins (same prompt, same length, EOS ignored).
    def twin(p: SamplingParams, n: int) -> SamplingParams:
        return SamplingParams(temperature=0.7, seed=p.seed, max_tokens=n, ignore_eos=True)

    b1 = [PER_SCHEMA * k for k in (0, 3, 6, 9)]  # one request of four different schemas
    b16 = list(range(0, 50, 3))[:16]
    speed: dict[str, list[float]] = {k: [] for k in ("b1 c", "b1 u", "b16 c", "b16 u")}
    llm.grammars.times = GrammarTimes()  # count the speed runs only
    for r in range(args.rounds):
        log(f"[speed] round {r + 1}/{args.rounds} ({load()})")
        for constrained in (True, False) if r % 2 == 0 else (False, True):
            tag = "c" if constrained else "u"
            rates = []
            for i in b1:
                p = params[i] if constrained else twin(params[i], lengths[i])
                rates.append(llm.generate([prompts[i]], p)[0].metrics.decode_tokens_per_s)
            speed[f"b1 {tag}"].append(statistics.median(rates))
            ps = [params[i] if constrained else twin(params[i], lengths[i]) for i in b16]
            t0 = time.perf_counter()
            batch = llm.generate([prompts[i] for i in b16], ps)
            wall = time.perf_counter() - t0
            first = max(o.metrics.ttft for o in batch)  # every request's prefill and first token are in
            tokens = sum(len(o.token_ids) - 1 for o in batch)
            speed[f"b16 {tag}"].append(tokens / (wall - first))
            log(f"  {tag}: b1 {speed[f'b1 {tag}'][-1]:.1f} tok/s, b16 {speed[f'b16 {tag}'][-1]:.1f} tok/s")
    med = {k: statistics.median(v) for k, v in speed.items()}
    times = llm.grammars.times
    per_step_ms = {k: 1000 * getattr(times, k) / max(times.steps, 1) for k in ("masks", "wait", "apply")}
    finish_load = load()

    lines = [
        f"# Structured output on SmolLM2-135M (CPU engine), {datetime.date.today()}",
        "",
        f"`.venv/bin/python benchmarks/structured_output.py --engine {args.engine} --rounds {args.rounds} "
        f"--threads {args.threads}`; grammar library llguidance; engine `{args.engine}` (fp32, onnxruntime).",
        "",
        "## Validity",
        f"{valid}/{len(outs)} outputs parse and validate ({'jsonschema' if _has_jsonschema() else 'hand checks'}) over "
        f"{len(SCHEMAS)} schemas x {PER_SCHEMA} seeds (temperature 0.7, max_tokens {MAX_TOKENS}); output length "
        f"median {statistics.median(lengths)} tokens, max {max(lengths)}; all 50 in one batch in {validity_s:.1f} s.",
        *(f"- invalid: {f}" for f in failures),
        "",
        "## Decode speed, constrained vs unconstrained (same prompts and lengths; medians of "
        f"{args.rounds} alternating rounds)",
        "",
        "| batch | constrained tok/s | unconstrained tok/s | ratio | target |",
        "|---|---|---|---|---|",
        f"| 1 (per request) | {med['b1 c']:.1f} | {med['b1 u']:.1f} | {med['b1 c'] / med['b1 u']:.2f}x | >= 0.8x |",
        f"| 16 (whole batch) | {med['b16 c']:.1f} | {med['b16 u']:.1f} | {med['b16 c'] / med['b16 u']:.2f}x "
        "| >= 0.8x |",
        "",
        f"Rounds: {json.dumps({k: [round(x, 1) for x in v] for k, v in speed.items()})}",
        "",
        f"Grammar cost per constrained step ({times.steps} steps, {times.rows} masks): masks computed on the worker "
        f"thread {per_step_ms['masks']:.3f} ms (overlapping the engine step), engine loop waiting for them "
        f"{per_step_ms['wait']:.3f} ms, masking the logits + advancing the matchers {per_step_ms['apply']:.3f} ms.",
        "",
        f"Machine load (shared 2-core machine): at the start {load_start}, at the end {finish_load}.",
        "",
        "Examples:",
        *(f"- `{e}`" for e in examples),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
        log(f"wrote {args.out}")


def _has_jsonschema() -> bool:
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
