"""The numpy oracle of ``trtbuild::MoE`` (README.md): softmax top-k routing and the routed SwiGLU experts, with
float, int8 (a scale per row) or int4 experts (packed two per byte, a scale per block of ``group_size`` in-features),
and for quantized experts optionally int8 activations (``activation_block``: each expert input quantized at run
time per block of that many in-features of each token, QLinear's rule: ``quantize_activation_blocks``).

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
    """The node's attributes: experts kept per token, whether their weights are renormalised, the activation;
    for int4 experts (uint8 weights) the in-features per scale (``group_size``: given exactly when the experts are
    int4; a positive even number); and for quantized experts (int8 or int4) the in-features per run-time int8
    activation scale (``activation_block``: absent, float activations; with int4 experts it divides
    ``group_size``)."""

    top_k: int
    renormalize: bool
    activation: str = ACTIVATION_SILU
    group_size: int | None = None
    activation_block: int | None = None

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError("top_k must be at least 1")
        if self.activation != ACTIVATION_SILU:
            raise ValueError(f"activation {self.activation!r} is not supported (silu)")
        if self.group_size is not None and (self.group_size < 2 or self.group_size % 2):
            raise ValueError(f"group_size {self.group_size} must be a positive even number")
        if self.activation_block is not None:
            if self.activation_block < 1:
                raise ValueError(f"activation_block {self.activation_block} must be positive")
            if self.group_size is not None and self.group_size % self.activation_block:
                raise ValueError(f"activation_block {self.activation_block} must divide group_size {self.group_size}")


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """uint8 ``[..., n/2]`` -> int8 ``[..., n]`` in [-8, 7]: byte j holds column 2j in its low nibble and 2j + 1 in
    its high one, each a two's-complement int4 (the dense int4 checkpoint format)."""
    packed = np.asarray(packed, np.uint8)
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.int8)
    return np.where(nibbles > 7, nibbles - 16, nibbles).astype(np.int8)


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    """Int4 experts ``[E, rows, in/2]`` with their scales ``[E, rows, ceil(in / group_size)]`` -> float64
    ``[E, rows, in]``: column c of a row is ``q[c] * scale[c // group_size]`` (the last group may be partial)."""
    q = unpack_int4(packed).astype(np.float64)
    per_column = np.repeat(np.asarray(scale, np.float64), group_size, axis=-1)[..., : q.shape[-1]]
    return q * per_column


def quantize_activation_blocks(x: np.ndarray, block: int) -> np.ndarray:
    """float32 rows ``x [T, K]`` through int8 per block of ``block`` in-features of each row (the last block may be
    shorter), in float32 as QLinear computes it (``trtbuild/kernels/cpu/linear.h``, step 1):
    ``s = max(amax / 127, FLT_MIN)`` (true division), ``q = round_half_even(x / s)``; returns ``q * s`` in float64."""
    x = np.asarray(x, np.float32)
    out = np.empty(x.shape, np.float64)
    tiny = np.finfo(np.float32).tiny
    for start in range(0, x.shape[-1], block):
        part = x[:, start : start + block]
        s = np.maximum(np.abs(part).max(axis=-1, keepdims=True) / np.float32(127.0), np.float32(tiny))
        q = np.rint(part / s.astype(np.float32))
        out[:, start : start + block] = q.astype(np.float64) * s.astype(np.float64)
    return out


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
    are int8 and each row is ``q * scale[e, row]``, or, with ``attrs.group_size``, packed int4 (``dequantize_int4``).
    With ``attrs.activation_block`` (quantized experts only) both products read their input through
    ``quantize_activation_blocks``: ``hidden[t]`` and ``silu(g) * u``, the latter taken in float32 first."""
    quantized = gate_up_scale is not None and down_scale is not None
    assert attrs.activation_block is None or quantized, "activation_block needs quantized experts"
    if attrs.group_size is not None:
        assert gate_up_scale is not None and down_scale is not None, "int4 experts need their scales"
        gate_up = dequantize_int4(gate_up, gate_up_scale, attrs.group_size)
        down = dequantize_int4(down, down_scale, attrs.group_size)
    elif quantized:
        gate_up = np.asarray(gate_up, np.float64) * np.asarray(gate_up_scale, np.float64)[..., None]
        down = np.asarray(down, np.float64) * np.asarray(down_scale, np.float64)[..., None]
    block = attrs.activation_block
    x = np.asarray(hidden, np.float64) if block is None else quantize_activation_blocks(hidden, block)
    experts, weights = route(router_logits, attrs.top_k, attrs.renormalize)
    inter = gate_up.shape[1] // 2
    out = np.zeros_like(x)
    for e in np.unique(experts):
        tokens, slots = np.nonzero(experts == e)
        gu = x[tokens] @ np.asarray(gate_up[e], np.float64).T
        g, u = gu[:, :inter], gu[:, inter:]
        act = g / (1.0 + np.exp(-g)) * u
        if block is not None:
            act = quantize_activation_blocks(act.astype(np.float32), block)
        y = act @ np.asarray(down[e], np.float64).T
        np.add.at(out, tokens, weights[tokens, slots, None] * y)
    return out.astype(np.float32)
