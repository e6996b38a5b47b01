"""FP8 (E4M3) scale granularity on SmolLM2-135M: per-tensor vs per-channel weights, static vs dynamic activations.

    python benchmarks/fp8_granularity.py [--datasets lee_news flask_docs] [--variants NAME ...] [--checkpoint]
        [--draws N] [--threads T] [--windows 8] [--seq-len 512] [--calib-size 16] [--calib-seq-len 256]

Every linear but ``lm_head`` of the transformers model rebuilt from the float32 checkpoint of the GGUF is
fake-quantized, and the perplexity on the evaluation windows ``trtbuild eval`` scores (``eval.eval_windows``) is
compared with the float model's. Two implementations of the same casts:

- ``own:``: exact E4M3 casts, trtbuild's ``quantize.fp8.e4m3`` (``x / scale`` saturated at +-448,
  ``torch.float8_e4m3fn``, times ``scale``; ``scale = amax / 448``, as the checkpoint stores it and ONNX
  QuantizeLinear divides by it). Weights per tensor (per source module: q, k, v, gate, up separately, as trtbuild's
  fp8 checkpoint is) or per output channel;
  activations static per tensor (max over the lee_news calibration split), dynamic per tensor, or dynamic per
  token (each row's max, computed at run time). Weight ranges ``@pow2``: rounded up to 448 x a power of two (the
  same E4M3 grid for both granularities); ``@search``: each row's (or module's) range times the ``2^(k/16)`` with
  the least output error ``e^T H e`` on the calibration inputs; ``@search_a``: the same against the per-token fp8
  inputs the weights will meet. ``--draws N``: N runs of per-tensor and per-channel weights with every range times
  a random factor in [1, 2) (the E4M3 grid moved, nothing clipped): the spread of the rounding draw;
- ``mo:``: modelopt's quantizers (``FP8_DEFAULT_CFG``; its weight quantizer with ``axis: 0``;
  ``FP8_PER_CHANNEL_PER_TOKEN_CFG``), calibrated as ``trtbuild quantize`` does (``calibrate.modelopt_config`` +
  ``mtq.quantize`` + ``calibrate.unify_fused_groups``), then also the checkpoint tensors ``export.export_linear``
  writes for them, dequantized back into the model (``ckpt:``, with ``--checkpoint``), so the export step is checked
  too.

Runs in torch (no engine build): 30 s to a few minutes per row and dataset on 2 shared cores. Findings:
docs/quantization.md, "FP8 scale granularity".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trtbuild.quantize.fp8 import e4m3

E4M3_MAX = 448.0

# variant -> (weights, activations); weights: None | "tensor" | "channel"; activations: None | "static" |
# "tensor" (dynamic per tensor) | "token" (dynamic per token)
OWN: dict[str, tuple[str | None, str | None]] = {
    "own:w_tensor": ("tensor", None),
    "own:w_channel": ("channel", None),
    "own:w_tensor@pow2": ("tensor@pow2", None),
    "own:w_channel@pow2": ("channel@pow2", None),
    "own:w_tensor@search": ("tensor@search", None),
    "own:w_channel@search": ("channel@search", None),
    "own:a_static": (None, "static"),
    "own:a_dyn_tensor": (None, "tensor"),
    "own:a_token": (None, "token"),
    "own:w_tensor+a_static": ("tensor", "static"),  # trtbuild's fp8 today
    "own:w_channel+a_static": ("channel", "static"),
    "own:w_channel+a_token": ("channel", "token"),  # FP8 rowwise
    "own:w_channel@search+a_token": ("channel@search", "token"),  # FP8 rowwise, searched weight scales
    "own:w_channel@search_a+a_token": ("channel@search_a", "token"),  # ... searched against fp8 activations
}
# modelopt variants: (weight axis, activations) on top of FP8_DEFAULT_CFG / FP8_PER_CHANNEL_PER_TOKEN_CFG
MODELOPT: dict[str, tuple[int | None, str | None]] = {
    "mo:w_tensor": (None, None),
    "mo:w_channel": (0, None),
    "mo:w_tensor+a_static": (None, "static"),  # FP8_DEFAULT_CFG: trtbuild's fp8
    "mo:w_channel+a_static": (0, "static"),
    "mo:w_channel+a_token": (0, "token"),  # FP8_PER_CHANNEL_PER_TOKEN_CFG
}
DEFAULT_VARIANTS = ["float", *OWN, *MODELOPT]


def weight_amax(w: Any, granularity: str, generator: Any = None) -> Any:
    """The range that maps to 448: ``[]`` (``tensor``) or ``[out, 1]`` (``channel``) of a ``[out, in]`` weight.

    ``tensor@pow2`` / ``channel@pow2``: the max rounded up to 448 x a power of two, so every scale is a power of two
    and the E4M3 grid is the same for both granularities (they differ only where a value is subnormal). With a
    ``generator``, each range is multiplied by a random factor in [1, 2): the same granularity, no clipping, the
    E4M3 grid shifted by a random fraction of a binade (one "draw" of the rounding errors)."""
    import torch

    kind, _, rounding = granularity.partition("@")
    amax = w.abs().amax() if kind == "tensor" else w.abs().amax(dim=1, keepdim=True)
    if rounding == "pow2":
        amax = E4M3_MAX * torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    if generator is not None:
        amax = amax * (1 + torch.rand(amax.shape, generator=generator))
    return amax


def quantized_linears(model: Any) -> dict[str, Any]:
    """The ``nn.Linear`` modules of the decoder layers (every linear but ``lm_head``)."""
    import torch

    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}


def static_amax(model: Any, samples: np.ndarray) -> dict[str, Any]:
    """Per-linear max |input| over the calibration ``samples`` (what modelopt's max calibrator records)."""
    import torch

    amax: dict[str, Any] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(_m: Any, args: tuple[Any, ...]) -> None:
            a = args[0].detach().abs().amax()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in quantized_linears(model).items()]
    with torch.no_grad():
        for row in samples:
            model(torch.from_numpy(np.ascontiguousarray(row))[None])
    for h in handles:
        h.remove()
    return amax


SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # modules reading one input


# twin of the moment hook inside fp8.search_weight_scales (no function of its own), which has no float-input case
def input_moments(model: Any, samples: np.ndarray, token_quantized: bool = False) -> dict[str, Any]:
    """Per-linear ``(H, C)`` of its input ``x`` over the calibration ``samples``: ``H = E[x x^T]`` ``[in, in]``
    and ``C`` None; with ``token_quantized``, of the per-token E4M3 input ``xq`` the weights will meet:
    ``H = E[xq xq^T]`` and ``C = E[xq (xq - x)^T]`` (the activation error the weight rounding may offset)."""
    import torch

    def reader(name: str) -> str:  # the module whose input hook records the shared input
        head, _, kind = name.rpartition(".")
        return f"{head}.{SHARED_INPUT.get(kind, kind)}"

    linears = quantized_linears(model)
    sums: dict[str, Any] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(_m: Any, args: tuple[Any, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            xq = e4m3(x, x.abs().amax(-1, keepdim=True)) if token_quantized else x
            new = torch.stack([xq.T @ xq, xq.T @ (xq - x)])
            sums[name] = sums[name] + new if name in sums else new

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items() if reader(n) == n]
    with torch.no_grad():
        for row in samples:
            model(torch.from_numpy(np.ascontiguousarray(row))[None])
    for h in handles:
        h.remove()
    moments = {n: sums[reader(n)] / samples.size for n in linears}
    return {n: (m[0], m[1] if token_quantized else None) for n, m in moments.items()}


# fp8.best_row_ranges is this per row against fp8 inputs; kept for the per-tensor and float-input variants measured
def searched_amax(w: Any, granularity: str, moments: tuple[Any, Any], steps: int = 16) -> Any:
    """The range of ``w`` x ``2^(k / steps)``, ``k < steps``, with the least output error (per row for ``channel``,
    summed over the rows for ``tensor``): the E4M3 grid offset that suits the inputs best. The error of a row ``w``
    rounded to ``w + e``: ``e^T H e`` for float inputs, ``E[(e.xq + w.(xq - x))^2] = e^T H e + 2 e^T C w + const``
    for quantized ones (``input_moments``)."""
    import torch

    h, c = moments
    wc = None if c is None else w @ c.T
    base = weight_amax(w, granularity)
    best_err, best = None, None
    for k in range(steps):
        amax = base * 2.0 ** (k / steps)
        e = e4m3(w, amax) - w
        err = ((e @ h) * e).sum(1, keepdim=True)
        if wc is not None:
            err = err + 2 * (e * wc).sum(1, keepdim=True)
        if granularity == "tensor":
            err = err.sum()
        if best is None:
            best_err, best = err, amax.expand_as(err).clone() if granularity == "channel" else amax
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, amax, best)
    return best


def apply_own(
    model: Any,
    weights: str | None,
    acts: str | None,
    calib: dict[str, Any],
    seed: int | None = None,
    moments: dict[str, Any] | None = None,
) -> None:
    """Fake-quantize ``model`` in place with the casts above (``seed``: random weight-range factors, one draw;
    ``moments``: the input second moments a ``@search`` weight granularity minimises the output error with)."""
    import torch

    generator = None if seed is None else torch.Generator().manual_seed(seed)
    for name, m in quantized_linears(model).items():
        if weights is not None:
            kind, _, rounding = weights.partition("@")
            with torch.no_grad():
                if rounding.startswith("search"):
                    assert moments is not None
                    amax = searched_amax(m.weight, kind, moments[name])
                else:
                    amax = weight_amax(m.weight, weights, generator)
                m.weight.copy_(e4m3(m.weight, amax))
        if acts == "static":
            m.register_forward_pre_hook(lambda _m, args, a=calib[name]: (e4m3(args[0], a),))
        elif acts == "tensor":
            m.register_forward_pre_hook(lambda _m, args: (e4m3(args[0], args[0].abs().amax()),))
        elif acts == "token":
            m.register_forward_pre_hook(lambda _m, args: (e4m3(args[0], args[0].abs().amax(-1, keepdim=True)),))


def modelopt_fp8_config(cfg: Any, axis: int | None, acts: str | None) -> dict[str, Any]:
    """trtbuild's modelopt config for fp8 (``calibrate.modelopt_config``), with the weight axis and the activation
    quantizer of the variant: static per tensor (FP8_DEFAULT_CFG), dynamic per token (FP8_PER_CHANNEL_PER_TOKEN_CFG's
    input quantizer) or none."""
    import modelopt.torch.quantization as mtq

    from trtbuild.config import ActivationScales, QFormat, QuantConfig
    from trtbuild.quantize.calibrate import modelopt_config

    config = modelopt_config(cfg, QuantConfig(qformat=QFormat.FP8, activation_scales=ActivationScales.STATIC))
    for entry in config["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer":
            entry["cfg"] = {**entry["cfg"], "axis": axis}
        if entry.get("quantizer_name") == "*input_quantizer":
            if acts == "token":
                (rowwise,) = [
                    e
                    for e in mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG["quant_cfg"]
                    if e["quantizer_name"] == "*input_quantizer"
                ]
                entry["cfg"] = copy.deepcopy(rowwise["cfg"])
            elif acts is None:
                entry["enable"] = False
    return config


def apply_modelopt(model: Any, cfg: Any, axis: int | None, acts: str | None, samples: np.ndarray) -> None:
    """Calibrate ``model`` with modelopt as ``trtbuild quantize`` does (quantize, then unify the fused groups)."""
    import modelopt.torch.quantization as mtq
    import torch

    from trtbuild.quantize.calibrate import unify_fused_groups

    def forward_loop(m: Any) -> None:
        with torch.no_grad():
            for row in samples:
                m(torch.from_numpy(np.ascontiguousarray(row))[None])

    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):  # modelopt prints its progress
        warnings.simplefilter("ignore")
        mtq.quantize(model, modelopt_fp8_config(cfg, axis, acts), forward_loop if acts == "static" else None)
        unify_fused_groups(model, cfg)


def checkpoint_model(model: Any, cfg: Any, base: Any) -> Any:
    """``base`` (a float model) with the weights and static input scales of the checkpoint tensors that
    ``export.export_linear`` makes from the calibrated modelopt ``model``: what the engine's Q/DQ graph computes."""
    import torch

    from trtbuild.checkpoint.formats import FORMATS
    from trtbuild.checkpoint.layout import canonical_linears
    from trtbuild.config import QFormat
    from trtbuild.quantize.export import export_linear
    from trtbuild.quantize.hf_model import hf_modules

    spec = FORMATS[QFormat.FP8]
    static = model.get_submodule(hf_modules(cfg, canonical_linears(cfg)[0])[0]).input_quantizer.is_enabled
    for prefix in canonical_linears(cfg):
        if prefix == "lm_head":
            continue
        names = hf_modules(cfg, prefix)
        modules = [model.get_submodule(n) for n in names]
        if not modules[0].weight_quantizer.is_enabled:
            continue
        t = export_linear(spec, modules, prefix, static)
        w = t[prefix + ".weight"].float() * t[prefix + ".weight_scale"][:, None]
        rows = [base.get_submodule(n).out_features for n in names]
        for n, part in zip(names, torch.split(w, rows), strict=True):
            with torch.no_grad():
                base.get_submodule(n).weight.copy_(part)
            if prefix + ".input_scale" in t:
                amax = t[prefix + ".input_scale"] * E4M3_MAX
                base.get_submodule(n).register_forward_pre_hook(lambda _m, args, a=amax: (e4m3(args[0], a),))
    return base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["lee_news", "flask_docs"])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=DEFAULT_VARIANTS)
    parser.add_argument("--checkpoint", action="store_true", help="also score the exported tensors of mo: variants")
    parser.add_argument(
        "--draws", type=int, default=0, help="random-grid draws of own:w_tensor and own:w_channel (the spread)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 runs better on a crowded machine)")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--calib-size", type=int, default=16)
    parser.add_argument("--calib-seq-len", type=int, default=256)
    args = parser.parse_args()

    import torch

    from trtbuild.checkpoint.files import load_checkpoint
    from trtbuild.config import DType, EvalConfig, QFormat, QuantConfig
    from trtbuild.convert.convert import convert
    from trtbuild.demo import smollm2_gguf_path
    from trtbuild.eval import eval_windows
    from trtbuild.quantize.hf_model import build_hf_model
    from trtbuild.quantize.quantize import calibration_samples

    torch.set_num_threads(args.threads)
    qcfg = QuantConfig(qformat=QFormat.FP8, calib_size=args.calib_size, calib_seq_len=args.calib_seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        convert(smollm2_gguf_path(), ckpt, DType.FLOAT32, dequantize=True)
        cfg, weights = load_checkpoint(ckpt)
        samples = calibration_samples(ckpt, qcfg)
        windows = {
            d: eval_windows(ckpt, EvalConfig(dataset=d, windows=args.windows, seq_len=args.seq_len))
            for d in args.datasets
        }

    def perplexity(model: Any, rows: np.ndarray) -> float:
        nll = 0.0
        with torch.no_grad():
            for row in rows:
                logits = model(torch.from_numpy(np.ascontiguousarray(row))[None]).logits[0].double()
                nll += float(torch.nn.functional.cross_entropy(logits[:-1], torch.from_numpy(row[1:]), reduction="sum"))
        return math.exp(nll / (rows.shape[0] * (rows.shape[1] - 1)))

    static = any(OWN[v][1] == "static" for v in args.variants if v in OWN)
    calib = static_amax(build_hf_model(cfg, weights), samples) if static else {}
    moments: dict[bool, dict[str, Any]] = {}  # token_quantized -> input_moments
    for kind in {str(OWN[v][0]) for v in args.variants if v in OWN and "@search" in str(OWN[v][0])}:
        quantized = kind.endswith("@search_a")
        if quantized not in moments:
            moments[quantized] = input_moments(build_hf_model(cfg, weights), samples, quantized)
    rows: list[tuple[str, list[float]]] = []

    def score(name: str, model: Any) -> None:
        rows.append((name, [perplexity(model, windows[d]) for d in args.datasets]))
        base = rows[0][1]
        cells = "  ".join(f"{p:8.3f} {100 * (p / b - 1):+6.2f}%" for p, b in zip(rows[-1][1], base, strict=True))
        print(f"| {name:28s} {cells}", flush=True)

    print(f"calibration: lee_news {samples.shape[0]} x {samples.shape[1]}; evaluation {args.windows} x {args.seq_len}")
    print(f"| {'variant':28s} " + "  ".join(f"{d:>17s}" for d in args.datasets))
    score("float", build_hf_model(cfg, weights))
    for name in [v for v in args.variants if v != "float"]:
        if name in OWN:
            model = build_hf_model(cfg, weights)
            apply_own(model, *OWN[name], calib, moments=moments.get(str(OWN[name][0]).endswith("@search_a")))
            score(name, model)
        elif name in MODELOPT:
            model = build_hf_model(cfg, weights)
            apply_modelopt(model, cfg, *MODELOPT[name], samples)
            score(name, model)
            if args.checkpoint and MODELOPT[name][1] != "token":
                score(name.replace("mo:", "ckpt:"), checkpoint_model(model, cfg, build_hf_model(cfg, weights)))
    for granularity in ("tensor", "channel") if args.draws else ():
        for seed in range(args.draws):
            model = build_hf_model(cfg, weights)
            apply_own(model, granularity, None, calib, seed)
            score(f"own:w_{granularity} draw {seed}", model)


if __name__ == "__main__":
    main()
