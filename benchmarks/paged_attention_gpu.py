"""The paged-attention Triton kernel on a CUDA GPU: its speed next to SDPA on the same KV bytes.

    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site .
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/paged_attention_gpu.py [--sweep] [--budget-s 220]

Prints one JSON line per case (and appends them to ``$OUT/paged_attention_gpu.jsonl`` when ``$OUT`` is set), then
a ``done`` line. The cases run in a worker process (``python3 -X faulthandler``) that the script supervises: a case
that raises prints its error; one that kills its worker (a segfault, a lost CUDA context, silence past
``--case-timeout``) prints the exit status and the fault's last lines, and a fresh worker goes on from the next case.
The kernel's correctness on the GPU (the oracle checks, garbage metadata, the AOT form) is a test:
``tests/test_gpu_paged_attention.py`` (``pytest -m gpu``). Cases:

- ``decode`` / ``prefill``: bf16, Llama-8B heads (32 q / 8 kv, head 128) and SmolLM2 heads (9 q / 3 kv, head 64),
  block size 16, scrambled block tables. The kernel (two-kernel and fused forms, default launch choices) against
  ``torch.nn.functional.scaled_dot_product_attention`` on a contiguous cache of the same shape and a device copy of
  the same KV bytes, all in the same run. Decode reports KV-read GB/s, prefill causal TFLOP/s, and
  ``ratio_vs_sdpa`` = SDPA time / kernel time (the issue's targets: >= 0.8 decode batch >= 16 ctx >= 2048,
  >= 0.5 decode batch 1 ctx 8192, >= 0.5 prefill 2048). Each kernel form is timed three ways, so a fixed per-call
  cost shows where it lives: ``*_ms`` CUDA events per call (``triton.testing.do_bench``, L2 flushed), ``*_graph_ms``
  inside a captured CUDA graph (as the engine's decode steps run: no host launch cost; SDPA alike, ``sdpa_graph_ms``
  and ``ratio_graph_vs_sdpa``, target >= 0.5 at batch 1 ctx 1024), ``*_host_ms`` host wall per eager call.
  Each form's output is also checked against the op's float32 torch body on the same inputs (``*_max_err``); the
  ``done`` line names the cases over ``MAX_ERR`` in ``wrong`` (a wrong kernel's time means nothing).
- ``sweep`` (``--sweep``; give it ``--budget-s 600``): on four decode shapes (Llama-8B b1 ctx 8192, b16 / b64 ctx
  2048, SmolLM2 b16 ctx 2048) five tilings at the launcher's split choice, split counts and the fused form at the
  default tiling; on three prefill shapes six tilings. Each timed by events (``ms``) and inside a CUDA graph
  (``graph_ms``); a ``sweep_best`` line per shape names the fastest (by ``graph_ms``): what ``DECODE_TILING``,
  ``PREFILL_TILING`` and ``choose_num_segments`` should become. Each sweep line has its own ``max_err``.

Cases stop (printed as skipped) once ``--budget-s`` seconds have passed, so the run stays under 4 minutes.
``--smoke`` runs tiny shapes on the CPU through Triton's interpreter (sets ``TRITON_INTERPRET=1``): a check of this
script, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtbuild.backends.torch.build.isolate import RESULT_PREFIX, report

LAYOUTS = {"llama8b": (32, 8, 128), "smollm2": (9, 3, 64)}
DECODE = [(1, 1024), (1, 8192), (16, 2048), (16, 8192), (64, 2048), (64, 8192), (256, 1024)]
PREFILL = [(1, 512), (1, 2048), (4, 512), (4, 2048)]
DEVICE, SPEED_DTYPE = "cuda", "bfloat16"  # --smoke: "cpu", "float32" (Triton's interpreter)
START_PREFIX = "CASE-START "  # a worker's line: the case it begins (a crash before its result costs that case)


def sync(torch: Any) -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Case:
    """One timed case: ``kind`` is its JSON lines' ``kind`` (``env``, ``decode``, ``prefill`` or ``sweep``); a sweep
    case carries the ``tiling`` and ``splits`` it forces (None: the launcher's choice) and the kernel form."""

    kind: str
    name: str
    layout: str = ""
    batch: int = 0
    new: int = 0
    ctx: int = 0
    tiling: tuple[int, int, int, int] | None = None  # (block_m, block_n, num_warps, num_stages)
    splits: int | None = None
    fused: bool = False


DECODE_TILINGS = [(16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 4, 3), (16, 128, 4, 3), (32, 64, 4, 2)]
PREFILL_TILINGS = [
    (64, 64, 4, 2),
    (128, 32, 4, 2),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
]
# (block_m, block_n, num_warps, num_stages); decode shapes (layout, batch, context), prefill (layout, batch, tokens)
SWEEP_DECODE = [("llama8b", 1, 8192), ("llama8b", 16, 2048), ("smollm2", 16, 2048), ("llama8b", 64, 2048)]
SWEEP_SPLITS = {("llama8b", 1, 8192): (8, 16, 32, 64), ("llama8b", 16, 2048): (1, 2, 4, 8)}
SWEEP_PREFILL = [("llama8b", 1, 2048), ("llama8b", 4, 2048), ("smollm2", 1, 2048)]


def plan(sweep: bool, smoke: bool) -> list[Case]:
    """Every case of a run, in order; the supervisor and its workers build the same list."""
    if smoke:  # tiny shapes, interpreter: the script's code paths
        return [
            Case("decode", "smoke-decode", "tiny", 2, 1, 40),
            Case("prefill", "smoke-prefill", "tiny", 1, 20, 20),
            Case("sweep", "smoke-sweep", "tiny", 2, 1, 40, (16, 32, 4, 2), 2),
            Case("sweep", "smoke-sweep-fused", "tiny", 2, 1, 40, (16, 32, 4, 2), fused=True),
        ]
    cases = [Case("env", "env")]
    for layout in LAYOUTS:
        cases += [Case("decode", f"{layout}-decode-b{b}-ctx{c}", layout, b, 1, c) for b, c in DECODE]
        cases += [Case("prefill", f"{layout}-prefill-b{b}-n{n}", layout, b, n, n) for b, n in PREFILL]
    if sweep:  # tilings at the launcher's split choice, then split counts and the fused form at the default tiling
        from trtbuild.plugins.paged_attention.triton_kernel import DECODE_TILING as D  # imports no Triton

        default = (D.block_m, D.block_n, D.num_warps, D.num_stages)
        for layout, b, c in SWEEP_DECODE:
            shape = f"{layout}-decode-b{b}-ctx{c}"
            for t in DECODE_TILINGS:
                cases.append(Case("sweep", f"{shape}-{_tag(t)}", layout, b, 1, c, t))
            for s in SWEEP_SPLITS.get((layout, b, c), ()):
                cases.append(Case("sweep", f"{shape}-{_tag(default)}-s{s}", layout, b, 1, c, default, s))
            cases.append(Case("sweep", f"{shape}-{_tag(default)}-fused", layout, b, 1, c, default, fused=True))
        for layout, b, n in SWEEP_PREFILL:
            for t in PREFILL_TILINGS:
                cases.append(Case("sweep", f"{layout}-prefill-b{b}-n{n}-{_tag(t)}", layout, b, n, n, t))
    return cases


def _tag(t: tuple[int, int, int, int]) -> str:
    return f"{t[0]}x{t[1]}w{t[2]}s{t[3]}"


def paged_inputs(torch: Any, hq: int, hkv: int, d: int, batch: int, new: int, ctx: int, bs: int = 16):
    """bf16 GPU tensors of a batch of ``batch`` sequences with ``new`` tokens each ending at context ``ctx``."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    blocks_per_seq = -(-ctx // bs)
    nb = batch * blocks_per_seq
    dt = getattr(torch, SPEED_DTYPE)
    k = torch.randn(nb, bs, hkv, d, device=DEVICE, dtype=dt, generator=gen)
    v = torch.randn(nb, bs, hkv, d, device=DEVICE, dtype=dt, generator=gen)
    tables = torch.randperm(nb, device=DEVICE, generator=gen).reshape(batch, blocks_per_seq)
    positions = (torch.arange(ctx - new, ctx, device=DEVICE)).repeat(batch)
    qsl = torch.arange(0, batch + 1, device=DEVICE) * new
    qkv = torch.randn(batch * new, (hq + 2 * hkv) * d, device=DEVICE, dtype=dt, generator=gen)
    return qkv, k, v, positions, tables, qsl


def bench(torch: Any, fn: Callable[[], Any]) -> float:
    """Milliseconds per call (triton's do_bench, after a compile/warm-up call); one timed call on the CPU."""
    fn()
    sync(torch)
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=40))


def host_ms(torch: Any, fn: Callable[[], Any], calls: int = 50) -> float:
    """Host wall milliseconds per call over ``calls`` back-to-back calls and one final sync: what a caller that
    launches eagerly pays (launch overhead and host-side preparation, or the kernel, whichever is longer)."""
    fn()
    sync(torch)
    calls = calls if DEVICE == "cuda" else 1
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(torch)
    return (time.perf_counter() - t0) * 1e3 / calls


def graph_ms(torch: Any, fn: Callable[[], Any], calls: int = 16, replays: int = 20) -> float | None:
    """Milliseconds per call with ``calls`` calls captured in one CUDA graph, replayed ``replays`` times (CUDA events
    around the replays): the device time of the call without host launch costs, as the engine's decode steps run.
    No L2 flush between calls (unlike ``bench``): compare it with SDPA timed the same way. None on the CPU."""
    if DEVICE != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, allocates) outside the capture, as torch's docs ask
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (calls * replays)


def three_ways(torch: Any, fn: Callable[[], Any], name: str) -> dict[str, float | None]:
    """A call timed three ways (issue 35): CUDA events per call (``bench``), inside a CUDA graph, host wall."""
    graph = graph_ms(torch, fn)
    return {f"{name}_ms": round(bench(torch, fn), 4), f"{name}_graph_ms": None if graph is None else round(graph, 4),
            f"{name}_host_ms": round(host_ms(torch, fn), 4)}  # fmt: skip


def sdpa_ms(torch: Any, hq: int, hkv: int, d: int, batch: int, new: int, ctx: int) -> dict[str, float]:
    """SDPA on a contiguous cache: with ``enable_gqa`` and with the kv heads expanded (whichever backend is faster
    is the baseline: ``sdpa_ms`` is the minimum)."""
    import torch.nn.functional as F

    dt = getattr(torch, SPEED_DTYPE)
    q = torch.randn(batch, hq, new, d, device=DEVICE, dtype=dt)
    k = torch.randn(batch, hkv, ctx, d, device=DEVICE, dtype=dt)
    v = torch.randn_like(k)
    causal = new > 1
    res = {}
    with contextlib.suppress(Exception):  # a backend without GQA support: the expanded form below still runs
        gqa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)  # noqa: E731
        res["sdpa_gqa_ms"] = bench(torch, gqa)
    ke, ve = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    expanded = lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)  # noqa: E731
    res["sdpa_expanded_ms"] = bench(torch, expanded)
    res = {key: round(val, 4) for key, val in res.items()}
    fastest = gqa if res.get("sdpa_gqa_ms", math.inf) <= res["sdpa_expanded_ms"] else expanded
    graph = graph_ms(torch, fastest)
    return {**res, "sdpa_ms": min(res.values()), "sdpa_graph_ms": None if graph is None else round(graph, 4)}


# A timed launch whose output is further than this from the float32 reference (bf16 outputs of size ~0.1-1) is
# reported wrong: its time says nothing. The oracle tests' own limits are tighter; this one only catches a kernel
# that computes garbage on this GPU.
MAX_ERR = 5e-2


def reference_output(torch: Any, qkv: Any, k: Any, v: Any, positions: Any, tables: Any, qsl: Any, cos_sin: Any,
                     attrs: Any) -> Any:  # fmt: skip
    """The op's plain-torch body (float32, the engine's own fallback) on the case's inputs, computed before any
    timed launch; on copies of the caches, so the timed launches start from the same bytes."""
    from trtbuild.backends.torch.ops import paged_attention_torch

    out = paged_attention_torch(qkv, k.clone(), v.clone(), positions, tables, qsl, cos_sin, attrs)
    sync(torch)
    return out.float()


def max_err(torch: Any, out: Any, expected: Any) -> float:
    """The largest absolute difference of the last timed launch's output from the reference."""
    sync(torch)
    return float(f"{(out.float() - expected).abs().max().item():.3g}")


def speed_case(torch: Any, tk: Any, ref: Any, layout: str, batch: int, new: int, ctx: int) -> dict[str, Any]:
    hq, hkv, d = LAYOUTS[layout]
    qkv, k, v, positions, tables, qsl = paged_inputs(torch, hq, hkv, d, batch, new, ctx)
    cos_sin = torch.from_numpy(ref.rotary_cos_sin_cache(ctx, d, theta=5e5)).to(DEVICE)
    attrs = ref.PagedAttentionAttrs(hq, hkv, d, 1 / math.sqrt(d))
    out = torch.empty(qkv.shape[0], hq * d, device=DEVICE, dtype=qkv.dtype)
    res: dict[str, Any] = {"layout": layout, "batch": batch, "new_tokens": new, "context": ctx}
    expected = reference_output(torch, qkv, k, v, positions, tables, qsl, cos_sin, attrs)
    for name, fused in (("kernel", False), ("kernel_fused", True)):
        call = lambda f=fused: tk.paged_attention_triton(  # noqa: E731
            qkv, k, v, positions, tables, qsl, cos_sin, attrs, fused=f, out=out
        )
        res.update(three_ways(torch, call, name))
        res[f"{name}_max_err"] = max_err(torch, out, expected)
    res.update(sdpa_ms(torch, hq, hkv, d, batch, new, ctx))
    kv_bytes = 2 * batch * ctx * hkv * d * k.element_size()
    src = torch.empty(kv_bytes // k.element_size(), device=DEVICE, dtype=k.dtype)
    dst = torch.empty_like(src)
    res["copy_ms"] = round(bench(torch, lambda: dst.copy_(src)), 4)
    res["kv_bytes"] = kv_bytes
    if new == 1:
        for key in ("kernel", "kernel_fused", "sdpa", "copy"):
            res[f"{key}_GBps"] = round(kv_bytes / res[f"{key}_ms"] / 1e6, 1)
    else:
        flops = 4 * batch * hq * d * new * (new + 1) / 2  # causal QK^T + PV
        for key in ("kernel", "kernel_fused", "sdpa"):
            res[f"{key}_TFLOPs"] = round(flops / res[f"{key}_ms"] / 1e9, 1)
    res["ratio_vs_sdpa"] = float(f"{res['sdpa_ms'] / res['kernel_ms']:.3g}")  # 3 significant digits: never 0
    res["ratio_fused_vs_sdpa"] = float(f"{res['sdpa_ms'] / res['kernel_fused_ms']:.3g}")
    if res["sdpa_graph_ms"] is not None:  # both inside CUDA graphs: no host launch cost on either side
        for key, name in (("ratio_graph_vs_sdpa", "kernel"), ("ratio_fused_graph_vs_sdpa", "kernel_fused")):
            res[key] = float(f"{res['sdpa_graph_ms'] / res[f'{name}_graph_ms']:.3g}")
    return res


def sweep_case(torch: Any, tk: Any, ref: Any, case: Case) -> dict[str, Any]:
    """One launch choice on one shape: CUDA events per call (``ms``) and inside a CUDA graph (``graph_ms``, the
    device time without host launch costs, which decides decode tilings: the engine's decode steps are graphs)."""
    hq, hkv, d = LAYOUTS[case.layout]
    qkv, k, v, positions, tables, qsl = paged_inputs(torch, hq, hkv, d, case.batch, case.new, case.ctx)
    cos_sin = torch.from_numpy(ref.rotary_cos_sin_cache(case.ctx, d, theta=5e5)).to(DEVICE)
    attrs = ref.PagedAttentionAttrs(hq, hkv, d, 1 / math.sqrt(d))
    out = torch.empty(qkv.shape[0], hq * d, device=DEVICE, dtype=qkv.dtype)
    tiling = tk.Tiling(*case.tiling)
    call = lambda: tk.paged_attention_triton(  # noqa: E731
        qkv, k, v, positions, tables, qsl, cos_sin, attrs, fused=case.fused, out=out, num_kv_splits=case.splits,
        tiling=tiling,
    )  # fmt: skip
    expected = reference_output(torch, qkv, k, v, positions, tables, qsl, cos_sin, attrs)
    graph = graph_ms(torch, call)
    return {"layout": case.layout, "batch": case.batch, "new_tokens": case.new, "context": case.ctx,
            "tiling": list(case.tiling), "splits": case.splits, "fused": case.fused, "ms": round(bench(torch, call), 4),
            "graph_ms": None if graph is None else round(graph, 4),
            "max_err": max_err(torch, out, expected)}  # fmt: skip


def sweep_best(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per swept shape, the fastest correct launch choice (by ``graph_ms``, else ``ms``): what to set the defaults
    to."""
    shapes: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("kind") == "sweep" and "ms" in r and r["max_err"] <= MAX_ERR:  # a wrong launch is never best
            shapes.setdefault((r["layout"], r["batch"], r["new_tokens"], r["context"]), []).append(r)
    best = []
    for (layout, batch, new, ctx), rows in shapes.items():
        top = min(rows, key=lambda r: r["graph_ms"] if r["graph_ms"] is not None else r["ms"])
        best.append({"kind": "sweep_best", "layout": layout, "batch": batch, "new_tokens": new, "context": ctx,
                     **{k: top[k] for k in ("case", "tiling", "splits", "fused", "ms", "graph_ms")},
                     "of": len(rows)})  # fmt: skip
    return best


def run_case(case: Case, fault: str | None) -> dict[str, Any]:
    """In a worker: one case's fields (imports are cached after the first case)."""
    import torch
    import triton

    from trtbuild.plugins.paged_attention import reference as ref
    from trtbuild.plugins.paged_attention import triton_kernel as tk

    if fault in (case.name, f"{case.name}:hang"):  # --fault: how the tests check that a crash costs one case
        if fault.endswith(":hang"):
            time.sleep(3600)
        os.kill(os.getpid(), signal.SIGSEGV)
    if case.kind == "env":
        props = torch.cuda.get_device_properties(0)
        return {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                "triton": triton.__version__, "python": sys.version.split()[0]}  # fmt: skip
    if case.tiling is None:
        return speed_case(torch, tk, ref, case.layout, case.batch, case.new, case.ctx)
    return sweep_case(torch, tk, ref, case)


def context_lost() -> bool:
    """Whether this process's CUDA context is unusable (a sticky error such as an illegal address): every later
    case would fail, so the worker exits and the supervisor starts a fresh one."""
    import torch

    if DEVICE != "cuda":
        return False
    try:
        torch.cuda.synchronize()
        return False
    except Exception:  # any error here means the context is gone
        return True


def worker(cases: list[Case], first: int, deadline: float, fault: str | None) -> int:
    """Run ``cases[first:]``, printing a start marker and then a result line per case (``isolate.report``)."""
    for index in range(first, len(cases)):
        case = cases[index]
        base = {"index": index, "kind": case.kind, "case": case.name}
        if time.time() > deadline:
            report({**base, "skipped": "time budget spent"})
            continue
        print(f"{START_PREFIX}{index}", flush=True)
        t0 = time.time()
        try:
            report({**base, **run_case(case, fault), "wall_s": round(time.time() - t0, 2)})
        except Exception as e:  # every case reports and the run goes on
            tb = traceback.format_exc().strip().splitlines()[-6:]
            report({**base, "error": f"{type(e).__name__}: {e}"[:500], "trace": tb})
            if context_lost():
                return 3
    return 0


class Supervisor:
    """Runs the cases in a worker process and starts a new worker after the case a crash (a segfault, a lost CUDA
    context, a hang past ``case_timeout``) took down: one such case costs itself, never the rest of the run."""

    def __init__(self, cases: list[Case], worker_args: list[str], budget_s: float, case_timeout: float) -> None:
        self.cases, self.worker_args = cases, worker_args
        self.start = time.time()
        self.deadline = self.start + budget_s
        self.case_timeout = case_timeout
        out = os.environ.get("OUT")
        self.path = Path(out) / "paged_attention_gpu.jsonl" if out else None
        self.records: list[dict[str, Any]] = []

    def emit(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        line = json.dumps(record, default=str)
        print(line, flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(line + "\n")

    def run(self) -> None:
        first = 0
        while first < len(self.cases):
            if time.time() > self.deadline:
                for case in self.cases[first:]:
                    self.emit({"kind": case.kind, "case": case.name, "skipped": "time budget spent"})
                break
            first = self.one_worker(first)
        for best in sweep_best(self.records):
            self.emit(best)
        wrong = [r["case"] for r in self.records  # a NaN error is wrong too (NaN > MAX_ERR is False)
                 if any(k.endswith("max_err") and not v <= MAX_ERR for k, v in r.items())]  # fmt: skip
        self.emit({"kind": "done", "elapsed_s": round(time.time() - self.start, 1), "wrong": wrong})

    def one_worker(self, first: int) -> int:
        """Start a worker at ``cases[first]``; returns the index of the first case it did not finish."""
        cmd = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), *self.worker_args,
               "--worker-from", str(first), "--deadline", repr(self.deadline)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put(None)], daemon=True).start()
        tail: collections.deque[str] = collections.deque(maxlen=20)
        in_flight, done, hung = None, first, False
        while True:
            try:
                line = lines.get(timeout=self.case_timeout)
            except queue.Empty:
                proc.kill()
                hung = True
                break
            if line is None:
                break
            if line.startswith(START_PREFIX):
                in_flight = int(line[len(START_PREFIX) :])
            elif line.startswith(RESULT_PREFIX):
                record = json.loads(line[len(RESULT_PREFIX) :])
                done, in_flight = record.pop("index") + 1, None
                self.emit(record)
            else:
                tail.append(line.rstrip())
        rc = proc.wait()
        if in_flight is None and (rc == 0 or done > first):
            return done  # finished, or left a lost CUDA context behind after reporting its case
        lost = in_flight if in_flight is not None else done  # died before its first case started: count that one
        case = self.cases[lost]
        what = f"timed out after {self.case_timeout:.0f}s without output" if hung else f"worker died (exit status {rc})"
        self.emit({"kind": case.kind, "case": case.name, "error": what, "rc": rc, "trace": list(tail)})
        return lost + 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time a few tilings / split counts")
    parser.add_argument("--budget-s", type=float, default=220.0, help="start no case after this many seconds")
    parser.add_argument("--case-timeout", type=float, default=150.0, help="kill a case silent this many seconds")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run through the Triton interpreter")
    parser.add_argument("--fault", help=argparse.SUPPRESS)  # tests: CASE segfaults its worker, CASE:hang hangs it
    parser.add_argument("--worker-from", type=int, help=argparse.SUPPRESS)  # in a worker: the first case
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # in a worker: the budget's end
    args = parser.parse_args()
    global DEVICE, SPEED_DTYPE
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton's first import (the workers inherit it)
        DEVICE, SPEED_DTYPE = "cpu", "float32"
        LAYOUTS["tiny"] = (4, 2, 16)
    cases = plan(args.sweep, args.smoke)
    if args.worker_from is not None:
        return worker(cases, args.worker_from, args.deadline, args.fault)
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            print(json.dumps({"kind": "env", "error": "no CUDA device"}), flush=True)
            return 2
    flags = [f for f, on in (("--sweep", args.sweep), ("--smoke", args.smoke)) if on]
    flags += ["--fault", args.fault] if args.fault else []  # (a worker's deadline is the supervisor's)
    Supervisor(cases, flags, args.budget_s, args.case_timeout).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
