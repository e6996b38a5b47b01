"""A trtbuild checkpoint as a transformers model again, so modelopt can calibrate it (Llama family, Qwen3, Phi-3,
Gemma 2 and 3; the mixture-of-experts families, Mixtral and Qwen3-MoE, add their routers and experts in
``hf_moe.py``).

Canonical fused tensors are split back into the Hugging Face modules (``attn.qkv`` -> q/k/v_proj rows,
``mlp.gate_up`` -> gate/up_proj rows), except for Phi-3, whose modules are fused as the canonical tensors are
(``qkv_proj``, ``gate_up_proj``). ``LINEARS`` / ``FUSED_LINEARS`` are the tables of which HF modules make each
canonical linear (``checkpoint.layout.LAYER_LINEARS``, in the same order); ``layer_linears`` picks one.
Qwen3's and Gemma 3's per-head q/k norms are not linears: they stay float (``NORMS``).

Gemma 2 and 3 (``models.gemma``): their RMSNorms scale by ``1 + w``; the checkpoint stores ``1 + w`` and the HF
model ``w`` (``hf_state_dict`` subtracts the one; pre-quant scales are folded into the stored ``1 + w``,
``export.py``). The pre-MLP norm, canonical ``post_attn_norm``, is HF's ``pre_feedforward_layernorm``; HF's
``post_attention_layernorm`` is the sandwich norm on the attention output (``GEMMA_LAYER_NORMS``). Gemma 2 has no
q/k norms and one rotary base; its attention-score soft-capping applies after modelopt's K/V quantizers, as the
engine's attention caps scores of the dequantized cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checkpoint.layout import LAYER_LINEARS
from ..config import AttentionKind, MlpKind, ModelConfig, NormKind, PositionKind
from ..errors import TrtbuildError
from .hf_config import GEMMA, GEMMA2, GEMMA3, MODEL_TYPES, ONE_PLUS_W_NORMS, hf_config, query_pre_attn_scalar

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
# Architectures whose transformers model takes ModelConfig's sliding windows (Gemma 3 reads its own layer_types).
WINDOWED = frozenset(
    {"MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"}
    | {"MixtralForCausalLM", "Qwen3MoeForCausalLM"}
)
assert tuple(LINEARS) == tuple(FUSED_LINEARS) == LAYER_LINEARS  # one per canonical linear, in layer order

# Canonical float tensors (below ``layers.{i}.``) of optional per-layer norms -> their HF parameter (Qwen3, Gemma 3).
NORMS: dict[str, str] = {
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
}
# Canonical per-layer norms (below ``layers.{i}.``) -> their HF parameter (below ``model.layers.{i}.``).
LAYER_NORMS: dict[str, str] = {
    "input_norm.weight": "input_layernorm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
}
GEMMA_LAYER_NORMS: dict[str, str] = {  # sandwich norms; HF's post_attention_layernorm norms the attention output
    "input_norm.weight": "input_layernorm.weight",
    "attn.post_norm.weight": "post_attention_layernorm.weight",
    "post_attn_norm.weight": "pre_feedforward_layernorm.weight",
    "mlp.post_norm.weight": "post_feedforward_layernorm.weight",
}


def check_quantizable(cfg: ModelConfig) -> None:
    """Raise a one-line error when ``cfg``'s architecture cannot be quantized by trtbuild, or its checkpoint holds
    what the rebuilt transformers model would not compute (``hf_config``, ``hf_moe.moe_hf_config``)."""
    if cfg.architecture not in MODEL_TYPES:
        raise TrtbuildError(
            f"quantize: architecture {cfg.architecture} is not supported (supported: {', '.join(sorted(MODEL_TYPES))})"
        )
    gemma = cfg.architecture in GEMMA
    mlp = MlpKind.GEGLU if gemma else MlpKind.SWIGLU
    if cfg.norm is not NormKind.RMS or cfg.mlp is not mlp or cfg.position is not PositionKind.ROPE:
        raise TrtbuildError(f"quantize: {cfg.architecture} checkpoint has an unexpected norm/MLP/position layout")
    if cfg.sandwich_norms != gemma or (gemma and cfg.qk_norm != (cfg.architecture == GEMMA3)):
        raise TrtbuildError(f"quantize: {cfg.architecture} checkpoint has an unexpected norm layout")
    partial_ok = cfg.architecture == "Phi3ForCausalLM"  # the one transformers model here that rotates part of a head
    ropes = [r for r in (cfg.rope, cfg.local_rope) if r is not None]
    if any(r.rotary_dim != cfg.head_size for r in ropes) and not partial_ok:
        raise TrtbuildError(f"quantize: partial rotary embedding is not supported for {cfg.architecture}")
    if gemma:
        check_gemma(cfg)
        return
    gemma_only = (
        ("sliding-window layers", AttentionKind.SLIDING in cfg.layer_types and cfg.architecture not in WINDOWED),
        ("an attention scale", cfg.attention_scale is not None),
        ("soft-capping", cfg.attn_softcap is not None or cfg.final_softcap is not None),
        ("an embedding multiplier", cfg.embed_multiplier != 1.0),
    )
    for feature, present in gemma_only:
        if present:
            raise TrtbuildError(f"quantize: {cfg.architecture} checkpoint has {feature}, which quantize cannot rebuild")


def check_gemma(cfg: ModelConfig) -> None:
    """Raise a one-line error where a Gemma checkpoint holds what transformers' Gemma 2 / Gemma 3 would not compute:
    an attention scale not of an integer ``query_pre_attn_scalar``; for Gemma 2 a second rotary embedding or heads
    that do not divide ``hidden_size`` (``Gemma2Config`` refuses them)."""
    name = "Gemma 2" if cfg.architecture == GEMMA2 else "Gemma 3"
    if query_pre_attn_scalar(cfg) ** -0.5 != cfg.softmax_scale:
        raise TrtbuildError(
            f"quantize: attention scale {cfg.softmax_scale} is not query_pre_attn_scalar ** -0.5 for an integer "
            f"query_pre_attn_scalar (what transformers' {name} takes)"
        )
    if cfg.architecture != GEMMA2:
        return
    if cfg.local_rope is not None:
        raise TrtbuildError("quantize: Gemma 2 checkpoint has a rotary embedding of its own for the sliding layers")
    if cfg.hidden_size % cfg.num_heads:
        raise TrtbuildError(
            f"quantize: Gemma 2 hidden_size {cfg.hidden_size} is not a multiple of num_heads {cfg.num_heads} "
            "(transformers' Gemma2Config refuses it)"
        )


def layer_linears(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Canonical linear (below ``layers.{i}.``) -> the HF modules (below ``model.layers.{i}.``) of ``cfg``'s model."""
    return FUSED_LINEARS if cfg.architecture in FUSED_ARCHITECTURES else LINEARS


def hf_modules(cfg: ModelConfig, prefix: str) -> list[str]:
    """The HF module names making the canonical linear ``prefix`` of ``cfg``'s model."""
    if prefix == "lm_head":
        return ["lm_head"]
    _, n, rest = prefix.split(".", 2)
    return [f"model.layers.{n}.{m}" for m in layer_linears(cfg)[rest]]


def hf_state_dict(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """Canonical float32 tensors -> the HF model's state dict (fused tensors split by rows; Gemma's ``1 + w`` norm
    weights back to ``w``)."""
    import torch

    def t(name: str) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(weights[name], dtype=np.float32))

    one = 1.0 if cfg.architecture in ONE_PLUS_W_NORMS else 0.0

    def norm(name: str) -> torch.Tensor:
        return t(name) - one

    sd = {"model.embed_tokens.weight": t("embed.weight"), "model.norm.weight": norm("final_norm.weight")}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = t("lm_head.weight")
    q, kv, i = cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size, cfg.intermediate_size
    fused = cfg.architecture in FUSED_ARCHITECTURES
    layer_norms = GEMMA_LAYER_NORMS if cfg.architecture in GEMMA else LAYER_NORMS
    for n in range(cfg.num_layers):
        p, h = f"layers.{n}.", f"model.layers.{n}."
        for name, hf_name in layer_norms.items():
            sd[h + hf_name] = norm(p + name)
        dense = not cfg.is_sparse(n)  # a sparse layer's router and experts: hf_moe.moe_state_dict
        if dense:
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
                sd[h + hf_name] = norm(p + name)
        if dense:
            gate, up = torch.split(t(p + "mlp.gate_up.weight"), [i, i])
            sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"] = gate.clone(), up.clone()
    return sd


def build_hf_model(cfg: ModelConfig, weights: dict[str, np.ndarray]):
    """The float32 transformers model of a (float) dense checkpoint, in eval mode with eager attention."""
    assert cfg.moe is None, "hf_moe.build_moe_hf_model rebuilds a mixture-of-experts model"
    check_quantizable(cfg)
    return instantiate_hf_model(cfg, hf_config(cfg), hf_state_dict(cfg, weights))


def instantiate_hf_model(cfg: ModelConfig, spec: dict[str, Any], state_dict: dict[str, Any]):
    """The float32 transformers model of the ``config.json`` ``spec`` holding ``state_dict`` (every parameter of it
    but a tied head), in eval mode with eager attention."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)  # every parameter is overwritten below; the seed only makes the throw-away init repeatable
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise TrtbuildError(
            f"quantize: checkpoint does not map onto {cfg.architecture} "
            f"(missing {missing[:1]}, unexpected {unexpected[:1]})"
        )
    if cfg.tie_word_embeddings:
        model.tie_weights()
    if cfg.architecture in GEMMA:  # the checkpoint's multiplier: sqrt(hidden_size) rounded to its dtype
        model.model.embed_tokens.embed_scale.fill_(cfg.embed_multiplier)
    return model.eval()
