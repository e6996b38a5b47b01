"""``trtbuild.lang`` fork(4) with a ~1,000-token shared prefix vs four independent requests, on SmolLM2's CPU engine.

    .venv/bin/python benchmarks/lang_fork.py [--engine artifacts/demo/smollm2-engine] [--rounds 3] [--threads 2]

Issue 37's target: the fork computes the prefix once (the runner's stats say so) and finishes in <= 0.4x the time
of four independent requests. Each round takes a fresh prefix (so nothing is cached from an earlier round) and runs,
alternating which goes first:

- fork: a program appends the prefix, forks 4 branches, each appends its own question and generates 32 tokens
  (greedy, EOS ignored);
- independent: the same four texts (prefix + question) as four requests given to one ``LLM.generate`` call.

Reported: wall time, ``llm.stats.num_computed_tokens`` and ``prefix_cache_hits`` of each, medians over rounds, and
the load average (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from trtbuild import LLM, SamplingParams
from trtbuild.lang import function, gen

NEW_TOKENS = 32
QUESTIONS = [" Question: who? Answer:", " Question: where? Answer:", " Question: when? Answer:", " Question: why?"]


def prefix_text(llm: LLM, round_index: int, target_tokens: int = 1000) -> str:
    words = ["river", "stone", "market", "lantern", "harbour", "orchard", "signal", "copper", "meadow", "quarry"]
    text, i = f"Report {round_index}.", 0
    while len(llm.tokenizer.encode(text)) < target_tokens:
        text += f" The {words[(i * 7 + round_index) % 10]} near the {words[(i * 3 + 1) % 10]} was noted at {i}."
        i += 1
    return text


@function
def branches(s, prefix):
    s += prefix
    forks = s.fork(len(QUESTIONS))
    for f, q in zip(forks, QUESTIONS, strict=True):
        f += q + gen("answer", max_tokens=NEW_TOKENS, ignore_eos=True)
    forks.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Path, default=Path("artifacts/demo/smollm2-engine"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.engine, num_threads=args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results: dict[str, list[tuple[float, int, int]]] = {"fork": [], "independent": []}
    prefix_tokens = 0
    for r in range(args.rounds):
        prefix = prefix_text(llm, r)
        prefix_tokens = len(llm.tokenizer.encode(prefix))
        print(f"round {r + 1}: prefix {prefix_tokens} tokens, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
        for kind in ("fork", "independent") if r % 2 == 0 else ("independent", "fork"):
            # The other kind's prefix is different text: nothing cached from it helps this one.
            text = prefix if kind == "fork" else prefix.replace("Report", "Record", 1)
            llm.reset_stats()
            t0 = time.perf_counter()
            if kind == "fork":
                branches.run(llm, prefix=text)
            else:
                llm.generate([text + q for q in QUESTIONS], params)
            wall = time.perf_counter() - t0
            stats = llm.stats
            results[kind].append((wall, stats.num_computed_tokens, stats.prefix_cache_hits))
            print(f"  {kind}: {wall:.2f} s, computed {stats.num_computed_tokens}, hits {stats.prefix_cache_hits}")
    med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in results.items()}
    f, ind = med["fork"], med["independent"]
    print(f"\nprefix ~{prefix_tokens} tokens, 4 branches x {NEW_TOKENS} new tokens; medians of {args.rounds} rounds")
    print("| | wall s | computed tokens | prefix-cache hit tokens |")
    print("|---|---|---|---|")
    print(f"| fork(4) | {f[0]:.2f} | {f[1]:.0f} | {f[2]:.0f} |")
    print(f"| 4 independent requests | {ind[0]:.2f} | {ind[1]:.0f} | {ind[2]:.0f} |")
    print(f"| ratio | {f[0] / ind[0]:.2f}x (target <= 0.4x) | {f[1] / ind[1]:.2f}x | |")
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
