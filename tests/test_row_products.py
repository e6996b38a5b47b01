"""The one-row products of int4 weights dequantized in blocks (``trtbuild/backends/torch/row_products.py``) against
the weight dequantized code by code in float64: whole blocks only, a partial last block, fewer in-features than a
block, with and without zero points; eager and compiled by Inductor (which once miscomputed a transposed blocked
weight inside an engine's graph)."""

from __future__ import annotations

import pytest
import torch

from trtbuild.backends.torch.row_products import BlockedRows, dequantized_blocks, times_blocked_codes

CASES = [(96, 32, False), (80, 32, True), (16, 32, False), (200, 64, True)]  # in-features, block, zero points


def blocked_weight(in_features: int, block: int, zero_points: bool) -> tuple[torch.Tensor, ...]:
    """Random codes ``[out, in]`` (0..15 with zero points, else -8..7), float32 scales and uint8 zero points
    ``[out, blocks]``, and the float64 weight they stand for."""
    g = torch.Generator().manual_seed(in_features + block)
    out, blocks = 24, -(-in_features // block)
    low, high, dtype = (0, 16, torch.uint8) if zero_points else (-8, 8, torch.int8)
    codes = torch.randint(low, high, (out, in_features), generator=g).to(dtype)
    scale = torch.rand(out, blocks, generator=g) * 0.1 + 0.01
    zero = torch.randint(0, 16, (out, blocks), generator=g).to(torch.uint8) if zero_points else None
    per_code = torch.arange(in_features) // block
    shift = zero[:, per_code].double() if zero is not None else 0.0
    weight = (codes.double() - shift) * scale[:, per_code].double()
    return codes, scale, zero, weight


@pytest.mark.parametrize("in_features,block,zero_points", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_blocked_products_match_the_dequantized_weight(in_features, block, zero_points, dtype):
    codes, scale, zero, weight = blocked_weight(in_features, block, zero_points)
    w = BlockedRows("codes", "scale", "zero" if zero is not None else None, block)
    a = torch.randn(1, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = a.double() @ weight.T
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2 * float(expected.abs().max())
    got = times_blocked_codes(a, w, codes, scale, zero)
    assert got.dtype == dtype and got.shape == (1, codes.shape[0])
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=0)
    dequantized = dequantized_blocks(w, codes, scale, zero, dtype)
    assert dequantized.dtype == dtype and dequantized.shape == codes.shape
    torch.testing.assert_close(dequantized.double(), weight, atol=1e-6 if dtype == torch.float32 else 2e-2, rtol=1e-2)


@pytest.mark.parametrize("in_features,block,zero_points", CASES)
def test_compiled_blocked_products_match_the_dequantized_weight(in_features, block, zero_points):
    codes, scale, zero, weight = blocked_weight(in_features, block, zero_points)
    w = BlockedRows("codes", "scale", "zero" if zero is not None else None, block)

    def products(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # one row fused; three rows by a matmul
        return times_blocked_codes(a[:1], w, codes, scale, zero), a @ dequantized_blocks(
            w, codes, scale, zero, a.dtype
        ).t()

    a = torch.randn(3, in_features, generator=torch.Generator().manual_seed(2))
    one, several = torch.compile(products, fullgraph=True)(a)
    expected = a.double() @ weight.T
    torch.testing.assert_close(one.double(), expected[:1], atol=1e-4, rtol=0)
    torch.testing.assert_close(several.double(), expected, atol=1e-4, rtol=0)
