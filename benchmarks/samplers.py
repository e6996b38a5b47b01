"""The samplers without whole-row sorts, against the whole-row forms they replaced (same tokens, alternating).

    .venv/bin/python benchmarks/samplers.py [--device cpu|cuda] [--rounds 7] [--json FILE] [--engine DIR ...]

- The torch engines' filters (``trtbuild/backends/torch/sampling.py``) for vocabularies of 49,152 (SmolLM2) and
  128,256 (Llama 3), batches 1 and 64: ``_top_k`` (the k-th largest from ``torch.topk``) and ``_top_p`` (the
  ``TOP_P_CANDIDATES`` most likely tokens sorted, the whole row where they hold too little mass) against a stable
  sort of the whole row (``_top_p_sorted``; top-k by the sorted row's k-th value). On ``--device cuda`` the times
  are CUDA-synchronised.
- The host sampler (``trtbuild/runtime/sampling.py``, the onnxruntime engine's) on 64 rows of 49,152: its
  ``kth_largest`` (a strided sample's threshold, then a partition above it) and ``draw`` (the cumulative weights of
  the kept tokens only) against ``np.partition`` of the whole row and the whole row's cumulative weights.
- ``--engine DIR`` (repeatable): 64 requests of 64 random tokens, 32 new at temperature 0.8 / top_p 0.9, through
  ``LLM(seed=0)`` with the engine's sampler swapped between the two forms each round (an onnxruntime engine: the
  host sampler's; a torch engine: the device filters); output tok/s.

Inputs are LM-like float32 logits (20 likely tokens over a normal tail, temperature 0.8); medians of ``--rounds``.
Each pair is checked to keep the same tokens first. Results: benchmarks/results/2026-12-06-cpu2-samplers.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from trtbuild.backends.torch import sampling as device
from trtbuild.runtime import sampling as host


def sorted_top_k(x: torch.Tensor, k: list[int]) -> torch.Tensor:
    """Top-k by a stable sort of the whole row (the device filter before 2026-12-06)."""
    values = torch.sort(x, dim=-1, descending=True, stable=True).values
    kth = values.gather(1, torch.tensor([n - 1 for n in k], device=x.device)[:, None])
    return x.masked_fill(x < kth, -torch.inf)


def whole_row_draw(row: np.ndarray, u: float, *, filtered: bool = True) -> int:
    """The host's draw before 2026-12-06: the whole row's cumulative weights."""
    cdf = np.cumsum(np.exp(row - row.max()))
    target = min(u * cdf[-1], np.nextafter(cdf[-1], 0.0))
    return min(int(np.searchsorted(cdf, target, side="right")), row.shape[0] - 1)


def whole_row_kth(values: np.ndarray, m: int) -> float:
    n = values.shape[0]
    return float(np.partition(values, n - m)[n - m])


SHIPPED = {"device": (device._top_k, device._top_p), "host": (host.draw, host.kth_largest)}
WHOLE_ROW = {"device": (sorted_top_k, device._top_p_sorted), "host": (whole_row_draw, whole_row_kth)}


@contextmanager
def form(which: dict[str, tuple[Any, Any]]) -> Iterator[None]:
    """Both samplers' module functions set to ``which`` (SHIPPED or WHOLE_ROW) inside, shipped again after."""
    device._top_k, device._top_p = which["device"]
    host.draw, host.kth_largest = which["host"]
    try:
        yield
    finally:
        device._top_k, device._top_p = SHIPPED["device"]
        host.draw, host.kth_largest = SHIPPED["host"]


def timed(fn: Callable[[], Any], dev: str) -> float:
    if dev == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def lm_logits(batch: int, vocab: int) -> torch.Tensor:
    x = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 2.0
    x[:, :20] += 12.0
    return x / 0.8


def compare(name: str, fn: Callable[[], Any], rounds: int, dev: str, **fields: Any) -> dict[str, Any]:
    """``fn`` (returning what it computes) under the whole-row and shipped forms: same result, then the times."""
    with form(WHOLE_ROW):
        before = fn()
    after = fn()
    same = torch.equal(before, after) if isinstance(before, torch.Tensor) else before == after
    assert same, f"{name}: the two forms differ"
    times: dict[str, list[float]] = {"shipped": [], "whole_row": []}
    for _ in range(rounds):
        with form(WHOLE_ROW):
            times["whole_row"].append(timed(fn, dev))
        times["shipped"].append(timed(fn, dev))
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    record = {"case": name, **fields, "shipped_ms": round(ms["shipped"], 3), "whole_row_ms": round(ms["whole_row"], 3),
              "speedup": round(ms["whole_row"] / ms["shipped"], 2)}  # fmt: skip
    print(f"{name:<48}: {ms['shipped']:8.2f} ms (whole row {ms['whole_row']:8.2f} ms, {record['speedup']:.1f}x)",
          flush=True)  # fmt: skip
    return record


class Request:
    """What the host sampler reads of a request (``SamplingRequest``)."""

    def __init__(self, params: host.SamplingParams) -> None:
        self.sampling_params, self.prompt_token_ids, self.output_token_ids = params, [1], [1]
        self.generator = np.random.default_rng(1)


def engine_rounds(engine: str, rounds: int) -> dict[str, Any]:
    """Output tok/s of 64 top-p requests through ``LLM``, the sampler's two forms alternating."""
    from trtbuild.runtime.llm import LLM, SamplingParams

    llm = LLM(engine, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, 64).tolist() for _ in range(64)]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, ignore_eos=True)
    llm.generate(prompts[:8], params)  # warm-up
    tok_s: dict[str, list[float]] = {"shipped": [], "whole_row": []}
    for _ in range(rounds):
        for name, which in (("whole_row", WHOLE_ROW), ("shipped", SHIPPED)):
            with form(which):
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                tok_s[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    print(f"{engine}: 64 requests top_p 0.9: {med['shipped']:.1f} output tok/s (whole row {med['whole_row']:.1f}, "
          f"{med['shipped'] / med['whole_row']:.2f}x); rounds {tok_s}", flush=True)  # fmt: skip
    return {"engine": engine, **{f"{k}_tok_s": [round(t, 1) for t in v] for k, v in tok_s.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="write the records here too")
    parser.add_argument("--engine", action="append", default=[], help="also time 64 requests through LLM")
    args = parser.parse_args()
    records = []
    for vocab in (49152, 128256):
        for batch in (1, 64):
            x = lm_logits(batch, vocab).to(args.device)
            p = torch.full((batch,), 0.9, device=args.device)
            fields = {"vocab": vocab, "batch": batch, "device": args.device}
            cases = {"top_p 0.9": lambda x=x, p=p: device._top_p(x, p),
                     "top_k 50": lambda x=x: device._top_k(x, [50] * len(x))}  # fmt: skip
            for label, fn in cases.items():
                name = f"device {label}, vocab {vocab}, batch {batch}"
                records.append(compare(name, fn, args.rounds, args.device, **fields))
    logits = lm_logits(64, 49152).numpy()
    for label, params in (("top_p 0.9", host.SamplingParams(temperature=0.8, top_p=0.9)),
                          ("top_k 50", host.SamplingParams(temperature=0.8, top_k=50))):  # fmt: skip

        def sample(params: host.SamplingParams = params) -> list[int]:
            return host.Sampler(0).sample(logits, [Request(params) for _ in range(64)]).token_ids

        records.append(compare(f"host {label}, vocab 49152, batch 64", sample, args.rounds, "cpu", vocab=49152))
    for engine in args.engine:
        records.append(engine_rounds(engine, 3))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
