"""trtbuild's own int4 weight quantization (``int4_wo`` and ``int4_awq``), symmetric or with zero points.

Per group of ``group`` input features of each output row (a last partial group spans the remaining features):
- symmetric: ``scale = amax / 7``, ``q = clamp(round(w / scale), -8, 7)``, ``w ~ q * scale``;
- zero points (``QuantConfig.zero_points``, llama.cpp's Q4_1 and the AWQ paper's grid): ``scale = (max - min) / 15``,
  ``zp = clamp(round(-min / scale), 0, 15)``, ``q = clamp(round(w / scale) + zp, 0, 15)``, ``w ~ (q - zp) * scale``.

A clip ``ratio`` (AWQ's clip search, ``awq.py``) shrinks the range (``amax``, or ``min`` and ``max``) before that.
The quantized module keeps its codes (``Int4Weight``, for the export) and computes with exactly what the engine
computes: its weight becomes the dequantized weight and a forward pre-hook multiplies its input by the pre-quant
scale, so the calibrated model stays the fake-quantized oracle of the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoint.formats import pack_int4

SYMMETRIC_BOUND = 7.0
UNSIGNED_MAX = 15.0
TINY = 1e-8  # smallest scale: an all-zero group quantizes to zeros instead of dividing by zero


@dataclass
class Int4Weight:
    """The int4 form of one ``[out, in]`` weight: ``codes`` (int8 in [-8, 7], or in [0, 15] with zero points)
    ``[out, in]``, ``scale`` float32 ``[out, groups]``, ``zero_point`` (uint8 codes ``[out, groups]`` or None) and
    the ``pre_quant_scale`` ``[in]`` its input is multiplied by (AWQ; None for round-to-nearest)."""

    codes: Any
    scale: Any
    zero_point: Any | None
    pre_quant_scale: Any | None

    def dequantized(self, group: int) -> Any:
        """The float ``[out, in]`` weight the codes stand for (still to be applied to the pre-scaled input)."""
        cols = self.codes.shape[1]
        scale = self.scale.repeat_interleave(group, dim=1)[:, :cols]
        q = self.codes.float()
        if self.zero_point is not None:
            q = q - self.zero_point.float().repeat_interleave(group, dim=1)[:, :cols]
        return q * scale


def grouped(w: Any, group: int) -> Any:
    """``[..., out, in]`` -> ``[..., out, groups, group]``; a partial last group is padded with copies of the
    row's last feature, which leaves its range as it is (padded features meet zero inputs in the searches)."""
    import torch

    cols = w.shape[-1]
    pad = -cols % group
    if pad:
        w = torch.cat([w, w[..., -1:].expand(*w.shape[:-1], pad)], dim=-1)
    return w.reshape(*w.shape[:-1], -1, group)


def group_ranges(wg: Any, zero_points: bool) -> tuple[Any, Any | None]:
    """The range of grouped weights ``[..., groups, group]``, each ``[..., groups, 1]``: ``(amax, None)``
    (symmetric), or ``(max, min)`` widened to hold 0 (zero points: 0 stays exact)."""
    if not zero_points:
        return wg.abs().amax(dim=-1, keepdim=True), None
    return wg.amax(dim=-1, keepdim=True).clamp_min(0.0), wg.amin(dim=-1, keepdim=True).clamp_max(0.0)


def group_params(ranges: tuple[Any, Any | None], ratio: Any = 1.0) -> tuple[Any, Any | None]:
    """``(scale, zero point or None)``, each ``[..., groups, 1]`` (zero point as float), of ``ranges`` shrunk by
    ``ratio`` (a number, or broadcast against ``[..., groups, 1]``)."""
    import torch

    hi, lo = ranges
    if lo is None:
        return (hi * ratio / SYMMETRIC_BOUND).clamp_min(TINY), None
    scale = ((hi - lo) * ratio / UNSIGNED_MAX).clamp_min(TINY)
    return scale, torch.round(-lo * ratio / scale).clamp(0.0, UNSIGNED_MAX)


def fake_quantize(wg: Any, ranges: tuple[Any, Any | None], ratio: Any = 1.0) -> Any:
    """Quantize-dequantize grouped weights ``[..., groups, group]`` of ``ranges`` (``group_ranges``) shrunk by
    ``ratio``."""
    scale, zp = group_params(ranges, ratio)
    return (codes_of(wg, scale, zp) - (0.0 if zp is None else zp)) * scale


def codes_of(wg: Any, scale: Any, zp: Any | None) -> Any:
    """The float codes of grouped weights: in [-8, 7] (symmetric) or [0, 15] (zero points)."""
    import torch

    if zp is None:
        return torch.round(wg / scale).clamp(-SYMMETRIC_BOUND - 1, SYMMETRIC_BOUND)
    return torch.round(wg / scale + zp).clamp(0.0, UNSIGNED_MAX)


def quantize_weight(w: Any, group: int, zero_points: bool, ratio: Any = 1.0) -> Int4Weight:
    """The int4 form of ``w`` ``[out, in]`` (``ratio``: 1, or per group ``[out, groups, 1]``)."""
    import torch

    wg = grouped(w.float(), group)
    scale, zp = group_params(group_ranges(wg, zero_points), ratio)
    codes = codes_of(wg, scale, zp).flatten(-2)[:, : w.shape[1]]
    return Int4Weight(
        codes.to(torch.int8 if zp is None else torch.uint8),
        scale.squeeze(-1).float().contiguous(),
        None if zp is None else zp.squeeze(-1).to(torch.uint8),
        None,
    )


def install(module: Any, q: Int4Weight, group: int) -> None:
    """Make ``module`` (an ``nn.Linear``, modelopt's quantizers off) compute with ``q``: the dequantized weight
    and, with a pre-quant scale, a forward pre-hook multiplying its input by it; the codes stay on
    ``module.int4_weight`` for the export."""
    import torch

    with torch.no_grad():
        module.weight.copy_(q.dequantized(group).to(module.weight.dtype))
    module.int4_weight = q
    if q.pre_quant_scale is not None:
        pqs = q.pre_quant_scale.to(module.weight.dtype)
        module.register_forward_pre_hook(lambda _m, args: (args[0] * pqs, *args[1:]))


def export_int4_linear(modules: list[Any], prefix: str) -> dict[str, Any]:
    """The checkpoint tensors of canonical linear ``prefix`` from its quantized (``install``-ed) ``modules``:
    packed codes, scales, zero points when used, and the (shared) pre-quant scale when set."""
    import torch

    parts: list[Int4Weight] = [m.int4_weight for m in modules]
    out = {
        prefix + ".weight": pack_int4(torch.cat([p.codes for p in parts])),
        prefix + ".weight_scale": torch.cat([p.scale for p in parts]).contiguous(),
    }
    if parts[0].zero_point is not None:
        out[prefix + ".weight_zero_point"] = torch.cat([p.zero_point for p in parts]).contiguous()
    if parts[0].pre_quant_scale is not None:
        out[prefix + ".pre_quant_scale"] = parts[0].pre_quant_scale.float().clone()
    return out
