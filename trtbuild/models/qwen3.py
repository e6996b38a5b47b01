"""Qwen3: the Llama layout with an RMSNorm on each query and key head (``q_norm`` / ``k_norm``, weight of head_dim,
the model's ``rms_norm_eps``) applied after the projection and before rotary, no q/k/v bias unless
``attention_bias``, and a head_dim of its own (transformers' ``Qwen3Config`` defaults it to 128, not hidden/heads).

Sliding-window layers (``use_sliding_window``: ``layer_types``, else the layers from ``max_window_layers`` on) attend
over the last ``sliding_window`` positions, as in transformers (``llama.window_layers``).
"""

from __future__ import annotations

from typing import Any

from ..config import DType, ModelConfig
from .llama import llama_layout_config, window_layers
from .registration import Refusals, register_architecture

QWEN3_DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config.head_dim when config.json does not give one


@register_architecture("Qwen3ForCausalLM")
def qwen3_config(arch: str, hf: dict[str, Any], dtype: DType, refusals: Refusals) -> ModelConfig:
    head_size = int(hf.get("head_dim") or QWEN3_DEFAULT_HEAD_DIM)
    if hf.get("hidden_act", "silu") != "silu":
        refusals.refuse(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
    layer_types, window = window_layers(hf, refusals)
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:  # transformers' default Qwen3 rotary ignores it
        refusals.refuse("partial_rotary_factor is not supported for Qwen3 (rotary spans head_dim)")
    bias = bool(hf.get("attention_bias", False))  # q, k, v and o alike
    return llama_layout_config(
        arch,
        {k: v for k, v in hf.items() if k != "partial_rotary_factor"},  # refused above: rotary spans head_dim
        dtype,
        refusals,
        head_size=head_size,
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        qkv_bias=bias,
        attn_out_bias=bias,
        qk_norm=True,
        layer_types=layer_types,
        sliding_window=window,
    )
