"""``trtbuild.lang`` fork(4) with a ~1,000-token shared prefix vs four independent requests, on SmolLM2's CPU engine.

    .venv/bin/python benchmarks/lang_fork.py [--engine artifacts/demo/smollm2-engine] [--rounds 3] [--threads 2]

Issue 37's target: the fork computes the prefix once (the runner's stats say so) and finishes in <= 0.4x the time
of four independent requests. Each round takes a fresh prefix (so nothing is cached from an earlier round) and runs,
alternating which goes first:

- fork: a program appends the prefix, forks 4 branches, each appends its own question and generates 32 tokens
  (greedy, EOS ignored);
- independent: the same four texts (prefix + question) as four requests given to one ``LLM.generate`` call (the
  scheduler's in-batch prefix sharing: the later requests wait a step for the first's prefix blocks);
- independent, no prefix caching: the same on a second ``LLM`` with ``enable_prefix_caching=False`` (each request
  computes the whole prefix).

Reported: wall time, ``llm.stats.num_computed_tokens`` and ``prefix_cache_hits`` of each, medians over rounds, and
the load average (the machine is shared).
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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(args.engine, num_threads=args.threads)
    uncached = LLM(args.engine, num_threads=args.threads, enable_prefix_caching=False)
    load_start = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    kinds = ("fork", "independent", "uncached")
    results: dict[str, list[tuple[float, int, int]]] = {k: [] for k in kinds}
    prefix_tokens = 0
    for r in range(args.rounds):
        prefix = prefix_text(llm, r)
        prefix_tokens = len(llm.tokenizer.encode(prefix))
        print(f"round {r + 1}: prefix {prefix_tokens} tokens, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            # The other kind's prefix is different text: nothing cached from it helps this one.
            text = prefix if kind == "fork" else prefix.replace("Report", "Record", 1)
            engine = uncached if kind == "uncached" else llm
            engine.reset_stats()
            t0 = time.perf_counter()
            if kind == "fork":
                branches.run(engine, prefix=text)
            else:
                engine.generate([text + q for q in QUESTIONS], params)
            wall = time.perf_counter() - t0
            stats = engine.stats
            results[kind].append((wall, stats.num_computed_tokens, stats.prefix_cache_hits))
            print(f"  {kind}: {wall:.2f} s, computed {stats.num_computed_tokens}, hits {stats.prefix_cache_hits}")
    med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in results.items()}
    f, ind, unc = med["fork"], med["independent"], med["uncached"]
    lines = [
        f"# trtbuild.lang fork(4) vs four independent requests, SmolLM2-135M (CPU engine), {datetime.date.today()}",
        "",
        f"`.venv/bin/python benchmarks/lang_fork.py --engine {args.engine} --rounds {args.rounds} "
        f"--threads {args.threads}`: a {prefix_tokens}-token shared prefix, 4 branches x {NEW_TOKENS} new tokens "
        f"(greedy, EOS ignored); medians of {args.rounds} rounds, kinds alternating.",
        "",
        "| | wall s | computed tokens | prefix-cache hit tokens | fork's wall time / this |",
        "|---|---|---|---|---|",
        f"| fork(4) | {f[0]:.2f} | {f[1]:.0f} | {f[2]:.0f} | |",
        f"| 4 requests in one generate call | {ind[0]:.2f} | {ind[1]:.0f} | {ind[2]:.0f} | {f[0] / ind[0]:.2f}x |",
        f"| 4 requests, prefix caching off | {unc[0]:.2f} | {unc[1]:.0f} | {unc[2]:.0f} | {f[0] / unc[0]:.2f}x |",
        "",
        f"Rounds (wall s): {json.dumps({k: [round(x[0], 2) for x in v] for k, v in results.items()})}",
        "",
        f"Machine load (shared 2-core machine): at the start {load_start}, at the end "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
