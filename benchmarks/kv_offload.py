"""TTFT with the KV offload tier against recompute, on a block pool too small to keep the prefixes (issue 36).

    .venv/bin/python benchmarks/kv_offload.py [--engine artifacts/demo/smollm2-engine] [--threads 2]
        [--doc-len 2000 --questions 16] [--chat-turns 20] [--pool-blocks 150] [--json figures.json]

Two LLMs on the same engine run side by side in one process, request by request (so that the machine's drift hits
both alike): ``recompute`` (no tier) and ``offload`` (a host-memory tier and a disk tier in a temporary directory).
Both have the same small pool (``--pool-blocks`` blocks), which holds one request's prefix but not two.

- document: two documents of ``--doc-len`` random tokens, each asked ``--questions`` questions (16 tokens each), the
  documents alternating, so each evicts the other from the pool; the first question of each document is cold for
  both sides and left out of the medians.
- chat: two conversations of ``--chat-turns`` turns (48 user tokens, 16 reply tokens each), alternating; every turn
  resends the whole conversation; turn 1 is left out.
- restart: a third LLM opened on the offload side's disk tier alone (a new ``serve``, or another process) answers a
  new question on document A: its TTFT against the recompute side's for the same prompt.

Greedy, EOS ignored. TTFT is ``RequestMetrics.ttft`` (queueing to the first token); TPOT the mean time per output
token after the first (the offload side also stores blocks while decoding). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from trtbuild.config import RuntimeConfig
from trtbuild.runtime.kv_cache import bytes_per_block
from trtbuild.runtime.kv_offload import KVOffloadConfig
from trtbuild.runtime.llm import LLM, SamplingParams

QUESTION_LEN, USER_LEN, REPLY_LEN = 16, 48, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=Path("artifacts/demo/smollm2-engine"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--doc-len", type=int, default=2000)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--chat-turns", type=int, default=20)
    ap.add_argument("--pool-blocks", type=int, default=150)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    config = RuntimeConfig.load(args.engine)
    per_block = bytes_per_block(config.model, config.build.kv_block_size)
    memory = (args.pool_blocks + 1) * per_block
    disk_dir = Path(tempfile.mkdtemp(prefix="kv-offload-bench-"))
    offload = KVOffloadConfig(memory=4 << 30, disk_dir=disk_dir, disk=8 << 30)
    sides = {
        "recompute": LLM(args.engine, kv_cache_memory=memory, num_threads=args.threads),
        "offload": LLM(args.engine, kv_cache_memory=memory, num_threads=args.threads, kv_offload=offload),
    }
    rng = np.random.default_rng(0)
    vocab = config.model.vocab_size

    def tokens(n: int) -> list[int]:
        return rng.integers(100, vocab - 100, n).tolist()

    figures: dict[str, dict[str, float]] = {}
    # --- document: two documents alternating, each asked every question
    docs = [tokens(args.doc_len), tokens(args.doc_len)]
    questions = [tokens(QUESTION_LEN) for _ in range(args.questions)]
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for q, question in enumerate(questions):
        for d, doc in enumerate(docs):
            for name, llm in sides.items():
                ttft, tpot = ask(llm, doc + question, REPLY_LEN)
                if q > 0:
                    runs[name].append((ttft, tpot))
                progress(f"document {d} question {q} {name}: TTFT {ttft * 1000:.0f} ms")
    figures["document"] = summary(runs)
    # --- chat: two conversations alternating; each turn resends the conversation so far plus a new user message
    chats: list[list[int]] = [[], []]
    runs = {name: [] for name in sides}
    for turn in range(args.chat_turns):
        for c in range(2):
            chats[c] += tokens(USER_LEN)
            replies = {}
            for name, llm in sides.items():
                out = llm.generate([chats[c]], SamplingParams(temperature=0.0, max_tokens=REPLY_LEN, ignore_eos=True))
                m = out[0].outputs[0].metrics
                replies[name] = out[0].outputs[0].token_ids
                if turn > 0:
                    runs[name].append((m.ttft, m.tpot))
                progress(f"chat {c} turn {turn} {name}: {len(chats[c])} tokens, TTFT {m.ttft * 1000:.0f} ms")
            if replies["recompute"] != replies["offload"]:
                raise SystemExit(f"chat {c} turn {turn}: the two sides' greedy replies differ")
            chats[c] += replies["recompute"]
    figures["chat"] = summary(runs)
    # --- restart: a fresh LLM on the disk tier only, first request over a known document
    sides["offload"].offloader.close()
    restarted = LLM(
        args.engine,
        kv_cache_memory=memory,
        num_threads=args.threads,
        kv_offload=KVOffloadConfig(disk_dir=disk_dir, disk=8 << 30),
    )
    prompt = docs[0] + tokens(QUESTION_LEN)
    cold = ask(sides["recompute"], prompt, REPLY_LEN)
    warm = ask(restarted, prompt, REPLY_LEN)
    figures["restart"] = {
        "recompute_ttft_ms": round(cold[0] * 1000, 1),
        "offload_ttft_ms": round(warm[0] * 1000, 1),
        "ratio": round(warm[0] / cold[0], 3),
        "disk_hits": restarted.stats.kv_offload[0].hits,
    }
    stats = sides["offload"].stats
    figures["offload_tiers"] = {t.name: {"hits": t.hits, "misses": t.misses} for t in stats.kv_offload}
    print_table(figures, args)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


def ask(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    m = out[0].outputs[0].metrics
    return m.ttft, m.tpot


def summary(runs: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    ttft = {name: statistics.median(t for t, _ in r) for name, r in runs.items()}
    tpot = {name: statistics.median(p for _, p in r) for name, r in runs.items()}
    return {
        "requests": len(runs["offload"]),
        "recompute_ttft_ms": round(ttft["recompute"] * 1000, 1),
        "offload_ttft_ms": round(ttft["offload"] * 1000, 1),
        "ttft_ratio": round(ttft["offload"] / ttft["recompute"], 3),
        "recompute_tpot_ms": round(tpot["recompute"] * 1000, 2),
        "offload_tpot_ms": round(tpot["offload"] * 1000, 2),
        "tpot_ratio": round(tpot["offload"] / tpot["recompute"], 3),
    }


def print_table(figures: dict[str, dict], args: argparse.Namespace) -> None:
    print("| workload | requests | TTFT recompute ms | TTFT offload ms | ratio | TPOT recompute ms | TPOT offload ms |")
    print("|---|---|---|---|---|---|---|")
    for name, label in (
        ("document", f"document {args.doc_len} tok x {args.questions} questions, 2 docs alternating"),
        ("chat", f"chat, {args.chat_turns} turns x 2 conversations alternating"),
    ):
        f = figures[name]
        print(
            f"| {label} | {f['requests']} | {f['recompute_ttft_ms']} | {f['offload_ttft_ms']} | {f['ttft_ratio']}x | "
            f"{f['recompute_tpot_ms']} | {f['offload_tpot_ms']} |"
        )
    r = figures["restart"]
    print(
        f"| restart: new LLM on the disk tier, known document | 1 | {r['recompute_ttft_ms']} | "
        f"{r['offload_ttft_ms']} | {r['ratio']}x | | |"
    )
    print(f"\npool {args.pool_blocks} blocks; offload tiers: {figures['offload_tiers']}")


def progress(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
