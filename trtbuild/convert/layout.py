"""The canonical checkpoint layout: which tensors a ``ModelConfig`` implies, with their shapes.

Linear weights are ``[out_features, in_features]``; fused tensors concatenate their parts along dim 0
(``attn.qkv`` = q | k | v rows, ``mlp.gate_up`` = gate | up rows).
"""

from __future__ import annotations

from ..config import MlpKind, ModelConfig, NormKind, PositionKind


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor a checkpoint of ``cfg`` holds (no more, no fewer)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    layer_norm = cfg.norm is NormKind.LAYER
    out: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, h), "final_norm.weight": (h,)}
    if cfg.position is PositionKind.LEARNED:
        out["pos_embed.weight"] = (cfg.max_position_embeddings, h)
    if layer_norm:
        out["final_norm.bias"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        out[p + "input_norm.weight"] = (h,)
        out[p + "post_attn_norm.weight"] = (h,)
        if layer_norm:
            out[p + "input_norm.bias"] = (h,)
            out[p + "post_attn_norm.bias"] = (h,)
        out[p + "attn.qkv.weight"] = (cfg.qkv_size, h)
        if cfg.qkv_bias:
            out[p + "attn.qkv.bias"] = (cfg.qkv_size,)
        if cfg.qk_norm:  # one RMSNorm weight shared by every query head, one by every key head
            out[p + "attn.q_norm.weight"] = (cfg.head_size,)
            out[p + "attn.k_norm.weight"] = (cfg.head_size,)
        out[p + "attn.out.weight"] = (h, cfg.num_heads * cfg.head_size)
        if cfg.attn_out_bias:
            out[p + "attn.out.bias"] = (h,)
        if cfg.mlp is MlpKind.SWIGLU:
            out[p + "mlp.gate_up.weight"] = (2 * i, h)
        else:
            out[p + "mlp.up.weight"] = (i, h)
            if cfg.mlp_bias:
                out[p + "mlp.up.bias"] = (i,)
        out[p + "mlp.down.weight"] = (h, i)
        if cfg.mlp_bias:
            out[p + "mlp.down.bias"] = (h,)
    return out
