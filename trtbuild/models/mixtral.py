"""Mixtral (``MixtralForCausalLM``): the Mistral layout with every layer's MLP a sparse mixture of
``num_local_experts`` SwiGLU experts (``block_sparse_moe``), of which a softmax router keeps the
``num_experts_per_tok`` most probable per token and always renormalises their weights to sum to 1.

A ``sliding_window`` slides every layer, as Mistral's (``llama.py``). ``router_jitter_noise`` only acts in
training and is ignored. Shared experts and non-softmax routers are refused (``moe.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import DType, ModelConfig, MoeConfig
from .llama import every_layer, llama_layout_config
from .moe import refuse_moe_variants
from .registration import Refusals, register_architecture


@register_architecture("MixtralForCausalLM")
def mixtral_config(arch: str, hf: dict[str, Any], dtype: DType, refusals: Refusals) -> ModelConfig:
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_size = int(hf.get("head_dim") or hidden // heads)
    refuse_moe_variants(hf, refusals)
    layer_types, window = every_layer(hf.get("sliding_window"), int(hf["num_hidden_layers"]))
    cfg = llama_layout_config(
        arch,
        hf,
        dtype,
        refusals,
        head_size=head_size,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096 * 32)),
        qkv_bias=False,
        attn_out_bias=False,
        layer_types=layer_types,
        sliding_window=window,
    )
    moe = MoeConfig(
        num_experts=int(hf.get("num_local_experts", 8)),
        top_k=int(hf.get("num_experts_per_tok", 2)),
        intermediate_size=int(hf["intermediate_size"]),
        renormalize=True,
        sparse_layers=list(range(cfg.num_layers)),
    )
    return replace(cfg, moe=moe)
