"""Engine step times side by side: onnxruntime engines A, B, ... in one process, their steps interleaved.

    .venv/bin/python benchmarks/engine_steps.py ENGINE_A ENGINE_B [...] [--rounds 5] [--threads 2] [--batch 64]
        [--kinds decode-b1,prefill-128,decode-batch] [--small-pages-too] [--library OLD.so NEW.so]
    perf record -F 2999 -o /tmp/perf.data -- .venv/bin/python benchmarks/engine_steps.py ENGINE \
        --kinds decode-b1 --rounds 50    # then: perf report -i /tmp/perf.data --sort dso,symbol

For each engine, one round times (medians of a few calls each) a batch-1 decode step at a context of ~130 tokens, a
128-token prefill and a decode step of ``--batch`` sequences at that context, all on ``OrtSession`` directly (no
runner, no sampling): the engine's own cost per step kind. Rounds go engine after engine, then again, so that a
machine whose speed drifts (these 2-core machines move by up to 1.5x within minutes) drifts for all of them alike;
the table gives the median over rounds and the fastest round. With more than one session their onnxruntime workers
do not spin between runs (``session.intra_op.allow_spinning`` 0), so that a steady difference between sessions is
the engines' or kernels', not an idle pool's spinning; a lone session runs as the runtime's. Use it for kernel A/B
runs (build the same checkpoint twice, e.g. ``--cpu-linear native`` and ``--cpu-linear onnxruntime``); ``trtbuild
bench`` and ``benchmarks/vs_peers.py`` measure whole generations. ``--library`` opens each engine once per given
build of the native kernel library (e.g. ``g++ -O3 -march=native ... -shared -fPIC -o OLD.so`` of an earlier
``trtbuild/kernels/cpu/*.cc``, all in one command: ``trtbuild.kernels.library.compile_args``): a kernel A/B on
whole steps in one process. Takes about 20 s per engine and round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.config import RuntimeConfig
from trtbuild.runtime.batch import StepBatch
from trtbuild.runtime.kv_cache import bytes_per_block

BLOCKS_PER_SEQ = 10  # 160 cached positions at 16 per block: the 128-token prompt plus the decoded ones
KINDS = ("decode b1", "prefill 128", "decode batch")
KIND_FLAGS = {kind.replace(" ", "-"): kind for kind in KINDS}  # --kinds spells them decode-b1, prefill-128, ...


def _kinds(text: str) -> list[str]:
    unknown = [k for k in text.split(",") if k not in KIND_FLAGS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown step kind {unknown[0]!r} (choose from {', '.join(KIND_FLAGS)})")
    return [KIND_FLAGS[k] for k in text.split(",")]


def _median_s(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engines", nargs="+")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="sequences in the batched decode step")
    parser.add_argument(
        "--kinds",
        type=_kinds,
        default=list(KINDS),
        help=f"step kinds to time, comma-separated: {', '.join(KIND_FLAGS)} [default: all] (one kind and many "
        "--rounds make a steady load to profile, e.g. under perf record)",
    )
    parser.add_argument(
        "--small-pages-too",
        action="store_true",
        help="also time each engine with its weights on 4 KB pages (OrtSession(huge_pages=False)): the A/B of "
        "backends/onnxruntime/huge_pages.py",
    )
    parser.add_argument(
        "--library",
        nargs="+",
        type=Path,
        help="kernel library builds to compare: each engine is opened once per build (default: this machine's)",
    )
    args = parser.parse_args()
    kinds = [k for k in KINDS if k in args.kinds]
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 20000, 128).tolist()
    tables = [list(range(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ)) for i in range(args.batch)]
    cached = tables if "decode batch" in kinds else tables[:1]  # the other kinds read sequence 0 only
    libraries: list[Path | None] = args.library or [None]
    variants = [(e, True, lib) for e in args.engines for lib in libraries]
    variants += [(e, False, lib) for e in args.engines for lib in libraries if args.small_pages_too]
    labels = [e + ("" if huge else " (4 KB pages)") + (f" [{lib}]" if lib else "") for e, huge, lib in variants]
    # Several sessions in one process: an idle session's workers, spinning after its last step, would take the cores
    # of the one being timed (a kernel A/B then measured 1.6 ms against 0.9 ms alone, 2026-12-04).
    quiet = {"session.intra_op.allow_spinning": "0"} if len(variants) > 1 else None
    sessions = []
    for engine, huge, lib in variants:
        config = RuntimeConfig.load(Path(engine))
        per_block = bytes_per_block(config.model, config.build.kv_block_size)
        memory = per_block * (args.batch * BLOCKS_PER_SEQ + 2)  # block 0 unused: ids start at 1
        session = OrtSession(
            engine,
            kv_cache_memory=memory,
            num_threads=args.threads,
            huge_pages=huge,
            kernel_library=lib,
            session_config=quiet,
        )
        for i in range(0, len(cached), 8):  # the 128-token prompt of every sequence a kind reads in the cache
            rows = cached[i : i + 8]
            session.step(StepBatch.build([prompt] * len(rows), [0] * len(rows), rows))
        sessions.append(session)
    cases: dict[str, tuple[int, Callable[[int], StepBatch]]] = {
        "decode b1": (20, lambda i: StepBatch.build([[5]], [128 + i], tables[:1])),
        "prefill 128": (3, lambda i: StepBatch.build([prompt], [0], tables[:1])),
        "decode batch": (5, lambda i: StepBatch.build([[5]] * args.batch, [128 + i] * args.batch, tables)),
    }
    cases = {k: v for k, v in cases.items() if k in kinds}
    results = {e: {k: [] for k in kinds} for e in labels}
    for _ in range(args.rounds):
        for engine, session in zip(labels, sessions, strict=True):
            for kind, (calls, make) in cases.items():
                batches = iter([make(i) for i in range(calls)])
                results[engine][kind].append(_median_s(lambda s=session, b=batches: s.step(next(b)), calls))
    print(f"{args.threads} threads, {args.rounds} interleaved rounds; ms per step, median over rounds (fastest)")
    print("engine | " + " | ".join(k if k != "decode batch" else f"decode b{args.batch}" for k in kinds))
    for engine in labels:
        cells = [f"{1e3 * statistics.median(v):.2f} ({1e3 * min(v):.2f})" for v in results[engine].values()]
        print(f"{engine} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
