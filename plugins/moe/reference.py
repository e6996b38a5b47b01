"""The numpy oracle of ``trtbuild::MoE`` (README.md): softmax top-k routing and the routed SwiGLU experts.

Computed in float64 and returned in float32; every lowering and kernel of the op is tested against it
(``tests/test_cpu_moe.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DOMAIN = "trtbuild"  # the plugin domain of every trtbuild op (the paged-attention plugin's too)
OP_TYPE = "MoE"
OP_VERSION = 1
ACTIVATION_SILU = "silu"


@dataclass(frozen=True)
class MoeAttrs:
    """The node's attributes: experts kept per token, whether their weights are renormalised, the activation."""

    top_k: int
    renormalize: bool
    activation: str = ACTIVATION_SILU

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError("top_k must be at least 1")
        if self.activation != ACTIVATION_SILU:
            raise ValueError(f"activation {self.activation!r} is not supported (silu)")


def route(router_logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each token's experts ``[T, k]`` (int64, most probable first; equal probabilities: the lower expert first)
    and their weights ``[T, k]`` (float64): the softmax over every expert at those experts, divided by their sum
    when ``renormalize``."""
    logits = np.asarray(router_logits, np.float64)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, experts, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return experts.astype(np.int64), weights


def moe(
    hidden: np.ndarray,
    router_logits: np.ndarray,
    gate_up: np.ndarray,
    down: np.ndarray,
    attrs: MoeAttrs,
    gate_up_scale: np.ndarray | None = None,
    down_scale: np.ndarray | None = None,
) -> np.ndarray:
    """``out[t] = sum_j w[t, j] * down[e] @ (silu(g) * u)`` with ``g | u = gate_up[e] @ hidden[t]`` over token t's
    routed experts ``e = experts[t, j]`` (``route``): float32 ``[T, H]``. With the scales, ``gate_up`` and ``down``
    are int8 and each row is ``q * scale[e, row]``."""
    if gate_up_scale is not None and down_scale is not None:
        gate_up = np.asarray(gate_up, np.float64) * np.asarray(gate_up_scale, np.float64)[..., None]
        down = np.asarray(down, np.float64) * np.asarray(down_scale, np.float64)[..., None]
    x = np.asarray(hidden, np.float64)
    experts, weights = route(router_logits, attrs.top_k, attrs.renormalize)
    inter = gate_up.shape[1] // 2
    out = np.zeros_like(x)
    for e in np.unique(experts):
        tokens, slots = np.nonzero(experts == e)
        gu = x[tokens] @ np.asarray(gate_up[e], np.float64).T
        g, u = gu[:, :inter], gu[:, inter:]
        act = g / (1.0 + np.exp(-g)) * u
        y = act @ np.asarray(down[e], np.float64).T
        np.add.at(out, tokens, weights[tokens, slots, None] * y)
    return out.astype(np.float32)
