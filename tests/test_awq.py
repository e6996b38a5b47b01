"""trtbuild's int4 quantizer and AWQ searches (``quantize/int4.py``, ``quantize/awq.py``) on synthetic linears."""

from __future__ import annotations

import copy

import pytest
import torch

from trtbuild.config import QFormat, QuantConfig
from trtbuild.quantize.awq import InputStats, _awq_group, low_rank, output_error
from trtbuild.quantize.int4 import install, quantize_weight


def activations(tokens: int, width: int, seed: int) -> torch.Tensor:
    """LLM-like inputs: a few channels carry most of the magnitude, and channels are correlated."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g) @ (torch.eye(width) + 0.3 * torch.randn(width, width, generator=g))
    x[:, :: width // 8] *= 20.0  # outlier channels
    return x


def test_gram_error_is_the_output_error():
    g = torch.Generator().manual_seed(0)
    x, dw = torch.randn(300, 48, generator=g), torch.randn(7, 48, generator=g)
    direct = (x @ dw.T).square().sum(0)
    torch.testing.assert_close(output_error(dw, x.T @ x), direct, rtol=1e-4, atol=1e-3)


def test_low_rank_keeps_the_diagonal_and_the_top_directions():
    x = activations(500, 96, 1)
    gram = x.T @ x
    basis, residual = low_rank(gram, rank=16)
    approx = basis @ basis.T + torch.diag(residual)
    torch.testing.assert_close(torch.diagonal(approx), torch.diagonal(gram), rtol=1e-4, atol=1e-2)
    top = torch.linalg.eigh(gram).eigenvalues[-4:]
    torch.testing.assert_close(torch.linalg.eigh(basis @ basis.T).eigenvalues[-4:], top, rtol=1e-3, atol=1e-2)
    exact, _ = low_rank(gram[:8, :8], rank=16)  # rank >= width: exact
    torch.testing.assert_close(exact @ exact.T, gram[:8, :8], rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("zero_points", [False, True])
def test_int4_codes_and_round_trip(zero_points):
    w = torch.randn(16, 80) + (0.5 if zero_points else 0.0)  # a partial last group of 16
    q = quantize_weight(w, 32, zero_points)
    lo, hi = (0, 15) if zero_points else (-8, 7)
    assert int(q.codes.min()) >= lo and int(q.codes.max()) <= hi and q.scale.shape == (16, 3)
    assert (q.zero_point is not None) == zero_points
    err = (q.dequantized(32) - w).abs()
    step = q.scale.repeat_interleave(32, dim=1)[:, :80]
    assert bool((err <= step / 2 + 1e-6).all())  # round-to-nearest over the whole (unclipped) range


@pytest.mark.parametrize("zero_points", [False, True])
def test_awq_beats_round_to_nearest_on_held_out_tokens(zero_points):
    """Scale and clip searches on calibration tokens lower the output error on other tokens of the same kind."""
    torch.manual_seed(0)
    linears = [torch.nn.Linear(128, 96, bias=False), torch.nn.Linear(128, 64, bias=False)]  # two sharing an input
    calib, held_out = activations(2048, 128, 2), activations(1024, 128, 3)
    stats = InputStats(torch.zeros(128, 128), torch.zeros(128))
    stats.add(calib)
    qcfg = QuantConfig(qformat=QFormat.INT4_AWQ, group_size=32, zero_points=zero_points)
    with torch.no_grad():
        ref = [m(held_out) for m in linears]
        rtn = copy.deepcopy(linears)
        for m in rtn:
            install(m, quantize_weight(m.weight, 32, zero_points), 32)
        awq = copy.deepcopy(linears)
        _awq_group(awq, ("self_attn.v_proj", "self_attn.o_proj"), stats, qcfg)
        assert torch.equal(awq[0].int4_weight.pre_quant_scale, awq[1].int4_weight.pre_quant_scale)  # shared
        rtn_err = sum(float((m(held_out) - r).square().sum()) for m, r in zip(rtn, ref, strict=True))
        awq_err = sum(float((m(held_out) - r).square().sum()) for m, r in zip(awq, ref, strict=True))
    assert awq_err < 0.8 * rtn_err
