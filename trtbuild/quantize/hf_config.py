"""The Hugging Face ``config.json`` of a trtbuild checkpoint, for the transformers model that ``hf_model.py``
rebuilds (the inverse of each family's reader in ``trtbuild/models``): the sizes every family shares
(``hf_sizes``), the Llama family's, Qwen3's and Phi-3's keys (``hf_config``), and Gemma 2's and 3's
(``gemma_hf_config``: ``rope_parameters`` per layer type in Gemma 3, ``query_pre_attn_scalar``, the soft-caps).
``hf_moe.moe_hf_config`` adds the mixture-of-experts keys.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig, RopeConfig
from ..models.llama import HF_LAYER_TYPES

# Architectures quantize accepts -> transformers model_type.
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral",  # mixture of experts: hf_moe.py
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
# Gemma's architectures: GeGLU, sandwich norms (``hf_model.GEMMA_LAYER_NORMS``), query_pre_attn_scalar, soft-caps,
# an embedding multiplier; q/k norms in Gemma 3 only (``gemma_hf_config``, ``hf_model.check_gemma``).
GEMMA = frozenset({GEMMA2, GEMMA3})
# Architectures whose RMSNorms scale by (1 + w): the checkpoint stores 1 + w (``convert.tensor_names``), HF w.
ONE_PLUS_W_NORMS = GEMMA


def query_pre_attn_scalar(cfg: ModelConfig) -> int:
    """Gemma's ``query_pre_attn_scalar`` (an integer in transformers) of the softmax scale ``q ** -0.5``."""
    return round(cfg.softmax_scale**-2)


def hf_rope(rope: RopeConfig) -> dict[str, Any]:
    """transformers' ``rope_parameters`` of ``rope`` (inverse of ``models.llama.rope_from_hf``, full rotation)."""
    if rope.scaling != 1.0:
        return {"rope_type": "linear", "rope_theta": rope.theta, "factor": rope.scaling}
    return {"rope_type": "default", "rope_theta": rope.theta}


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``cfg`` (inverse of ``models.llama.llama_config``,
    ``models.qwen3.qwen3_config``, ``models.phi3.phi3_config`` and ``models.gemma.gemma_config``)."""
    assert cfg.rope is not None
    if cfg.architecture in GEMMA:
        return gemma_hf_config(cfg)
    rope = hf_rope(cfg.rope)
    out: dict[str, Any] = dict(
        **hf_sizes(cfg),
        rope_parameters=rope,
        rope_theta=cfg.rope.theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        hidden_act="silu",
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
    )
    if cfg.architecture == "LlamaForCausalLM":
        out["attention_bias"] = cfg.qkv_bias
    if cfg.architecture in ("MistralForCausalLM", "Phi3ForCausalLM"):  # a window slides every layer
        out["sliding_window"] = cfg.sliding_window
    if cfg.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):  # the window slides the layers it names
        out.update(use_sliding_window=cfg.sliding_window is not None, layer_types=hf_layer_types(cfg))
        out["sliding_window"] = cfg.sliding_window
    if cfg.architecture == "Qwen3ForCausalLM":
        out["attention_bias"] = cfg.qkv_bias
    if cfg.architecture == "Phi3ForCausalLM":  # head_dim is hidden / heads
        del out["head_dim"]
        rope["partial_rotary_factor"] = cfg.rope.rotary_dim / cfg.head_size
        out["pad_token_id"] = None  # Phi3Config's default pad id 32000 may exceed the vocab
    return out


def hf_sizes(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` keys every rebuilt model shares: architecture, model type, sizes, positions, norm eps."""
    return dict(
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
    )


def hf_layer_types(cfg: ModelConfig) -> list[str]:
    """``cfg``'s layer kinds in transformers' names (the inverse of ``models.llama.HF_LAYER_TYPES``)."""
    names = {kind: name for name, kind in HF_LAYER_TYPES.items()}
    return [names[kind] for kind in cfg.layer_types]


def gemma_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """Gemma 2's or Gemma 3's ``config.json`` (transformers 5: Gemma 3 has ``rope_parameters`` per layer type, Gemma
    2 one): the inverse of ``models.gemma.gemma_config``. The embedding multiplier is ``hidden_size ** 0.5`` there;
    ``build_hf_model`` sets the checkpoint's own (rounded to its dtype)."""
    assert cfg.rope is not None
    rope: dict[str, Any] = hf_rope(cfg.rope)  # Gemma 2: one rotary embedding (``check_gemma``)
    if cfg.architecture == GEMMA3:
        rope = {"full_attention": rope, "sliding_attention": hf_rope(cfg.local_rope or cfg.rope)}
    return dict(
        **hf_sizes(cfg),
        hidden_activation="gelu_pytorch_tanh",
        layer_types=hf_layer_types(cfg),
        # a model with no sliding layer has no window; transformers wants a number all the same (then unused)
        sliding_window=cfg.sliding_window or cfg.max_position_embeddings,
        rope_parameters=rope,
        query_pre_attn_scalar=query_pre_attn_scalar(cfg),
        attn_logit_softcapping=cfg.attn_softcap,
        final_logit_softcapping=cfg.final_softcap,
        attention_bias=False,
        use_bidirectional_attention=False,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        pad_token_id=None,
    )
