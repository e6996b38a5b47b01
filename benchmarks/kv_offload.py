"""TTFT with the KV offload tier against recompute, on a block pool too small to keep the prefixes (issue 36).

    .venv/bin/python benchmarks/kv_offload.py [--engine artifacts/demo/smollm2-engine] [--threads 2]
        [--doc-len 2000 --questions 16] [--pool-blocks 150] [--chat-turns 20 --chat-conversations 3]
        [--chat-pool-blocks 84] [--workloads document,chat] [--json figures.json]

Two LLMs on the same engine run side by side in one process, request by request (so that the machine's drift hits
both alike): ``recompute`` (no tier) and ``offload`` (a host-memory tier and a disk tier in a temporary directory).
Both have the same small pool, which holds one request's prefix but not all of them.

- document: two documents of ``--doc-len`` random tokens, each asked ``--questions`` questions (16 tokens each), the
  documents alternating, so each evicts the other from the pool; the first question of each document is cold for
  both sides and left out of the medians.
- chat: ``--chat-conversations`` conversations of ``--chat-turns`` turns (48 user tokens, 16 reply tokens each),
  taking turns, on a pool of ``--chat-pool-blocks`` (84: one 20-turn conversation fits, three evict each other from
  about turn 7); every turn resends the whole conversation; turn 1 is left out. A second row keeps only the turns
  whose prefix the recompute side's pool had evicted (it found under half the prompt in its prefix cache).
- process: a second process opened on the offload side's disk tier (or with ``--remote redis://...``, both sides on
  that Redis server alone) answers a new question on a document this
  process computed; its TTFT against this process's recompute of the same prompt.
- restart (with document): a third LLM opened on the offload side's disk tier alone (a new ``serve``, or another
  process) answers a new question on document A: its TTFT against the recompute side's for the same prompt.

Greedy, EOS ignored. TTFT is ``RequestMetrics.ttft`` (queueing to the first token); TPOT the mean time per output
token after the first (the offload side also stores blocks while decoding). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from trtbuild.config import RuntimeConfig
from trtbuild.runtime.kv_cache import bytes_per_block
from trtbuild.runtime.kv_offload import KVOffloadConfig
from trtbuild.runtime.llm import LLM, RequestMetrics, SamplingParams

QUESTION_LEN, USER_LEN, REPLY_LEN = 16, 48, 16
CHILD = """
import json, sys
from trtbuild.runtime.kv_offload import KVOffloadConfig
from trtbuild.runtime.llm import LLM, SamplingParams
engine, directory, threads, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
remote = directory.startswith("redis://")
tier = KVOffloadConfig(url=directory) if remote else KVOffloadConfig(disk_dir=directory, disk=8 << 30)
llm = LLM(engine, num_threads=threads, kv_offload=tier)
out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
print(json.dumps({"ttft": out[0].outputs[0].metrics.ttft, "disk_hits": llm.stats.kv_offload[0].hits}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=Path("artifacts/demo/smollm2-engine"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--doc-len", type=int, default=2000)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=150)
    ap.add_argument("--chat-turns", type=int, default=20)
    ap.add_argument("--chat-conversations", type=int, default=3)
    ap.add_argument("--chat-pool-blocks", type=int, default=84)
    ap.add_argument(
        "--workloads", default="document,chat", help="comma-separated: document (and restart), chat, process"
    )
    ap.add_argument("--remote", default=None, help="redis://HOST:PORT: the offload side uses only this Redis tier")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    config = RuntimeConfig.load(args.engine)
    per_block = bytes_per_block(config.model, config.build.kv_block_size)
    disk_dir = Path(tempfile.mkdtemp(prefix="kv-offload-bench-"))
    offload = KVOffloadConfig(memory=4 << 30, disk_dir=disk_dir, disk=8 << 30)
    if args.remote:
        offload = KVOffloadConfig(url=args.remote)
    rng = np.random.default_rng(0)
    vocab = config.model.vocab_size

    def tokens(n: int) -> list[int]:
        return rng.integers(100, vocab - 100, n).tolist()

    def open_sides(pool_blocks: int) -> dict[str, LLM]:
        memory = (pool_blocks + 1) * per_block
        return {
            "recompute": LLM(args.engine, kv_cache_memory=memory, num_threads=args.threads),
            "offload": LLM(args.engine, kv_cache_memory=memory, num_threads=args.threads, kv_offload=offload),
        }

    figures: dict[str, dict] = {}
    workloads = set(args.workloads.split(","))
    if "document" in workloads:
        sides = open_sides(args.pool_blocks)
        # two documents alternating, each asked every question
        docs = [tokens(args.doc_len), tokens(args.doc_len)]
        questions = [tokens(QUESTION_LEN) for _ in range(args.questions)]
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        for q, question in enumerate(questions):
            for d, doc in enumerate(docs):
                for name, llm in sides.items():
                    m = ask(llm, doc + question, REPLY_LEN)
                    if q > 0:
                        runs[name].append((m.ttft, m.tpot))
                    progress(f"document {d} question {q} {name}: TTFT {m.ttft * 1000:.0f} ms")
        figures["document"] = summary(runs)
        # restart: a fresh LLM on the disk tier only, first request over a known document
        sides["offload"].offloader.close()
        restarted = LLM(
            args.engine,
            kv_cache_memory=(args.pool_blocks + 1) * per_block,
            num_threads=args.threads,
            kv_offload=KVOffloadConfig(disk_dir=disk_dir, disk=8 << 30),
        )
        prompt = docs[0] + tokens(QUESTION_LEN)
        cold = ask(sides["recompute"], prompt, REPLY_LEN).ttft
        warm = ask(restarted, prompt, REPLY_LEN).ttft
        figures["restart"] = {
            "recompute_ttft_ms": round(cold * 1000, 1),
            "offload_ttft_ms": round(warm * 1000, 1),
            "ratio": round(warm / cold, 3),
            "disk_hits": restarted.stats.kv_offload[0].hits,
        }
        figures["document_tiers"] = {
            t.name: {"hits": t.hits, "misses": t.misses} for t in sides["offload"].stats.kv_offload
        }
        del sides, restarted
    if "process" in workloads:
        # a second process on the same disk tier: this one computes a document (storing it), the child answers a
        # new question on it; against this process's recompute of the child's prompt
        sides = open_sides(args.pool_blocks)
        doc, question = tokens(args.doc_len), tokens(QUESTION_LEN)
        ask(sides["offload"], doc + tokens(QUESTION_LEN), REPLY_LEN)
        sides["offload"].offloader.close()
        child = [
            sys.executable,
            "-c",
            CHILD,
            str(args.engine),
            args.remote or str(disk_dir),
            str(args.threads),
            json.dumps(doc + question),
        ]
        other = json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout)
        cold = ask(sides["recompute"], doc + question, REPLY_LEN).ttft
        figures["process"] = {
            "recompute_ttft_ms": round(cold * 1000, 1),
            "offload_ttft_ms": round(other["ttft"] * 1000, 1),
            "ratio": round(other["ttft"] / cold, 3),
            "disk_hits": other["disk_hits"],
        }
        del sides
    if "chat" in workloads:
        sides = open_sides(args.chat_pool_blocks)
        chats: list[list[int]] = [[] for _ in range(args.chat_conversations)]
        runs = {name: [] for name in sides}
        evicted = {name: [] for name in sides}
        for turn in range(args.chat_turns):
            for c, chat in enumerate(chats):
                chat += tokens(USER_LEN)
                replies, cached = {}, 0
                for name, llm in sides.items():
                    out = llm.generate([chat], SamplingParams(temperature=0.0, max_tokens=REPLY_LEN, ignore_eos=True))
                    m = out[0].outputs[0].metrics
                    replies[name] = out[0].outputs[0].token_ids
                    cached = m.num_cached_tokens if name == "recompute" else cached
                    if turn > 0:
                        runs[name].append((m.ttft, m.tpot))
                        if cached < len(chat) / 2:
                            evicted[name].append((m.ttft, m.tpot))
                    progress(f"chat {c} turn {turn} {name}: {len(chat)} tokens, TTFT {m.ttft * 1000:.0f} ms")
                if replies["recompute"] != replies["offload"]:
                    raise SystemExit(f"chat {c} turn {turn}: the two sides' greedy replies differ")
                chat += replies["recompute"]
        figures["chat"] = summary(runs)
        figures["chat_evicted"] = summary(evicted)
        figures["chat_tiers"] = {
            t.name: {"hits": t.hits, "misses": t.misses} for t in sides["offload"].stats.kv_offload
        }
    print_table(figures, args)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


def ask(llm: LLM, prompt: list[int], max_tokens: int) -> RequestMetrics:
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return out[0].outputs[0].metrics


def tier_counts(llm: LLM) -> dict[str, dict[str, int]]:
    return {t.name: {"hits": t.hits, "misses": t.misses} for t in llm.stats.kv_offload}


def summary(runs: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    if not runs["offload"]:
        return {
            "requests": 0,
            **dict.fromkeys(("recompute_ttft_ms", "offload_ttft_ms", "ttft_ratio"), math.nan),
            **dict.fromkeys(("recompute_tpot_ms", "offload_tpot_ms", "tpot_ratio"), math.nan),
        }
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
    rows = {
        "document": f"document {args.doc_len} tok x {args.questions} questions, 2 docs alternating, "
        f"pool {args.pool_blocks} blocks",
        "chat": f"chat, {args.chat_turns} turns x {args.chat_conversations} conversations taking turns, "
        f"pool {args.chat_pool_blocks} blocks: turns 2-{args.chat_turns}",
        "chat_evicted": "chat, the turns whose prefix the pool had evicted",
    }
    for name, label in rows.items():
        if name in figures:
            f = figures[name]
            print(
                f"| {label} | {f['requests']} | {f['recompute_ttft_ms']} | {f['offload_ttft_ms']} | "
                f"{f['ttft_ratio']}x | {f['recompute_tpot_ms']} | {f['offload_tpot_ms']} |"
            )
    for name, label in (
        ("restart", "restart: new LLM on the disk tier, known document"),
        ("process", f"second process on the {'Redis' if args.remote else 'disk'} tier, known document"),
    ):
        if name in figures:
            r = figures[name]
            print(f"| {label} | 1 | {r['recompute_ttft_ms']} | {r['offload_ttft_ms']} | {r['ratio']}x | | |")
    for name in ("document_tiers", "chat_tiers"):
        if name in figures:
            print(f"\n{name}: {figures[name]}")


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
