"""Blending cached documents into RAG prompts (``trtbuild/runtime/blend.py``) against full recompute (issue 36, item 2).

    PYTHONPATH=. .venv/bin/python benchmarks/kv_blend.py [--engine artifacts/demo/smollm2-engine] [--threads 2]
        [--doc-tokens 500] [--orders 8] [--variants 16:0,64:0,16:1,32:1,64:1] [--chunks-after-head] [--new-tokens 32]

Text: the evaluation split of ``lee_news`` (gensim's test corpus of Australian news, LGPL-2.1; read from the
installed package, not redistributed): four documents of ``--doc-tokens`` tokens (articles joined, cut at that
length), and a fifth article whose first 48 tokens are the question and next 64 tokens the answer span.

A prompt is a fixed head ("Documents:"), the four documents in one of ``--orders`` orders (seeded permutations),
and the question. Two LLMs on the same engine run side by side, request by request (so the machine's drift hits both
alike), both with prefix caching (the head is shared, the documents never are as a prefix):

- recompute: the prompt as plain tokens;
- blend k, last m: ``generate_blended`` with ``recompute_tokens=k`` and ``recompute_last_chunks=m``, after
  ``cache_chunks`` computed each document once (not timed: a RAG service computes its documents when it indexes
  them), from position 0, or after the prompts' head with ``--chunks-after-head`` (``Chunk.context``).

Reported per side, medians over the orders: TTFT (``RequestMetrics.ttft``) and its ratio to recompute; greedy
agreement with recompute over ``--new-tokens`` tokens (positions equal, and outputs equal as a whole); the answer
span's perplexity (teacher-forced: the answer appended to the prompt, ``prompt_logprobs`` from its first token) and
its ratio to recompute's. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
from pathlib import Path

import numpy as np

from trtbuild import LLM, SamplingParams
from trtbuild.calibration_data import Split, load_documents
from trtbuild.runtime.blend import BlendedPrompt, Chunk, cache_chunks, generate_blended

HEAD = "Documents:\n"
QUESTION_TOKENS, ANSWER_TOKENS = 48, 64


def texts(llm: LLM, doc_tokens: int) -> tuple[list[list[int]], list[int], list[int]]:
    """(4 documents, question, answer) as token ids from lee_news' evaluation split."""
    tok = llm.tokenizer
    documents = load_documents("lee_news", Split.EVALUATION)
    articles = [tok.encode(" " + a.strip(), add_special_tokens=False) for a in documents]
    docs, current, i = [], [], 0
    while len(docs) < 4:
        current += articles[i]
        i += 1
        if len(current) >= doc_tokens:
            docs.append(current[:doc_tokens])
            current = []
    while len(articles[i]) < QUESTION_TOKENS + ANSWER_TOKENS:
        i += 1
    last = articles[i]
    return docs, last[:QUESTION_TOKENS], last[QUESTION_TOKENS : QUESTION_TOKENS + ANSWER_TOKENS]


def perplexity(output) -> float:
    scored = [lp.logprob for lp in output.prompt_logprobs if lp is not None]
    return math.exp(-sum(scored) / len(scored))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Path, default=Path("artifacts/demo/smollm2-engine"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--doc-tokens", type=int, default=500)
    parser.add_argument("--orders", type=int, default=8)
    parser.add_argument(
        "--variants", default="16:0,64:0,16:1,32:1,64:1", help="recompute_tokens:recompute_last_chunks, comma-separated"
    )
    parser.add_argument("--chunks-after-head", action="store_true", help="chunks computed after the prompts' head")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    variants = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",")]
    recompute = LLM(args.engine, num_threads=args.threads)
    blended = LLM(args.engine, num_threads=args.threads)
    docs, question, answer = texts(recompute, args.doc_tokens)
    head = recompute.tokenizer.encode(HEAD)  # with BOS, as a plain prompt starts
    chunks = [Chunk(tuple(d), tuple(head) if args.chunks_after_head else ()) for d in docs]
    cache_chunks(blended, chunks)
    rng = np.random.default_rng(0)
    orders = [tuple(rng.permutation(4).tolist()) for _ in range(args.orders)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    warm = head + docs[0][:64]
    recompute.generate([warm], greedy)  # warm-up: the head in both prefix caches, the sessions' first calls
    blended.generate([warm], greedy)
    rows: dict[str, dict[str, list[float]]] = {"recompute": {}}
    for order in orders:
        plain = BlendedPrompt((head, *(Chunk(tuple(docs[i])) for i in order), question))
        start = len(plain.token_ids())
        scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, prompt_logprobs_from=start)
        [ref] = recompute.generate([plain.token_ids()], greedy)
        [ref_score] = recompute.generate([plain.token_ids() + answer], scored)
        _add(rows["recompute"], ref.outputs[0].metrics.ttft, 1.0, 1.0, perplexity(ref_score))
        parts = (head, *(chunks[i] for i in order))
        ask, score = BlendedPrompt((*parts, question)), BlendedPrompt((*parts, question + answer))
        for k, m in variants:
            [out] = generate_blended(blended, [ask], greedy, recompute_tokens=k, recompute_last_chunks=m)
            [out_score] = generate_blended(blended, [score], scored, recompute_tokens=k, recompute_last_chunks=m)
            a, b = np.array(out.outputs[0].token_ids), np.array(ref.outputs[0].token_ids)
            _add(rows.setdefault(f"blend k={k}, last {m} computed", {}), out.outputs[0].metrics.ttft,
                 float((a == b).mean()), float((a == b).all()), perplexity(out_score))  # fmt: skip
    base = rows["recompute"]
    print(f"# Blending cached documents vs recompute, {args.engine.name}, {datetime.date.today()}\n")
    print(f"`{' '.join(['PYTHONPATH=. .venv/bin/python', *sys.argv])}`: 4 documents of {args.doc_tokens} tokens "
          f"(lee_news), {len(orders)} orders, {args.new_tokens} greedy tokens; medians over the orders (ratios: "
          "the median of the per-order ratios).\n")  # fmt: skip
    print("| side | TTFT ms | TTFT / recompute | greedy tokens equal | outputs equal | answer PPL | PPL / recompute |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        ttft_ratio = statistics.median(a / b for a, b in zip(r["ttft"], base["ttft"], strict=True))
        ppl_ratio = statistics.median(a / b for a, b in zip(r["ppl"], base["ppl"], strict=True))
        print(f"| {name} | {1000 * statistics.median(r['ttft']):.0f} | {ttft_ratio:.2f}x | "
              f"{100 * statistics.mean(r['agree']):.0f}% | {int(sum(r['equal']))}/{len(r['equal'])} | "
              f"{statistics.median(r['ppl']):.3f} | {ppl_ratio:.3f}x |")  # fmt: skip
    print(f"\nPer-order answer PPL: { {n: [round(p, 3) for p in r['ppl']] for n, r in rows.items()} }")
    print(f"Machine load: {', '.join(f'{x:.2f}' for x in os.getloadavg())} (the end of the run)")


def _add(row: dict[str, list[float]], ttft: float, agree: float, equal: float, ppl: float) -> None:
    for key, value in (("ttft", ttft), ("agree", agree), ("equal", equal), ("ppl", ppl)):
        row.setdefault(key, []).append(value)


if __name__ == "__main__":
    main()
