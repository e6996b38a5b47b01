"""The native CPU paged-attention kernel alone: microseconds per call and KV bytes read per second.

One ``trtbuild.cpu::PagedAttention`` node (SmolLM2-135M's shape: 9 query heads, 3 KV heads, head size 64, KV blocks
of ``--block-size`` 16) run by onnxruntime with the compiled library, for ``B`` decoding sequences each at context
``--ctx``, with a float32, int8 or fp8 KV cache. Each timed call reads a different layer's pool (``--layers`` pools,
30 by default) as a model step does, so the context comes from DRAM rather than the last call's cache lines.

    .venv/bin/python benchmarks/cpu_kernel.py [--batch 1 64] [--ctx 190] [--threads 2] [--reps 5]
    .venv/bin/python benchmarks/cpu_kernel.py --library OLD.so NEW.so --reps 50   # A/B builds of the kernel
    .venv/bin/python benchmarks/cpu_kernel.py --batch 16 --ctx 0 --new 128   # a prefill chunk of 16 prompts

Prints one line per (batch, KV type, library): the median and the fastest of ``--reps`` passes over all layers (µs
per call), and the KV bytes read per second at the median. Several libraries are timed in one process on the same
pools, their passes interleaved (A, B, A, B, ...): these 2-core machines drift by up to 1.5x within seconds, so
separate runs compare the machine's moods more than the kernels (their outputs are checked to agree on the way).
With several libraries the sessions' workers do not spin between calls (an idle session spinning took the cores of
the one timed: 1.6 ms against 0.9 ms alone on a 2-vCPU Xeon, 2026-12-04), so A/B figures sit a few percent above a
lone build's, and at batch 1 waking the workers dominates (27 us against 17 alone): A/B batch 1 in separate runs.
The pools are on 4 KB pages as the runtime's KV cache (``--pages huge``: numpy's huge pages).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort

from trtbuild.backends.onnxruntime.build.native import single_node_model
from trtbuild.kernels.library import library_path
from trtbuild.plugins.paged_attention import KV_FLOAT, KV_FP8, KV_INT8, PagedAttentionAttrs, rotary_cos_sin_cache
from trtbuild.runtime.kv_cache import lazy_zeros

HQ, HKV, D = 9, 3, 64
DTYPES = {KV_FLOAT: np.float32, KV_INT8: np.int8, KV_FP8: np.uint8}  # an fp8 cache holds E4M3 bit patterns
NAMES = {KV_FLOAT: "float32", KV_INT8: "int8", KV_FP8: "fp8"}


def _session(kv: int, library: str, threads: int, spin: bool) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(library)
    opts.intra_op_num_threads = threads
    if not spin:  # several sessions in one process: idle workers spinning would take the running one's cores
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    model = single_node_model(PagedAttentionAttrs(HQ, HKV, D, D**-0.5, False, kv), rotary=True)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _copy(dst: np.ndarray, src: np.ndarray) -> np.ndarray:
    dst[...] = src
    return dst


def measure(
    batch: int,
    ctx: int,
    kv: int,
    libraries: list[str],
    threads: int,
    layers: int,
    reps: int,
    bs: int = 16,
    new: int = 1,
    small_pages: bool = True,
) -> list[tuple[float, float, float]]:
    """Per library: median and fastest µs per call and KV GB/s read, for ``batch`` sequences of ``new`` tokens
    each (1: decodes) after ``ctx`` cached positions."""
    rng = np.random.default_rng(0)
    blocks_per_seq = (ctx + new + bs - 1) // bs
    num_blocks = batch * blocks_per_seq
    dtype = DTYPES[kv]
    pools = []
    for _ in range(layers):
        if kv == KV_FLOAT:
            k, v = (rng.standard_normal((num_blocks, bs, HKV, D)).astype(np.float32) for _ in range(2))
        else:
            k, v = (rng.integers(0, 100, (num_blocks, bs, HKV, D)).astype(dtype) for _ in range(2))
        if small_pages:  # as the runtime's PagedKVCache holds them (numpy advises huge pages for large arrays)
            k, v = (_copy(lazy_zeros(a.shape, a.dtype), a) for a in (k, v))
        pools.append([ort.OrtValue.ortvalue_from_numpy(a) for a in (k, v)])
    tables = rng.permutation(num_blocks).reshape(batch, blocks_per_seq).astype(np.int64)
    feeds = {
        "qkv": rng.standard_normal((batch * new, (HQ + 2 * HKV) * D)).astype(np.float32),
        "positions": np.tile(np.arange(ctx, ctx + new, dtype=np.int64), batch),
        "block_tables": tables,
        "query_start_loc": np.arange(0, batch * new + 1, new, dtype=np.int64),
        "cos_sin": rotary_cos_sin_cache(ctx + new + 16, D, 10000.0),
    }
    if kv != KV_FLOAT:
        feeds["k_scale"] = feeds["v_scale"] = np.array(0.05, dtype=np.float32)
    runs = []
    for library in libraries:
        sess = _session(kv, library, threads, spin=len(libraries) == 1)
        bindings = []
        for k, v in pools:
            b = sess.io_binding()
            b.bind_ortvalue_input("key_cache", k)
            b.bind_ortvalue_input("value_cache", v)
            for name, arr in feeds.items():
                b.bind_cpu_input(name, arr)
            b.bind_output("out", "cpu")
            bindings.append(b)
        for b in bindings:  # warm-up: thread pool, page faults
            sess.run_with_iobinding(b)
        runs.append((sess, bindings, bindings[0].get_outputs()[0].numpy().copy()))
    for _, _, out in runs[1:]:  # every build computes the same attention (the caches' writes repeat the same values)
        np.testing.assert_allclose(out, runs[0][2], atol=1e-4, rtol=0)
    per_call: list[list[float]] = [[] for _ in runs]
    for _ in range(reps):
        for (sess, bindings, _), times in zip(runs, per_call, strict=True):
            t0 = time.perf_counter()
            for b in bindings:
                sess.run_with_iobinding(b)
            times.append((time.perf_counter() - t0) / layers)
    kv_bytes = 2 * batch * (ctx + new) * HKV * D * np.dtype(dtype).itemsize
    results = []
    for times in per_call:
        us = statistics.median(times) * 1e6
        results.append((us, min(times) * 1e6, kv_bytes / (us * 1e-6) / 1e9))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--ctx", type=int, default=190, help="cached positions per sequence before the decoded token")
    ap.add_argument("--kv", choices=list(NAMES.values()), nargs="+", default=list(NAMES.values()))
    ap.add_argument("--new", type=int, default=1, help="new tokens per sequence (1: decodes; e.g. 128: prefills)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16, help="KV slots per block (the engines' default: 16)")
    ap.add_argument("--layers", type=int, default=30, help="pools cycled through (30: SmolLM2's layers)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--pages",
        choices=["small", "huge"],
        default="small",
        help="the pools on 4 KB pages (as the runtime's KV cache) or on transparent huge pages (numpy's default)",
    )
    ap.add_argument(
        "--library", nargs="+", help="kernel libraries to time, interleaved (default: this machine's build)"
    )
    args = ap.parse_args()
    libraries = args.library or [str(library_path())]
    passes = f"{args.reps} interleaved passes over {args.layers} layers"
    print(f"ctx {args.ctx} + {args.new} new, {args.threads} threads, {passes}")
    for i, library in enumerate(libraries):
        print(f"  [{i}] {library}")
    for batch in args.batch:
        for kv, name in NAMES.items():
            if name in args.kv:
                results = measure(
                    batch,
                    args.ctx,
                    kv,
                    libraries,
                    args.threads,
                    args.layers,
                    args.reps,
                    args.block_size,
                    args.new,
                    small_pages=args.pages == "small",
                )
                for i, (us, fastest, gbs) in enumerate(results):
                    tag = f"  [{i}]" if len(libraries) > 1 else ""
                    print(
                        f"batch {batch:3d}  kv {name:7s}{tag}  {us:9.1f} us/call (fastest {fastest:7.1f})"
                        f"  {gbs:6.1f} GB/s of KV"
                    )


if __name__ == "__main__":
    main()
