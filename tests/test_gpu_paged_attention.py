"""The paged-attention Triton kernel against the numpy oracle on a CUDA GPU (``-m gpu``), and a few of the same
cases on the CPU through Triton's interpreter (the default suite).

Each case runs in a child process of its own (``isolated_case``: a kernel fault costs one case); tensors go to
the case's device, Triton compiles for the GPU there and interprets on the CPU. Cases: ragged batches (prefill,
chunk after a cached prefix, decode, single-token context; block size 16 and 5) in fp32/fp16/bf16, both forms
(two kernels, fused), forced split-KV, int8/fp8 caches, sliding windows and soft-capping: kernel vs
``reference.paged_attention`` (max abs error of the output and both caches, tolerance per dtype; with a window, the
same step again with the block-table entries before each sequence's window pointed at a spare block of NaNs must
give the same output); garbage metadata of the whole int32 range (the kernel must not
fault); on the GPU, the TensorRT AOT form compiled to PTX for the GPU's own architecture. The speed of the same
kernel is ``benchmarks/paged_attention_gpu.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

MARKS = {"cpu": [], "cuda": [pytest.mark.gpu]}
TOL = {"float32": 2e-4, "float16": 1e-2, "bfloat16": 5e-2}  # max abs error of the output, float caches
MODULE = "test_gpu_paged_attention"  # what the child processes import to find the cases below

# (dtype, fused, num_kv_splits, kv cache, block size[, sliding window, softcap]) of each oracle check, per device
CHECKS = {
    "cuda": [
        ("float32", False, None, "float", 16),
        ("float32", True, None, "float", 5),
        ("float16", True, None, "float", 16),
        ("bfloat16", False, None, "float", 5),
        ("bfloat16", True, None, "float", 16),
        ("bfloat16", False, 3, "float", 16),
        *[("bfloat16", fused, 4, kv, 16) for kv in ("int8", "fp8") for fused in (False, True)],
        ("bfloat16", True, None, "float", 16, 100, None),  # the decode at 300 skips its first 12 blocks
        ("float32", False, 3, "float", 5, 37, 2.0),
        ("bfloat16", False, None, "float", 16, None, 50.0),  # Gemma 2's attention soft-capping
        ("float16", True, None, "float", 5, 8, 1.5),  # a window shorter than a query tile
        ("bfloat16", True, 4, "int8", 16, 64, 30.0),
        ("bfloat16", False, 4, "fp8", 16, 20, None),
    ],
    "cpu": [
        ("float32", True, None, "float", 5),
        ("float32", False, 3, "int8", 16),
        ("float32", True, 2, "fp8", 16),
        ("float32", False, 3, "float", 5, 37, 2.0),
    ],
}
# (fused, activation dtype) of each garbage-metadata case, per device
GARBAGE = {"cuda": [(False, "bfloat16"), (True, "bfloat16")], "cpu": [(True, "float32")]}


def check_id(
    dtype: str,
    fused: bool,
    splits: int | None,
    kv: str,
    bs: int,
    window: int | None = None,
    softcap: float | None = None,
) -> str:
    split = "" if splits is None else f"-split{splits}"
    extra = ("" if window is None else f"-window{window}") + ("" if softcap is None else f"-softcap{softcap:g}")
    return f"{dtype}-{kv}-{'fused' if fused else 'two-kernels'}{split}-bs{bs}{extra}"


@pytest.mark.parametrize(
    "device, case",
    [
        pytest.param(device, case, marks=MARKS[device], id=f"{device}-{check_id(*case)}")
        for device, cases in CHECKS.items()
        for case in cases
    ],
)
def test_kernel_matches_the_oracle(device: str, case: tuple[Any, ...], isolated_case: Callable) -> None:
    got = isolated_case(MODULE, "check_case", *case[:5], device, *case[5:], device=device, timeout=600)
    assert got["ok"], got


@pytest.mark.parametrize(
    "device, fused, dtype",
    [
        pytest.param(device, fused, dtype, marks=MARKS[device], id=f"{device}-fused{int(fused)}")
        for device, cases in GARBAGE.items()
        for fused, dtype in cases
    ],
)
def test_garbage_metadata_does_not_fault(device: str, fused: bool, dtype: str, isolated_case: Callable) -> None:
    assert isolated_case(MODULE, "garbage_case", fused, dtype, device, device=device, timeout=600)["ok"]


@pytest.mark.gpu
def test_aot_form_compiles_for_this_gpu(isolated_case: Callable) -> None:
    got = isolated_case(MODULE, "aot_case", device="cuda", timeout=600)
    assert got["ok"], got


# --------------------------------------------------------------------------------------------- the cases
# Run in the child processes: JSON-able arguments in, a dict of figures out.


def make_step(rng: np.random.Generator, hq: int, hkv: int, d: int, bs: int, new: list[int], starts: list[int]):
    """numpy arrays of one ragged step: fp32 qkv/caches, scrambled block tables (as in test_triton_kernel)."""
    needed = [-(-(s + n) // bs) for s, n in zip(starts, new, strict=True)]
    nb = sum(needed) + 2
    perm = rng.permutation(nb)
    tables = rng.integers(0, nb, size=(len(new), max(needed) + 1))
    used = 0
    for b, n in enumerate(needed):
        tables[b, :n] = perm[used : used + n]
        used += n
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, new, strict=True)])
    return {
        "qkv": rng.standard_normal((sum(new), (hq + 2 * hkv) * d)).astype(np.float32),
        "k": rng.standard_normal((nb, bs, hkv, d)).astype(np.float32),
        "v": rng.standard_normal((nb, bs, hkv, d)).astype(np.float32),
        "positions": positions.astype(np.int64),
        "tables": tables.astype(np.int64),
        "qsl": np.concatenate([[0], np.cumsum(new)]).astype(np.int64),
    }


def check_case(
    dtype: str,
    fused: bool,
    splits: int | None,
    kv: str,
    bs: int,
    device: str,
    window: int | None = None,
    softcap: float | None = None,
) -> dict[str, Any]:
    """One ragged step through the kernel and the oracle: the max abs errors and whether they are in tolerance
    (quantized caches: in quantization levels, 1 = one level apart). With a ``window``, the step runs again on the
    untouched caches with the block-table entries wholly before each sequence's window pointed at a spare block
    filled with NaN (float caches): the output must be the same (``null_block_diff`` 0)."""
    import torch

    from trtbuild.plugins.paged_attention import reference as ref
    from trtbuild.plugins.paged_attention import triton_kernel as tk

    rng = np.random.default_rng(bs)
    hq, hkv, d = 8, 2, 64
    step = make_step(rng, hq, hkv, d, bs, [37, 1, 20, 1, 5], [0, 300, 100, 0, 61])
    cos_sin = ref.rotary_cos_sin_cache(512, d, theta=10000.0)
    kv_type = {"float": ref.KV_FLOAT, "int8": ref.KV_INT8, "fp8": ref.KV_FP8}[kv]
    attrs = ref.PagedAttentionAttrs(
        hq, hkv, d, 1 / math.sqrt(d), kv_cache_dtype=kv_type, sliding_window=window, softcap=softcap
    )
    tdt = getattr(torch, dtype)
    qkv = torch.from_numpy(step["qkv"]).to(device, tdt)
    scales: dict[str, float] = {}
    if kv == "float":
        k_np, v_np = (step[x].astype(np.float32) for x in ("k", "v"))
        k = torch.from_numpy(k_np).to(device, tdt)
        v = torch.from_numpy(v_np).to(device, tdt)
        k_np, v_np = k.float().cpu().numpy(), v.float().cpu().numpy()
    else:
        scales = {"k_scale": 0.03, "v_scale": 0.02}
        k_np = ref.quantize_kv(step["k"], scales["k_scale"], kv_type)
        v_np = ref.quantize_kv(step["v"], scales["v_scale"], kv_type)
        tt = torch.int8 if kv == "int8" else torch.float8_e4m3fn
        k, v = (torch.from_numpy(x.view(np.int8).copy()).view(tt).to(device) for x in (k_np, v_np))
    meta = [torch.from_numpy(step[x]).to(device) for x in ("positions", "tables", "qsl")]
    untouched = k.clone(), v.clone()
    cos_sin_t = torch.from_numpy(cos_sin).to(device)
    out = tk.paged_attention_triton(qkv, k, v, *meta, cos_sin_t, attrs, fused=fused, num_kv_splits=splits, **scales)
    sync(device)
    null_diff = 0.0
    if window is not None:
        tables, positions, qsl = step["tables"], step["positions"], step["qsl"]
        first, last = positions[qsl[:-1]], positions[qsl[1:] - 1]
        cols = np.arange(tables.shape[1])[None, :]
        before = cols < (np.maximum(first - window + 1, 0) // bs)[:, None]
        null = min(set(range(len(step["k"]))) - set(tables[cols <= (last // bs)[:, None]].tolist()))  # unowned
        k_null, v_null = untouched
        if kv == "float":
            k_null[null], v_null[null] = float("nan"), float("nan")
        meta[1] = torch.from_numpy(np.where(before, null, tables)).to(device)
        again = tk.paged_attention_triton(
            qkv, k_null, v_null, *meta, cos_sin_t, attrs, fused=fused, num_kv_splits=splits, **scales
        )
        sync(device)
        null_diff = float(np.nan_to_num((again.float() - out.float()).abs().max().cpu().numpy(), nan=np.inf))
    qkv_np = qkv.float().cpu().numpy()
    r_out, r_k, r_v = ref.paged_attention(
        qkv_np, k_np, v_np, step["positions"], step["tables"], step["qsl"], cos_sin, attrs, **scales
    )
    err_out = float(np.abs(out.float().cpu().numpy() - r_out).max())
    if kv == "float":
        err_k = float(np.abs(k.float().cpu().numpy() - r_k).max())
        err_v = float(np.abs(v.float().cpu().numpy() - r_v).max())
    else:  # in quantization steps (1 = one level apart)
        got_k, got_v = (x.view(torch.int8).cpu().numpy().view(r_k.dtype) for x in (k, v))
        err_k = float(np.abs(ref.dequantize_kv(got_k, 1.0) - ref.dequantize_kv(r_k, 1.0)).max())
        err_v = float(np.abs(ref.dequantize_kv(got_v, 1.0) - ref.dequantize_kv(r_v, 1.0)).max())
    tol = TOL[dtype] * (4 if kv != "float" else 1)
    cache_tol = tol if kv == "float" else (1.0 if kv == "int8" else 32.0)  # fp8 levels: one step is up to 32
    ok = err_out <= tol and err_k <= cache_tol and err_v <= cache_tol and null_diff == 0.0
    return {
        "ok": ok, "max_err_out": err_out, "max_err_k": err_k, "max_err_v": err_v, "tol": tol,
        "null_block_diff": null_diff,
    }  # fmt: skip


def garbage_case(fused: bool, dtype: str, device: str) -> dict[str, Any]:
    """Random metadata of the whole int32 range: the kernel must not fault (CUDA would report it here)."""
    import torch

    from trtbuild.plugins.paged_attention import reference as ref
    from trtbuild.plugins.paged_attention import triton_kernel as tk

    rng = np.random.default_rng(7)
    hq, hkv, d, t, b = 8, 2, 64, 33, 5
    attrs = ref.PagedAttentionAttrs(hq, hkv, d, 0.125)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=device, dtype=getattr(torch, dtype))
    k = torch.zeros(9, 16, hkv, d, device=device, dtype=qkv.dtype)
    v = torch.zeros_like(k)
    cos_sin = torch.from_numpy(ref.rotary_cos_sin_cache(40, d, theta=1e4)).to(device)
    info = np.iinfo(np.int32)
    for _ in range(5 if device == "cuda" else 1):
        meta = [rng.integers(info.min, info.max, size=s, dtype=np.int32) for s in ((t,), (b, 7), (b + 1,))]
        tk.paged_attention_triton(
            qkv, k, v, *[torch.from_numpy(x).to(device) for x in meta], cos_sin, attrs, fused=fused
        )
    sync(device)
    return {"ok": True}


def aot_case() -> dict[str, Any]:
    """The TensorRT AOT form compiles with this machine's Triton for its GPU (no TensorRT needed)."""
    import torch

    from trtbuild.plugins.paged_attention import reference as ref
    from trtbuild.plugins.paged_attention import triton_kernel as tk

    props = torch.cuda.get_device_properties(0)
    arch = props.major * 10 + props.minor
    k = tk.compile_ptx(ref.PagedAttentionAttrs(32, 8, 128, 0.088), has_rope=True, arch=arch, float_type="bf16")
    return {"ok": "mma" in k.ptx, "arch": arch, "name": k.name, "ptx_isa": k.ptx_isa, "shared_mem": k.shared_mem,
            "threads": k.num_threads, "block_q": k.block_q}  # fmt: skip


def sync(device: str) -> None:
    """Wait for the GPU's queued work (its faults surface here)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
