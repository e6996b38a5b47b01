"""The formats ``quant_vs_llamacpp.py`` compares, one ``Row`` each: trtbuild variants quantized (by the ``trtbuild
quantize`` command) and built, llama.cpp GGUFs quantized from the F32 one (``llama_model_quantize`` through
``peers_worker.py``), the published GGUF as it is; and their bits per weight, from the bytes they store."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from peers_common import Failed, Peers, atomic_dir, error, log, stored_tensors

# llama.cpp format -> llama_ftype (llama.h: LLAMA_FTYPE_MOSTLY_*)
GGUF_FTYPES = {"F32": 0, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K_M": 15}
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
    floats, stored = stored_tensors(float_ckpt), stored_tensors(ckpt)

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
