"""The Llama family: Llama, Mistral (every layer slides over ``sliding_window`` when the config sets one) and Qwen2
(q/k/v bias; sliding layers from ``max_window_layers`` on, or as ``layer_types`` says, when ``use_sliding_window``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config import AttentionKind, DType, MlpKind, ModelConfig, NormKind, PositionKind, RopeConfig
from .registration import Refusals, register_architecture


def rope_from_hf(hf: dict[str, Any], head_size: int, refusals: Refusals) -> RopeConfig:
    """Read rotary settings from transformers 4.x (``rope_theta``/``rope_scaling``) or 5.x (``rope_parameters``)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        scaling = 1.0
    elif kind == "linear":
        scaling = float(params["factor"])
    else:
        refusals.refuse(f"rope type {kind!r} is not supported (supported: default, linear)")
        scaling = 1.0
    rotary_dim = int(head_size * float(hf.get("partial_rotary_factor", 1.0)))
    return RopeConfig(theta=theta, rotary_dim=rotary_dim, interleaved=False, scaling=scaling)


@register_architecture("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
def llama_config(arch: str, hf: dict[str, Any], dtype: DType, refusals: Refusals) -> ModelConfig:
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_size = int(hf.get("head_dim") or hidden // heads)
    if hf.get("hidden_act", "silu") != "silu":
        refusals.refuse(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
    if hf.get("mlp_bias"):
        refusals.refuse("mlp_bias is not supported for gated MLPs")
    if arch == "MistralForCausalLM":  # transformers' Mistral slides every layer when the config has a window
        layer_types, window = every_layer(hf.get("sliding_window"), int(hf["num_hidden_layers"]))
    else:
        layer_types, window = window_layers(hf, refusals)
    return llama_layout_config(
        arch,
        hf,
        dtype,
        refusals,
        head_size=head_size,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
        attn_out_bias=bool(hf.get("attention_bias", False)) and arch != "Qwen2ForCausalLM",
        layer_types=layer_types,
        sliding_window=window,
    )


# transformers' names of the layer types -> AttentionKind (quantize's rebuilt configs use the inverse)
HF_LAYER_TYPES = {"full_attention": AttentionKind.FULL, "sliding_attention": AttentionKind.SLIDING}


def every_layer(window: int | None, layers: int) -> tuple[list[AttentionKind], int | None]:
    """(layer kinds, window) of a model whose every layer slides when its config has a window (Mistral, Phi-3,
    Mixtral, Qwen3-MoE), and none does without."""
    if not window:
        return [AttentionKind.FULL] * layers, None
    return [AttentionKind.SLIDING] * layers, int(window)


def check_layer_count(names: Sequence[str], layers: int) -> None:
    """``layer_types`` must name every layer (transformers' config validation refuses it otherwise)."""
    if len(names) != layers:
        raise ValueError(f"layer_types names {len(names)} layers, num_hidden_layers is {layers}")


def read_layer_types(names: Sequence[str], layers: int, refusals: Refusals) -> list[AttentionKind]:
    """A config's ``layer_types`` as ``AttentionKind``s: each name it does not know is refused (and read as full)."""
    check_layer_count(names, layers)
    for name in sorted(set(names) - set(HF_LAYER_TYPES)):
        refusals.refuse(f"layer type {name!r} is not supported (full_attention, sliding_attention)")
    return [HF_LAYER_TYPES.get(n, AttentionKind.FULL) for n in names]


def window_layers(hf: dict[str, Any], refusals: Refusals) -> tuple[list[AttentionKind], int | None]:
    """Qwen2 / Qwen3's per-layer attention kinds and window (None when no layer slides), as transformers reads them:
    no layer slides unless ``use_sliding_window`` (and a ``sliding_window``); then ``layer_types`` where given, else
    the layers from ``max_window_layers`` on."""
    layers = int(hf["num_hidden_layers"])
    given = hf.get("layer_types")
    if given:  # checked whether or not a layer slides
        check_layer_count(given, layers)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if not window:
        return [AttentionKind.FULL] * layers, None
    first_sliding = int(hf.get("max_window_layers", 28))
    names = given or ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(layers)]
    layer_types = read_layer_types(names, layers, refusals)
    return layer_types, int(window) if AttentionKind.SLIDING in layer_types else None


def llama_layout_config(
    arch: str,
    hf: dict[str, Any],
    dtype: DType,
    refusals: Refusals,
    *,
    head_size: int,
    max_position_embeddings: int,
    qkv_bias: bool,
    attn_out_bias: bool,
    qk_norm: bool = False,
    layer_types: Sequence[AttentionKind] = (),
    sliding_window: int | None = None,
) -> ModelConfig:
    """The ``ModelConfig`` of a model in the Llama layout (RMSNorm, SwiGLU MLP without bias, RoPE) from its
    transformers ``config.json`` (``hf``); what a family reads its own way comes in as the keyword arguments."""
    eos = hf.get("eos_token_id")
    heads = int(hf["num_attention_heads"])
    return ModelConfig(
        architecture=arch,
        dtype=dtype,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_size=head_size,
        intermediate_size=int(hf["intermediate_size"]),
        max_position_embeddings=max_position_embeddings,
        norm=NormKind.RMS,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        mlp=MlpKind.SWIGLU,
        position=PositionKind.ROPE,
        rope=rope_from_hf(hf, head_size, refusals),
        qkv_bias=qkv_bias,
        attn_out_bias=attn_out_bias,
        mlp_bias=False,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=list(eos) if isinstance(eos, list) else ([] if eos is None else [int(eos)]),
        qk_norm=qk_norm,
        layer_types=list(layer_types),
        sliding_window=sliding_window,
    )
