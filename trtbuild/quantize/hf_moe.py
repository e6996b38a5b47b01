"""A mixture-of-experts checkpoint (Mixtral, Qwen3-MoE) as a transformers model again, so modelopt can calibrate
its KV-cache ranges (``moe.py``).

transformers 5 holds a sparse layer's experts fused, as the canonical tensors are (``checkpoint.layout``):
``mlp.experts.gate_up_proj [E, 2I, H]`` (each expert's gate | up rows), ``mlp.experts.down_proj [E, H, I]`` and the
router ``mlp.gate.weight [E, H]`` (``EXPERT_TENSORS``); the attention, the norms and Qwen3-MoE's dense layers are
rebuilt as for the dense families (``hf_model.hf_state_dict``). Both families slide a window over every layer when
they have one (``models.mixtral``, ``models.qwen3_moe``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import ModelConfig
from .hf_config import hf_config
from .hf_model import check_quantizable, hf_state_dict, instantiate_hf_model

# Canonical tensor of a sparse layer (below ``layers.{i}.``) -> its HF parameter (below ``model.layers.{i}.``).
EXPERT_TENSORS: dict[str, str] = {
    "moe.router.weight": "mlp.gate.weight",
    "moe.gate_up.weight": "mlp.experts.gate_up_proj",
    "moe.down.weight": "mlp.experts.down_proj",
}


def moe_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of the MoE ``cfg`` (inverse of ``models.mixtral.mixtral_config`` and
    ``models.qwen3_moe.qwen3_moe_config``)."""
    moe = cfg.moe
    assert moe is not None
    out = hf_config(cfg)
    out.update(num_experts_per_tok=moe.top_k, sliding_window=cfg.sliding_window)
    if cfg.architecture == "MixtralForCausalLM":  # every layer sparse, renormalised; intermediate_size is an expert's
        out.update(num_local_experts=moe.num_experts, intermediate_size=moe.intermediate_size)
        return out
    dense = [n for n in range(cfg.num_layers) if not cfg.is_sparse(n)]
    out.update(
        num_experts=moe.num_experts,
        moe_intermediate_size=moe.intermediate_size,
        norm_topk_prob=moe.renormalize,
        decoder_sparse_step=1,
        mlp_only_layers=dense,  # the layers models.qwen3_moe found dense, whatever step made them so
        use_sliding_window=cfg.sliding_window is not None,
        attention_bias=cfg.qkv_bias,
    )
    return out


def moe_state_dict(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """Canonical float32 tensors -> the HF MoE model's state dict."""
    import torch

    sd = hf_state_dict(cfg, weights)
    for n in range(cfg.num_layers):
        if cfg.is_sparse(n):
            for name, hf_name in EXPERT_TENSORS.items():
                w = np.ascontiguousarray(weights[f"layers.{n}.{name}"], dtype=np.float32)
                sd[f"model.layers.{n}.{hf_name}"] = torch.from_numpy(w)
    return sd


def build_moe_hf_model(cfg: ModelConfig, weights: dict[str, np.ndarray]):
    """The float32 transformers model of an MoE checkpoint's (float, or dequantized) weights, in eval mode with
    eager attention."""
    assert cfg.moe is not None
    check_quantizable(cfg)
    return instantiate_hf_model(cfg, moe_hf_config(cfg), moe_state_dict(cfg, weights))
