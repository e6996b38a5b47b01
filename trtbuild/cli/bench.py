"""``trtbuild bench ENGINE_DIR``: offline throughput/latency of an engine on random token-id prompts.

Every request is ``--shared-prefix-len`` tokens common to all requests followed by ``--input-len`` random tokens
(vLLM's random dataset with a prefix), generates exactly ``--output-len`` tokens (``ignore_eos``; greedy, or
sampled with ``--temperature`` / ``--top-p`` / ``--top-k``), and all arrive at once; ``--concurrency`` caps how
many run together (the LLM's ``max_num_seqs``). The token ids and the sampler's draws come from ``--seed``, so
runs are repeatable. One short warm-up request runs first and is not counted; it starts with the shared prefix,
which is therefore in the prefix cache when the measured requests arrive (as a server's system prompt would be).
A request whose next block another is still computing waits a step to share it
(docs/runner.md, "Engine loop").
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import click

from ..errors import RequestError
from .kv_offload import kv_offload_options
from .run import EngineFlags, engine_options, open_llm


@dataclass(frozen=True)
class BenchWorkload:
    """What ``run_bench`` sends: ``num_requests`` prompts of ``shared_prefix_len + input_len`` tokens, each
    generating ``output_len`` tokens greedily (``temperature`` 0) or sampled with ``temperature`` / ``top_p`` /
    ``top_k`` (``SamplingParams``' meanings; draws seeded from ``seed``, so a run repeats)."""

    num_requests: int
    input_len: int
    output_len: int
    shared_prefix_len: int = 0
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_requests", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise RequestError(f"--{name.replace('_', '-')} must be >= 1")
        if self.shared_prefix_len < 0:
            raise RequestError("--shared-prefix-len must be >= 0")
        self.params()  # the sampling values' checks (RequestError, one line)

    def params(self) -> Any:
        """The requests' ``SamplingParams``."""
        from ..runtime.sampling import SamplingParams

        sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return SamplingParams(**sampling, max_tokens=self.output_len, ignore_eos=True)

    def prompts(self, vocab_size: int) -> list[list[int]]:
        import numpy as np

        rng = np.random.default_rng(self.seed)
        prefix = rng.integers(0, vocab_size, self.shared_prefix_len).tolist()
        return [prefix + rng.integers(0, vocab_size, self.input_len).tolist() for _ in range(self.num_requests)]


@dataclass(frozen=True)
class BenchResult:
    """The figures ``trtbuild bench`` prints (``--json``: this object, as is)."""

    num_requests: int
    prompt_tokens: int
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    kv_blocks_peak: int
    kv_blocks_total: int
    kv_waste_pct: float
    # A model of sliding and full layers (runtime/kv_groups.py): the sliding group's peak and usable blocks (those
    # above are the full layers'); None without one.
    kv_sliding_blocks_peak: int | None
    kv_sliding_blocks_total: int | None
    preemptions: int
    prefix_cache_hit_rate: float
    steps: int
    engine_calls: int
    profile: dict[str, float] | None = None  # --profile: seconds per part of the run (see runtime/profile.py)
    # --kv-offload-*: each tier's counters (name, hits, misses, bytes_loaded, blocks_stored, bytes_stored, evictions)
    kv_offload: list[dict[str, Any]] | None = None


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of the finite ``values``; nan when there are none."""
    import numpy as np

    finite = [v for v in values if math.isfinite(v)]
    return float(np.percentile(finite, q)) if finite else math.nan


def run_bench(llm: Any, workload: BenchWorkload, *, show_progress: bool = False, profile: bool = False) -> BenchResult:
    """Run ``workload`` through ``llm`` (an ``LLM``) after a short warm-up; timings and engine counters.

    ``show_progress``: a bar of finished requests on stderr (when it is a terminal). ``profile``: also split the
    run's time into the runner's phases, the session's work and (when ``llm`` was made with
    ``profile_kernels=True``) onnxruntime's kernels by kind (``BenchResult.profile``)."""
    from ..runtime.profile import Breakdown, SessionTimes
    from ..runtime.sampling import SamplingParams

    prompts = workload.prompts(llm.vocab_size)
    warm_up = [*prompts[0][: workload.shared_prefix_len], 1, 2, 3]  # also puts the shared prefix in the cache
    llm.generate([warm_up], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    llm.reset_stats()
    session_times = getattr(llm.session, "times", SessionTimes())
    before = replace(session_times)
    params = workload.params()
    start = time.perf_counter()
    outputs = _generate_with_progress(llm, prompts, params, show_progress)
    duration = time.perf_counter() - start
    stats = llm.stats
    breakdown = None
    if profile:
        kernel_times = getattr(llm.session, "kernel_times", None)
        kernels = kernel_times(skip_runs=before.calls) if kernel_times and llm.profile_kernels else None
        breakdown = Breakdown.build(duration, stats.num_steps, llm.phase_times, session_times.since(before), kernels)
    metrics = [o.metrics for o in outputs]
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(m.num_output_tokens for m in metrics)
    ttft = [m.ttft * 1000 for m in metrics]
    tpot = [m.tpot * 1000 for m in metrics]
    return BenchResult(
        num_requests=workload.num_requests,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        duration_s=round(duration, 4),
        output_tokens_per_s=round(output_tokens / duration, 2),
        total_tokens_per_s=round((prompt_tokens + output_tokens) / duration, 2),
        ttft_p50_ms=round(percentile(ttft, 50), 2),
        ttft_p99_ms=round(percentile(ttft, 99), 2),
        tpot_p50_ms=round(percentile(tpot, 50), 2),
        tpot_p99_ms=round(percentile(tpot, 99), 2),
        kv_blocks_peak=stats.peak_used_blocks,
        kv_blocks_total=stats.num_blocks,
        kv_waste_pct=round(100 * stats.kv_waste, 2),
        kv_sliding_blocks_peak=stats.peak_used_sliding_blocks,
        kv_sliding_blocks_total=stats.num_sliding_blocks,
        preemptions=stats.num_preemptions,
        prefix_cache_hit_rate=round(stats.prefix_cache_hit_rate, 4),
        steps=stats.num_steps,
        engine_calls=stats.num_engine_calls,
        profile=breakdown.as_dict() if breakdown else None,
        kv_offload=[asdict(t) for t in stats.kv_offload] if stats.kv_offload else None,
    )


def _generate_with_progress(llm: Any, prompts: list[list[int]], params: Any, show: bool) -> list[Any]:
    """``llm.generate(prompts, params)``, with a progress bar when ``show`` (as ``run --input``'s: drawn at once,
    redrawn every step with the tokens/s so far)."""
    from ..progress import Progress

    finished = llm.generate_iter(prompts, params)
    outputs: list[Any] = [None] * len(prompts)
    with Progress(len(prompts), "benchmarking", "req", enabled=None if show else False, work_unit="tok") as bar:
        bar.update(0)
        for done in finished.by_step():
            for i, out in done:
                outputs[i] = out
            if bar.enabled:
                generated, left = finished.tokens()
                bar.update(len(done), work=generated, work_left=left)
    return outputs


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--num-requests", type=int, default=64, show_default=True, help="requests, all arriving at once")
@click.option("--input-len", type=int, default=128, show_default=True, help="random prompt tokens per request")
@click.option("--output-len", type=int, default=128, show_default=True, help="tokens generated per request")
@click.option(
    "--shared-prefix-len",
    type=int,
    default=0,
    show_default=True,
    help="tokens before the random ones, the same in every request",
)
@click.option("--concurrency", type=int, default=None, help="requests running at once [default: engine's batch size]")
@click.option("--no-prefix-caching", is_flag=True, help="disable automatic prefix caching")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the random prompts (and sampling)")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy, else sampled")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="nucleus sampling mass (--temperature > 0)")
@click.option("--top-k", type=int, default=None, help="keep the k most likely tokens [default: all]")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of a table")
@click.option(
    "--profile",
    is_flag=True,
    help="split the time into the runner's work, onnxruntime's kernels by kind and the rest "
    "(runs onnxruntime's profiler, which times every node: up to 2x slower at batch 1; read the shares, and "
    "measure speed without it)",
)
@engine_options
@kv_offload_options
def bench(
    engine_dir: Path,
    num_requests: int,
    input_len: int,
    output_len: int,
    shared_prefix_len: int,
    concurrency: int | None,
    no_prefix_caching: bool,
    seed: int,
    temperature: float,
    top_p: float,
    top_k: int | None,
    as_json: bool,
    profile: bool,
    engine: EngineFlags,
    kv_offload: Any,
) -> None:
    """Measure throughput, latency and KV-cache use on random prompts."""
    workload = BenchWorkload(num_requests, input_len, output_len, shared_prefix_len, seed, temperature, top_p, top_k)
    if concurrency is not None and engine.max_num_seqs is not None:
        raise RequestError("give --concurrency or --max-num-seqs, not both")
    opened = time.perf_counter()
    if concurrency is not None:
        engine = replace(engine, max_num_seqs=concurrency)
    llm = open_llm(
        engine_dir,
        engine,
        flags={"max_num_seqs": "--concurrency"} if concurrency is not None else None,
        enable_prefix_caching=not no_prefix_caching,
        profile_kernels=profile,
        kv_offload=kv_offload,
        seed=seed,
    )
    open_s = round(time.perf_counter() - opened, 2)  # a torch-compile engine compiles here (docs/gpu.md)
    result = run_bench(llm, workload, show_progress=not as_json, profile=profile)
    if as_json:
        fields = {**asdict(workload), **asdict(result), "open_s": open_s}
        click.echo(json.dumps({k: None if isinstance(v, float) and math.isnan(v) else v for k, v in fields.items()}))
        return
    r = result
    sampled = "greedy" if temperature == 0 else f"temperature {temperature}, top_p {top_p}, top_k {top_k or 'all'}"
    click.echo(
        f"{r.num_requests} requests x ({shared_prefix_len} shared + {input_len} in, {output_len} out, {sampled}) "
        f"in {r.duration_s:.2f} s (engine opened in {open_s:.1f} s)"
    )
    click.echo(
        f"  throughput     {r.output_tokens_per_s:10.1f} output tok/s   {r.total_tokens_per_s:10.1f} total tok/s"
    )
    click.echo(f"  TTFT           {r.ttft_p50_ms:10.1f} ms p50         {r.ttft_p99_ms:10.1f} ms p99")
    click.echo(f"  TPOT           {r.tpot_p50_ms:10.1f} ms p50         {r.tpot_p99_ms:10.1f} ms p99")
    click.echo(
        f"  KV cache       {r.kv_blocks_peak:10d} blocks peak    of {r.kv_blocks_total}, {r.kv_waste_pct:.2f}% waste"
    )
    if r.kv_sliding_blocks_peak is not None:
        click.echo(f"  KV sliding     {r.kv_sliding_blocks_peak:10d} blocks peak    of {r.kv_sliding_blocks_total}")
    click.echo(f"  preemptions    {r.preemptions:10d}")
    click.echo(f"  prefix cache   {100 * r.prefix_cache_hit_rate:10.1f}% of prompt tokens hit")
    click.echo(f"  steps          {r.steps:10d}               {r.engine_calls} engine calls")
    for t in r.kv_offload or []:
        click.echo(
            f"  KV offload {t['name']:7s} {t['hits']:6d} hits {t['misses']:6d} misses   "
            f"{t['bytes_loaded'] / 2**20:.1f} MiB loaded, {t['bytes_stored'] / 2**20:.1f} MiB stored"
        )
    if r.profile is not None:
        _print_profile(r)


def _print_profile(r: BenchResult) -> None:
    from ..runtime.profile import Breakdown

    breakdown = Breakdown(r.duration_s, r.steps, r.profile or {})
    click.echo(f"  where the time goes ({r.steps} steps):")
    click.echo(f"    {'part':58s} {'s':>8s} {'ms/step':>9s} {'%':>6s}")
    for part, seconds, per_step, pct in breakdown.rows():
        click.echo(f"    {part:58s} {seconds:8.2f} {per_step:9.2f} {pct:6.1f}")
