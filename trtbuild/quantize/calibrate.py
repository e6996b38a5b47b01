"""Calibration with NVIDIA modelopt: ``mtq.quantize`` on the transformers model rebuilt from the checkpoint.

Each ``QFormat`` starts from modelopt's own config (``FORMATS[...].modelopt_config``). trtbuild then sets:
- the int4 block size (``group_size``; a last partial block is zero-padded, which leaves its range unchanged);
- for ``int4_awq``, AWQ's clip search (``awq_clip``: per-block ranges that minimise the output error) after the
  config's AWQ-lite scale search *and* after the fused groups share one pre-quant scale (below): re-smoothing a
  module resets its weight ranges, so modelopt's ``awq_full`` (lite then clip, then the export's re-smoothing)
  would lose most of the clip search. On SmolLM2-135M at group 128 the engine measured +37.6% with ``awq_full``;
- the SmoothQuant alpha (default 0.8, not modelopt's 0.5: on SmolLM2-135M alpha 0.5 raised perplexity by a
  third, 0.8 by under 2%);
- with dynamic activation scales: fp8 takes modelopt's per-channel / per-token config, and int8_sq calibrates as
  SmoothQuant (for its smoothing scales) before its input quantizers are switched to run-time scales per block of
  16 in-features (``make_inputs_dynamic``; the calibrated per-tensor ranges are dropped);
- ``enable: False`` for the excluded modules (``lm_head`` stays out of modelopt's pass in every format);
- for a quantized KV cache, modelopt's per-tensor K/V quantizers (``*[kv]_bmm_quantizer``: keys after rotary,
  as the cache stores them).

The int4 formats are calibrated by trtbuild itself (``awq.py``: round-to-nearest or AWQ, symmetric or with zero
points): modelopt then only quantizes what else the format holds (the LM head when not excluded, KV-cache ranges,
calibrated on the int4 model). ``modelopt_int4=True`` keeps modelopt's own int4 calibration (symmetric only),
for comparison (``benchmarks/awq_vs_modelopt.py``).

After calibration the modules that one canonical tensor fuses (q/k/v, gate/up) get one pre-quant scale
(averaged; weights re-smoothed and re-quantized, as modelopt's export does) and one input range: the model is
then exactly what the exported checkpoint computes, and serves as the fake-quantized oracle.
"""

from __future__ import annotations

import contextlib
import copy
import io
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..checkpoint.formats import FORMATS, Numeric, activation_block, dynamic_activations, static_activations
from ..checkpoint.layout import canonical_linears, excluded_linears
from ..config import KVCacheDType, ModelConfig, QFormat, QuantConfig
from ..errors import TrtbuildError
from .hf_model import hf_modules

KV_NUM_BITS = {KVCacheDType.INT8: 8, KVCacheDType.FP8: (4, 3)}


def modelopt_reads_tokens(qcfg: QuantConfig) -> bool:
    """Whether calibrating ``qcfg`` runs the model on the calibration tokens for modelopt's quantizers or the
    smoothing: static activation ranges, SmoothQuant / AWQ pre-quant scales (AWQ by ``awq.py`` for int4 unless
    ``modelopt_int4``), KV-cache ranges. Else modelopt calibrates the weights alone (``forward_loop=None``: its max
    calibration reads every weight directly either way, and run-time activation scales record nothing)."""
    spec = FORMATS[qcfg.qformat]
    return static_activations(qcfg) or spec.smoothing or qcfg.kv_cache_dtype in KV_NUM_BITS


def modelopt_config(cfg: ModelConfig, qcfg: QuantConfig, *, int4_by_trtbuild: bool = False) -> dict[str, Any]:
    """modelopt's config for ``qcfg.qformat`` with trtbuild's block size, exclusions and KV-cache quantizers
    (with ``int4_by_trtbuild``, every decoder linear is left to ``awq.py``: disabled here)."""
    import modelopt.torch.quantization as mtq

    spec = FORMATS[qcfg.qformat]
    name = spec.dynamic_modelopt_config if dynamic_activations(qcfg) and spec.dynamic_modelopt_config else None
    if int4_by_trtbuild:
        name = "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"
    config = copy.deepcopy(getattr(mtq, name or spec.modelopt_config))
    if qcfg.qformat is QFormat.INT8_SQ:
        config["algorithm"] = {"method": "smoothquant", "alpha": qcfg.smoothquant_alpha}
    for entry in config["quant_cfg"]:
        block = (entry.get("cfg") or {}).get("block_sizes")
        if block is not None:
            block[-1] = qcfg.group_size
    if qcfg.kv_cache_dtype in KV_NUM_BITS:
        config["quant_cfg"].append(kv_quantizers(qcfg))
    excluded = excluded_linears(cfg, qcfg.exclude)
    if int4_by_trtbuild:  # the LM head's quantizer stays on (modelopt refuses a config quantizing no weight)
        excluded = [n for n in canonical_linears(cfg) if n != "lm_head"]
        head = {"num_bits": 8, "axis": 0}  # quantize_lm_head's
        config["quant_cfg"].append({"quantizer_name": "lm_head.weight_quantizer", "cfg": head, "enable": True})
    for name in excluded:
        for module in hf_modules(cfg, name):
            config["quant_cfg"].append({"quantizer_name": f"{module}.*", "enable": False})
    return config


def kv_quantizers(qcfg: QuantConfig) -> dict[str, Any]:
    """modelopt's ``quant_cfg`` entry for the per-tensor K/V quantizers of ``qcfg.kv_cache_dtype``
    (``*[kv]_bmm_quantizer``: keys after rotary, as the cache stores them)."""
    kv = {"num_bits": KV_NUM_BITS[qcfg.kv_cache_dtype], "axis": None}
    return {"quantizer_name": "*[kv]_bmm_quantizer", "cfg": kv}


def sample_loop(qcfg: QuantConfig, samples: np.ndarray, progress: bool) -> Callable[[Any], None]:
    """modelopt's ``forward_loop``: the model run on each row of ``samples`` (a progress bar on a terminal)."""
    import torch

    from ..progress import progress as progress_bar

    passes = iter(range(1, 100))

    def forward_loop(m: Any) -> None:
        desc = f"calibrating {qcfg.qformat.value} (pass {next(passes)})"
        with torch.no_grad():
            shown = None if progress else False  # on a terminal only
            for row in progress_bar(samples, len(samples), desc, "sample", enabled=shown):
                m(torch.from_numpy(np.ascontiguousarray(row))[None])

    return forward_loop


def calibrate_kv_cache(model: Any, qcfg: QuantConfig, samples: np.ndarray, *, progress: bool = True) -> Any:
    """Calibrate ``model``'s K/V quantizers alone on ``samples`` (every other quantizer modelopt inserts stays off:
    the weights are already the quantized checkpoint's, ``moe_kv.py``); returns it."""
    assert qcfg.kv_cache_dtype in KV_NUM_BITS and len(samples)
    with third_party_quiet():
        import modelopt.torch.quantization as mtq

        config = {"quant_cfg": [{"quantizer_name": "*", "enable": False}, kv_quantizers(qcfg)], "algorithm": "max"}
        mtq.quantize(model, config, sample_loop(qcfg, samples, progress))
    return model


def calibrate(
    model: Any,
    cfg: ModelConfig,
    qcfg: QuantConfig,
    samples: np.ndarray,
    *,
    progress: bool = True,
    modelopt_int4: bool = False,
) -> Any:
    """Quantize ``model`` in place with modelopt, calibrating on ``samples`` ``[n, L]`` token ids; returns it.

    With no samples, modelopt calibrates the weights alone (weight-only round-to-nearest). int4 formats are
    calibrated by ``awq.py`` unless ``modelopt_int4``."""
    with third_party_quiet():
        import modelopt.torch.quantization as mtq

    forward_loop = sample_loop(qcfg, samples, progress)
    if FORMATS[qcfg.qformat].weights is Numeric.INT4 and not modelopt_int4:
        return _calibrate_int4(model, cfg, qcfg, samples, forward_loop, progress)
    if qcfg.zero_points:
        raise TrtbuildError("modelopt's int4 calibration has no zero points")
    with third_party_quiet():
        reads_tokens = modelopt_reads_tokens(qcfg) and len(samples)  # fp8 rowwise: the samples are fp8.py's alone
        mtq.quantize(model, modelopt_config(cfg, qcfg), forward_loop if reads_tokens else None)
        unify_fused_groups(model, cfg)
        if dynamic_activations(qcfg):
            make_inputs_dynamic(model, activation_block(qcfg))
        if qcfg.qformat is QFormat.FP8 and dynamic_activations(qcfg) and len(samples):
            from .fp8 import search_weight_scales

            search_weight_scales(model, cfg, qcfg, samples)
        if qcfg.qformat is QFormat.INT4_AWQ:  # AWQ's clip search, on the weights as the fused graph smooths them
            mtq.calibrate(model, {"method": "awq_clip"}, forward_loop)
        if "lm_head" not in excluded_linears(cfg, qcfg.exclude):
            quantize_lm_head(model)
    return model


def _calibrate_int4(
    model: Any, cfg: ModelConfig, qcfg: QuantConfig, samples: np.ndarray, forward_loop: Any, progress: bool
) -> Any:
    """int4 by ``awq.py``; then modelopt's KV-cache ranges (on the int4 model) and int8 LM head."""
    import modelopt.torch.quantization as mtq

    from .awq import quantize_int4

    with third_party_quiet():
        mtq.quantize(model, modelopt_config(cfg, qcfg, int4_by_trtbuild=True), None)
        model.get_submodule("lm_head").weight_quantizer.disable()  # quantize_lm_head's, if not excluded
        quantize_int4(model, cfg, qcfg, samples, progress=progress)
        if qcfg.kv_cache_dtype in KV_NUM_BITS:
            mtq.calibrate(model, "max", forward_loop)
        if "lm_head" not in excluded_linears(cfg, qcfg.exclude):
            quantize_lm_head(model)
    return model


# A module's input quantizers: a linear's, and the two that modelopt's fused-experts wrapper (``_QuantFusedExperts``)
# shares between a mixture-of-experts layer's experts.
INPUT_QUANTIZERS = ("input_quantizer", "gate_up_proj_input_quantizer", "down_proj_input_quantizer")


def make_inputs_dynamic(model: Any, block: int | None) -> None:
    """Switch every enabled input quantizer to run-time scales, ``amax / bound`` per block of ``block`` in-features
    of each token (None: per token), keeping its pre-quant (smoothing) scale; its calibrated range is dropped."""
    for module in model.modules():
        for attr in INPUT_QUANTIZERS:
            quantizer = getattr(module, attr, None)
            if quantizer is not None and quantizer.is_enabled:
                quantizer.set_from_attribute_config({"type": "dynamic", "block_sizes": {-1: block}, "axis": None})
                quantizer.reset_amax()
                if block is not None:
                    quantizer.register_forward_pre_hook(_forget_block_shape)


def _forget_block_shape(quantizer: Any, args: Any) -> None:
    """modelopt fixes a block quantizer's input shape at its first call and refuses any other; blocks along the last
    axis are reshaped to ``(-1, block)`` whatever the token count, so let it set the shape up again each call."""
    for attr in ("_block_reshape_size", "_original_shape"):
        if hasattr(quantizer, attr):
            delattr(quantizer, attr)


def quantize_lm_head(model: Any) -> None:
    """Quantize the LM head as int8 weight-only, per output channel (``checkpoint.formats.HEAD_FORMAT``), in every
    format.

    The vocabulary projection is the most precision-sensitive linear and, on small models, the largest one read
    per decoded token (SmolLM2-135M: 49152 x 576, 108 MiB in float32, ~40% of an int8 decode step). int8 keeps
    it within +0.12% perplexity there; int4 at group 32 costs +17.5%. No smoothing (a tied head shares its weight
    with the embedding, which must stay as it is): modelopt's max calibration of the weight alone, applied after
    the format's pass, so only the head's forward sees the quantized weight and the embedding stays float.
    """
    import torch

    head = model.get_submodule("lm_head")
    quantizer = head.weight_quantizer
    # block_sizes before axis (setting one clears the other); the calibrator is rebuilt for the new axis
    attributes = {"block_sizes": None, "num_bits": 8, "axis": 0, "calibrator": "max", "enable": True}
    quantizer.set_from_attribute_config(attributes)
    quantizer.disable_quant()
    quantizer.enable_calib()
    with torch.no_grad():
        quantizer(head.weight)
    quantizer.load_calib_amax()
    quantizer.disable_calib()
    quantizer.enable_quant()


def unify_fused_groups(model: Any, cfg: ModelConfig) -> None:
    """Make the modules of each fused canonical tensor share what one graph node applies to their common input.

    modelopt's export recipe (``preprocess_linear_fusion(resmooth_only=True)``): one pre-quant scale (the mean;
    the weights are re-smoothed and re-calibrated), then one activation range (the max). Weight ranges stay per
    module: per-tensor (fp8) weight scales become a per-output-channel vector of the fused tensor, so a small
    k_proj does not inherit q_proj's range.
    """
    import torch
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion

    for name in canonical_linears(cfg):
        modules = [model.get_submodule(m) for m in hf_modules(cfg, name)]
        if len(modules) < 2 or not modules[0].weight_quantizer.is_enabled:
            continue
        preprocess_linear_fusion(modules, resmooth_only=True)
        quantizers = [m.input_quantizer for m in modules]
        if quantizers[0].is_enabled and quantizers[0].amax is not None:
            amax = torch.max(torch.stack([q.amax for q in quantizers]))
            for q in quantizers:
                q.amax = amax


# What modelopt and the libraries under it say during calibration that is not the user's business, by message or
# by origin: modelopt's version notice and its note on the LM head it never smooths; deprecation notices raised in
# torch, modelopt, transformers or urllib3 code (torch.jit.script, FutureWarnings). Any other warning still shows.
QUIET_WARNINGS = (
    (UserWarning, r"transformers .* is not tested with current version of modelopt", ""),
    (UserWarning, r".* is not calibrated, skip smoothing", ""),
    (DeprecationWarning, "", r"(torch|modelopt|transformers)(\.|$)"),
    (FutureWarning, "", r"(torch|modelopt|transformers)(\.|$)"),
    (Warning, r"SOCKS support in urllib3 requires", r"urllib3(\.|$)"),
)


@contextlib.contextmanager
def third_party_quiet() -> Iterator[None]:
    """modelopt's prints and the library warnings of ``QUIET_WARNINGS`` kept off the terminal while it runs.

    modelopt prints to stdout as it works (``Registered <class ...> to _QuantAttention for KV Cache quantization``,
    ``Inserted 756 quantizers``, ``Smoothed 14 modules``): captured, and written to stderr only when the block fails
    with an unexpected exception (a trtbuild error stays one line). Exceptions always propagate.
    """
    captured = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(captured):
        for category, message, module in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
        try:
            yield
        except Exception as e:
            if not isinstance(e, TrtbuildError):
                sys.stderr.write(captured.getvalue())
            raise
