"""The systems and variants ``vs_peers.py`` compares, and its table: the medians of a run's samples, or of several
partial runs' ``--json`` files merged (``vs_peers.py --merge``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

# What is compared: vs_peers.py prepares and measures these; they are the table's rows and columns.
PRECISIONS = ("fp32", "int8", "int4")
# trtbuild variant -> (precision, quantize flags or None for float32). The CLI_DEFAULTS are what a user gets from
# `trtbuild quantize --qformat F` with nothing else (every linear quantized, the LM head int8 weight-only); the
# others are tuned variants, and "+fhead" ones the LM head kept in float (`--exclude lm_head`, the default before
# 2026-12-04), to show what it costs.
TRT_VARIANTS = {
    "fp32": ("fp32", None),
    "int8_wo": ("int8", ["--qformat", "int8_wo"]),
    "int8_sq": ("int8", ["--qformat", "int8_sq"]),
    "int8_pt": ("int8", ["--qformat", "int8_sq", "--activation-scales", "per_token"]),
    "int8_wo+fhead": ("int8", ["--qformat", "int8_wo", "--exclude", "lm_head"]),
    "int4_awq": ("int4", ["--qformat", "int4_awq"]),
    "int4_wo": ("int4", ["--qformat", "int4_wo", "--group-size", "128"]),
    "int4_awq+fhead": ("int4", ["--qformat", "int4_awq", "--exclude", "lm_head"]),
}
CLI_DEFAULTS = ("fp32", "int8_wo", "int8_sq", "int4_awq")
GGUF_VARIANTS = {"fp32": ("F32", 0), "int8": ("Q8_0", 7), "int4": ("Q4_0", 2)}  # precision -> (name, llama_ftype)
SYSTEMS = ("trtbuild", "ort", "llama")
TITLES = {"trtbuild": "trtbuild", "ort": "onnxruntime-genai 0.18", "llama": "llama.cpp (llama-cpp-python 0.3.36)"}
CHECK_TOKENS = 16
MATVEC_COPIES = 8  # 905 MB a pass: beyond any L3 (a 2-vCPU Xeon VM kept one 113 MB matrix in its L3: 51 GB/s)


# ---------------------------------------------------------------- the table


def median(samples: list[dict], metric: str, system: str, variant: str, batch: int) -> float | None:
    values = [
        s["value"]
        for s in samples
        if s["metric"] == metric and s["system"] == system and s["variant"] == variant and s["batch"] == batch
    ]
    return statistics.median(values) if values else None


def fmt(value: float | None, scale: float = 1.0, unit: str = "") -> str:
    if value is None:
        return "—"
    v = value * scale
    return f"{v:.0f}{unit}" if v >= 100 else f"{v:.1f}{unit}"


def precision_of(check: dict) -> str:
    return TRT_VARIANTS[check["variant"]][0] if check["system"] == "trtbuild" else check["variant"]


def check_cell(check: dict) -> str:
    verdict = "yes" if check["matching"] == check["of"] else f"no (first {check['matching']} match)"
    return verdict + (f" ({check['variant']})" if check["system"] == "trtbuild" and check["variant"] != "fp32" else "")


def table(result: dict) -> str:
    """The markdown table of medians (rows with no figure left out), then bandwidth, conditions and errors."""
    s, checks = result["samples"], result["checks"]
    meta = result.get("meta", {})
    batches = sorted({x["batch"] for x in s if x["metric"] == "output_tok_s"})

    def cell(system: str, metric: str, precision: str, sizes: list[int], scale: float = 1.0, unit: str = "") -> str:
        """One system's medians for one precision: per variant, the figures for ``sizes`` joined by ' / '."""
        variants = [v for v, (q, _) in TRT_VARIANTS.items() if q == precision] if system == "trtbuild" else [precision]
        parts = []
        for v in variants:
            figures = [median(s, metric, system, v, b) for b in sizes]
            if any(f is not None for f in figures):
                label = GGUF_VARIANTS[precision][0] if system == "llama" else ""
                if system == "trtbuild":
                    label = f"{v}, CLI default" if v in CLI_DEFAULTS else v
                shown = " / ".join(fmt(f, scale, unit) for f in figures)
                parts.append(f"{shown} ({label})" if label and precision != "fp32" else shown)
        return ", ".join(parts) or "—"

    rows = [f"| | {TITLES['trtbuild']} | {TITLES['ort']} | {TITLES['llama']} |", "|---|---|---|---|"]

    def row(label: str, cells: list[str]) -> None:
        if any(c != "—" for c in cells):
            rows.append(f"| {label} | {' | '.join(cells)} |")

    for p in PRECISIONS:
        row(f"decode tok/s, batch 1, {p}", [cell(x, "decode_tok_s", p, [1]) for x in SYSTEMS])
    for p in PRECISIONS:
        row(
            f"TTFT, {meta.get('prompt_len', 128)}-token prompt, {p}",
            [cell(x, "ttft_s", p, [1], 1000, " ms") for x in SYSTEMS],
        )
    sizes = " / ".join(map(str, batches))
    for p in PRECISIONS:
        trt, ort = cell("trtbuild", "output_tok_s", p, batches), cell("ort", "output_tok_s", p, batches)
        row(f"output tok/s, {sizes} prompts at once, {p}", [trt, ort + " (static batch)" if ort != "—" else ort, "—"])
    for p in PRECISIONS if checks else ():
        cells = [
            ", ".join(check_cell(c) for c in checks if c["system"] == sys_ and precision_of(c) == p) or "—"
            for sys_ in SYSTEMS
        ]
        row(f"first {CHECK_TOKENS} greedy tokens = trtbuild fp32's, {p}", cells)
    lines = rows
    bw = median(s, "bandwidth_gb_s", "machine", "", 0)
    wb = result.get("fp32_weight_bytes")
    if bw is not None:
        what = f"{MATVEC_COPIES} x 113 MB fp32 matrices x vector from DRAM, onnxruntime"
        lines.append(f"\n2-thread mat-vec read bandwidth: {bw:.1f} GB/s ({what})")
        if wb:
            lines.append(f"fp32 weight-read ceiling at batch 1: {bw * 1e9 / wb:.0f} tok/s ({wb / 1e6:.0f} MB a token)")
    if meta:
        lines.append(
            f"{meta.get('date', '')}; {meta.get('threads')} threads each; medians of {meta.get('rounds')} interleaved "
            f"rounds; {meta.get('prompt_len')} prompt tokens, {meta.get('new_tokens')} new greedy, EOS ignored; "
            f"peers: {meta.get('peer_versions', {})}; took {meta.get('elapsed_s', 0) / 60:.1f} min"
        )
    for e in result.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


def merge(paths: list[Path]) -> dict:
    out: dict = {"samples": [], "checks": [], "errors": []}
    for path in paths:
        part = json.loads(path.read_text())
        for key in ("samples", "checks", "errors"):
            out[key] += part.get(key, [])
        out["fp32_weight_bytes"] = part.get("fp32_weight_bytes", out.get("fp32_weight_bytes"))
        meta = dict(part.get("meta", {}))
        if "meta" in out:  # the parts' durations add up; their round counts are listed (e.g. "2/1")
            meta["elapsed_s"] = out["meta"]["elapsed_s"] + meta.get("elapsed_s", 0)
            meta["rounds"] = f"{out['meta']['rounds']}/{meta.get('rounds')}"
            meta["peer_versions"] = meta.get("peer_versions") or out["meta"].get("peer_versions", {})
        out["meta"] = meta
    out["checks"] = list({(c["system"], c["variant"]): c for c in out["checks"]}.values())  # a repeated check: the last
    return out
