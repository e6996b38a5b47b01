"""Perplexity for ``quant_vs_llamacpp.py``: trtbuild's through ``trtbuild.cli.eval.evaluate``, llama.cpp's from its
logits on the same token ids (``peers_worker.py``'s ``nll`` task), cached in ``--work/accuracy.json``; and the sanity
line comparing the two float references on one window."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import time
from pathlib import Path

import numpy as np
from peers_common import Failed, Peers, error, log
from quant_vs_llamacpp_formats import Row


class AccuracyCache:
    """Perplexities already measured, keyed by system, format, dataset, window shape and the model's mtime."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict:
        """The file as it is now: runs for other formats may share ``--work`` and add to it meanwhile."""
        return json.loads(self.path.read_text()) if self.path.is_file() else {}

    @staticmethod
    def key(row: Row, dataset: str, args: argparse.Namespace) -> str:
        return f"{row.system}|{row.name}|{dataset}|{args.windows}x{args.seq_len}|{row.model.stat().st_mtime_ns}"

    def get(self, row: Row, dataset: str, args: argparse.Namespace) -> float | None:
        return self.read().get(self.key(row, dataset, args))

    def put(self, row: Row, dataset: str, args: argparse.Namespace, ppl: float) -> None:
        data = self.read() | {self.key(row, dataset, args): ppl}
        tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path)


def llamacpp_nll_sums(peers: Peers, gguf: Path, windows: np.ndarray, threads: int) -> list[float]:
    req = {"task": "nll", "model": str(gguf), "windows": windows.tolist(), "threads": threads}
    return peers.request(req)["nll_sums"]


def measure_accuracy(args: argparse.Namespace, rows: list[Row], peers: Peers | None, result: dict) -> None:
    from trtbuild.cli.eval import evaluate
    from trtbuild.config import EvalConfig
    from trtbuild.errors import TrtbuildError
    from trtbuild.eval import eval_windows

    cache = AccuracyCache(args.work / "accuracy.json")
    tokenizer_engine = args.work / "trt-fp32" / "engine"  # eval_windows reads its tokenizer.json
    for dataset in args.datasets:
        cfg = EvalConfig(dataset=dataset, windows=args.windows, seq_len=args.seq_len)
        windows = eval_windows(tokenizer_engine, cfg)
        for row in rows:
            ppl = cache.get(row, dataset, args)
            if ppl is None:
                t = time.perf_counter()
                try:
                    if row.system == "trtbuild":
                        ppl = evaluate(row.model, cfg).perplexity
                    else:
                        sums = llamacpp_nll_sums(peers, row.model, windows, args.eval_threads)
                        ppl = math.exp(sum(sums) / (windows.shape[0] * (args.seq_len - 1)))
                except (TrtbuildError, Failed, subprocess.TimeoutExpired) as exc:
                    error(f"perplexity {row.system} {row.name} {dataset}: {exc}")
                    result["errors"].append(f"perplexity {row.system} {row.name} {dataset}: {exc}")
                    continue
                cache.put(row, dataset, args, ppl)
                log(f"[accuracy] {row.system} {row.name} {dataset}: {ppl:.3f} ({time.perf_counter() - t:.0f}s)")
            row.ppl[dataset] = ppl
    sanity_check(args, rows, peers, result)


def sanity_check(args: argparse.Namespace, rows: list[Row], peers: Peers | None, result: dict) -> None:
    """llama.cpp F32 vs trtbuild fp32 on the first window of the first dataset: the same weights and token ids."""
    from trtbuild.cli.eval import evaluate
    from trtbuild.config import EvalConfig
    from trtbuild.eval import eval_windows

    refs = {r.system: r for r in rows if r.reference}
    if len(refs) < 2 or peers is None:
        return
    cfg = EvalConfig(dataset=args.datasets[0], windows=1, seq_len=args.seq_len)
    trt = evaluate(refs["trtbuild"].model, cfg).perplexity
    window = eval_windows(refs["trtbuild"].model, cfg)
    try:
        nll = llamacpp_nll_sums(peers, refs["llama.cpp"].model, window, args.eval_threads)[0]
        llama = math.exp(nll / (args.seq_len - 1))
    except (Failed, subprocess.TimeoutExpired) as exc:
        error(f"sanity check: {exc}")
        return
    diff = 100 * (llama / trt - 1)
    verdict = "ok" if abs(diff) <= 0.5 else "MISMATCH (more than 0.5%)"
    result["sanity"] = {"dataset": cfg.dataset, "trtbuild_fp32": trt, "llamacpp_f32": llama, "diff_pct": diff}
    result["sanity_line"] = (
        f"sanity: window 0 of {cfg.dataset} ({args.seq_len} tokens): trtbuild fp32 perplexity {trt:.4f}, "
        f"llama.cpp F32 {llama:.4f} ({diff:+.3f}%): {verdict}"
    )
    log(result["sanity_line"])
