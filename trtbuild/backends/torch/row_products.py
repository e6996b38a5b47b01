"""Products of ONE row by a weight (a batch-1 decode step, a single logits row), computed as multiply-and-sum
reductions that Inductor fuses, dequantization included, into one memory-bound pass over the weight.

A matmul of one row reads its weight on one thread of the CPU's BLAS (~11 GB/s on 2 cores, docs/gpu.md) and, for a
weight dequantized in the graph, first writes a float copy of it every step. The fused form reads the weight held
``[out, in]`` (``RowLayout``) once, over all threads:

- a float weight: ``(a * w).sum(-1)``;
- int8 / fp8 per output row or per tensor: the row times the codes, summed, the scale applied to the sums
  (``RowLayout.scales``: one multiply a row, not a weight);
- in blocks along the in-features (``RowLayout.blocks``: int4 with or without zero points; a GGUF checkpoint's
  Q4_1 codes with their offsets, Q4_0 and Q8_0, its Q8_0 tied head too): the row times the codes dequantized by
  their block's factors, summed; the factors are read once a block, never repeated over the codes. Several rows
  multiply a weight dequantized by the same factors; the graph's own dequantizing nodes are dropped.

``PortableModule`` (``importer.py``) picks the layout at import and the form per product as it is traced.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

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
    """A row weight dequantized in blocks of ``block`` in-features (int4; llama.cpp's Q8_0 / Q4_1 blocks), as the
    module holds it: its codes ``[out, in]`` (int8, or uint8 with zero points or an offset), float32 scales and any
    zero points or offsets ``[out, ceil(in / block)]`` (the last block may be partial; a tied head's offsets
    ``[out, blocks, 1]``, the embedding gather's shape): ``w = (code - zero point) * scale + offset``. Names are the
    initializers'."""

    codes: str
    scale: str
    zero_point: str | None
    block: int
    offset: str | None = None  # GGUF Q4_1's ``weight_offset`` (``checkpoint.graph.emit_weight_offset``)


@dataclass(frozen=True)
class RowLayout:
    """How a ``PortableModule`` holds its weights for one-row products (``row_layout``)."""

    rows: frozenset[str] = frozenset()  # weights held [out, in], one row multiplied along each of theirs
    transposed: frozenset[str] = frozenset()  # initializers stored [out, in] (``held_rows``) for ``rows``
    # row weights dequantized per output row or per tensor -> (their quantized data, held [out, in]; the scale): one
    # row is multiplied by the codes and summed, and the scale applied to the sums (one multiply a row, not a weight)
    scales: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # row weights dequantized in blocks of in-features: every product reads their codes and factors, none the graph's
    # dequantized weight, whose nodes are dropped (the name is then no node's output)
    blocks: Mapping[str, BlockedRows] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)  # the graph's nodes: transposed data's dequantizers flipped


def held_rows(t: Tensor) -> Tensor:
    """An initializer of ``RowLayout.transposed`` as the module holds it: ``[in, out]`` -> ``[out, in]``, a block
    offset ``[blocks, 1, out]`` -> ``[out, blocks]``."""
    return t.reshape(t.shape[0], -1).t().contiguous()


def row_layout(nodes: list[Node], weights: Mapping[str, Tensor], *, quantized_only: bool) -> RowLayout:
    """The weights a module holds ``[out, in]`` for one-row products, and how: the MatMul weights (second inputs read
    by MatMul nodes only) that are float 2-D initializers (unless ``quantized_only``), or dequantized from a 2-D
    initializer read by the dequantizer only: int8 / fp8 per channel or per tensor (the dequantizer's ``axis``
    flipped), or in blocks of in-features with 2-D scales and zero points of their own (int4, Q8_0), a GGUF Q4_1
    offset added on the way; a ``Gemm``'s ``transB`` weight (a tied head), ``[out, in]`` already, float or dequantized
    per row or in blocks (with an offset: a GGUF ``int8_min_wo`` embedding's, ``checkpoint.graph.emit_row_offset``)."""
    readers: dict[str, set[tuple[str, int]]] = {}
    for node in nodes:
        for slot, name in enumerate(node.inputs):
            readers.setdefault(name, set()).add((node.op, slot))
    producers = {o: i for i, n in enumerate(nodes) for o in n.outputs}

    def only_read_by(name: str, op: str, slot: int) -> bool:
        return readers.get(name) == {(op, slot)}

    def made_by(name: str, op: str, read_by: tuple[str, int]) -> int | None:  # the node of ``op`` making ``name``
        i = producers.get(name)
        return i if i is not None and nodes[i].op == op and only_read_by(name, *read_by) else None

    def dequantized(name: str, reader: tuple[str, int], own: bool = True) -> tuple[list[int], str | None] | None:
        """The nodes computing weight ``name`` (read by ``reader`` only) from a dequantizer (first): it alone, or it
        and a GGUF Q4_1 offset's Reshape, Add, Reshape (``checkpoint.graph.emit_weight_offset``); the offset (read
        by that Add only if ``own``)."""
        if (dq := made_by(name, "DequantizeLinear", reader)) is not None:
            return [dq], None
        rows_i = made_by(name, "Reshape", reader)
        add_i = None if rows_i is None else made_by(nodes[rows_i].inputs[0], "Add", ("Reshape", 0))
        groups_i = None if add_i is None else made_by(nodes[add_i].inputs[0], "Reshape", ("Add", 0))
        dq = None if groups_i is None else made_by(nodes[groups_i].inputs[0], "DequantizeLinear", ("Reshape", 0))
        if dq is None or add_i is None or (own and not only_read_by(nodes[add_i].inputs[1], "Add", 1)):
            return None
        offset = nodes[add_i].inputs[1]
        return ([dq, groups_i, add_i, rows_i], offset) if weights.get(offset) is not None else None

    def scale_per_row(dq: Node, axis: int) -> tuple[str, str] | None:  # axis: the scale's, on the [out, in] data
        scale = weights.get(dq.inputs[1]) if len(dq.inputs) > 1 else None
        if dq.attrs.get("block_size", 0) or scale is None or dq.inputs[0] not in weights:
            return None
        return (dq.inputs[0], dq.inputs[1]) if scale.numel() == 1 or (scale.dim() == 1 and axis == 0) else None

    def in_blocks(dq: Node, offset: str | None, in_axis: int, own: bool) -> BlockedRows | None:
        """``dq`` blocked along its data's in-features (``in_axis``) with 2-D factors (read by it only if ``own``)."""
        data, block = weights.get(dq.inputs[0]), int(dq.attrs.get("block_size", 0))
        params = [(slot, p) for slot, p in enumerate(dq.inputs[1:], 1) if p]  # scale, zero point
        scale = weights.get(params[0][1]) if params else None
        if not block or data is None or data.dim() != 2 or dq.attrs.get("axis", 1) % 2 != in_axis:
            return None
        if scale is None or scale.dim() != 2 or any(weights.get(p) is None for _, p in params):
            return None
        if any(weights[p].shape != scale.shape for _, p in params) or (
            offset and weights[offset].numel() != scale.numel()
        ):
            return None
        if own and not all(only_read_by(p, "DequantizeLinear", slot) for slot, p in [(0, dq.inputs[0]), *params]):
            return None
        return BlockedRows(dq.inputs[0], params[0][1], params[1][1] if len(params) > 1 else None, block, offset)

    rows, transposed, dropped = set(), set(), set()
    scales: dict[str, tuple[str, str]] = {}
    blocks: dict[str, BlockedRows] = {}
    nodes = list(nodes)
    for node in nodes:  # a Gemm's transB weight is [out, in] already (a tied LM head)
        name = node.inputs[1] if node.op == "Gemm" and node.attrs.get("transB", 0) else ""
        if not name or node.attrs.get("transA", 0) or any(op == "MatMul" for op, _ in readers[name]):
            continue
        i = producers.get(name)
        dq = nodes[i] if i is not None and nodes[i].op == "DequantizeLinear" else None
        chain = None if dq is not None else dequantized(name, ("Gemm", 1), own=False)  # the embedding's offsets
        if chain is not None:
            i, dq = chain[0][0], nodes[chain[0][0]]
        if dq is None and quantized_only:
            continue
        rows.add(name)
        if dq is None:
            continue
        offset = chain[1] if chain is not None else None
        if only_read_by(name, "Gemm", 1) and (head := in_blocks(dq, offset, 1, own=False)):
            blocks[name] = head  # its codes may be the embedding's too: held as they are
            dropped.update(chain[0] if chain is not None else [i])
        elif chain is None and (factors := scale_per_row(dq, dq.attrs.get("axis", 1) % 2)):
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
        chain = dequantized(name, ("MatMul", 1))
        if chain is None:
            continue
        (dq_i, *_), offset = chain
        dq = nodes[dq_i]
        if blocked := in_blocks(dq, offset, 0, own=True):  # [in, out]: codes and factors held [out, in] too
            blocks[name] = blocked
            transposed.update(p for p in (blocked.codes, blocked.scale, blocked.zero_point, offset) if p)
            dropped.update(chain[0])
            rows.add(name)
            continue
        data, params = weights.get(dq.inputs[0]), [p for p in dq.inputs[1:] if p]
        if offset or dq.attrs.get("block_size", 0) or data is None or data.dim() != 2:
            continue
        if not only_read_by(dq.inputs[0], "DequantizeLinear", 0) or not all(
            p in weights and weights[p].dim() <= 1 for p in params
        ):
            continue
        axis = dq.attrs.get("axis", 1) % 2
        if factors := scale_per_row(dq, 1 - axis):
            scales[name] = factors
        rows.add(name)
        transposed.add(dq.inputs[0])
        nodes[dq_i] = replace(dq, attrs={**dq.attrs, "axis": 1 - axis})
    kept = [n for i, n in enumerate(nodes) if i not in dropped]
    return RowLayout(frozenset(rows), frozenset(transposed), scales, blocks, kept)


def times_rows(a: Tensor, w_out_in: Tensor) -> Tensor:
    """``a [1, in] @ w_out_in.T`` as one fused multiply-and-sum."""
    return (a * w_out_in).sum(-1).unsqueeze(0)


def times_scaled_codes(a: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    """``a [1, in]`` times a weight of ``codes [out, in]`` dequantized by ``scale`` per output row or per tensor:
    the row times the codes, summed in float32, the scale applied to the sums."""
    sums = (a * codes.to(a.dtype)).sum(-1, dtype=torch.float32) * scale.reshape(-1)
    return sums.to(a.dtype).unsqueeze(0)


def _blocks(t: Tensor, block: int) -> list[tuple[Tensor, slice]]:
    """``t [out, in]`` (or ``[in]``) in its whole blocks ``[out, in // block, block]`` and a partial last block
    ``[out, 1, in % block]``, those of them that exist, each with the slice of the blocks' factors it takes."""
    whole = t.shape[-1] // block
    parts = [(t[..., : whole * block].reshape(*t.shape[:-1], whole, block), slice(0, whole))] if whole else []
    if t.shape[-1] % block:
        parts.append((t[..., whole * block :].unsqueeze(-2), slice(whole, None)))
    return parts


class BlockTensors(NamedTuple):
    """The tensors of a ``BlockedRows`` as the module holds them (``[out, in]``; factors ``[out, blocks]``)."""

    codes: Tensor
    scale: Tensor
    zero_point: Tensor | None
    offset: Tensor | None


def _values(t: BlockTensors, codes: Tensor, blocks: slice) -> Tensor:
    """``codes [out, n, block]`` (the blocks ``blocks`` of ``t.codes``) dequantized in float32."""
    values = codes.float()
    if t.zero_point is not None:
        values = values - t.zero_point[:, blocks, None].float()
    values = values * t.scale[:, blocks, None]
    if t.offset is None:
        return values
    return values + t.offset.flatten(1)[:, blocks, None].float()  # a tied head's [out, blocks, 1]: the gather's


def times_blocked_codes(a: Tensor, block: int, t: BlockTensors) -> Tensor:
    """``a [1, in]`` times a weight dequantized in blocks of ``block`` in-features: one float32 sum a row over its
    whole blocks (and one over a partial last block) of the row times the codes dequantized by their block's factors,
    which Inductor broadcasts a block at a time. (Summing each block first and scaling the block sums after costs a
    horizontal reduction a block: 15% slower for SmolLM2's 30 layers on 2 CPU cores, measured.)"""
    pieces = zip(_blocks(a.reshape(-1).float(), block), _blocks(t.codes, block), strict=True)
    y = sum((x * _values(t, codes, factors)).sum((-1, -2)) for (x, _), (codes, factors) in pieces)
    return y.to(a.dtype).unsqueeze(0)  # type: ignore[union-attr]


def dequantized_blocks(block: int, t: BlockTensors, dtype: torch.dtype) -> Tensor:
    """The weight ``[out, in]`` in ``dtype``, each block's codes dequantized by its factors (for products of several
    rows)."""
    pieces = [_values(t, c, factors).reshape(t.codes.shape[0], -1) for c, factors in _blocks(t.codes, block)]
    return (torch.cat(pieces, -1) if len(pieces) > 1 else pieces[0]).to(dtype)
