"""Products of ONE row by a weight (a batch-1 decode step, a single logits row), computed as multiply-and-sum
reductions that Inductor fuses, dequantization included, into one memory-bound pass over the weight.

A matmul of one row reads its weight on one thread of the CPU's BLAS (~11 GB/s on 2 cores, docs/gpu.md) and, for a
weight dequantized in the graph, first writes a float copy of it every step. The fused form reads the weight held
``[out, in]`` (``RowLayout``) once, over all threads:

- a float weight: ``(a * w).sum(-1)``;
- int8 / fp8 per output row or per tensor: the row times the codes, summed, the scale applied to the sums
  (``RowLayout.scales``: one multiply a row, not a weight);
- int4 in blocks along the in-features (``RowLayout.blocks``): the row times the codes (less the block's zero point)
  times the block's scale, summed: the block scales are read once a block, never repeated over the codes. Several
  rows multiply a weight dequantized by the same factors.

``PortableModule`` (``importer.py``) picks the layout at import and the form per product as it is traced.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .nodes import Node


class RowProducts(enum.Enum):
    """Which products of ONE row by a weight (a batch-1 decode step, a single logits row) a compiled module computes
    as multiply-and-sum reductions that Inductor fuses with the weight's dequantization, instead of matmuls."""

    NONE = "none"  # every product a matmul
    QUANTIZED = "quantized"  # the weights dequantized in the graph (a matmul would first write a dequantized copy)
    ALL = "all"  # every MatMul weight and a Gemm's transposed one (the CPU: its BLAS reads one row on one thread)


def default_row_products(device: torch.device) -> RowProducts:
    """The one-row products a compiled engine on ``device`` fuses (``TorchSession``'s and the AOTInductor build's
    default): all of them on the CPU, where the BLAS reads one row on one thread (2x faster decode, measured); the
    quantized weights' on a GPU, where a matmul would first write a dequantized copy of the weight every step (the
    float weights keep cuBLAS until ``benchmarks/gpu_check.py``'s ``*_matmuls`` cases have measured the fused form
    there)."""
    return RowProducts.ALL if device.type == "cpu" else RowProducts.QUANTIZED


@dataclass(frozen=True)
class BlockedRows:
    """A row weight dequantized in blocks of ``block`` in-features (int4), as the module holds it: its codes
    ``[out, in]`` (int8, or uint8 with zero points), float32 scales and any zero points ``[out, ceil(in / block)]``
    (the last block may be partial). Names are the initializers'."""

    codes: str
    scale: str
    zero_point: str | None
    block: int


@dataclass(frozen=True)
class RowLayout:
    """How a ``PortableModule`` holds its weights for one-row products (``row_layout``)."""

    rows: frozenset[str] = frozenset()  # weights held [out, in], one row multiplied along each of theirs
    transposed: frozenset[str] = frozenset()  # initializers stored transposed for ``rows``
    # row weights dequantized per output row or per tensor -> (their quantized data, held [out, in]; the scale): one
    # row is multiplied by the codes and summed, and the scale applied to the sums (one multiply a row, not a weight)
    scales: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # row weights dequantized in blocks of in-features (int4): their products never read the dequantizer's output
    blocks: Mapping[str, BlockedRows] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)  # the graph's nodes, the transposed data's dequantizers flipped


def row_layout(nodes: list[Node], weights: Mapping[str, Tensor], *, quantized_only: bool) -> RowLayout:
    """The weights a module holds ``[out, in]`` for one-row products, and how: the MatMul weights (second inputs read
    by MatMul nodes only) that are float 2-D initializers (unless ``quantized_only``), or the output of a
    ``DequantizeLinear`` of a 2-D initializer read by it only (int8 / fp8 per channel or per tensor; int4 in blocks of
    in-features, with its 2-D scales and zero points); a ``Gemm``'s ``transB`` weight (a tied head) as it is. The
    transposed weights' dequantizers get their ``axis`` flipped (1-D scales stay as they are, 2-D ones transposed)."""
    readers: dict[str, set[tuple[str, int]]] = {}
    for node in nodes:
        for slot, name in enumerate(node.inputs):
            readers.setdefault(name, set()).add((node.op, slot))
    dequantizers = {n.outputs[0]: i for i, n in enumerate(nodes) if n.op == "DequantizeLinear"}

    def only_read_by(name: str, op: str, slot: int) -> bool:
        return readers.get(name) == {(op, slot)}

    def scale_per_row(dq: Node, axis: int) -> tuple[str, str] | None:  # axis: the scale's, on the [out, in] data
        scale = weights.get(dq.inputs[1]) if len(dq.inputs) > 1 else None
        if dq.attrs.get("block_size", 0) or scale is None or dq.inputs[0] not in weights:
            return None
        return (dq.inputs[0], dq.inputs[1]) if scale.numel() == 1 or (scale.dim() == 1 and axis == 0) else None

    rows, transposed, nodes = set(), set(), list(nodes)
    scales: dict[str, tuple[str, str]] = {}
    blocks: dict[str, BlockedRows] = {}
    for node in nodes:  # a Gemm's transB weight is [out, in] already (a tied LM head)
        name = node.inputs[1] if node.op == "Gemm" and node.attrs.get("transB", 0) else ""
        not_matmul = name and all(op != "MatMul" for op, _ in readers[name]) and not node.attrs.get("transA", 0)
        if not_matmul and (name in dequantizers or not quantized_only):
            rows.add(name)
            dq = nodes[dequantizers[name]] if name in dequantizers else None
            factors = scale_per_row(dq, dq.attrs.get("axis", 1) % 2) if dq else None
            if factors:
                scales[name] = factors
    for node in nodes:
        name = node.inputs[1] if node.op == "MatMul" else ""
        if not only_read_by(name, "MatMul", 1):
            continue
        w = weights.get(name)
        if w is not None and w.dim() == 2 and w.is_floating_point() and w.dtype != torch.float8_e4m3fn:
            if not quantized_only:
                rows.add(name)
                transposed.add(name)
            continue
        dq = nodes[dequantizers[name]] if name in dequantizers else None
        data = weights.get(dq.inputs[0]) if dq else None
        if dq is None or data is None or data.dim() != 2 or not only_read_by(dq.inputs[0], "DequantizeLinear", 0):
            continue
        axis, block = dq.attrs.get("axis", 1) % 2, int(dq.attrs.get("block_size", 0))
        params = [(slot, p) for slot, p in enumerate(dq.inputs[1:], 1) if p]  # scale, zero point
        if block:  # int4: blocks along the in-features (axis 0 of [in, out]), 2-D scales and zero points of its own
            own = [p in weights and weights[p].dim() == 2 and only_read_by(p, "DequantizeLinear", i) for i, p in params]
            if axis != 0 or not all(own):
                continue
            zero_point = params[1][1] if len(params) > 1 else None
            blocks[name] = BlockedRows(dq.inputs[0], params[0][1], zero_point, block)
            transposed.update(p for _, p in params)
        elif not all(p in weights and weights[p].dim() <= 1 for _, p in params):
            continue
        elif factors := scale_per_row(dq, 1 - axis):
            scales[name] = factors
        rows.add(name)
        transposed.add(dq.inputs[0])
        nodes[dequantizers[name]] = replace(dq, attrs={**dq.attrs, "axis": 1 - axis})
    return RowLayout(frozenset(rows), frozenset(transposed), scales, blocks, nodes)


def times_rows(a: Tensor, w_out_in: Tensor) -> Tensor:
    """``a [1, in] @ w_out_in.T`` as one fused multiply-and-sum."""
    return (a * w_out_in).sum(-1).unsqueeze(0)


def times_scaled_codes(a: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    """``a [1, in]`` times a weight of ``codes [out, in]`` dequantized by ``scale`` per output row or per tensor:
    the row times the codes, summed in float32, the scale applied to the sums."""
    sums = (a * codes.to(a.dtype)).sum(-1, dtype=torch.float32) * scale.reshape(-1)
    return sums.to(a.dtype).unsqueeze(0)


def _blocks(t: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``t [out, in]`` (or ``[in]``) split into its whole blocks ``[out, in // block, block]`` and the rest
    ``[out, 1, in % block]`` (empty where ``block`` divides ``in``)."""
    whole = t.shape[-1] // block * block
    head, tail = t[..., :whole], t[..., whole:]
    return head.reshape(*t.shape[:-1], -1, block), tail.unsqueeze(-2)


def times_blocked_codes(a: Tensor, w: BlockedRows, codes: Tensor, scale: Tensor, zero_point: Tensor | None) -> Tensor:
    """``a [1, in]`` times a weight dequantized in blocks of ``w.block`` in-features (``BlockedRows``: ``codes [out,
    in]``, ``scale`` and ``zero_point`` ``[out, blocks]``): one float32 sum a row over its whole blocks (and one over
    a partial last block) of the row times the codes (less the block's zero point) times the block's scale, which
    Inductor broadcasts a block at a time. (Summing each block first and scaling the block sums after costs a
    horizontal reduction a block: 15% slower for SmolLM2's 30 layers on 2 CPU cores, measured.)"""
    x = a.reshape(-1).float()
    whole = codes.shape[-1] // w.block
    y = None
    for part, (xp, cp) in enumerate(zip(_blocks(x, w.block), _blocks(codes, w.block), strict=True)):
        if not cp.numel():
            continue
        factors = slice(whole, None) if part else slice(0, whole)
        values = cp.float() if zero_point is None else cp.float() - zero_point[:, factors, None].float()
        product = (xp * values * scale[:, factors, None]).sum((-1, -2))
        y = product if y is None else y + product
    return y.to(a.dtype).unsqueeze(0)


def dequantized_blocks(
    w: BlockedRows, codes: Tensor, scale: Tensor, zero_point: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """The weight ``[out, in]`` of ``BlockedRows`` in ``dtype``: ``(codes - zero_point) * scale`` per block, the
    factors broadcast over each block's codes (for products of several rows)."""
    out_features, whole = codes.shape[0], codes.shape[1] // w.block
    pieces = []
    for i, c in enumerate(_blocks(codes, w.block)):
        if not c.numel():
            continue
        factors = slice(whole, None) if i else slice(0, whole)
        values = c.float()
        if zero_point is not None:
            values = values - zero_point[:, factors, None].float()
        pieces.append((values * scale[:, factors, None]).reshape(out_features, -1))
    return (torch.cat(pieces, -1) if len(pieces) > 1 else pieces[0]).to(dtype)
