"""Load generator for OpenAI-compatible servers (in the style of ``vllm bench serve``), through the ``openai`` client.

    .venv/bin/python benchmarks/serve.py --base-url http://127.0.0.1:8000/v1 --tokenizer ENGINE_DIR \\
        --num-requests 64 --input-len 128 --output-len 128 --concurrency 8 [--request-rate 4] [--json]

Sends ``--num-requests`` streamed ``/v1/completions`` requests, each a text prompt of ``--input-len`` random tokens
(vLLM's random dataset: seeded random token ids, decoded, re-encoded and cut to the length), greedy, asking for
``--output-len`` tokens with EOS suppressed (``--ignore-eos field``: vLLM's/trtbuild's ``ignore_eos``;
``logit-bias``: ``logit_bias`` -100 on the EOS token, for servers without the field, e.g. llama.cpp's). Requests
arrive at ``--request-rate`` per second (Poisson) or all at once (``inf``), at most ``--concurrency`` in flight.
One warm-up request runs first and is not counted.

Reports request/s, output and total tok/s, and p50/p90/p99 of TTFT (send to the first chunk), TPOT ((end - first
token) / (output tokens - 1)), ITL (gaps between streamed chunks) and end-to-end latency. Output tokens are the
server's ``usage`` when it sends one in the stream, else the number of chunks (one per token on both servers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


def make_prompts(tokenizer_path: Path, num: int, input_len: int, seed: int) -> tuple[list[str], list[int]]:
    """``num`` text prompts of about ``input_len`` tokens each, and the tokenizer's EOS ids."""
    from tokenizers import Tokenizer

    path = tokenizer_path / "tokenizer.json" if tokenizer_path.is_dir() else tokenizer_path
    tok = Tokenizer.from_file(str(path))
    rng = np.random.default_rng(seed)
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    usable = [i for i in range(tok.get_vocab_size()) if tok.id_to_token(i) not in special]
    prompts = []
    for _ in range(num):
        ids = rng.choice(usable, input_len).tolist()
        for _ in range(8):  # decode -> encode changes the length a little: cut or pad until it settles
            text = tok.decode(ids)
            encoded = tok.encode(text, add_special_tokens=False).ids
            if len(encoded) == input_len:
                break
            ids = encoded[:input_len] + rng.choice(usable, max(0, input_len - len(encoded))).tolist()
        prompts.append(text)
    config = path.with_name("tokenizer_config.json")
    eos: list[int] = []
    if config.is_file():
        entry = json.loads(config.read_text()).get("eos_token")
        content = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(content, str) and tok.token_to_id(content) is not None:
            eos = [tok.token_to_id(content)]
    return prompts, eos


async def one_request(client: Any, args: argparse.Namespace, prompt: str, extra: dict[str, Any]) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = start
    chunks = 0
    try:
        stream = await client.completions.create(
            model=args.model,
            prompt=prompt,
            max_tokens=args.output_len,
            temperature=0.0,
            stream=True,
            **({"stream_options": {"include_usage": True}} if args.include_usage else {}),
            extra_body=extra,
        )
        async for chunk in stream:
            now = time.perf_counter()
            choice = chunk.choices[0] if chunk.choices else None
            # one chunk per token (its text may be empty: an incomplete character); llama.cpp ends with a chunk
            # that only says finish_reason
            if choice is not None and (choice.text or choice.finish_reason is None):
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                chunks += 1
                last = now
            if getattr(chunk, "usage", None) is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.output_tokens = chunk.usage.completion_tokens
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    prompts, eos = make_prompts(args.tokenizer, args.num_requests + 1, args.input_len, args.seed)
    if args.ignore_eos == "field":
        extra: dict[str, Any] = {"ignore_eos": True}
    elif args.ignore_eos == "logit-bias":
        if not eos:
            sys.exit("error: --ignore-eos logit-bias needs the EOS token in tokenizer_config.json")
        extra = {"logit_bias": {str(t): -100 for t in eos}}
    else:
        extra = {}
    async with openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=3600) as client:
        if args.model is None:
            args.model = (await client.models.list()).data[0].id
        warm = await one_request(client, args, prompts[0], extra)
        if not warm.ok:
            sys.exit(f"error: the warm-up request failed ({warm.error})")
        limit = asyncio.Semaphore(args.concurrency or args.num_requests)
        rng = np.random.default_rng(args.seed + 1)

        async def limited(prompt: str) -> RequestResult:
            async with limit:
                return await one_request(client, args, prompt, extra)

        tasks = []
        start = time.perf_counter()
        for prompt in prompts[1:]:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, results, duration)


def summarize(args: argparse.Namespace, results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)

    def pct(values: list[float]) -> dict[str, float | None]:
        finite = [v * 1000 for v in values if math.isfinite(v)]
        if not finite:
            return {"p50": None, "p90": None, "p99": None, "mean": None}
        return {f"p{q}": round(float(np.percentile(finite, q)), 2) for q in (50, 90, 99)} | {
            "mean": round(float(np.mean(finite)), 2)
        }

    return {
        "base_url": args.base_url,
        "model": args.model,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "concurrency": args.concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "input_len": args.input_len,
        "output_len": args.output_len,
        "duration_s": round(duration, 3),
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 2),
        "ttft_ms": pct([r.ttft for r in ok]),
        "tpot_ms": pct([r.tpot for r in ok]),
        "itl_ms": pct([x for r in ok for x in r.itl]),
        "e2e_ms": pct([r.e2e for r in ok]),
    }


def print_table(s: dict[str, Any]) -> None:
    print(f"{s['base_url']}  model {s['model']}")
    print(
        f"{s['completed']}/{s['num_requests']} requests ok, concurrency {s['concurrency'] or 'unbounded'}, "
        f"rate {s['request_rate']}/s, {s['input_len']} in / {s['output_len']} out, {s['duration_s']:.1f} s"
    )
    print(f"  request/s          {s['request_throughput']:10.3f}")
    print(f"  output tok/s       {s['output_throughput']:10.1f}")
    print(f"  total tok/s        {s['total_token_throughput']:10.1f}")
    print(f"  {'(ms)':17s}  {'p50':>9s} {'p90':>9s} {'p99':>9s} {'mean':>9s}")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        row = s[key]
        cells = " ".join(f"{v:9.1f}" if v is not None else f"{'-':>9s}" for v in row.values())
        print(f"  {label:17s}  {cells}")
    for e in s["errors"]:
        print(f"  error: {e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--model", default=None, help="model id [default: the first of /v1/models]")
    p.add_argument("--api-key", default="none")
    p.add_argument("--tokenizer", type=Path, required=True, help="tokenizer.json, or a directory holding one")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight at most [default: all]")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second [default: inf]")
    p.add_argument("--ignore-eos", choices=["field", "logit-bias", "off"], default="field")
    p.add_argument("--no-include-usage", dest="include_usage", action="store_false", help="count chunks instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    for name in ("num_requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0")
    return args


def summarize_run(argv: list[str]) -> dict[str, Any]:
    """Run the load described by ``argv`` (this script's flags) and return the summary without printing it."""
    return asyncio.run(run(parse_args(argv)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    summary = asyncio.run(run(args))
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
    return summary


if __name__ == "__main__":
    main()
