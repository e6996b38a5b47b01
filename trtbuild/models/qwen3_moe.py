"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 (``qwen3.py``: per-head q/k RMSNorm, its head_dim) whose sparse
layers' MLP is a mixture of ``num_experts`` SwiGLU experts of ``moe_intermediate_size``: a
softmax router over every expert keeps the ``num_experts_per_tok`` most probable per token, their probabilities
renormalised to sum to 1 only when ``norm_topk_prob``.

A layer is sparse when it is not in ``mlp_only_layers`` and ``(layer + 1) % decoder_sparse_step == 0`` (as
transformers' ``Qwen3MoeDecoderLayer``); the others keep a dense MLP of ``intermediate_size``. ``num_experts`` 0
makes every layer dense. Shared experts and non-softmax routers are refused (``moe.py``).

Unlike Qwen3's, transformers' Qwen3-MoE attention slides in every layer when ``use_sliding_window`` is set (it reads
neither ``layer_types`` nor ``max_window_layers``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import DType, ModelConfig, MoeConfig
from .llama import every_layer
from .moe import refuse_moe_variants
from .qwen3 import qwen3_config
from .registration import Refusals, register_architecture

# transformers' Qwen3MoeConfig defaults, for keys a config.json leaves out
QWEN3_MOE_DEFAULTS = {"intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts_per_tok": 8}


@register_architecture("Qwen3MoeForCausalLM")
def qwen3_moe_config(arch: str, hf: dict[str, Any], dtype: DType, refusals: Refusals) -> ModelConfig:
    hf = {**QWEN3_MOE_DEFAULTS, **hf}
    refuse_moe_variants(hf, refusals)
    cfg = qwen3_config(arch, hf, dtype, refusals)
    layer_types, window = every_layer(
        hf.get("sliding_window") if hf.get("use_sliding_window") else None, cfg.num_layers
    )
    cfg = replace(cfg, layer_types=layer_types, sliding_window=window)
    # transformers 5 writes num_experts as num_local_experts (its attribute map), earlier versions as num_experts
    experts = int(hf.get("num_experts", hf.get("num_local_experts", 128)))
    step = int(hf.get("decoder_sparse_step", 1))
    if step <= 0:
        raise ValueError(f"decoder_sparse_step {step} must be positive")
    dense = {int(n) for n in hf.get("mlp_only_layers") or []}
    sparse = [n for n in range(cfg.num_layers) if n not in dense and experts > 0 and (n + 1) % step == 0]
    if not sparse:
        return cfg  # every layer dense: the Qwen3 layout
    moe = MoeConfig(
        num_experts=experts,
        top_k=int(hf["num_experts_per_tok"]),
        intermediate_size=int(hf["moe_intermediate_size"]),
        renormalize=bool(hf.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )
    return replace(cfg, moe=moe)
