"""The Triton kernel against the numpy oracle, run on the CPU through Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

_TRITON_ALREADY_IMPORTED = "triton" in sys.modules
os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: @triton.jit then runs on CPU tensors

torch = pytest.importorskip("torch", reason="the Triton kernel tests need torch")
triton_language = pytest.importorskip(
    "triton.language", reason="the Triton kernel tests need triton (pip install 'triton==3.9.0')"
)
if type(triton_language.sum).__name__ != "InterpretedFunction":  # pragma: no cover
    pytest.skip(
        f"triton was imported before TRITON_INTERPRET=1 was set (already imported: {_TRITON_ALREADY_IMPORTED}); "
        "set it in the environment or in conftest.py",
        allow_module_level=True,
    )

from trtbuild.plugins.paged_attention import triton_kernel  # noqa: E402
from trtbuild.plugins.paged_attention.reference import (  # noqa: E402
    KV_FLOAT,
    KV_FP8,
    KV_INT8,
    PagedAttentionAttrs,
    dequantize_kv,
    paged_attention,
    quantize_kv,
    rotary_cos_sin_cache,
)


@dataclass
class Step:
    qkv: np.ndarray
    key_cache: np.ndarray
    value_cache: np.ndarray
    positions: np.ndarray
    block_tables: np.ndarray
    query_start_loc: np.ndarray


def make_step(
    rng: np.random.Generator,
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    new_tokens: list[int],
    starts: list[int],
    share_first_block: tuple[int, int] | None = None,
) -> Step:
    """A ragged step: sequence b gets ``new_tokens[b]`` tokens at positions ``starts[b]...``; blocks scrambled."""
    needed = [-(-(s + n) // block_size) for s, n in zip(starts, new_tokens, strict=True)]
    num_blocks = sum(needed) + 3  # a few spare blocks that nobody owns
    perm = rng.permutation(num_blocks)
    width = max(needed) + 2
    tables = rng.integers(0, num_blocks, size=(len(starts), width))  # unused entries: any valid block id
    used = 0
    for b, n in enumerate(needed):
        tables[b, :n] = perm[used : used + n]
        used += n
    if share_first_block is not None:  # prefix sharing: both sequences only read their first block this step
        a, b = share_first_block
        assert starts[a] >= block_size and starts[b] >= block_size
        tables[b, 0] = tables[a, 0]
    t = sum(new_tokens)
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int64)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, new_tokens, strict=True)])
    return Step(
        qkv=rng.standard_normal((t, (hq + 2 * hkv) * d)).astype(np.float32),
        key_cache=rng.standard_normal((num_blocks, block_size, hkv, d)).astype(np.float32),
        value_cache=rng.standard_normal((num_blocks, block_size, hkv, d)).astype(np.float32),
        positions=positions.astype(np.int64),
        block_tables=tables.astype(np.int64),
        query_start_loc=qsl,
    )


def run_both(
    step: Step,
    cos_sin: np.ndarray | None,
    attrs: PagedAttentionAttrs,
    fused: bool,
    index_dtype: torch.dtype = torch.int64,
    atol: float = 1e-4,
    **launch: Any,
) -> None:
    """Run the oracle and the kernel on the same step; compare output and both updated caches.

    ``launch`` goes to the kernel (``tiling``, ``num_kv_splits``, ``k_scale``/``v_scale`` for a quantized cache)."""
    scales = {k: launch[k] for k in ("k_scale", "v_scale") if k in launch}
    ref_out, ref_k, ref_v = paged_attention(
        step.qkv,
        step.key_cache,
        step.value_cache,
        step.positions,
        step.block_tables,
        step.query_start_loc,
        cos_sin,
        attrs,
        **scales,
    )
    k, v = to_torch_cache(step.key_cache), to_torch_cache(step.value_cache)
    out = triton_kernel.paged_attention_triton(
        torch.from_numpy(step.qkv),
        k,
        v,
        torch.from_numpy(step.positions).to(index_dtype),
        torch.from_numpy(step.block_tables).to(index_dtype),
        torch.from_numpy(step.query_start_loc).to(index_dtype),
        None if cos_sin is None else torch.from_numpy(cos_sin),
        attrs,
        fused=fused,
        **launch,
    )
    np.testing.assert_allclose(out.float().numpy(), ref_out.astype(np.float32), atol=atol, rtol=0)
    if attrs.kv_cache_dtype == KV_FLOAT:
        np.testing.assert_allclose(k.float().numpy(), ref_k.astype(np.float32), atol=atol, rtol=0)
        np.testing.assert_allclose(v.float().numpy(), ref_v.astype(np.float32), atol=atol, rtol=0)
    else:  # the same quantization levels (at most one step apart where fp32 vs fp64 RoPE rounds differently)
        for got, want, scale in ((k, ref_k, scales["k_scale"]), (v, ref_v, scales["v_scale"])):
            got_deq = dequantize_kv(from_torch_cache(got, want.dtype), scale)
            np.testing.assert_allclose(got_deq, dequantize_kv(want, scale), atol=1.01 * scale * (cos_sin is not None))


def to_torch_cache(cache: np.ndarray) -> torch.Tensor:
    """A numpy cache (float, int8 or ml_dtypes fp8) as the torch tensor the kernel takes."""
    if cache.dtype.itemsize == 1 and cache.dtype != np.int8:
        return torch.from_numpy(cache.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(cache.copy())


def from_torch_cache(cache: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    return cache.view(torch.uint8).numpy().view(dtype) if dtype.itemsize == 1 else cache.numpy()


# (rotary dim as a fraction of head size or None, interleaved)
ROPE_CASES = [(None, False), (1.0, False), (1.0, True), (0.5, False), (0.5, True)]


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernels", "fused"])
@pytest.mark.parametrize("rope", ROPE_CASES, ids=lambda r: "norope" if r[0] is None else f"rot{r[0]}-il{int(r[1])}")
@pytest.mark.parametrize("heads", [(4, 2), (6, 1)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
def test_ragged_batch_matches_reference(heads: tuple[int, int], rope: tuple[float | None, bool], fused: bool) -> None:
    hq, hkv = heads
    d, block_size = 8, 3  # block size divides none of the sequence lengths below
    frac, interleaved = rope
    rng = np.random.default_rng(hq * 100 + hkv * 10 + int(fused))
    # prefill from 0 | decode | continuation chunk after a cached prefix | decode | prefill, sharing block 0 of seq 2
    step = make_step(rng, hq, hkv, d, block_size, [5, 1, 4, 1, 2], [0, 7, 4, 13, 0], share_first_block=(2, 1))
    cos_sin = None if frac is None else rotary_cos_sin_cache(32, int(d * frac), theta=10000.0)
    attrs = PagedAttentionAttrs(hq, hkv, d, 1 / np.sqrt(d), rotary_interleaved=interleaved)
    run_both(step, cos_sin, attrs, fused)


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernels", "fused"])
def test_int32_metadata_and_odd_head_size(fused: bool) -> None:
    """TensorRT feeds int32 metadata; a head size that is not a power of two exercises the masks."""
    rng = np.random.default_rng(7)
    hq, hkv, d = 4, 2, 12
    step = make_step(rng, hq, hkv, d, 5, [3, 1, 7], [9, 20, 0])
    cos_sin = rotary_cos_sin_cache(32, 8, theta=500.0)
    attrs = PagedAttentionAttrs(hq, hkv, d, 0.3, rotary_interleaved=False)
    run_both(step, cos_sin, attrs, fused, index_dtype=torch.int32)


def test_prefill_then_decode_through_the_kernel_cache() -> None:
    """Step 2 attends over keys the kernel itself wrote in step 1 (long context: several tiles)."""
    rng = np.random.default_rng(3)
    hq, hkv, d, bs = 4, 2, 8, 4
    attrs = PagedAttentionAttrs(hq, hkv, d, 1 / np.sqrt(d))
    cos_sin = rotary_cos_sin_cache(64, d, theta=10000.0)
    prompt = make_step(rng, hq, hkv, d, bs, [37], [0])
    cache_k = torch.from_numpy(prompt.key_cache.copy())
    cache_v = torch.from_numpy(prompt.value_cache.copy())
    ref_k, ref_v = prompt.key_cache, prompt.value_cache
    steps = [(prompt.qkv, prompt.positions, prompt.query_start_loc)]
    decode_qkv = rng.standard_normal((1, (hq + 2 * hkv) * d)).astype(np.float32)
    steps.append((decode_qkv, np.array([37]), np.array([0, 1])))
    for qkv, pos, qsl in steps:
        ref_out, ref_k, ref_v = paged_attention(qkv, ref_k, ref_v, pos, prompt.block_tables, qsl, cos_sin, attrs)
        out = triton_kernel.paged_attention_triton(
            torch.from_numpy(qkv),
            cache_k,
            cache_v,
            torch.from_numpy(pos),
            torch.from_numpy(prompt.block_tables),
            torch.from_numpy(qsl),
            torch.from_numpy(cos_sin),
            attrs,
            fused=True,
        )
        np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-4, rtol=0)
    np.testing.assert_allclose(cache_k.numpy(), ref_k, atol=1e-4, rtol=0)
    np.testing.assert_allclose(cache_v.numpy(), ref_v, atol=1e-4, rtol=0)


def test_bad_inputs_are_rejected() -> None:
    attrs = PagedAttentionAttrs(4, 2, 8, 0.35)
    qkv = torch.zeros(2, 64)
    cache = torch.zeros(4, 4, 2, 8)
    meta = torch.zeros(2, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0, 2])
    with pytest.raises(ValueError, match="qkv shape"):
        triton_kernel.paged_attention_triton(torch.zeros(2, 60), cache, cache.clone(), *meta, None, attrs)
    with pytest.raises(ValueError, match="contiguous"):
        triton_kernel.paged_attention_triton(qkv, cache.transpose(0, 1), cache.clone(), *meta, None, attrs)
    with pytest.raises(ValueError, match="at least one row"):
        triton_kernel.paged_attention_triton(qkv, cache, cache.clone(), meta[0], meta[1][:, :0], meta[2], None, attrs)
    with pytest.raises(ValueError, match="rotary dim"):
        triton_kernel.paged_attention_triton(qkv, cache, cache.clone(), *meta, torch.zeros(8, 10), attrs)


def _run_python(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_module_imports_without_triton_and_fails_only_when_called() -> None:
    code = """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        from trtbuild.plugins.paged_attention import triton_kernel
        try:
            triton_kernel.paged_attention_triton(None, None, None, None, None, None, None, None)
        except ImportError as e:
            print("ImportError:", e)
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = _run_python(code, env)
    assert result.returncode == 0, result.stderr
    assert "needs triton" in result.stdout and "pip install 'trtbuild[kernels]'" in result.stdout


def test_fused_kernel_compiles_to_ptx_without_a_gpu() -> None:
    """The TensorRT AOT path: Triton's own LLVM + ptxas turn the fused kernel into PTX for sm_80 and sm_90."""
    code = """
        import re
        from trtbuild.plugins.paged_attention.reference import PagedAttentionAttrs
        from trtbuild.plugins.paged_attention.triton_kernel import compile_ptx
        windowed = PagedAttentionAttrs(6, 2, 64, 0.125, True, sliding_window=4096, softcap=50.0)
        for arch, ftype, attrs in ((80, "fp16", None), (90, "fp32", None), (90, "bf16", windowed)):
            attrs = attrs or PagedAttentionAttrs(6, 2, 64, 0.125, True)
            k = compile_ptx(attrs, has_rope=True, arch=arch, float_type=ftype)
            entry = re.search(r"\\.entry\\s+(\\w+)\\(([^)]*)\\)", k.ptx, re.S)
            params = entry.group(2).count(".param")
            mma = "mma" in k.ptx  # tensor-core instructions (mma.sync on sm_80, wgmma on sm_90)
            target = re.search(r"\\.target (\\w+)", k.ptx).group(1)
            print(arch, k.name, entry.group(1), target, params, k.num_threads, int(mma), k.block_q)
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = _run_python(code, env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.strip().splitlines()]
    assert [line[0] for line in lines] == ["80", "90", "90"]  # the last: with a sliding window and softcap
    for arch, name, entry, target, params, threads, _mma, block_q in lines:
        assert name == entry == "_paged_attention_kernel"
        assert target.startswith(f"sm_{arch}")
        # 10 pointers + 7 int32 scalars in TensorRT's (inputs, scalars, outputs) order, then Triton's two scratch
        # pointers, which TensorRT's AOT launcher leaves null (the kernel uses no scratch: checked in compile_ptx).
        assert int(params) == 19
        assert int(threads) % 32 == 0
        assert int(block_q) == 64 // 3  # AOT tiling: 64 rows = 21 tokens x 3 query heads per kv head
    assert lines[0][6] == "1"  # fp16 on sm_80 runs QK^T and PV on tensor cores


# Every JIT launch the GPU runs, compiled for sm_90 by Triton's own compiler (no GPU needed): the interpreter runs the
# same kernels but accepts code the compiler rejects. (name, heads, tiling, fused, segments, cache, window/softcap)
LAUNCH_VARIANTS = [
    ("decode-split", (32, 8, 128), "DECODE_TILING", False, 8, "bf16", False),
    ("decode-one-segment", (32, 8, 128), "DECODE_TILING", False, 1, "bf16", False),
    ("decode-fused-split", (32, 8, 128), "DECODE_TILING", True, 4, "bf16", False),
    ("prefill", (32, 8, 128), "PREFILL_TILING", False, 1, "bf16", False),
    ("prefill-fused", (32, 8, 128), "PREFILL_TILING", True, 1, "bf16", False),
    ("smollm2-decode-split", (9, 3, 64), "DECODE_TILING", False, 8, "bf16", False),
    ("smollm2-prefill", (9, 3, 64), "PREFILL_TILING", False, 1, "bf16", False),
    ("int8-cache-decode-split", (32, 8, 128), "DECODE_TILING", False, 8, "i8", False),
    ("fp8-cache-prefill", (32, 8, 128), "PREFILL_TILING", False, 1, "fp8e4nv", False),
    ("window-softcap-decode-split", (8, 4, 256), "DECODE_TILING", False, 4, "bf16", True),
]


@pytest.mark.slow
def test_every_launch_variant_compiles_for_sm90() -> None:
    """The GPU's JIT launches (decode / prefill tilings, split-KV, fused, head sizes 64 / 128 / 256, int8 / fp8
    caches, sliding window with softcap) plus the cache-write and reduce kernels compile to sm_90 PTX with the
    installed Triton, as ``paged_attention_triton`` would launch them on bf16 tensors (slow: ~15 compiles)."""
    code = f"""
        import triton
        from trtbuild.plugins.paged_attention import triton_kernel as tk
        from trtbuild.plugins.paged_attention.reference import KV_FLOAT, KV_FP8, KV_INT8, PagedAttentionAttrs
        from trtbuild.plugins.paged_attention.triton_compile import arg_types, compile_kernel, ptxas_report
        kernels = tk._kernels()
        print("triton", triton.__version__, "-")
        QUANT = {{"bf16": KV_FLOAT, "i8": KV_INT8, "fp8e4nv": KV_FP8}}

        def compile(kernel, consts, types, tiling=None):  # as Triton's JIT does for torch's 16-byte aligned tensors
            launch = {{"num_warps": 4, "num_stages": 1}} if tiling is None else {{"num_warps": tiling.num_warps,
                                                                               "num_stages": tiling.num_stages}}
            return compile_kernel(kernel, consts, types, arch=90, aligned=True, **launch)

        def pressure(kernel):  # "registers/spilled bytes", as ptxas reports them
            report = ptxas_report(kernel)
            return f"{{report['registers']}}/{{report['spill_bytes']}}"

        for name, (hq, hkv, d), tiling, fused, segments, cache, windowed in {LAUNCH_VARIANTS!r}:
            extra = {{"sliding_window": 512, "softcap": 30.0}} if windowed else {{}}
            attrs = PagedAttentionAttrs(hq, hkv, d, d ** -0.5, kv_cache_dtype=QUANT[cache], **extra)
            tiling = getattr(tk, tiling)
            write, consts = tk.launch_constexprs(attrs, True, fused, tiling=tiling, num_segments=segments, fp32=False)
            types = arg_types("bf16", cache_type=cache)
            k = compile(kernels._paged_attention_kernel, consts, types, tiling)
            print(name, "attention", k.metadata.num_warps, "wgmma" in k.asm["ptx"], pressure(k))
            if write is not None:
                w = compile(kernels._write_kv_kernel, write, types, tk.Tiling(0, 0, tk.WRITE_WARPS, 1))
                print(name, "write", w.metadata.num_warps, "-", pressure(w))
            if segments > 1:
                reduce = {{"NUM_HEADS": hq, "HEAD_SIZE": d, "NUM_SEGMENTS": segments,
                          "BLOCK_S": tk._next_pow2(segments), "BLOCK_D": consts["BLOCK_D"]}}
                compile(kernels._reduce_segments_kernel, reduce, types)
                print(name, "reduce")
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = _run_python(code, env, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    version, *lines = [line.split() for line in result.stdout.strip().splitlines()]
    assert version[0] == "triton", version
    attention = {line[0]: line for line in lines if line[1] == "attention"}
    assert list(attention) == [v[0] for v in LAUNCH_VARIANTS]
    assert attention["prefill"][3] == "True"  # bf16 prefill tiles on Hopper's warpgroup tensor cores
    # The two-kernel launches of the default tilings neither spill nor sit at the 255-register cap (the queries
    # rotated by the cache-write kernel: rotated in the attention kernel, the prefill tile took 255 registers and
    # spilled with Triton 3.6). The fused form, which also rotates the step's keys there, spills (printed on failure).
    two_kernel = [line for line in lines if "fused" not in line[0] and line[1] != "reduce"]
    assert all(int(line[4].split("/")[0]) < 255 and line[4].endswith("/0") for line in two_kernel), lines
    assert {line[0] for line in lines if line[1] == "reduce"} == {v[0] for v in LAUNCH_VARIANTS if v[4] > 1}


SMALL = triton_kernel.Tiling(block_m=16, block_n=16)  # several query tiles per sequence, several context tiles


@pytest.mark.parametrize("splits", [1, 3], ids=["one-segment", "3-segments"])
@pytest.mark.parametrize("fused", [False, True], ids=["two-kernels", "fused"])
@pytest.mark.parametrize("heads", [(4, 2), (6, 2)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
def test_query_tiles_and_kv_segments_match_reference(heads: tuple[int, int], fused: bool, splits: int) -> None:
    """Query tiles of 8 (group 2) or 5 (group 3: a padding row) tokens: sequences longer than a tile cross tile
    boundaries, shorter ones share none; a single-token context; split-KV segments (multiples of 16 positions) end
    mid-block since the block size 5 divides neither the tiles nor the lengths; 3 segments pad the reduce to 4."""
    hq, hkv = heads
    d = 16
    rng = np.random.default_rng(hq * 10 + int(fused) + splits)
    # prefill 19 | single-token context | chunk of 9 after a 7-token prefix | long decode | chunk of 3 after 40
    step = make_step(rng, hq, hkv, d, 5, [19, 1, 9, 1, 3], [0, 0, 7, 50, 40])
    cos_sin = rotary_cos_sin_cache(64, d, theta=10000.0)
    attrs = PagedAttentionAttrs(hq, hkv, d, 1 / np.sqrt(d))
    run_both(step, cos_sin, attrs, fused, tiling=SMALL, num_kv_splits=splits)


def test_default_tilings_and_decode_split() -> None:
    """The launcher's own choices: prefill tiling for a chunked step, decode tiling (+ forced split) for decode."""
    rng = np.random.default_rng(11)
    hq, hkv, d = 8, 2, 32
    attrs = PagedAttentionAttrs(hq, hkv, d, 1 / np.sqrt(d))
    cos_sin = rotary_cos_sin_cache(256, 16, theta=10000.0)
    run_both(make_step(rng, hq, hkv, d, 16, [70, 2], [0, 100]), cos_sin, attrs, fused=True)
    run_both(make_step(rng, hq, hkv, d, 16, [1, 1, 1], [150, 0, 77]), cos_sin, attrs, fused=False, num_kv_splits=4)


@pytest.mark.parametrize("d", [128, 256])
def test_cache_write_kernel_in_several_passes(d: int) -> None:
    """At the default prefill tiling a query tile holds 32 tokens (group 4) and the cache-write kernel writes keys,
    values and rotated queries ``WRITE_TILE // d`` tokens a pass (16 at head size 128, 8 at 256): a 70-token prefill
    after a 5-token prefix and a 19-token one, partial rotary, match the oracle (output and both caches)."""
    rng = np.random.default_rng(d)
    hq, hkv = 8, 2
    attrs = PagedAttentionAttrs(hq, hkv, d, 1 / np.sqrt(d))
    write, _ = triton_kernel.launch_constexprs(
        attrs, True, False, tiling=triton_kernel.PREFILL_TILING, num_segments=1, fp32=True
    )
    assert write["WRITE_ROWS"] < write["BLOCK_Q"] == 32
    step = make_step(rng, hq, hkv, d, 16, [70, 19], [5, 0])
    run_both(step, rotary_cos_sin_cache(96, d // 2, theta=10000.0), attrs, fused=False)


def test_fp16_uses_half_precision_dots() -> None:
    rng = np.random.default_rng(5)
    hq, hkv, d = 4, 1, 32
    step = make_step(rng, hq, hkv, d, 4, [6, 1], [3, 20])
    step.qkv, step.key_cache, step.value_cache = (
        x.astype(np.float16) for x in (step.qkv, step.key_cache, step.value_cache)
    )
    attrs = PagedAttentionAttrs(hq, hkv, d, 1 / np.sqrt(d))
    run_both(step, rotary_cos_sin_cache(32, d, theta=10000.0), attrs, fused=True, atol=1e-2, tiling=SMALL)


@pytest.mark.parametrize(
    ("kv_dtype", "fused", "rope", "splits"),
    [(KV_INT8, True, True, 1), (KV_INT8, False, False, 2), (KV_FP8, True, False, 2), (KV_FP8, False, True, 1)],
    ids=["int8-fused-rope", "int8-two-kernels-split", "fp8-fused-split", "fp8-two-kernels-rope"],
)
def test_quantized_kv_cache_matches_reference(kv_dtype: int, fused: bool, rope: bool, splits: int) -> None:
    """Keys/values are quantized on write and dequantized on read in the kernel, the step's own tokens included."""
    rng = np.random.default_rng(kv_dtype + int(fused))
    hq, hkv, d = 4, 2, 16
    step = make_step(rng, hq, hkv, d, 3, [5, 1, 4], [0, 17, 6])
    k_scale, v_scale = 0.02, 0.03 if kv_dtype == KV_INT8 else 0.01
    step.key_cache = quantize_kv(step.key_cache, k_scale, kv_dtype)
    step.value_cache = quantize_kv(step.value_cache, v_scale, kv_dtype)
    attrs = PagedAttentionAttrs(hq, hkv, d, 1 / np.sqrt(d), kv_cache_dtype=kv_dtype)
    cos_sin = rotary_cos_sin_cache(32, d, theta=10000.0) if rope else None
    launch = dict(k_scale=k_scale, v_scale=v_scale, tiling=SMALL, num_kv_splits=splits)
    run_both(step, cos_sin, attrs, fused, atol=2e-3, **launch)


# (sliding window, softcap, fused, split-KV segments, kv cache)
WINDOW_CASES = [
    (4, None, False, 1, KV_FLOAT),  # window < block size 5 and < a tile
    (11, None, True, 1, KV_FLOAT),  # across blocks and 16-wide context tiles
    (23, None, False, 3, KV_FLOAT),  # split-KV segments over the window only
    (9, None, True, 2, KV_INT8),
    (None, 1.5, False, 1, KV_FLOAT),
    (None, 0.7, True, 3, KV_FLOAT),
    (13, 2.0, True, 1, KV_FLOAT),
    (7, 1.2, False, 2, KV_FP8),
]


@pytest.mark.parametrize(
    ("window", "softcap", "fused", "splits", "kv_dtype"),
    WINDOW_CASES,
    ids=lambda x: str(x) if not isinstance(x, bool) else ("fused" if x else "two-kernels"),
)
def test_window_and_softcap_match_reference(
    window: int | None, softcap: float | None, fused: bool, splits: int, kv_dtype: int
) -> None:
    """A ragged step (prefill longer than the window, decode and a chunk far past it) with a sliding window and/or
    soft-capping. With a window, the block-table entries of blocks wholly before each sequence's window then point
    at a spare block (the runner's null block) filled with NaN: the output is unchanged (the kernel never reads
    those blocks)."""
    rng = np.random.default_rng(41 + int(fused) + splits)
    hq, hkv, d, bs = 6, 2, 16, 5
    step = make_step(rng, hq, hkv, d, bs, [19, 1, 9, 1, 3], [0, 0, 40, 57, 31])
    attrs = PagedAttentionAttrs(hq, hkv, d, 0.4, kv_cache_dtype=kv_dtype, sliding_window=window, softcap=softcap)
    launch: dict[str, Any] = dict(tiling=SMALL, num_kv_splits=splits)
    if kv_dtype != KV_FLOAT:
        launch.update(k_scale=0.02, v_scale=0.03)
        step.key_cache = quantize_kv(step.key_cache, 0.02, kv_dtype)
        step.value_cache = quantize_kv(step.value_cache, 0.03, kv_dtype)
    cos_sin = rotary_cos_sin_cache(64, d, theta=10000.0)
    run_both(step, cos_sin, attrs, fused, atol=1e-4 if kv_dtype == KV_FLOAT else 2e-3, **launch)
    if window is None:
        return

    def output(tables: np.ndarray, caches: list[torch.Tensor]) -> np.ndarray:
        meta = (torch.from_numpy(x) for x in (step.positions, tables, step.query_start_loc))
        out = triton_kernel.paged_attention_triton(
            torch.from_numpy(step.qkv), *caches, *meta, torch.from_numpy(cos_sin), attrs, fused=fused, **launch
        )
        return out.numpy()

    first, last = step.positions[step.query_start_loc[:-1]], step.positions[step.query_start_loc[1:] - 1]
    columns = np.arange(step.block_tables.shape[1])[None, :]
    before = columns < (np.maximum(first - window + 1, 0) // bs)[:, None]
    assert before.sum() >= 4
    owned = step.block_tables[columns <= (last // bs)[:, None]]
    null = min(set(range(len(step.key_cache))) - set(owned.tolist()))  # a block no sequence owns
    want = output(step.block_tables, [to_torch_cache(step.key_cache), to_torch_cache(step.value_cache)])
    caches = [to_torch_cache(step.key_cache), to_torch_cache(step.value_cache)]
    if kv_dtype == KV_FLOAT:
        caches[0][null], caches[1][null] = float("nan"), float("nan")
    np.testing.assert_array_equal(output(np.where(before, null, step.block_tables), caches), want)


def test_choose_num_segments_fills_the_gpu() -> None:
    choose = triton_kernel.choose_num_segments
    assert choose(num_tiles=1, num_kv_heads=8, max_context=8192, num_sms=132) == 64  # batch 1: 512 programs
    assert choose(num_tiles=20, num_kv_heads=8, max_context=2048, num_sms=132) == 4  # batch 16: 160 programs
    assert choose(num_tiles=80, num_kv_heads=8, max_context=2048, num_sms=132) == 1  # batch 64: 640 programs
    assert choose(num_tiles=1, num_kv_heads=8, max_context=200, num_sms=132) == 1  # too short to split
    assert choose(num_tiles=1, num_kv_heads=8, max_context=600, num_sms=132) == 4  # 4 segments of >= 128
    assert choose(num_tiles=1, num_kv_heads=1, max_context=1 << 20, num_sms=132) == triton_kernel.MAX_SEGMENTS


@contextmanager
def bounds_checked(tensors: list[torch.Tensor], writable: list[torch.Tensor]) -> Iterator[list[str]]:
    """Instrument the interpreter: every unmasked load must fall inside one of ``tensors`` (or a temporary of the
    launch: split-KV partials, rotated queries), every unmasked store inside one of ``writable`` (or a temporary);
    violations are collected, not executed."""
    from triton.runtime import interpreter

    def spans(ts: list[torch.Tensor]) -> list[tuple[int, int]]:
        return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts]

    readable, stores = spans(tensors + writable), spans(writable)
    errors: list[str] = []
    builder = interpreter.InterpreterBuilder
    real_load, real_store, real_scratch = builder.create_masked_load, builder.create_masked_store, None

    def check(kind: str, ptrs: Any, mask: Any, allowed: list[tuple[int, int]]) -> bool:
        addr = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.int64)
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        inside = np.zeros(addr.shape, bool)
        for lo, hi in allowed:
            inside |= (addr >= lo) & (addr + size <= hi)
        if not inside.all():
            errors.append(f"{kind} of {int((~inside).sum())} elements out of bounds")
        return bool(inside.all())

    def load(self: Any, ptrs: Any, mask: Any, other: Any, *args: Any) -> Any:
        ok = check("load", ptrs, mask, readable)
        return real_load(self, ptrs, mask if ok else type(mask)(np.zeros_like(mask.data), mask.dtype), other, *args)

    def store(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any) -> Any:
        if check("store", ptrs, mask, stores):
            return real_store(self, ptrs, value, mask, *args)
        return None

    def scratch(*args: Any) -> Any:
        buf = real_scratch(*args)
        readable.extend(spans([buf]))
        stores.extend(spans([buf]))
        return buf

    real_scratch = triton_kernel._scratch
    builder.create_masked_load, builder.create_masked_store = load, store
    triton_kernel._scratch = scratch
    try:
        yield errors
    finally:
        builder.create_masked_load, builder.create_masked_store = real_load, real_store
        triton_kernel._scratch = real_scratch


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # garbage in, garbage partials out
@pytest.mark.parametrize(
    ("fused", "splits", "index_dtype"),
    [(True, 1, torch.int32), (False, 1, torch.int64), (True, 2, torch.int64)],
    ids=["fused-int32", "two-kernels-int64", "fused-split"],
)
def test_garbage_metadata_never_accesses_out_of_bounds(fused: bool, splits: int, index_dtype: torch.dtype) -> None:
    """TensorRT times plugins on made-up inputs: whatever positions, block tables and query_start_loc hold (random
    values of the whole integer range, all zeros), every load and store stays inside the op's tensors."""
    rng = np.random.default_rng(int(fused) + splits)
    hq, hkv, d, bs, nb, t, b, m = 4, 2, 16, 3, 5, 7, 3, 4
    info = np.iinfo(np.int32 if index_dtype == torch.int32 else np.int64)
    attrs = PagedAttentionAttrs(hq, hkv, d, 0.25, rotary_interleaved=True)
    qkv = torch.from_numpy(rng.standard_normal((t, (hq + 2 * hkv) * d)).astype(np.float32))
    cos_sin = torch.from_numpy(rotary_cos_sin_cache(6, d, theta=100.0))
    for trial in range(4):
        if trial == 0:
            meta = [np.zeros(t), np.zeros((b, m)), np.zeros(b + 1)]
        else:
            lo, hi = (info.min, info.max) if trial % 2 else (-3, 12)
            meta = [rng.integers(lo, hi, size=s, dtype=info.dtype) for s in ((t,), (b, m), (b + 1,))]
        positions, tables, qsl = (torch.from_numpy(np.asarray(x)).to(index_dtype) for x in meta)
        k_cache, v_cache = torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d)
        out = torch.zeros(t, hq * d)
        inputs = [qkv, positions, tables, qsl, cos_sin]
        with bounds_checked(inputs, [k_cache, v_cache, out]) as errors:
            triton_kernel.paged_attention_triton(
                qkv, k_cache, v_cache, positions, tables, qsl, cos_sin, attrs,
                fused=fused, out=out, tiling=SMALL, num_kv_splits=splits,
            )  # fmt: skip
        assert errors == [], (trial, errors)


def test_bounds_checker_catches_an_out_of_bounds_access() -> None:
    """The instrumentation above is real: a cache one block short of what the block table names is caught."""
    rng = np.random.default_rng(1)
    step = make_step(rng, 4, 2, 16, 4, [6], [0])
    attrs = PagedAttentionAttrs(4, 2, 16, 0.25)
    full = torch.from_numpy(step.key_cache.copy())
    short_k, short_v = full[:1].clone(), full[:1].clone()  # the kernel clamps block ids to this one block...
    tables = torch.from_numpy(step.block_tables)
    args = (torch.from_numpy(step.positions), tables, torch.from_numpy(step.query_start_loc), None, attrs)
    qkv = torch.from_numpy(step.qkv)
    with bounds_checked([qkv, *args[:3]], [short_k, short_v]) as errors:  # ...but out is not registered
        triton_kernel.paged_attention_triton(qkv, short_k, short_v, *args, tiling=SMALL)
    assert errors and all(e.startswith("store") for e in errors)
