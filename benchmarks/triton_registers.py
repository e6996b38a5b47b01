"""The paged-attention Triton kernels' register use, spills and shared memory on sm_90, without a GPU.

    .venv/bin/python benchmarks/triton_registers.py [--layout llama8b] [--kind prefill] [--json FILE]
    PYTHONPATH=/path/to/other/triton .venv/bin/python benchmarks/triton_registers.py   # another Triton version

Compiles every launch of ``paged_attention_gpu.py``'s sweep (both forms, both head layouts, the decode and prefill
tilings; bf16, rotary, float cache) with the installed Triton for sm_90, the way Triton's JIT would on a GPU
(16-byte aligned pointers), and runs the ``ptxas`` Triton compiles with (``-v``) on each kernel. One line per launch:
registers per thread of the attention and cache-write kernels, bytes of register spill stores, shared memory.
255 registers is the cap: a kernel there (or spilling) keeps values in local memory in its inner loop. These are
static figures of the compiler; only ``paged_attention_gpu.py`` on a GPU measures speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # paged_attention_gpu: the tilings and head layouts
from paged_attention_gpu import DECODE_TILINGS, LAYOUTS, PREFILL_TILINGS

DECODE_SEGMENTS = 8  # a split decode launch (the reduce kernel is tiny)
os.environ.pop("TRITON_INTERPRET", None)  # before Triton's first import: compile, do not interpret


def launch_report(layout: str, kind: str, tiling: tuple[int, int, int, int], fused: bool) -> dict[str, Any]:
    import triton

    from trtbuild.plugins.paged_attention import triton_kernel as tk
    from trtbuild.plugins.paged_attention.reference import PagedAttentionAttrs
    from trtbuild.plugins.paged_attention.triton_compile import arg_types, compile_kernel, ptxas_report

    hq, hkv, d = LAYOUTS[layout]
    attrs = PagedAttentionAttrs(hq, hkv, d, d**-0.5)
    t = tk.Tiling(*tiling)
    segments = DECODE_SEGMENTS if kind == "decode" else 1
    write, attention = tk.launch_constexprs(attrs, True, fused, tiling=t, num_segments=segments, fp32=False)
    kernels = tk._kernels()
    row: dict[str, Any] = {"triton": triton.__version__, "layout": layout, "kind": kind, "tiling": list(tiling),
                           "form": "fused" if fused else "two-kernel"}  # fmt: skip
    sm90 = {"arch": 90, "aligned": True}  # as Triton's JIT compiles for torch's (16-byte aligned) tensors
    compiled = compile_kernel(kernels._paged_attention_kernel, attention, arg_types("bf16"), num_warps=t.num_warps,
                              num_stages=t.num_stages, **sm90)  # fmt: skip
    row["attention"] = ptxas_report(compiled)
    if write is not None:
        compiled = compile_kernel(kernels._write_kv_kernel, write, arg_types("bf16"), num_warps=tk.WRITE_WARPS,
                                  num_stages=1, **sm90)  # fmt: skip
        row["write"] = ptxas_report(compiled)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), action="append", help="head layouts (default: all)")
    parser.add_argument("--kind", choices=["decode", "prefill"], action="append", help="default: both")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    for layout in args.layout or list(LAYOUTS):
        for kind in args.kind or ["prefill", "decode"]:
            for tiling in PREFILL_TILINGS if kind == "prefill" else DECODE_TILINGS:
                for fused in (False, True):
                    row = launch_report(layout, kind, tiling, fused)
                    rows.append(row)
                    attn, write = row["attention"], row.get("write")
                    cells = [f"{layout:8} {kind:7} {'x'.join(map(str, tiling)):12} {row['form']:10}",
                             f"attention {attn['registers']:3} regs {attn['spill_bytes']:5} B spilled "
                             f"{attn['smem'] // 1024:4} KiB smem"]  # fmt: skip
                    if write is not None:
                        cells.append(f"write {write['registers']:3} regs {write['spill_bytes']:4} B spilled")
                    print("  ".join(cells), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
