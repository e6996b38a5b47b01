"""The torch engines' sampler (``DeviceSampler``): its top-k / top-p filters against a sort of the whole row.

    .venv/bin/python benchmarks/device_sampler.py [--device cpu|cuda] [--rounds 7] [--json FILE]

For each vocabulary (SmolLM2's 49,152, Llama 3's 128,256) and batch (1, 64), LM-like float32 logits (20 likely
tokens over a normal tail) go through ``sample_rows``'s filters two ways, alternating, medians of ``--rounds``:
the shipped ones (``_top_k``: the k-th largest by ``torch.topk``; ``_top_p``: only the ``TOP_P_CANDIDATES`` most
likely tokens sorted, the whole row when they hold too little mass) and the whole-row stable sort they replaced
(``_top_p_sorted``, with top-k by the sorted row's k-th value). Each pair is first checked to keep the same tokens.
On a GPU the times are CUDA-synchronised. Prints one line per case and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from trtbuild.backends.torch.sampling import _top_k, _top_p, _top_p_sorted


def sorted_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k by a stable sort of the whole row (the filter before 2026-12-06)."""
    values = torch.sort(x, dim=-1, descending=True, stable=True).values
    return x.masked_fill(x < values[:, k - 1 : k], -torch.inf)


def timed(fn: Callable[[], Any], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="write the records here too")
    args = parser.parse_args()
    records = []
    for vocab in (49152, 128256):
        for batch in (1, 64):
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(batch, vocab, generator=gen) * 2.0
            x[:, :20] += 12.0
            x = (x / 0.8).to(args.device)
            p = torch.full((batch,), 0.9, device=args.device)
            cases = {
                "top_p 0.9": (lambda x=x, p=p: _top_p(x, p), lambda x=x, p=p: _top_p_sorted(x, p)),
                "top_k 50": (lambda x=x: _top_k(x, [50] * len(x)), lambda x=x: sorted_top_k(x, 50)),
            }
            for name, (new, old) in cases.items():
                assert torch.equal(new(), old()), name
                times: dict[str, list[float]] = {"new": [], "old": []}
                for _ in range(args.rounds):
                    times["new"].append(timed(new, args.device))
                    times["old"].append(timed(old, args.device))
                ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                record = {"vocab": vocab, "batch": batch, "filter": name, "device": args.device,
                          "shipped_ms": round(ms["new"], 3), "whole_sort_ms": round(ms["old"], 3),
                          "speedup": round(ms["old"] / ms["new"], 2)}  # fmt: skip
                records.append(record)
                print(f"vocab {vocab:>6} batch {batch:>2} {name:<9}: {ms['new']:8.2f} ms "
                      f"(whole-row sort {ms['old']:8.2f} ms, {record['speedup']:.1f}x)", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
