"""Qwen3: the Llama layout with an RMSNorm on each query and key head (``q_norm`` / ``k_norm``, weight of head_dim,
the model's ``rms_norm_eps``) applied after the projection and before rotary, no q/k/v bias unless
``attention_bias``, and a head_dim of its own (transformers' ``Qwen3Config`` defaults it to 128, not hidden/heads).

Sliding-window layers (``use_sliding_window``, ``layer_types``) are refused: the paged-attention op attends to the
whole context.
"""

from __future__ import annotations

from typing import Any

from ..config import DType, ModelConfig
from .llama import llama_layout_config
from .registration import Refusals, register_architecture

QWEN3_DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config.head_dim when config.json does not give one


@register_architecture("Qwen3ForCausalLM")
def qwen3_config(arch: str, hf: dict[str, Any], dtype: DType, refusals: Refusals) -> ModelConfig:
    layers = int(hf["num_hidden_layers"])
    head_size = int(hf.get("head_dim") or QWEN3_DEFAULT_HEAD_DIM)
    if hf.get("hidden_act", "silu") != "silu":
        refusals.refuse(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
    # transformers' Qwen3Config: without layer_types, layers from max_window_layers on slide when the window is on
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    first_sliding = int(hf.get("max_window_layers", 28)) if window is not None else layers
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i >= first_sliding else "full_attention" for i in range(layers)
    ]
    if len(layer_types) != layers:
        raise ValueError(f"layer_types names {len(layer_types)} layers, num_hidden_layers is {layers}")
    sliding = sum(kind != "full_attention" for kind in layer_types)
    if sliding:
        refusals.refuse(f"{sliding} of {layers} layers use sliding-window attention, which is not supported")
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
    )
