"""FP8 rowwise weight scales searched against the calibration inputs (``fp8`` with dynamic activation scales).

E4M3 is a floating-point format: a scale that is a power of two times another rounds every weight alike, so a
scale's size barely matters and only its mantissa does, which places the E4M3 grid relative to a row's values.
With ``amax / 448`` per row (max calibration) that placement is an accident, and on SmolLM2-135M one accident or
another moved the weight-only cost between +0.4% and +3.3% (``benchmarks/fp8_granularity.py``,
docs/quantization.md: this, not the granularity, is why per-channel scales once measured worse than per-tensor).

So each row tries its range times ``2^(k / STEPS)`` for ``k < STEPS`` (never below the max: nothing is clipped) and
keeps the one whose rounding error ``e`` costs the least output error against the inputs the row will meet, the
per-token E4M3 activations ``xq`` of the calibration tokens: ``E[(e.xq + w.(xq - x))^2] = e^T H e + 2 e^T C w +
const`` with ``H = E[xq xq^T]`` and ``C = E[xq (xq - x)^T]``. The fused modules of a canonical linear (q/k/v,
gate/up) read one input and share its moments. The result is set as each weight quantizer's ``amax``, so the
fake-quantized model and the exported checkpoint use it alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checkpoint.formats import Numeric
from ..checkpoint.layout import canonical_linears, excluded_linears
from ..config import ModelConfig, QuantConfig
from .hf_model import hf_modules

STEPS = 16  # candidate grid offsets per binade


def e4m3(x: Any, amax: Any) -> Any:
    """``x`` fake-quantized to E4M3 with ``scale = amax / 448`` (saturating; a zero range leaves zeros)."""
    import torch

    scale = torch.clamp(amax.float(), min=torch.finfo(torch.float32).tiny) / Numeric.FP8.bound
    q = (x.float() / scale).clamp(-Numeric.FP8.bound, Numeric.FP8.bound).to(torch.float8_e4m3fn)
    return q.float() * scale


def search_weight_scales(model: Any, cfg: ModelConfig, qcfg: QuantConfig, samples: np.ndarray) -> None:
    """Set every quantized decoder linear's per-row weight range to the searched one (module doc), in place."""
    import torch

    excluded = set(excluded_linears(cfg, qcfg.exclude))
    quantized = [name for name in canonical_linears(cfg) if name != "lm_head" and name not in excluded]
    groups = {name: hf_modules(cfg, name) for name in quantized}
    moments: dict[str, Any] = {}

    def record(name: str) -> Any:
        def hook(_module: Any, args: tuple[Any, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            xq = e4m3(x, x.abs().amax(-1, keepdim=True))  # what the per-token dynamic quantizer makes of it
            new = torch.stack([xq.T @ xq, xq.T @ (xq - x)])
            moments[name] = moments[name] + new if name in moments else new

        return hook

    handles = [model.get_submodule(mods[0]).register_forward_pre_hook(record(n)) for n, mods in groups.items()]
    try:
        with torch.no_grad():
            for row in samples:
                model(torch.from_numpy(np.ascontiguousarray(row))[None])
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        for name, mods in groups.items():
            h, c = moments.pop(name) / samples.size
            for module_name in mods:
                quantizer = model.get_submodule(module_name).weight_quantizer
                w = model.get_submodule(module_name).weight.detach().float()
                quantizer.amax = best_row_ranges(w, h, c).reshape(quantizer.amax.shape)


def best_row_ranges(w: Any, h: Any, c: Any) -> Any:
    """``[out, 1]``: per row of ``w``, the range ``max|w| x 2^(k / STEPS)`` with the least output error."""
    import torch

    base = w.abs().amax(dim=1, keepdim=True)
    wc = w @ c.T
    best_err, best = None, base
    for k in range(STEPS):
        amax = base * 2.0 ** (k / STEPS)
        e = e4m3(w, amax) - w
        err = ((e @ h) * e).sum(1, keepdim=True) + 2 * (e * wc).sum(1, keepdim=True)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, amax, best)
    return best
