"""GPT-2: LayerNorm, GELU (tanh approximation), learned positions, Conv1D weights (transposed at convert)."""

from __future__ import annotations

from typing import Any

from ..config import DType, MlpKind, ModelConfig, NormKind, PositionKind
from .registration import Refusals, register_architecture


@register_architecture("GPT2LMHeadModel")
def gpt2_config(arch: str, hf: dict[str, Any], dtype: DType, refusals: Refusals) -> ModelConfig:
    hidden, heads = int(hf["n_embd"]), int(hf["n_head"])
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        refusals.refuse(f"activation_function {act!r} is not supported (gelu_new)")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        refusals.refuse("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    eos = hf.get("eos_token_id")
    return ModelConfig(
        architecture=arch,
        dtype=dtype,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(hf["n_layer"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_size=hidden // heads,
        intermediate_size=int(hf.get("n_inner") or 4 * hidden),
        max_position_embeddings=int(hf["n_positions"]),
        norm=NormKind.LAYER,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        mlp=MlpKind.GELU_TANH,
        position=PositionKind.LEARNED,
        rope=None,
        qkv_bias=True,
        attn_out_bias=True,
        mlp_bias=True,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )
