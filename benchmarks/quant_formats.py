"""Decode speed at batch 1 and engine size per quantization format, against the float32 engine.

    python benchmarks/quant_formats.py ENGINE_DIR [ENGINE_DIR ...] [--prompt-len 128] [--new-tokens 128]
        [--threads 2] [--rounds 3]

Each engine decodes ``--new-tokens`` greedy tokens after a ``--prompt-len`` prompt through its paged cache
(``OrtSession`` directly: no scheduler, no sampling overhead beyond argmax). Engines are measured in turn,
alternating over ``--rounds`` (the machines are shared and noisy); the report gives the median decode tok/s,
the prefill time, the speed ratio to the first engine and the size on disk. Not a test: numbers for the notes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.config import RuntimeConfig
from trtbuild.runtime.batch import StepBatch
from trtbuild.runtime.kv_cache import bytes_per_block


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def decode_run(session: OrtSession, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens per second) for one greedy generation."""
    bs = session.cache.block_size
    blocks = list(range(1, (len(prompt) + new_tokens) // bs + 2))
    t = time.perf_counter()
    logits = session.step(StepBatch.build([prompt], [0], [blocks]))
    prefill = time.perf_counter() - t
    token, pos = int(logits[0].argmax()), len(prompt)
    t = time.perf_counter()
    for _ in range(new_tokens):
        logits = session.step(StepBatch.build([[token]], [pos], [blocks]))
        token, pos = int(logits[0].argmax()), pos + 1
    return prefill, new_tokens / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engines", type=Path, nargs="+", help="engine directories; the first is the baseline")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 20000, args.prompt_len)]
    sessions = {}
    for engine in args.engines:
        rc = RuntimeConfig.load(engine)
        blocks = (args.prompt_len + args.new_tokens) // rc.build.kv_block_size + 3
        memory = blocks * bytes_per_block(rc.model, rc.build.kv_block_size)
        sessions[engine] = OrtSession(engine, kv_cache_memory=memory, num_threads=args.threads)
        decode_run(sessions[engine], prompt[:16], 4)  # warm-up
    results: dict[Path, list[tuple[float, float]]] = {e: [] for e in args.engines}
    for _ in range(args.rounds):
        for engine, session in sessions.items():
            results[engine].append(decode_run(session, prompt, args.new_tokens))
    base = statistics.median(r[1] for r in results[args.engines[0]])
    print(f"{'engine':40s} {'decode tok/s':>12s} {'x base':>7s} {'prefill s':>9s} {'size MiB':>9s}")
    for engine, runs in results.items():
        tps = statistics.median(r[1] for r in runs)
        prefill = statistics.median(r[0] for r in runs)
        print(f"{engine.name:40s} {tps:12.1f} {tps / base:7.2f} {prefill:9.3f} {dir_size(engine) / 2**20:9.1f}")


if __name__ == "__main__":
    main()
