"""What the mixture-of-experts families (``mixtral.py``, ``qwen3_moe.py``) share: the one-line refusals of the MoE
variants ``trtbuild::MoE`` does not express (plugins/moe/README.md): shared experts, routers that score by anything
but a softmax over every expert, grouped or scaled routing; experts of another activation than silu.
"""

from __future__ import annotations

from typing import Any

from .registration import Refusals

# Config keys of MoE variants the op does not express -> the value of the variant trtbuild runs (absent or this).
_PLAIN_VALUES: dict[str, Any] = {
    "shared_expert_intermediate_size": 0,  # Qwen2-MoE's always-on shared expert
    "n_shared_experts": 0,  # DeepSeek-V2/V3
    "num_shared_experts": 0,
    "scoring_func": "softmax",  # DeepSeek-V3: sigmoid router scores
    "topk_method": "greedy",  # DeepSeek: group-limited / bias-corrected selection
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
}


def refuse_moe_variants(hf: dict[str, Any], refusals: Refusals) -> None:
    """Refuse (one line each) the MoE features of ``hf`` that a softmax top-k router over routed SwiGLU experts
    does not cover, and activations other than silu."""
    if hf.get("hidden_act", "silu") != "silu":
        refusals.refuse(f"hidden_act {hf['hidden_act']!r} is not supported (silu experts)")
    for key, plain in _PLAIN_VALUES.items():
        value = hf.get(key)
        if value is not None and value != plain:
            only = "a softmax top-k router over routed experts only (no shared experts, no grouped or scaled routing)"
            refusals.refuse(f"{key}={value!r} is not supported: trtbuild's mixture of experts is {only}")
