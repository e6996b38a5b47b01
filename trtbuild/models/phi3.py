"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): the Llama layout stored fused (``qkv_proj``: q | k | v rows,
``gate_up_proj``: gate | up rows), no biases anywhere, head_size = hidden / heads, and a rotary embedding over the
first ``partial_rotary_factor * head_size`` dims of each head (NeoX half split; Phi-4-mini rotates 3/4 of them).

Refused, each in one line:

- ``rope_scaling`` / ``rope_parameters`` of any type but the default: LongRoPE (``longrope``; ``su`` and ``yarn``
  in older configs, which transformers reads as longrope) switches between two per-frequency factor tables at
  ``original_max_position_embeddings`` and scales cos/sin, which the rotary table of the paged-attention op does
  not express. This turns away the 128k Phi-3 models and Phi-4-mini; the 4k Phi-3 models convert.
- ``hidden_act`` other than silu; ``attention_bias`` / ``mlp_bias`` set (transformers' Phi-3 has no biases and
  would ignore such weights); a ``head_dim`` other than hidden / heads.

Sliding window: transformers' Phi-3 attends over the last ``sliding_window`` positions (key index > query index -
window) in every layer when the config sets one (Phi-3-mini-4k: 2047); so does the engine (every layer sliding).
"""

from __future__ import annotations

from typing import Any

from ..config import DType, ModelConfig
from .llama import every_layer, llama_layout_config
from .registration import Refusals, register_architecture


@register_architecture("Phi3ForCausalLM")
def phi3_config(arch: str, hf: dict[str, Any], dtype: DType, refusals: Refusals) -> ModelConfig:
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_size = hidden // heads
    if hf.get("head_dim") and int(hf["head_dim"]) != head_size:
        refusals.refuse(f"head_dim {hf['head_dim']} is not supported for Phi-3 (hidden_size / heads = {head_size})")
    if hf.get("hidden_act", "silu") != "silu":
        refusals.refuse(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refusals.refuse(f"{key} is not supported for Phi-3 (transformers' Phi3 has no biases)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        refusals.refuse(f"rope scaling {kind!r} (LongRoPE) is not supported: only the default rotary embedding")
        rope = {k: v for k, v in rope.items() if k in ("rope_theta", "partial_rotary_factor")}  # read on as default
    # transformers 5 keeps the factor in rope_parameters, 4.x at the top level
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    layer_types, window = every_layer(hf.get("sliding_window"), int(hf["num_hidden_layers"]))
    return llama_layout_config(
        arch,
        {**hf, "partial_rotary_factor": partial, "rope_parameters": rope, "rope_scaling": None},
        dtype,
        refusals,
        head_size=head_size,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        qkv_bias=False,
        attn_out_bias=False,
        layer_types=layer_types,
        sliding_window=window,
    )
