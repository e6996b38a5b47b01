"""int4 calibration of the decoder linears: round-to-nearest (``int4_wo``) or AWQ (``int4_awq``), both with or
without zero points (``int4.py`` has the number formats).

AWQ (Lin et al., 2023, as llm-awq runs it), layer by layer on the calibration tokens:
1. one float forward of the decoder layer records, per group of linears that read one input (q/k/v, o, gate/up,
   down), the Gram matrix ``H = X^T X`` of that input over every calibration token and its mean magnitude per
   channel. The output error of any weight change ``dW`` is then ``sum(dW H * dW)`` (``H`` is all the search needs
   from the tokens: the searches cost the same for 1k or 100k tokens);
2. scale search: ``s = mean|x|^alpha`` (normalised) for ``alpha`` in 0, 0.05, ..., 0.95; the group's weights are
   quantized as ``Q(W * s)`` (the input is divided by ``s``: the pre-quant scale ``1/s``, which the fused modules
   share); the ``alpha`` with the least output error over the group's modules wins (0 is round-to-nearest);
3. clip search: per group of ``group`` weights of each output row, the range shrunk by 1, 0.95, ..., 0.5 that
   minimises that group's own output error (the diagonal blocks of ``H``); q and k are not clipped (their error
   reaches the output through the attention scores, as llm-awq found), nor the q and k rows of a fused
   ``qkv_proj`` (Phi-3);
4. the next layer reads the float layer's output, with the mask and rotary tables the model gives that layer
   (``_layer_inputs``: Gemma 3's sliding and full layers differ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checkpoint.layout import excluded_linears
from ..config import ModelConfig, QFormat, QuantConfig
from .hf_model import layer_linears
from .int4 import Int4Weight, fake_quantize, group_ranges, grouped, install, quantize_weight

SCALE_GRID = [i / 10 for i in range(10)]  # alpha of s = mean|x| ** alpha, then refined to the nearest 0.05
CLIP_GRID = [1.0 - i / 20 for i in range(11)]  # range shrink ratios, as llm-awq's
RANK = 64  # eigen-directions of the Gram matrix the scale search keeps exactly
SEARCH_ROWS = 512  # weight rows the scale search measures (evenly spaced)
UNCLIPPED = ("self_attn.q_proj", "self_attn.k_proj")
FUSED_QKV = "self_attn.qkv_proj"  # q | k | v rows: only the v rows are clipped
MIN_MAGNITUDE = 1e-4


@dataclass
class InputStats:
    """What the searches need from one linear input: ``gram`` ``[in, in]`` (sum of x^T x) and ``mean_abs`` ``[in]``."""

    gram: Any
    abs_sum: Any
    tokens: int = 0

    def add(self, x: Any) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.gram.addmm_(x.T, x)
        self.abs_sum += x.abs().sum(0)
        self.tokens += x.shape[0]

    @property
    def mean_abs(self) -> Any:
        return self.abs_sum / max(self.tokens, 1)


def quantize_int4(model: Any, cfg: ModelConfig, qcfg: QuantConfig, samples: np.ndarray, *, progress: bool) -> None:
    """Quantize every non-excluded decoder linear of ``model`` to int4 in place (``install``): AWQ on ``samples``
    for ``int4_awq``, round-to-nearest otherwise."""
    import torch

    from ..progress import Progress

    excluded = set(excluded_linears(cfg, qcfg.exclude))
    layers = model.model.layers
    if qcfg.qformat is not QFormat.INT4_AWQ:
        for n, layer in enumerate(layers):
            for _, names in _quantized_groups(cfg, n, excluded):
                for name in names:
                    module = layer.get_submodule(name)
                    install(module, quantize_weight(module.weight, qcfg.group_size, qcfg.zero_points), qcfg.group_size)
        return
    with torch.no_grad():
        hidden, layer_kwargs = _layer_inputs(model, samples)
        qk_rows = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_size
        desc = f"calibrating {qcfg.qformat.value} (AWQ searches)"
        with Progress(len(layers), desc, "layer", enabled=None if progress else False) as bar:
            for n, layer in enumerate(layers):
                groups = _quantized_groups(cfg, n, excluded)
                stats = _record_inputs(layer, groups, hidden, layer_kwargs[n])
                hidden = stats.pop("__output__")
                for canonical, names in groups:
                    modules = [layer.get_submodule(name) for name in names]
                    _awq_group(modules, names, stats[canonical], qcfg, qk_rows=qk_rows)
                bar.update()


def _quantized_groups(cfg: ModelConfig, n: int, excluded: set[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(canonical suffix, HF module names below the layer) of layer ``n``'s quantized linears."""
    linears = layer_linears(cfg)
    return [(suffix, modules) for suffix, modules in linears.items() if f"layers.{n}.{suffix}" not in excluded]


def _layer_inputs(model: Any, samples: np.ndarray) -> tuple[Any, list[dict[str, Any]]]:
    """The hidden states entering the first decoder layer for ``samples`` (one batch) and, per layer, the keyword
    arguments the model passes it (mask, rotary tables, positions: Gemma 3's sliding and full layers get their own
    mask and tables). Recorded by one pass of the model's body with every layer swapped for a pass-through."""
    import torch

    layers = model.model.layers
    originals = list(layers)
    hidden: list[Any] = []
    per_layer: list[dict[str, Any]] = []

    class Record(torch.nn.Module):
        def forward(self, hidden_states: Any, **kwargs: Any) -> Any:
            if not hidden:  # the later layers get the pass-through of the same tensor
                hidden.append(hidden_states)
            per_layer.append({k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")})
            return hidden_states

    try:
        for n in range(len(layers)):
            layers[n] = Record()
        model.model(torch.from_numpy(np.ascontiguousarray(samples)), use_cache=False)
    finally:
        for n, layer in enumerate(originals):
            layers[n] = layer
    assert len(per_layer) == len(originals), (len(per_layer), len(originals))
    return hidden[0], per_layer


def _record_inputs(
    layer: Any, groups: list[tuple[str, tuple[str, ...]]], hidden: Any, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Run the float ``layer`` once, recording ``InputStats`` of each group's input; ``"__output__"``: its output."""
    import torch

    stats: dict[str, Any] = {}
    handles = []
    for canonical, names in groups:
        module = layer.get_submodule(names[0])
        width = module.in_features
        stats[canonical] = InputStats(torch.zeros(width, width), torch.zeros(width))
        handles.append(module.register_forward_pre_hook(lambda _m, args, s=stats[canonical]: s.add(args[0])))
    try:
        out = layer(hidden, **kwargs)
    finally:
        for h in handles:
            h.remove()
    stats["__output__"] = out[0] if isinstance(out, tuple) else out
    return stats


def output_error(dw: Any, gram: Any) -> Any:
    """``sum over tokens of |x dW^T|^2`` for each row of ``dw`` ``[..., out, in]``, from ``gram`` = X^T X."""
    return ((dw @ gram) * dw).sum(-1)


def low_rank(gram: Any, rank: int = RANK) -> tuple[Any, Any]:
    """``(basis [in, rank], residual [in])`` with ``gram ~ basis basis^T + diag(residual)``: the top eigenvectors
    (three subspace iterations; activation Gram matrices are dominated by a few outlier directions), the rest by
    its exact diagonal."""
    import torch

    rank = min(rank, gram.shape[0])
    v = torch.randn(gram.shape[0], rank, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        v, _ = torch.linalg.qr(gram @ v)
    eigenvalues, u = torch.linalg.eigh(v.T @ gram @ v)
    basis = (v @ u) * eigenvalues.clamp_min(0.0).sqrt()
    return basis, (torch.diagonal(gram) - basis.square().sum(1)).clamp_min(0.0)


def _scale_search(w: Any, stats: InputStats, group: int, zero_points: bool) -> Any:
    """AWQ's per-input-channel scale ``s`` (``Q(W s)`` on ``x / s``) with the least output error of ``w``: ``alpha``
    on a coarse grid, then refined between its neighbours; the error is measured on at most ``SEARCH_ROWS``
    evenly spaced rows of ``w``, through the low-rank-plus-diagonal form of the input's Gram matrix."""

    rows = w[:: max(1, w.shape[0] // SEARCH_ROWS)]
    cols = w.shape[1]
    basis, residual = low_rank(stats.gram)
    magnitude = stats.mean_abs.clamp_min(MIN_MAGNITUDE)
    errors: dict[float, tuple[float, Any]] = {}

    def error(alpha: float) -> float:
        if alpha not in errors:
            s = magnitude.pow(alpha)
            s = s / (s.max() * s.min()).sqrt()
            ws = grouped(rows * s, group)
            dws = (fake_quantize(ws, group_ranges(ws, zero_points)) - ws).flatten(-2)[:, :cols]  # = dW_eff * s
            err = (dws @ (basis / s[:, None])).square().sum() + (dws.square() @ (residual / s.square())).sum()
            errors[alpha] = (float(err), s)
        return errors[alpha][0]

    coarse = min(SCALE_GRID, key=error)
    step = SCALE_GRID[1] - SCALE_GRID[0]
    best = min([coarse, *(a for a in (coarse - step / 2, coarse + step / 2) if 0.0 <= a < 1.0)], key=error)
    return errors[best][1]


def _awq_group(
    modules: list[Any], names: tuple[str, ...], stats: InputStats, qcfg: QuantConfig, *, qk_rows: int = 0
) -> None:
    """Scale search over the modules reading one input, then each module's clip search; installs the result.
    ``qk_rows``: the leading (q and k) rows of a fused ``qkv_proj``, left unclipped."""
    import torch

    group, zp = qcfg.group_size, qcfg.zero_points
    s = _scale_search(torch.cat([m.weight.float() for m in modules]), stats, group, zp)
    gram_scaled = stats.gram / (s[:, None] * s[None, :])  # the Gram matrix of x / s
    blocks = _diagonal_blocks(gram_scaled, group)
    for module, name in zip(modules, names, strict=True):
        ws = module.weight.float() * s
        ratio: Any = 1.0
        if name == FUSED_QKV:
            wg = grouped(ws, group)
            ratio = torch.ones(*wg.shape[:2], 1)
            ratio[qk_rows:] = _clip_ratios(wg[qk_rows:], blocks, zp)
        elif name not in UNCLIPPED:
            ratio = _clip_ratios(grouped(ws, group), blocks, zp)
        q = quantize_weight(ws, group, zp, ratio)
        install(module, Int4Weight(q.codes, q.scale, q.zero_point, (1.0 / s).float()), group)


def _diagonal_blocks(gram: Any, group: int) -> Any:
    """``[groups, group, group]``: the Gram matrix's blocks of each weight group's inputs (zero-padded)."""
    import torch

    cols = gram.shape[0]
    padded = torch.zeros(-(-cols // group) * group, -(-cols // group) * group)
    padded[:cols, :cols] = gram
    g = padded.shape[0] // group
    return torch.stack([padded[i * group : (i + 1) * group, i * group : (i + 1) * group] for i in range(g)])


def _clip_ratios(wg: Any, blocks: Any, zero_points: bool) -> Any:
    """Per output row and group, the range shrink of ``CLIP_GRID`` with the least output error: ``[out, groups, 1]``."""
    import torch

    ranges = group_ranges(wg, zero_points)
    best_err = torch.full(wg.shape[:2], float("inf"))
    best_ratio = torch.ones(wg.shape[:2])
    for ratio in CLIP_GRID:
        dw = (fake_quantize(wg, ranges, ratio) - wg).transpose(0, 1)  # [groups, out, group]
        err = output_error(dw, blocks).T  # [out, groups]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return best_ratio[..., None]
