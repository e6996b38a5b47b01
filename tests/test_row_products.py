"""The one-row products of weights dequantized in blocks (``trtbuild/backends/torch/row_products.py``: int4 with or
without zero points, llama.cpp's Q4_1 with an offset, Q8_0) against the weight dequantized code by code in float64:
whole blocks only, a partial last block, fewer in-features than a block; eager and compiled by Inductor (which once
miscomputed a transposed blocked weight inside an engine's graph)."""

from __future__ import annotations

import pytest
import torch

from trtbuild.backends.torch.row_products import BlockTensors, dequantized_blocks, times_blocked_codes

# in-features, block, the codes' form: "symmetric" (-8..7), "zero_point" (0..15 less a zero point), "offset" (0..15,
# times the scale plus an offset: Q4_1)
CASES = [(96, 32, "symmetric"), (80, 32, "zero_point"), (16, 32, "symmetric"), (200, 64, "zero_point"),
         (96, 32, "offset"), (40, 32, "offset")]  # fmt: skip


def blocked_weight(in_features: int, block: int, form: str) -> tuple[BlockTensors, torch.Tensor]:
    """Random codes ``[out, in]`` and float32 factors ``[out, blocks]`` (uint8 zero points), and the float64 weight
    they stand for."""
    g = torch.Generator().manual_seed(in_features + block)
    out, blocks = 24, -(-in_features // block)
    low, high, dtype = (-8, 8, torch.int8) if form == "symmetric" else (0, 16, torch.uint8)
    codes = torch.randint(low, high, (out, in_features), generator=g).to(dtype)
    scale = torch.rand(out, blocks, generator=g) * 0.1 + 0.01
    zero = torch.randint(0, 16, (out, blocks), generator=g).to(torch.uint8) if form == "zero_point" else None
    offset = -torch.rand(out, blocks, generator=g) if form == "offset" else None
    per_code = torch.arange(in_features) // block
    weight = (codes.double() - (zero[:, per_code].double() if zero is not None else 0.0)) * scale[:, per_code].double()
    weight = weight + (offset[:, per_code].double() if offset is not None else 0.0)
    return BlockTensors(codes, scale, zero, offset), weight


@pytest.mark.parametrize("in_features,block,form", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_blocked_products_match_the_dequantized_weight(in_features, block, form, dtype):
    tensors, weight = blocked_weight(in_features, block, form)
    a = torch.randn(1, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = a.double() @ weight.T
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2 * float(expected.abs().max())
    got = times_blocked_codes(a, block, tensors)
    assert got.dtype == dtype and got.shape == (1, weight.shape[0])
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=0)
    dequantized = dequantized_blocks(block, tensors, dtype)
    assert dequantized.dtype == dtype and dequantized.shape == weight.shape
    torch.testing.assert_close(dequantized.double(), weight, atol=1e-6 if dtype == torch.float32 else 2e-2, rtol=1e-2)


@pytest.mark.parametrize("in_features,block,form", CASES)
def test_compiled_blocked_products_match_the_dequantized_weight(in_features, block, form):
    tensors, weight = blocked_weight(in_features, block, form)

    def products(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # one row fused; three rows by a matmul
        return times_blocked_codes(a[:1], block, tensors), a @ dequantized_blocks(block, tensors, a.dtype).t()

    a = torch.randn(3, in_features, generator=torch.Generator().manual_seed(2))
    one, several = torch.compile(products, fullgraph=True)(a)
    expected = a.double() @ weight.T
    torch.testing.assert_close(one.double(), expected[:1], atol=1e-4, rtol=0)
    torch.testing.assert_close(several.double(), expected, atol=1e-4, rtol=0)
