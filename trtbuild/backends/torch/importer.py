"""Import the portable graph (ONNX, ``trtbuild/graph/emit.py``) into a torch module (for ``torch.export`` or
``torch.compile``).

The module interprets the graph's nodes in order; tracing it (``torch.export``, Dynamo) yields one flat graph of aten
ops plus one ``torch.ops.trtbuild.paged_attention`` per layer and one ``torch.ops.trtbuild.moe`` per sparse layer. It
covers exactly the ops the emitter produces (float and quantized checkpoints); any other op fails the import with one
line naming it.

Float initializers become buffers in the engine's compute dtype; quantized weights keep their integer / float8
storage (int4 unpacked to int8) with float32 scales, and ``DequantizeLinear`` runs in the graph, where Inductor can
fuse it into the consumer. The rotary table stays float32. Inputs: the five step tensors then the caches, as a list,
then, for a model of both sliding and full layers, the sliding layers' block tables (``EngineIO.sliding_block_tables``;
a graph input after ``logits_indices``, before the caches).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import Tensor

from ...config import EngineIO
from ...errors import BuildError
from ...plugins import moe as moe_op
from ...plugins.paged_attention import DOMAIN, KV_FLOAT, OP_TYPE
from . import moe, ops
from .nodes import Node, op_name
from .row_products import (
    BlockTensors,
    RowLayout,
    RowProducts,
    dequantized_blocks,
    held_rows,
    row_layout,
    times_blocked_codes,
    times_rows,
    times_scaled_codes,
)

FLOAT8 = onnx.TensorProto.FLOAT8E4M3FN
STEP_INPUTS = ("input_ids", "positions", "block_tables", "query_start_loc", "logits_indices")


def _to_torch(array: np.ndarray) -> Tensor:
    """An initializer as a torch tensor: int4 -> int8 values, uint4 -> uint8, float8_e4m3fn kept as float8."""
    if array.dtype == np.dtype(ml_dtypes.int4):
        return torch.from_numpy(array.astype(np.int8))
    if array.dtype == np.dtype(ml_dtypes.uint4):
        return torch.from_numpy(array.astype(np.uint8))
    if array.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        return torch.from_numpy(np.array(array).view(np.uint8)).view(torch.float8_e4m3fn)
    array = np.ascontiguousarray(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _keep_float32(name: str, tensor: Tensor) -> bool:
    """Scales, scalar constants and the rotary table stay float32 (quantization math and the kernel read them as
    float32; a 0-d float32 tensor does not promote a half-precision operand)."""
    return tensor.dim() == 0 or name.endswith(("_scale", "cos_sin_cache"))


def import_weights(model: onnx.ModelProto, dtype: torch.dtype) -> dict[str, Tensor]:
    """The graph's tensor initializers as the engine holds them, by initializer name: float ones in ``dtype``
    (scales, scalars and the rotary table in float32), quantized ones in their integer / float8 storage (int4 as
    int8 values). int64 initializers (shapes, split sizes) are not weights: they stay in the graph."""
    weights = {}
    for init in model.graph.initializer:
        if init.data_type == onnx.TensorProto.INT64:
            continue
        tensor = _to_torch(numpy_helper.to_array(init))
        if tensor.is_floating_point() and tensor.dtype != torch.float8_e4m3fn and not _keep_float32(init.name, tensor):
            tensor = tensor.to(dtype)
        weights[init.name] = tensor
    return weights


def graph_structure(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without its weights (``import_weights``): nodes, inputs, outputs and the int64 initializers."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.initializer[:]
    out.graph.initializer.extend(i for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT64)
    return out


class PortableModule(torch.nn.Module):
    """The portable graph as a torch module: ``forward(input_ids, positions, block_tables, query_start_loc,
    logits_indices, caches[, sliding_block_tables]) -> logits`` where ``caches`` is ``[key_cache.0, value_cache.0,
    key_cache.1, ...]``, written in place (a sliding layer's with the sliding group's number of blocks), and
    ``sliding_block_tables`` is given exactly when the graph has that input (``sliding``). Logits are float32
    ``[N, vocab]``.

    ``weights``: the initializers as ``import_weights`` makes them (how the torch-compile runtime opens an engine:
    ``model`` is then the ``graph_structure``); None imports them from ``model``.

    ``row_products`` (``RowProducts``): which products of ONE row by a weight (a batch-1 decode step, a single
    logits row) are computed as a multiply-and-sum over the weight held ``[out, in]`` (``row_weights``: MatMul
    weights, float (``ALL`` only) or dequantized from int8 / fp8 per channel (``row_scales``) or in blocks
    (``row_blocks``: int4, GGUF Q4_1 / Q4_0 / Q8_0), stored transposed; a ``Gemm``'s ``transB`` weight, which
    already is: a tied LM head), which Inductor fuses, dequantization included, into one memory-bound reduction over
    all threads (``row_products.py``); other products stay matmuls. On 2 CPU cores the BLAS reads a one-row
    product's weight at ~11 GB/s (one thread), the fused reduction at ~29 (docs/gpu.md, CPU). For a module that is
    compiled: eager, the product would be materialised. ``default_row_products`` gives the defaults. Opening holds
    both layouts of the transposed weights until the constructor returns.

    ``fuse_one_row`` (an attribute, True after construction) picks the form per product by the row count as the
    module is traced; False computes every product as a matmul whatever it is, in the same weight layout: how
    ``torch.export`` traces the AOTInductor package's program for every step, since it cannot branch on a symbolic
    token count (its one-token program is traced with it True, ``build/writer.py``).

    Invariant: nothing of a module changes after construction (nodes, constants, layout, buffers' shapes and dtypes;
    ``fuse_one_row`` only before it is compiled or exported). The torch-compile runtime's graphs are not guarded on
    them (``runners.load_compiled``)."""

    def __init__(
        self,
        model: onnx.ModelProto,
        io: EngineIO,
        dtype: torch.dtype,
        weights: Mapping[str, Tensor] | None = None,
        *,
        row_products: RowProducts = RowProducts.NONE,
    ) -> None:
        super().__init__()
        unknown = sorted({op_name(n) for n in model.graph.node} - set(OPS))
        if unknown:
            raise BuildError(f"the torch backend cannot import op(s) {', '.join(unknown)} of the portable graph")
        self.dtype = dtype
        self.nodes = [Node.of(n) for n in model.graph.node]
        self.consts: dict[str, tuple[int, ...]] = {  # int64 initializers (split sizes, shapes) as Python ints
            i.name: tuple(int(v) for v in numpy_helper.to_array(i).reshape(-1))
            for i in model.graph.initializer
            if i.data_type == onnx.TensorProto.INT64
        }
        if weights is None:
            weights = import_weights(model, dtype)
        self.row_products = row_products
        self.fuse_one_row = True
        layout = RowLayout()
        if row_products is not RowProducts.NONE:
            layout = row_layout(self.nodes, weights, quantized_only=row_products is RowProducts.QUANTIZED)
            self.nodes = layout.nodes
        self.row_weights = layout.rows
        self.row_scales = layout.scales
        self.row_blocks = layout.blocks
        transposed = layout.transposed
        self._buffer_names: dict[str, str] = {}
        for i, (name, tensor) in enumerate(weights.items()):
            attr = f"w{i}"
            self.register_buffer(attr, held_rows(tensor) if name in transposed else tensor)
            self._buffer_names[name] = attr
        names = [i.name for i in model.graph.input]
        step = [getattr(io, n) for n in STEP_INPUTS]
        if names[: len(step)] != step:
            raise BuildError(f"portable graph inputs {names[: len(step)]} are not {step}")
        self.step_inputs = tuple(step)
        self.sliding = io.sliding_block_tables in names  # two KV-cache groups (ModelConfig.has_sliding_kv_group)
        self.sliding_input = io.sliding_block_tables
        self.cache_inputs = tuple(n for n in names[len(step) :] if n != io.sliding_block_tables)
        self.logits = io.logits
        # the blocked row weights are no node's output (their dequantizing nodes dropped): products read their codes
        missing = sorted({i for n in self.nodes for i in n.inputs} - set(weights) - set(self.consts) - set(names)
                         - {o for n in self.nodes for o in n.outputs} - set(self.row_blocks) - {""})  # fmt: skip
        if missing:
            raise BuildError(f"the engine's weights lack {len(missing)} tensor(s) the graph reads, e.g. {missing[0]}")

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        block_tables: Tensor,
        query_start_loc: Tensor,
        logits_indices: Tensor,
        caches: list[Tensor],
        sliding_block_tables: Tensor | None = None,
    ) -> Tensor:
        env: dict[str, Any] = dict(
            zip(self.step_inputs, (input_ids, positions, block_tables, query_start_loc, logits_indices), strict=True)
        )
        if self.sliding:
            if sliding_block_tables is None:
                raise ValueError("this graph's sliding layers read sliding_block_tables: pass them")
            env[self.sliding_input] = sliding_block_tables
        env.update(zip(self.cache_inputs, caches, strict=True))
        env[""] = None
        env.update(dict.fromkeys(self.row_blocks))  # no tensor: their products read the codes (``_times_weight``)
        for name, attr in self._buffer_names.items():
            env[name] = getattr(self, attr)
        for node in self.nodes:
            outs = OPS[node.op](self, node, [env[i] if i in env else self.consts[i] for i in node.inputs])
            env.update(zip(node.outputs, outs, strict=False))
        return env[self.logits].float()


Handler = Callable[[PortableModule, Node, Sequence[Any]], Sequence[Any]]


def _gather(m: PortableModule, node: Node, x: Sequence[Any]) -> Sequence[Any]:
    data, idx = x
    axis = node.attrs.get("axis", 0)
    return (torch.index_select(data, axis, idx),)


def _one_row(m: PortableModule, a: Tensor) -> bool:
    """Whether ``a @ weight`` is computed as a fused one-row product (``PortableModule.fuse_one_row``)."""
    return m.fuse_one_row and a.dim() == 2 and a.shape[0] == 1


def _times_weight(m: PortableModule, name: str, a: Tensor, w_out_in: Tensor | None) -> Tensor:
    """``a @ w_out_in.T`` for a row weight ``name`` (``row_products.py``): for one row of ``a``, a multiply-and-sum
    that Inductor fuses into one reduction over the weight's rows; over its codes where ``PortableModule.row_scales``
    or ``row_blocks`` has it (``w_out_in`` is then unread; None for a blocked one whose nodes the layout dropped);
    otherwise a matmul, of the weight dequantized by the same factors for a ``row_blocks`` one."""
    one_row = _one_row(m, a)
    if blocked := m.row_blocks.get(name):
        names = (blocked.codes, blocked.scale, blocked.zero_point, blocked.offset)
        tensors = BlockTensors(*(_buffer(m, n) if n else None for n in names))  # type: ignore[arg-type]
        if one_row:
            return times_blocked_codes(a, blocked.block, tensors)
        w_out_in = dequantized_blocks(blocked.block, tensors, a.dtype)
    assert w_out_in is not None, name
    if not one_row:
        return torch.matmul(a, w_out_in.t())
    if name in m.row_scales:
        return times_scaled_codes(a, *(_buffer(m, n) for n in m.row_scales[name]))
    return times_rows(a, w_out_in)


def _buffer(m: PortableModule, name: str) -> Tensor:
    """The tensor ``m`` holds for initializer ``name``."""
    return getattr(m, m._buffer_names[name])


def _matmul(m: PortableModule, node: Node, x: Sequence[Any]) -> Sequence[Any]:
    a, w = x[0], None if x[1] is None else x[1].to(x[0].dtype)
    if node.inputs[1] in m.row_weights:  # held [out, in]
        return (_times_weight(m, node.inputs[1], a, w),)
    return (torch.matmul(a, w),)


def _gemm(m: PortableModule, node: Node, x: Sequence[Any]) -> Sequence[Any]:
    a, b = x[0], None if x[1] is None else x[1].to(x[0].dtype)
    a = a.t() if node.attrs.get("transA", 0) else a
    product = (
        _times_weight(m, node.inputs[1], a, b)
        if node.attrs.get("transB", 0) and node.inputs[1] in m.row_weights
        else torch.matmul(a, b.t() if node.attrs.get("transB", 0) else b)
    )
    y = node.attrs.get("alpha", 1.0) * product
    if len(x) > 2 and x[2] is not None:
        y = y + node.attrs.get("beta", 1.0) * x[2]
    return (y,)


def _rms_norm(m: PortableModule, node: Node, x: Sequence[Any]) -> Sequence[Any]:
    h = x[0].float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + node.attrs.get("epsilon", 1e-5))
    return ((h * x[1].float()).to(x[0].dtype),)


def _layer_norm(m: PortableModule, node: Node, x: Sequence[Any]) -> Sequence[Any]:
    h = x[0].float()
    w, b = x[1].float(), x[2].float() if len(x) > 2 and x[2] is not None else None
    y = torch.nn.functional.layer_norm(h, (h.shape[-1],), w, b, node.attrs.get("epsilon", 1e-5))
    return (y.to(x[0].dtype),)


def _gelu(m: PortableModule, node: Node, x: Sequence[Any]) -> Sequence[Any]:
    return (torch.nn.functional.gelu(x[0], approximate=node.attrs.get("approximate", "none")),)


def _split(m: PortableModule, node: Node, x: Sequence[Any]) -> Sequence[Any]:
    if len(x) < 2 or not isinstance(x[1], tuple):
        raise BuildError(f"Split {node.outputs[0]}: the torch backend needs constant split sizes")
    return torch.split(x[0], list(x[1]), dim=node.attrs.get("axis", 0))


def _quantize(m: PortableModule, node: Node, x: Sequence[Any]) -> Sequence[Any]:
    """QuantizeLinear to int8 or float8_e4m3fn (the zero point's type, else ``output_dtype``), symmetric,
    saturating: per tensor, or blocked with scales computed in the graph (dynamic activation scales)."""
    data, scale = x[0], x[1]
    fp8 = (x[2].dtype == torch.float8_e4m3fn) if len(x) > 2 else node.attrs.get("output_dtype") == FLOAT8
    return (ops.quantize_kv(data, _expand_scale(node, data, scale), 17 if fp8 else 3),)


def _dequantize(m: PortableModule, node: Node, x: Sequence[Any]) -> Sequence[Any]:
    """DequantizeLinear: per tensor, per axis, or blocked along ``axis`` (the last block may be partial); a blocked
    zero point (int4 with zero points) is subtracted, per-tensor / per-axis ones are 0 in trtbuild's graphs."""
    data, scale = x[0], x[1]
    values = data.float()
    if node.attrs.get("block_size", 0) and len(x) > 2 and x[2] is not None:
        values = values - _expand_scale(node, data, x[2]).float()  # repeated over blocks as the scale is
    return ((values * _expand_scale(node, data, scale)).to(m.dtype),)


def _expand_scale(node: Node, data: Tensor, scale: Tensor) -> Tensor:
    """A Q/DQ node's scale broadcastable to ``data``: per tensor, per ``axis``, or repeated over blocks."""
    axis = node.attrs.get("axis", 1) % data.dim()
    block = node.attrs.get("block_size", 0)
    if block:
        return torch.repeat_interleave(scale, block, dim=axis).narrow(axis, 0, data.shape[axis])
    if scale.dim() == 1 and data.dim() > 1:
        shape = [1] * data.dim()
        shape[axis] = -1
        return scale.reshape(shape)
    return scale


def _paged_attention(m: PortableModule, node: Node, x: Sequence[Any]) -> Sequence[Any]:
    qkv, kc, vc, positions, tables, qsl = x[:6]
    cos_sin = x[6] if len(x) > 6 else None
    k_scale, v_scale = (x[7], x[8]) if len(x) > 8 else (None, None)
    a = node.attrs
    out = ops.paged_attention(
        qkv, kc, vc, positions, tables, qsl, cos_sin, k_scale, v_scale,
        int(a["num_heads"]), int(a["num_kv_heads"]), int(a["head_size"]), float(a["scale"]),
        bool(a.get("rotary_interleaved", 0)), int(a.get("kv_cache_dtype", KV_FLOAT)),
        None if a.get("sliding_window") is None else int(a["sliding_window"]),
        None if a.get("softcap") is None else float(a["softcap"]),
    )  # fmt: skip
    return (out, kc, vc)  # the cache outputs alias the (mutated) inputs


def _moe(m: PortableModule, node: Node, x: Sequence[Any]) -> Sequence[Any]:
    if node.attrs.get("activation", moe_op.ACTIVATION_SILU) != moe_op.ACTIVATION_SILU:
        raise BuildError(f"{node.outputs[0]}: the torch backend's MoE runs silu experts only")
    scales = (x[4], x[5]) if len(x) > 5 else (None, None)  # int8 or int4 experts
    group = int(node.attrs["group_size"]) if "group_size" in node.attrs else None  # int4 experts (uint8)
    block = int(node.attrs["activation_block"]) if "activation_block" in node.attrs else None  # int8 activations
    if block is not None and (block < 1 or scales[0] is None):
        raise BuildError(f"{node.outputs[0]}: activation_block {block} needs quantized experts and a positive block")
    return (moe.moe(*x[:4], *scales, int(node.attrs["top_k"]), bool(node.attrs["renormalize"]), group, block),)


OPS: dict[str, Handler] = {
    "Gather": _gather,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Add": lambda m, n, x: (x[0] + x[1],),
    "Mul": lambda m, n, x: (x[0] * x[1],),
    "Sigmoid": lambda m, n, x: (torch.sigmoid(x[0]),),
    "Tanh": lambda m, n, x: (torch.tanh(x[0]),),
    "Split": _split,
    "Concat": lambda m, n, x: (torch.cat(list(x), dim=n.attrs["axis"]),),  # Qwen3's normed q | k | v
    "Gelu": _gelu,
    "RMSNormalization": _rms_norm,
    "LayerNormalization": _layer_norm,
    "QuantizeLinear": _quantize,
    # dynamic activation scales (checkpoint.graph.emit_dynamic_quantization), computed in float32
    "Reshape": lambda m, n, x: (x[0].reshape(list(x[1])),),
    "Abs": lambda m, n, x: (torch.abs(x[0].float()),),
    "ReduceMax": lambda m, n, x: (torch.amax(x[0], dim=list(x[1]), keepdim=bool(n.attrs.get("keepdims", 1))),),
    "Div": lambda m, n, x: (x[0] / x[1],),
    "Max": lambda m, n, x: (torch.maximum(x[0], x[1]),),
    "DequantizeLinear": _dequantize,
    f"{DOMAIN}::{OP_TYPE}": _paged_attention,
    f"{moe_op.DOMAIN}::{moe_op.OP_TYPE}": _moe,
}
