"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3, text only (``Gemma3ForCausalLM``): the Llama layout with

- RMSNorms that scale by ``1 + w`` (the checkpoint stores ``1 + w``: ``convert.tensor_names`` adds the one), a
  per-head q/k norm as Qwen3's (Gemma 3 only), and sandwich norms: ``post_attention_layernorm`` on the attention
  output and ``post_feedforward_layernorm`` on the MLP output before each residual add, ``pre_feedforward_layernorm``
  before the MLP (``ModelConfig.sandwich_norms``);
- embeddings multiplied by sqrt(hidden_size) rounded to the model's dtype (a tied LM head reads the raw table);
- a GeGLU MLP (``gelu_pytorch_tanh(gate) * up``);
- sliding-window layers interleaved with full ones (``layer_types``; by default every second layer is full in
  Gemma 2, every sixth in Gemma 3: transformers' ``sliding_window_pattern``); Gemma 3 gives each kind its own rotary
  base (``rope_parameters`` per layer type in transformers 5; ``rope_theta`` / ``rope_local_base_freq`` before),
  the full layers' possibly linearly scaled, where Gemma 2 has one;
- the softmax scale ``query_pre_attn_scalar ** -0.5`` and, where the config sets them, soft-capping of the attention
  scores and of the final logits (Gemma 2 defaults to 50 and 30; Gemma 3's released configs set neither).

Refused, each in one line: an activation other than gelu_pytorch_tanh, q/k/v/o biases, bidirectional attention,
rotary types other than default and linear, and layer types other than full and sliding attention.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ..config import AttentionKind, DType, MlpKind, ModelConfig, RopeConfig
from .llama import llama_layout_config, read_layer_types, rope_from_hf
from .registration import Refusals, register_architecture

# transformers' Gemma2Config / Gemma3TextConfig defaults, for the keys config.json (or a GGUF file) may leave out
GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": {
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 2,
        "rope_theta": 10_000.0,
        "max_position_embeddings": 8192,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "Gemma3ForCausalLM": {
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "max_position_embeddings": 131_072,
    },
}


def dtype_round(x: float, dtype: DType) -> float:
    """``x`` rounded to ``dtype`` (transformers casts Gemma's embedding multiplier to the weights' dtype)."""
    import ml_dtypes

    kind = {DType.FLOAT32: np.float32, DType.FLOAT16: np.float16, DType.BFLOAT16: ml_dtypes.bfloat16}[dtype]
    return float(np.asarray(x, np.float32).astype(kind))


def _ropes(hf: dict[str, Any], head_size: int, refusals: Refusals) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's rotary embeddings of the full layers and of the sliding layers."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: one entry per layer type
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # transformers 4.x: rope_theta, rope_local_base_freq, rope_scaling for the full layers
        full = dict(hf.get("rope_scaling") or {})
        local = {"rope_theta": hf["rope_local_base_freq"]}
        full.setdefault("rope_theta", hf["rope_theta"])
    full.setdefault("rope_theta", hf["rope_theta"])
    local.setdefault("rope_theta", hf["rope_local_base_freq"])
    return rope_from_hf({"rope_parameters": full}, head_size, refusals), rope_from_hf(
        {"rope_parameters": local}, head_size, refusals
    )


@register_architecture("Gemma2ForCausalLM", "Gemma3ForCausalLM")
def gemma_config(arch: str, hf: dict[str, Any], dtype: DType, refusals: Refusals) -> ModelConfig:
    given = {k: v for k, v in hf.items() if v is not None or k.endswith("_softcapping")}  # None: no soft-capping
    hf = {**GEMMA_DEFAULTS[arch], **given}
    gemma3 = arch == "Gemma3ForCausalLM"
    layers = int(hf["num_hidden_layers"])
    head_size = int(hf["head_dim"])
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        refusals.refuse(f"hidden_activation {act!r} is not supported for Gemma (gelu_pytorch_tanh)")
    if hf.get("attention_bias"):
        refusals.refuse("attention_bias is not supported for Gemma")
    if hf.get("use_bidirectional_attention"):
        refusals.refuse("use_bidirectional_attention is not supported (trtbuild's attention is causal)")
    pattern = int(hf["sliding_window_pattern"])
    names = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    kinds = read_layer_types(names, layers, refusals)
    sliding = AttentionKind.SLIDING in kinds
    if gemma3:
        full_rope, local_rope = _ropes(hf, head_size, refusals)
    else:  # Gemma 2: one rotary embedding
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        full_rope = local_rope = rope_from_hf(
            {"rope_parameters": {"rope_theta": hf["rope_theta"], **params}}, head_size, refusals
        )
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "partial_rotary_factor")}
    cfg = llama_layout_config(
        arch,
        plain,
        dtype,
        refusals,
        head_size=head_size,
        max_position_embeddings=int(hf["max_position_embeddings"]),
        qkv_bias=False,
        attn_out_bias=False,
        qk_norm=gemma3,
    )
    final_cap, attn_cap = hf.get("final_logit_softcapping"), hf.get("attn_logit_softcapping")
    return replace(
        cfg,
        mlp=MlpKind.GEGLU,
        rope=full_rope,
        layer_types=kinds,
        sliding_window=int(hf["sliding_window"]) if sliding else None,
        local_rope=local_rope if sliding and local_rope != full_rope else None,
        attention_scale=float(hf["query_pre_attn_scalar"]) ** -0.5,
        attn_softcap=None if attn_cap is None else float(attn_cap),
        final_softcap=None if final_cap is None else float(final_cap),
        embed_multiplier=dtype_round(int(hf["hidden_size"]) ** 0.5, dtype),
        sandwich_norms=True,
    )
