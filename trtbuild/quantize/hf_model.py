"""A trtbuild checkpoint as a transformers model again, so modelopt can calibrate it (Llama family, Qwen3, Phi-3).

Canonical fused tensors are split back into the Hugging Face modules (``attn.qkv`` -> q/k/v_proj rows,
``mlp.gate_up`` -> gate/up_proj rows), except for Phi-3, whose modules are fused as the canonical tensors are
(``qkv_proj``, ``gate_up_proj``). ``LINEARS`` / ``FUSED_LINEARS`` are the tables of which HF modules make each
canonical linear (``checkpoint.layout.LAYER_LINEARS``, in the same order); ``layer_linears`` picks one.
Qwen3's per-head q/k norms are not linears: they stay float (``NORMS``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checkpoint.layout import LAYER_LINEARS
from ..config import MlpKind, ModelConfig, NormKind, PositionKind
from ..errors import TrtbuildError

# Architectures quantize accepts -> transformers model_type.
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}

# Canonical linear (below ``layers.{i}.``) -> the HF modules (below ``model.layers.{i}.``) fused into it, in row order.
LINEARS: dict[str, tuple[str, ...]] = {
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.out": ("self_attn.o_proj",),
    "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down": ("mlp.down_proj",),
}
# The same for architectures whose HF modules are fused as the canonical linears are (one module each).
FUSED_LINEARS: dict[str, tuple[str, ...]] = {
    "attn.qkv": ("self_attn.qkv_proj",),
    "attn.out": ("self_attn.o_proj",),
    "mlp.gate_up": ("mlp.gate_up_proj",),
    "mlp.down": ("mlp.down_proj",),
}
FUSED_ARCHITECTURES = frozenset({"Phi3ForCausalLM"})
assert tuple(LINEARS) == tuple(FUSED_LINEARS) == LAYER_LINEARS  # one per canonical linear, in layer order

# Canonical float tensors (below ``layers.{i}.``) of optional per-layer norms -> their HF parameter (Qwen3).
NORMS: dict[str, str] = {
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
}


def check_quantizable(cfg: ModelConfig) -> None:
    """Raise a one-line error when ``cfg``'s architecture cannot be quantized by trtbuild."""
    if cfg.moe is not None:
        raise TrtbuildError(
            f"quantize: {cfg.architecture} is a mixture-of-experts model, which trtbuild quantizes without a "
            "transformers model (int8_wo by round to nearest: quantize/moe.py)"
        )
    if cfg.architecture not in MODEL_TYPES:
        raise TrtbuildError(
            f"quantize: architecture {cfg.architecture} is not supported (supported: {', '.join(sorted(MODEL_TYPES))})"
        )
    if cfg.norm is not NormKind.RMS or cfg.mlp is not MlpKind.SWIGLU or cfg.position is not PositionKind.ROPE:
        raise TrtbuildError(f"quantize: {cfg.architecture} checkpoint has an unexpected norm/MLP/position layout")
    partial_ok = cfg.architecture == "Phi3ForCausalLM"  # the one transformers model here that rotates part of a head
    if cfg.rope is not None and cfg.rope.rotary_dim != cfg.head_size and not partial_ok:
        raise TrtbuildError(f"quantize: partial rotary embedding is not supported for {cfg.architecture}")


def layer_linears(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Canonical linear (below ``layers.{i}.``) -> the HF modules (below ``model.layers.{i}.``) of ``cfg``'s model."""
    return FUSED_LINEARS if cfg.architecture in FUSED_ARCHITECTURES else LINEARS


def hf_modules(cfg: ModelConfig, prefix: str) -> list[str]:
    """The HF module names making the canonical linear ``prefix`` of ``cfg``'s model."""
    if prefix == "lm_head":
        return ["lm_head"]
    _, n, rest = prefix.split(".", 2)
    return [f"model.layers.{n}.{m}" for m in layer_linears(cfg)[rest]]


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``cfg`` (inverse of ``models.llama.llama_config``,
    ``models.qwen3.qwen3_config`` and ``models.phi3.phi3_config``)."""
    assert cfg.rope is not None
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope.theta}
    if cfg.rope.scaling != 1.0:
        rope = {"rope_type": "linear", "rope_theta": cfg.rope.theta, "factor": cfg.rope.scaling}
    out: dict[str, Any] = dict(
        architectures=[cfg.architecture],
        model_type=MODEL_TYPES[cfg.architecture],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope,
        rope_theta=cfg.rope.theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        hidden_act="silu",
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
    )
    if cfg.architecture == "LlamaForCausalLM":
        out["attention_bias"] = cfg.qkv_bias
    if cfg.architecture == "MistralForCausalLM":
        out["sliding_window"] = None
    if cfg.architecture == "Qwen2ForCausalLM":
        out["use_sliding_window"] = False
    if cfg.architecture == "Qwen3ForCausalLM":
        out.update(attention_bias=cfg.qkv_bias, use_sliding_window=False)
    if cfg.architecture == "Phi3ForCausalLM":  # head_dim is hidden / heads; a window was folded into the positions
        del out["head_dim"]
        rope["partial_rotary_factor"] = cfg.rope.rotary_dim / cfg.head_size
        out.update(sliding_window=None, pad_token_id=None)  # Phi3Config's default pad id 32000 may exceed the vocab
    return out


def hf_state_dict(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """Canonical float32 tensors -> the HF model's state dict (fused tensors split by rows)."""
    import torch

    def t(name: str) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(weights[name], dtype=np.float32))

    sd = {"model.embed_tokens.weight": t("embed.weight"), "model.norm.weight": t("final_norm.weight")}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = t("lm_head.weight")
    q, kv, i = cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size, cfg.intermediate_size
    fused = cfg.architecture in FUSED_ARCHITECTURES
    for n in range(cfg.num_layers):
        p, h = f"layers.{n}.", f"model.layers.{n}."
        sd[h + "input_layernorm.weight"] = t(p + "input_norm.weight")
        sd[h + "post_attention_layernorm.weight"] = t(p + "post_attn_norm.weight")
        sd[h + "mlp.down_proj.weight"] = t(p + "mlp.down.weight")
        if fused:  # no biases (models.phi3)
            sd[h + "self_attn.qkv_proj.weight"] = t(p + "attn.qkv.weight")
            sd[h + "self_attn.o_proj.weight"] = t(p + "attn.out.weight")
            sd[h + "mlp.gate_up_proj.weight"] = t(p + "mlp.gate_up.weight")
            continue
        for suffix in ("weight", "bias"):
            if f"{p}attn.qkv.{suffix}" in weights:
                for m, part in zip(("q", "k", "v"), torch.split(t(f"{p}attn.qkv.{suffix}"), [q, kv, kv]), strict=True):
                    sd[f"{h}self_attn.{m}_proj.{suffix}"] = part.clone()
            if f"{p}attn.out.{suffix}" in weights:
                sd[f"{h}self_attn.o_proj.{suffix}"] = t(f"{p}attn.out.{suffix}")
        for name, hf_name in NORMS.items():
            if p + name in weights:
                sd[h + hf_name] = t(p + name)
        gate, up = torch.split(t(p + "mlp.gate_up.weight"), [i, i])
        sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"] = gate.clone(), up.clone()
    return sd


def build_hf_model(cfg: ModelConfig, weights: dict[str, np.ndarray]):
    """The float32 transformers model of a (float) checkpoint, in eval mode with eager attention."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    check_quantizable(cfg)
    spec = hf_config(cfg)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)  # every parameter is overwritten below; the seed only makes the throw-away init repeatable
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    missing, unexpected = model.load_state_dict(hf_state_dict(cfg, weights), strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise TrtbuildError(
            f"quantize: checkpoint does not map onto {cfg.architecture} "
            f"(missing {missing[:1]}, unexpected {unexpected[:1]})"
        )
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
