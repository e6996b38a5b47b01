"""Lower ``trtbuild::PagedAttention`` to standard ONNX ops that ONNX Runtime runs natively on the CPU.

ONNX Runtime has no CPU paged-attention kernel and a Python custom op costs ~18 µs per call, so each plugin node
is expanded into a static subgraph (no Python in the hot path):

1. metadata shared by all layers, computed once per step: each token's sequence ``b_t`` and row ``r_t`` in a
   ``[B, Sq]`` padded query layout (Sq = longest query chunk), each token's slot in the gathered context, and the
   causal mask ``j <= position`` over the gathered context of ``M * BS`` positions;
2. per layer: split QKV, rotate q/k, gather the layer's cache blocks through ``block_tables``, scatter this step's
   keys/values into the gathered context (the cache itself is read-only to the graph), batched GQA attention,
   gather the valid query rows back to ``[T, Hq * D]``.

The cache write becomes two graph outputs per layer, ``new_keys.{n}`` / ``new_values.{n}`` (``[T, Hkv, D]``,
keys rotated), which the runtime stores at the step's slots after the run (``OrtSession``).

A quantized KV cache (``kv_cache_dtype`` INT8 / FLOAT8E4M3FN, scales as inputs 7, 8): the new keys/values leave
the graph already quantized (``QuantizeLinear``) and enter attention dequantized, as the reference does; the
gathered cache blocks are dequantized after the gather, so only the context that is read is converted.
onnxruntime's CPU ``Gather`` has no float8 kernel, so an fp8 cache is declared ``uint8`` here (its bit patterns:
the same bytes) and decoded through a 256-entry table of E4M3FN values.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

from ..config import EngineIO
from ..graph.builder import GraphBuilder
from ..plugins.paged_attention import DOMAIN, KV_FLOAT, KV_FP8, OP_TYPE

NEG_INF = float("-inf")


def lower_for_onnxruntime(model: onnx.ModelProto, io: EngineIO) -> onnx.ModelProto:
    """Return a copy of the portable ``model`` with every plugin node expanded into standard ops."""
    graph = model.graph
    plugins = [n for n in graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    if not plugins:
        return model
    b = GraphBuilder(opset=_opset(model), prefix="ort/")
    first = plugins[0]
    widths = {init.name: int(init.dims[1]) for init in graph.initializer if len(init.dims) == 2}
    meta = _metadata(
        b,
        positions=first.input[3],
        block_tables=first.input[4],
        qsl=first.input[5],
        key_cache=first.input[1],
        cos_sin=first.input[6] if len(first.input) > 6 else "",
    )
    if "cos" in meta:
        meta["rotary_dim"] = widths[first.input[6]]  # the cos/sin table must be an initializer [P, R]
    meta_nodes = list(b.nodes)
    new_nodes: list[onnx.NodeProto] = []
    cache_outs: set[str] = set()
    fp8_caches: set[str] = set()
    cache_types: list[int] = []
    layer = 0
    for node in graph.node:
        if node.domain == DOMAIN and node.op_type == OP_TYPE:
            cache_types.append(_kv_cache_dtype(node))
            if cache_types[-1] == KV_FP8:
                fp8_caches.update(node.input[1:3])
            b.nodes = []
            _expand(b, node, meta, io.new_keys.format(layer=layer), io.new_values.format(layer=layer))
            new_nodes.extend(b.nodes)
            cache_outs.update(node.output[1:])
            layer += 1
        else:
            new_nodes.append(node)

    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(meta_nodes + new_nodes)
    out.graph.initializer.extend(b.initializers)
    kept = [o for o in out.graph.output if o.name not in cache_outs]
    del out.graph.output[:]
    out.graph.output.extend(kept)
    for n in range(layer):
        for name in (io.new_keys.format(layer=n), io.new_values.format(layer=n)):
            out.graph.output.append(helper.make_tensor_value_info(name, cache_types[n], ["num_tokens", None, None]))
    for value in out.graph.input:
        if value.name in fp8_caches:
            value.type.tensor_type.elem_type = TensorProto.UINT8
    kept_opsets = [o for o in out.opset_import if o.domain != DOMAIN]
    del out.opset_import[:]
    out.opset_import.extend(kept_opsets)
    return out


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _kv_cache_dtype(node: onnx.NodeProto) -> int:
    return next((int(helper.get_attribute_value(a)) for a in node.attribute if a.name == "kv_cache_dtype"), KV_FLOAT)


def _attr(node: onnx.NodeProto, name: str) -> int | float:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    raise KeyError(f"{node.name}: missing attribute {name}")


def _metadata(b: GraphBuilder, positions: str, block_tables: str, qsl: str, key_cache: str, cos_sin: str) -> dict:
    c = b.const
    t = b.op("Shape", [positions], name="meta.T")  # [1]
    tok = b.op("Range", [c(0), b.op("Squeeze", [t, c([0])]), c(1)], name="meta.token")  # [T]
    starts = b.op("Slice", [qsl, c([0]), c([-1]), c([0])], name="meta.starts")  # [B]
    ends = b.op("Slice", [qsl, c([1]), c([2**62]), c([0])], name="meta.ends")  # [B]
    ge = b.op("GreaterOrEqual", [b.op("Unsqueeze", [tok, c([1])]), b.op("Unsqueeze", [ends, c([0])])])
    seq = b.op("ReduceSum", [b.op("Cast", [ge], to=TensorProto.INT64), c([1])], keepdims=0, name="meta.seq")  # [T]
    row = b.op("Sub", [tok, b.op("Gather", [starts, seq])], name="meta.row")  # [T]
    sq = b.op("ReduceMax", [b.op("Sub", [ends, starts]), c([0])], keepdims=1, name="meta.Sq")  # [1]
    nseq = b.op("Shape", [starts], name="meta.B")  # [1]
    q_index = b.op("Add", [b.op("Mul", [seq, sq]), row], name="meta.q_index")  # [T] row in [B*Sq]
    q_index2 = b.op("Unsqueeze", [q_index, c([1])], name="meta.q_index2")  # [T, 1]
    bsq = b.op("Mul", [nseq, sq], name="meta.BSq")
    pad_pos = b.op(
        "ScatterND",
        [
            b.op("ConstantOfShape", [bsq], value=helper.make_tensor("z", TensorProto.INT64, [1], [0])),
            q_index2,
            positions,
        ],
    )
    qpos = b.op("Reshape", [pad_pos, b.op("Concat", [nseq, sq], axis=0)], name="meta.qpos")  # [B, Sq]
    nblk = b.op("Slice", [b.op("Shape", [block_tables]), c([1]), c([2]), c([0])], name="meta.M")
    bs = b.op("Slice", [b.op("Shape", [key_cache]), c([1]), c([2]), c([0])], name="meta.BS")
    sctx = b.op("Mul", [nblk, bs], name="meta.Sctx")  # [1]
    j = b.op("Range", [c(0), b.op("Squeeze", [sctx, c([0])]), c(1)], name="meta.ctx_pos")  # [Sctx]
    allowed = b.op("LessOrEqual", [b.op("Reshape", [j, c([1, 1, -1])]), b.op("Unsqueeze", [qpos, c([2])])])
    mask = b.op("Unsqueeze", [allowed, c([1, 2])], name="meta.mask")  # [B, 1, 1, Sq, Sctx]
    kv_index = b.op("Add", [b.op("Mul", [seq, sctx]), positions])
    meta = {
        "q_index": q_index,
        "q_index2": q_index2,
        "kv_index2": b.op("Unsqueeze", [kv_index, c([1])], name="meta.kv_index2"),
        "B": nseq,
        "Sq": sq,
        "BSq": bsq,
        "Sctx": sctx,
        "mask": mask,
        "T": t,
    }
    if cos_sin:
        rows = b.op("Gather", [cos_sin, positions], name="meta.rope_rows")  # [T, R]
        cos, sin = b.op_multi("Split", [rows], outputs=2, axis=1, num_outputs=2, name="meta.rope_split")
        meta["cos"] = b.op("Unsqueeze", [cos, c([1])], name="meta.cos")  # [T, 1, R/2]
        meta["sin"] = b.op("Unsqueeze", [sin, c([1])], name="meta.sin")
    return meta


def _rotate(b: GraphBuilder, x: str, meta: dict, head_size: int, rotary_dim: int, interleaved: bool, name: str) -> str:
    """RoPE on ``x [T, H, D]`` over its first ``rotary_dim`` dims."""
    c, half = b.const, rotary_dim // 2
    cos, sin = meta["cos"], meta["sin"]
    rot, rest = x, ""
    if rotary_dim < head_size:
        rot, rest = b.op_multi(
            "Split", [x, c([rotary_dim, head_size - rotary_dim])], outputs=2, axis=2, name=name + ".part"
        )
    if interleaved:
        pairs = b.op("Reshape", [rot, c([0, 0, half, 2])], name=name + ".pairs")
        x1, x2 = b.op_multi("Split", [pairs], outputs=2, axis=3, num_outputs=2, name=name + ".split")
        x1, x2 = b.op("Squeeze", [x1, c([3])]), b.op("Squeeze", [x2, c([3])])
    else:
        x1, x2 = b.op_multi("Split", [rot], outputs=2, axis=2, num_outputs=2, name=name + ".split")
    o1 = b.op("Sub", [b.op("Mul", [x1, cos]), b.op("Mul", [x2, sin])], name=name + ".o1")
    o2 = b.op("Add", [b.op("Mul", [x2, cos]), b.op("Mul", [x1, sin])], name=name + ".o2")
    if interleaved:
        both = b.op("Concat", [b.op("Unsqueeze", [o1, c([3])]), b.op("Unsqueeze", [o2, c([3])])], axis=3)
        out = b.op("Reshape", [both, c([0, 0, rotary_dim])], name=name + ".merged")
    else:
        out = b.op("Concat", [o1, o2], axis=2, name=name + ".merged")
    return b.op("Concat", [out, rest], axis=2, name=name + ".full") if rest else out


def _dequantize_cache(b: GraphBuilder, blocks: str, scale: str, kv_type: int, name: str) -> str:
    """Gathered int8 cache blocks -> float via ``DequantizeLinear``; fp8 ones (uint8 bits) via the E4M3FN table."""
    if kv_type != KV_FP8:
        return b.op("DequantizeLinear", [blocks, scale], name=name + "_dequant")
    table = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    codes = b.op("Cast", [blocks], to=TensorProto.INT32, name=name + "_codes")
    values = b.op("Gather", [b.const(table, dtype=np.float32), codes], name=name + "_fp8_decode")
    return b.op("Mul", [values, scale], name=name + "_dequant")


def _expand(b: GraphBuilder, node: onnx.NodeProto, meta: dict, new_keys: str, new_values: str) -> None:
    c, p = b.const, node.name
    hq, hkv, d = int(_attr(node, "num_heads")), int(_attr(node, "num_kv_heads")), int(_attr(node, "head_size"))
    scale, interleaved = float(_attr(node, "scale")), bool(_attr(node, "rotary_interleaved"))
    g = hq // hkv
    qkv, key_cache, value_cache = node.input[0], node.input[1], node.input[2]
    block_tables, cos_sin = node.input[4], node.input[6] if len(node.input) > 6 else ""
    q, k, v = b.op_multi("Split", [qkv, c([hq * d, hkv * d, hkv * d])], outputs=3, axis=1, name=p + ".split")
    q = b.op("Reshape", [q, c([0, hq, d])], name=p + ".q")
    k = b.op("Reshape", [k, c([0, hkv, d])], name=p + ".k")
    kv_type = _kv_cache_dtype(node)
    scales = {"k": node.input[7], "v": node.input[8]} if kv_type != KV_FLOAT else {}
    if kv_type == KV_FLOAT:
        v = b.op("Reshape", [v, c([0, hkv, d])], outputs=[new_values], name=p + ".v")
    else:
        v = b.op("Reshape", [v, c([0, hkv, d])], name=p + ".v")
    if cos_sin:
        rotary_dim = meta["rotary_dim"]
        q = _rotate(b, q, meta, d, rotary_dim, interleaved, p + ".rope_q")
        k = _rotate(b, k, meta, d, rotary_dim, interleaved, p + ".rope_k")
    if kv_type == KV_FLOAT:
        k = b.op("Identity", [k], outputs=[new_keys], name=p + ".new_keys")
    else:  # quantize for the cache; attend over the dequantized values like every later step will
        zero = np.array(0, dtype=ml_dtypes.float8_e4m3fn if kv_type == KV_FP8 else np.int8)
        zp = b.const(zero, dtype=zero.dtype)
        kq = b.op("QuantizeLinear", [k, scales["k"], zp], outputs=[new_keys], name=p + ".k_quant")
        vq = b.op("QuantizeLinear", [v, scales["v"], zp], outputs=[new_values], name=p + ".v_quant")
        k = b.op("DequantizeLinear", [kq, scales["k"], zp], name=p + ".k_dequant")
        v = b.op("DequantizeLinear", [vq, scales["v"], zp], name=p + ".v_dequant")

    def context(cache: str, new: str, tag: str) -> str:  # [B, Sctx, Hkv, D] with this step's rows written
        blocks = b.op("Gather", [cache, block_tables], name=f"{p}.{tag}_gather")  # [B, M, BS, Hkv, D]
        if kv_type != KV_FLOAT:
            blocks = _dequantize_cache(b, blocks, scales[tag], kv_type, f"{p}.{tag}")
        flat = b.op("Reshape", [blocks, c([-1, hkv, d])], name=f"{p}.{tag}_flat")
        written = b.op("ScatterND", [flat, meta["kv_index2"], new], name=f"{p}.{tag}_write")
        return b.op(
            "Reshape", [written, b.op("Concat", [meta["B"], meta["Sctx"], c([hkv, d])], axis=0)], name=f"{p}.{tag}_ctx"
        )

    kt = b.op("Transpose", [context(key_cache, k, "k")], perm=[0, 2, 3, 1], name=p + ".kT")  # [B, Hkv, D, Sctx]
    vv = b.op("Transpose", [context(value_cache, v, "v")], perm=[0, 2, 1, 3], name=p + ".vT")  # [B, Hkv, Sctx, D]
    q = b.op("Mul", [q, c([scale], dtype="float32")], name=p + ".q_scaled")
    zeros = b.op(
        "ConstantOfShape",
        [b.op("Concat", [meta["BSq"], c([hq, d])], axis=0)],
        value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0.0]),
        name=p + ".q_zeros",
    )
    qp = b.op("ScatterND", [zeros, meta["q_index2"], q], name=p + ".q_pad")  # [B*Sq, Hq, D]
    qp = b.op("Reshape", [qp, b.op("Concat", [meta["B"], meta["Sq"], c([hkv, g, d])], axis=0)], name=p + ".q5")
    qp = b.op("Transpose", [qp], perm=[0, 2, 3, 1, 4], name=p + ".qT")  # [B, Hkv, G, Sq, D]
    qp = b.op("Reshape", [qp, c([0, 0, -1, d])], name=p + ".q4")  # [B, Hkv, G*Sq, D]
    scores = b.op("MatMul", [qp, kt], name=p + ".scores")  # [B, Hkv, G*Sq, Sctx]
    s5 = b.op("Reshape", [scores, b.op("Concat", [meta["B"], c([hkv, g]), meta["Sq"], meta["Sctx"]], axis=0)])
    masked = b.op("Where", [meta["mask"], s5, c([NEG_INF], dtype="float32")], name=p + ".masked")
    probs = b.op("Softmax", [masked], axis=-1, name=p + ".softmax")
    shape4 = b.op("Concat", [meta["B"], c([hkv, -1]), meta["Sctx"]], axis=0)
    probs = b.op("Reshape", [probs, shape4], name=p + ".probs")  # [B, Hkv, G*Sq, Sctx]
    o = b.op("MatMul", [probs, vv], name=p + ".pv")  # [B, Hkv, G*Sq, D]
    o = b.op("Reshape", [o, b.op("Concat", [meta["B"], c([hkv, g]), meta["Sq"], c([d])], axis=0)], name=p + ".o5")
    o = b.op("Transpose", [o], perm=[0, 3, 1, 2, 4], name=p + ".oT")  # [B, Sq, Hkv, G, D]
    o = b.op("Reshape", [o, c([-1, hq * d])], name=p + ".o_flat")  # [B*Sq, Hq*D]
    b.op("Gather", [o, meta["q_index"]], outputs=[node.output[0]], name=p + ".out")
