"""The Triton kernel against the numpy oracle, run on the CPU through Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

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
    PagedAttentionAttrs,
    paged_attention,
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
) -> None:
    """Run the oracle and the kernel on the same step; compare output and both updated caches."""
    ref_out, ref_k, ref_v = paged_attention(
        step.qkv,
        step.key_cache,
        step.value_cache,
        step.positions,
        step.block_tables,
        step.query_start_loc,
        cos_sin,
        attrs,
    )
    k = torch.from_numpy(step.key_cache.copy())
    v = torch.from_numpy(step.value_cache.copy())
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
    )
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-4, rtol=0)
    np.testing.assert_allclose(k.numpy(), ref_k, atol=1e-4, rtol=0)
    np.testing.assert_allclose(v.numpy(), ref_v, atol=1e-4, rtol=0)


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
    with pytest.raises(ValueError, match="rotary dim"):
        triton_kernel.paged_attention_triton(qkv, cache, cache.clone(), *meta, torch.zeros(8, 10), attrs)


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=300
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
    assert "pip install 'triton==3.9.0'" in result.stdout


def test_fused_kernel_compiles_to_ptx_without_a_gpu() -> None:
    """The TensorRT AOT path: Triton's own LLVM + ptxas turn the fused kernel into PTX for sm_80 and sm_90."""
    code = """
        import re
        from trtbuild.plugins.paged_attention.reference import PagedAttentionAttrs
        from trtbuild.plugins.paged_attention.triton_kernel import compile_ptx
        for arch, ftype in ((80, "fp16"), (90, "fp32")):
            k = compile_ptx(PagedAttentionAttrs(6, 2, 64, 0.125, True), has_rope=True, arch=arch, float_type=ftype)
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
    assert [line[0] for line in lines] == ["80", "90"]
    for arch, name, entry, target, params, threads, mma, block_q in lines:
        assert name == entry == "_paged_attention_kernel"
        assert target.startswith(f"sm_{arch}")
        # 10 pointers + 7 int32 scalars in TensorRT's (inputs, scalars, outputs) order, then Triton's two scratch
        # pointers, which TensorRT's AOT launcher leaves null (the kernel uses no scratch: checked in compile_ptx).
        assert int(params) == 19
        assert int(threads) % 32 == 0
        assert int(block_q) == 64 // 3  # AOT tiling: 64 rows = 21 tokens x 3 query heads per kv head
    assert lines[0][6] == "1"  # fp16 on sm_80 runs QK^T and PV on tensor cores
