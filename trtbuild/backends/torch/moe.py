"""``torch.ops.trtbuild.moe``: the ``trtbuild::MoE`` plugin (plugins/moe/README.md) as a torch custom op.

Tokens are indexed per routed expert: each expert some token chose runs once on its tokens (``index_add_`` of the
weighted outputs), the others are not touched. The routing is data-dependent, so the op is opaque to
``torch.export`` / Inductor (its fake implementation gives the output's shape); a process running a torch engine
imports this module first (``TorchSession`` does), as ``ops.py``. Checked against the numpy oracle in
``tests/test_cpu_moe.py`` and, with int8 activations (``activation_block``), ``tests/test_moe_lowerings.py``.
"""

import torch
from torch import Tensor


@torch.library.custom_op("trtbuild::moe", mutates_args=())
def moe(
    hidden: Tensor,
    router_logits: Tensor,
    gate_up: Tensor,
    down: Tensor,
    gate_up_scale: Tensor | None,
    down_scale: Tensor | None,
    top_k: int,
    renormalize: bool,
    group_size: int | None = None,
    activation_block: int | None = None,
) -> Tensor:
    """``trtbuild::MoE``: ``[T, H]`` in ``hidden``'s dtype; routing in float32, experts in the weights' dtype (int8
    experts, given their row scales, are widened to ``hidden``'s dtype one routed expert at a time; int4 experts,
    uint8 two codes a byte with ``group_size``, likewise unpacked and scaled per block). ``activation_block`` (b,
    quantized experts only): both products read their input through int8 per block of b in-features of each token
    (``_quantize_blocks``), the hidden state once for every expert."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    inter = gate_up.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    if activation_block is not None:
        assert gate_up_scale is not None and down_scale is not None, "activation_block needs quantized experts"
        hidden = _quantize_blocks(hidden, activation_block)
    for e in torch.unique(experts).tolist():
        tokens, slots = torch.where(experts == e)
        w_gate_up, w_down = gate_up[e], down[e]
        if group_size is not None:
            assert gate_up_scale is not None and down_scale is not None, "int4 experts need their scales"
            w_gate_up = _dequantize_int4(w_gate_up, gate_up_scale[e], group_size).to(hidden.dtype)
            w_down = _dequantize_int4(w_down, down_scale[e], group_size).to(hidden.dtype)
        elif gate_up_scale is not None and down_scale is not None:
            w_gate_up = (w_gate_up.float() * gate_up_scale[e].float()[:, None]).to(hidden.dtype)
            w_down = (w_down.float() * down_scale[e].float()[:, None]).to(hidden.dtype)
        x = hidden[tokens].to(w_gate_up.dtype)
        g, u = (x @ w_gate_up.t()).split(inter, dim=-1)
        act = torch.nn.functional.silu(g) * u
        if activation_block is not None:
            act = _quantize_blocks(act, activation_block)
        y = act.to(w_down.dtype) @ w_down.t()
        out.index_add_(0, tokens, y.float() * weights[tokens, slots, None])
    return out.to(hidden.dtype)


def _dequantize_int4(packed: Tensor, scale: Tensor, group_size: int) -> Tensor:
    """One expert's int4 rows, uint8 ``[rows, in/2]`` (in-feature 2j in byte j's low nibble), times their scales
    ``[rows, ceil(in / group_size)]``: float32 ``[rows, in]``."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).to(torch.int8)
    codes = torch.where(nibbles > 7, nibbles - 16, nibbles).float()
    return codes * scale.float().repeat_interleave(group_size, dim=-1)[:, : codes.shape[-1]]


def _quantize_blocks(x: Tensor, block: int) -> Tensor:
    """Rows ``x [T, K]`` through int8 per block of ``block`` in-features (the last one may be shorter), QLinear's
    rule in float32 (plugins/moe/reference.py, ``quantize_activation_blocks``): ``s = max(amax / 127, FLT_MIN)``
    (true division), ``q = round_half_even(x / s)``; returns ``q * s`` in ``x``'s dtype."""
    rows = x.float()
    width = rows.shape[-1]
    blocks = torch.nn.functional.pad(rows, (0, -width % block)).unflatten(-1, (-1, block))  # zeros: amax unchanged
    scale = (blocks.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    return (torch.round(blocks / scale) * scale).flatten(-2)[..., :width].to(x.dtype)


@moe.register_fake
def _moe_fake(
    hidden,
    router_logits,
    gate_up,
    down,
    gate_up_scale,
    down_scale,
    top_k,
    renormalize,
    group_size=None,
    activation_block=None,
):
    return hidden.new_empty(hidden.shape)
