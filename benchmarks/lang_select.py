"""``trtbuild.lang`` ``select`` by ranking (one batched submission) vs constrained decoding, on SmolLM2's CPU engine.

    .venv/bin/python benchmarks/lang_select.py [--engine artifacts/demo/smollm2-engine] [--threads 2]

A ~460-token state, then ``select`` among four choices (one of six tokens), each method on a fresh ``LLM`` (an empty
prefix cache). Reported: the pick, wall time, engine steps, computed tokens and prefix-cache hit tokens (the
ranking computes the state once: the other choices' requests wait a step and hit its blocks), and the scores.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from trtbuild import LLM
from trtbuild.lang import ChoicesMethod, function, select

WORDS = ["river", "stone", "market", "lantern", "harbour", "orchard", "signal", "copper", "meadow", "quarry"]
PREFIX = "Report. " + " ".join(WORDS[i % 10] for i in range(450)) + "\nQuestion: which word came first? Answer:"
CHOICES = [" river", " stone", " market", " the lantern by the harbour"]


@function
def pick(s, method):
    s += PREFIX + select("answer", CHOICES, choices_method=method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Path, default=Path("artifacts/demo/smollm2-engine"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    for method in ChoicesMethod:
        llm = LLM(args.engine, num_threads=args.threads)
        start = time.perf_counter()
        state = pick.run(llm, method=method)
        wall = time.perf_counter() - start
        s = llm.stats
        scores = [round(x, 3) for x in state.get_meta_info("answer").normalized_logprobs] if method.ranks else "-"
        print(
            f"{method.name}: {state['answer']!r}, {wall:.2f} s, {s.num_steps} steps, computed "
            f"{s.num_computed_tokens}, hits {s.prefix_cache_hits}, state {len(llm.tokenizer.encode(PREFIX))} tokens, "
            f"normalized logprobs {scores}"
        )


if __name__ == "__main__":
    main()
