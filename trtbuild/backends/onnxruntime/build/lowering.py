"""Lower ``trtbuild::PagedAttention`` to standard ONNX ops that ONNX Runtime runs natively on the CPU.

ONNX Runtime has no CPU paged-attention kernel and a Python custom op costs ~18-47 µs per call, so each plugin
node is expanded into a static subgraph of opset-23 ops (no Python in the hot path), kept short because every node
costs a few µs of dispatch on top of its work (about 20 nodes a layer; the first form of this lowering had ~60):

1. metadata shared by all layers, computed once per step: each token's sequence ``b_t`` and row ``r_t`` in a
   ``[B, Sq]`` padded query layout (Sq = longest query chunk; a padding row repeats its sequence's last token),
   the block-table columns that hold cached positions (those before the batch's last first-new-token position:
   none for fresh prompts), the additive mask over the keys (cached positions before each sequence's first new
   token, then its new rows causally), and the rotary rows of the step's positions;
2. per layer: split QKV; one ``RotaryEmbedding`` over q and k together (every head of a token turns by the same
   angles); gather the layer's cached blocks and append this step's padded keys/values (``Concat``: the cache
   itself is read-only to the graph); one opset-23 ``Attention`` (GQA, additive mask) over the padded queries
   ``[B, Sq, Hq * D]`` and the keys ``[B, Sctx + Sq, Hkv * D]``; ``GatherND`` back to ``[T, Hq * D]``.

A layer with a ``sliding_window`` W gets its own context metadata (shared by the layers of that window): each
sequence gathers only the block-table columns (of the tables its layers read: ``sliding_block_tables`` in a model
of both attention kinds) from the block of its first new token's window start (``first - W + 1``) on, through
``GatherElements`` (so blocks wholly before the window, which the runner may have freed, are never read and the
gathered context is bounded by W), and the mask adds ``key position > query position - W`` to the
causal condition. A layer with ``softcap`` C runs its attention as standard ops (``MatMul``, then ``Div`` / ``Tanh``
/ ``Mul`` on the scaled scores before the additive mask, ``Softmax``, ``MatMul``) in place of ``Attention``.

The cache write becomes two graph outputs per layer, ``new_keys.{n}`` / ``new_values.{n}`` (``[T, Hkv, D]``,
keys rotated), which the runtime stores at the step's slots after the run (``OrtSession``).

A quantized KV cache (``kv_cache_dtype`` INT8 / FLOAT8E4M3FN, scales as inputs 7, 8): the new keys/values leave
the graph already quantized (``QuantizeLinear``) and enter attention dequantized, as the reference does; the
gathered cache blocks are dequantized after the gather, so only the context that is read is converted.
onnxruntime's CPU ``Gather`` has no float8 kernel, so an fp8 cache is declared ``uint8`` here (its bit patterns:
the same bytes) and decoded through a 256-entry table of E4M3FN values.

Pass contract (``passes.PASSES``: ``lowered-attention``): ``trtbuild::PagedAttention`` nodes -> standard opset-23
ops plus two ``new_keys`` / ``new_values`` graph outputs per layer; every other node is kept.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

from ....config import ORT_LOWERED_NODE_PREFIX, EngineIO
from ....graph.builder import GraphBuilder
from ....plugins.paged_attention import DOMAIN, KV_FLOAT, KV_FP8, OP_TYPE, PagedAttentionAttrs
from .graph_edit import node_attr, node_attrs


def lower_for_onnxruntime(model: onnx.ModelProto, io: EngineIO) -> onnx.ModelProto:
    """Return a copy of the portable ``model`` with every plugin node expanded into standard ops."""
    graph = model.graph
    plugins = [n for n in graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    if not plugins:
        return model
    b = GraphBuilder(opset=_opset(model), prefix=ORT_LOWERED_NODE_PREFIX)
    first = plugins[0]
    widths = {init.name: int(init.dims[1]) for init in graph.initializer if len(init.dims) == 2}
    meta = _metadata(b, positions=first.input[3], qsl=first.input[5], key_cache=first.input[1])
    # The rotary rows of the step's positions, once per cos/sin table (Gemma 3's full and sliding layers have two);
    # each table must be an initializer [P, R].
    tables = dict.fromkeys(n.input[6] for n in plugins if len(n.input) > 6 and n.input[6])
    meta["rope"] = {
        table: _rope_rows(b, table, first.input[3], widths[table], f"meta.rope{i}") for i, table in enumerate(tables)
    }
    # The cached blocks and the mask per sliding window (None: the whole causal context), each from the block tables
    # its layers read: a model of both kinds gives its sliding layers their own (EngineIO.sliding_block_tables).
    tables_of: dict[int | None, str] = {}
    for node in plugins:
        window = _op_attrs(node).sliding_window
        if tables_of.setdefault(window, node.input[4]) != node.input[4]:
            raise ValueError(f"{node.name}: layers of sliding window {window} read different block tables")
    contexts = {}
    if None in tables_of:
        contexts[None] = _full_context(b, meta, block_tables=tables_of[None])
    for window in sorted(w for w in tables_of if w is not None):
        contexts[window] = _window_context(b, meta, block_tables=tables_of[window], window=window)
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
            context = meta | contexts[_op_attrs(node).sliding_window]
            _expand(b, node, context, io.new_keys.format(layer=layer), io.new_values.format(layer=layer))
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
    return int(node_attr(node, "kv_cache_dtype", KV_FLOAT))


def _op_attrs(node: onnx.NodeProto) -> PagedAttentionAttrs:
    return PagedAttentionAttrs.from_onnx(node_attrs(node))


def _metadata(b: GraphBuilder, positions: str, qsl: str, key_cache: str) -> dict:
    c = b.const
    t = b.op("Shape", [positions], name="meta.T")  # [1]
    tok = b.op("Range", [c(0), b.op("Squeeze", [t, c([0])]), c(1)], name="meta.token")  # [T]
    starts = b.op("Slice", [qsl, c([0]), c([-1]), c([0])], name="meta.starts")  # [B]
    ends = b.op("Slice", [qsl, c([1]), c([2**62]), c([0])], name="meta.ends")  # [B]
    lens = b.op("Sub", [ends, starts], name="meta.lens")  # [B]
    ge = b.op("GreaterOrEqual", [b.op("Unsqueeze", [tok, c([1])]), b.op("Unsqueeze", [ends, c([0])])])
    seq = b.op("ReduceSum", [b.op("Cast", [ge], to=TensorProto.INT64), c([1])], keepdims=0, name="meta.seq")  # [T]
    row = b.op("Sub", [tok, b.op("Gather", [starts, seq])], name="meta.row")  # [T]
    sq = b.op("ReduceMax", [lens, c([0])], keepdims=1, name="meta.Sq")  # [1]
    # Padded query layout [B, Sq]: row r of sequence b is token starts[b] + min(r, len_b - 1), so padding rows
    # repeat the sequence's last token (their outputs are dropped; their mask rows are never empty).
    r = b.op("Range", [c(0), b.op("Squeeze", [sq, c([0])]), c(1)], name="meta.rows")  # [Sq]
    last = b.op("Unsqueeze", [b.op("Sub", [lens, c(1)]), c([1])], name="meta.last_row")  # [B, 1]
    pad_index = b.op(
        "Add", [b.op("Unsqueeze", [starts, c([1])]), b.op("Min", [b.op("Unsqueeze", [r, c([0])]), last])]
    )  # [B, Sq]
    bs = b.op("Slice", [b.op("Shape", [key_cache]), c([1]), c([2]), c([0])], name="meta.BS")
    first = b.op("Gather", [positions, starts], name="meta.first_pos")  # [B]
    meta = {
        "first_pos": first,
        "rows": r,
        "BS": bs,
        "Sq": sq,
        "B": b.op("Shape", [starts], name="meta.B"),
        "q_rows": b.op(
            "Concat", [b.op("Unsqueeze", [x, c([1])]) for x in (seq, row)], axis=1, name="meta.q_rows"
        ),  # [T, 2]: each token's (sequence, row) in the padded layout
        "pad_index": pad_index,
    }
    return meta


def _rope_rows(b: GraphBuilder, table: str, positions: str, rotary_dim: int, name: str) -> tuple[str, str, int]:
    """``(cos [1, T, R/2], sin [1, T, R/2], R)``: the rows of the cos/sin ``table`` at the step's positions."""
    rows = b.op("Gather", [table, positions], name=name + "_rows")  # [T, R]
    cos, sin = b.op_multi("Split", [rows], outputs=2, axis=1, num_outputs=2, name=name + "_split")
    cos = b.op("Unsqueeze", [cos, b.const([0])], name=name + "_cos")
    return cos, b.op("Unsqueeze", [sin, b.const([0])], name=name + "_sin"), rotary_dim


def _full_context(b: GraphBuilder, meta: dict, block_tables: str) -> dict:
    """``cached_tables`` and ``mask`` of the layers without a sliding window."""
    c = b.const
    first, bs, r, sq, nseq = meta["first_pos"], meta["BS"], meta["rows"], meta["Sq"], meta["B"]
    # Keys of a step: the cached context of each sequence (only the block-table columns that hold a position before
    # some sequence's first new token: none for a batch of fresh prompts), then the step's own padded rows [B, Sq].
    # A query attends to the cached positions before its sequence's first new token, and to its new rows up to its own.
    max_first = b.op("ReduceMax", [first, c([0])], keepdims=1)  # [1]
    ncached = b.op("Div", [b.op("Add", [max_first, b.op("Sub", [bs, c([1])])]), bs], name="meta.M_cached")  # ceil
    cached_tables = b.op("Slice", [block_tables, c([0]), ncached, c([1])], name="meta.cached_tables")  # [B, Mc]
    sctx = b.op("Mul", [ncached, bs], name="meta.Sctx")  # [1]
    j = b.op("Range", [c(0), b.op("Squeeze", [sctx, c([0])]), c(1)], name="meta.ctx_pos")  # [Sctx]
    cached = b.op("Less", [b.op("Unsqueeze", [j, c([0, 1])]), b.op("Unsqueeze", [first, c([1, 2])])])  # [B, 1, Sctx]
    causal = b.op("LessOrEqual", [b.op("Unsqueeze", [r, c([0, 1])]), b.op("Unsqueeze", [r, c([0, 2])])])  # [1,Sq,Sq]
    allowed = b.op(
        "Concat",
        [
            b.op("Expand", [cached, b.op("Concat", [nseq, sq, sctx], axis=0)]),
            b.op("Expand", [causal, b.op("Concat", [nseq, sq, sq], axis=0)]),
        ],
        axis=2,
    )  # [B, Sq, Sctx + Sq]
    additive = b.op("Where", [allowed, c(0.0, dtype="float32"), c(float("-inf"), dtype="float32")])
    mask = b.op("Unsqueeze", [additive, c([1])], name="meta.mask")  # [B, 1, Sq, Sctx + Sq], 0 or -inf
    return {"cached_tables": cached_tables, "mask": mask}


def _window_context(b: GraphBuilder, meta: dict, block_tables: str, window: int) -> dict:
    """``cached_tables`` and ``mask`` of the layers with this sliding window: sequence b gathers the block-table
    columns ``sb .. sb + Mc`` (``sb``: the block of ``first_b - window + 1``, ``Mc``: the most cached blocks any
    sequence has from its ``sb`` on), never an earlier one; a query at position ``first_b + r`` sees the cached
    positions ``k < first_b`` with ``k > first_b + r - window``, and its new rows ``r - window < r' <= r``."""
    c, w = b.const, f"meta.window{window}"
    first, bs, r = meta["first_pos"], meta["BS"], meta["rows"]
    start = b.op("Max", [b.op("Sub", [first, c(window - 1)]), c(0)], name=w + ".start")  # [B] first position seen
    start_block = b.op("Div", [start, bs], name=w + ".start_block")  # [B]
    cached_end = b.op("Div", [b.op("Add", [first, b.op("Sub", [bs, c(1)])]), bs])  # [B]: ceil(first / BS)
    mc = b.op("ReduceMax", [b.op("Sub", [cached_end, start_block]), c([0])], keepdims=1, name=w + ".Mc")  # [1]
    cols = b.op(
        "Add",
        [b.op("Unsqueeze", [start_block, c([1])]), b.op("Range", [c(0), b.op("Squeeze", [mc, c([0])]), c(1)])],
        name=w + ".columns",
    )  # [B, Mc]; a column past the table only holds positions >= first (masked): clamped to the last one
    last_col = b.op("Sub", [b.op("Slice", [b.op("Shape", [block_tables]), c([1]), c([2]), c([0])]), c(1)])
    tables = b.op("GatherElements", [block_tables, b.op("Min", [cols, last_col])], axis=1, name=w + ".tables")
    slot = b.op("Range", [c(0), b.op("Squeeze", [bs, c([0])]), c(1)], name=w + ".slot")  # [BS]
    key_pos = b.op(
        "Reshape",
        [b.op("Add", [b.op("Unsqueeze", [b.op("Mul", [cols, bs]), c([2])]), slot]), c([0, -1])],
        name=w + ".key_pos",
    )  # [B, Mc * BS]: the position each gathered cache slot holds
    query_pos = b.op("Add", [b.op("Unsqueeze", [first, c([1])]), b.op("Unsqueeze", [r, c([0])])])  # [B, Sq]
    lowest = b.op("Unsqueeze", [b.op("Sub", [query_pos, c(window)]), c([2])])  # [B, Sq, 1]: k must exceed it
    key_pos = b.op("Unsqueeze", [key_pos, c([1])])  # [B, 1, Sctx]
    cached = b.op(
        "And", [b.op("Less", [key_pos, b.op("Unsqueeze", [first, c([1, 2])])]), b.op("Greater", [key_pos, lowest])]
    )  # [B, Sq, Sctx]
    r_q, r_k = b.op("Unsqueeze", [r, c([0, 2])]), b.op("Unsqueeze", [r, c([0, 1])])  # [1, Sq, 1], [1, 1, Sq]
    new = b.op(
        "And", [b.op("LessOrEqual", [r_k, r_q]), b.op("Greater", [r_k, b.op("Sub", [r_q, c(window)])])]
    )  # [1, Sq, Sq]
    new = b.op("Expand", [new, b.op("Concat", [meta["B"], meta["Sq"], meta["Sq"]], axis=0)])
    allowed = b.op("Concat", [cached, new], axis=2)  # [B, Sq, Sctx + Sq]
    additive = b.op("Where", [allowed, c(0.0, dtype="float32"), c(float("-inf"), dtype="float32")])
    return {"cached_tables": tables, "mask": b.op("Unsqueeze", [additive, c([1])], name=w + ".mask")}


def _softcapped_attention(
    b: GraphBuilder, p: str, q: str, k: str, v: str, mask: str, attrs: PagedAttentionAttrs
) -> str:
    """``Attention`` with soft-capped scores as standard ops: ``q [B, Sq, Hq * D]`` against ``k``, ``v``
    ``[B, L, Hkv * D]`` (query head h reads kv head ``h // G``) with the additive ``mask [B, 1, Sq, L]``; the
    scaled scores go through ``softcap * Tanh(s / softcap)`` before the mask. Returns ``[B, Sq, Hq * D]``."""
    c = b.const
    hkv, d, softcap = attrs.num_kv_heads, attrs.head_size, attrs.softcap
    group = attrs.num_heads // hkv
    qh = b.op("Transpose", [b.op("Reshape", [q, c([0, 0, hkv, group, d])])], perm=[0, 2, 3, 1, 4])  # [B,Hkv,G,Sq,D]
    kh = b.op("Transpose", [b.op("Reshape", [k, c([0, 0, hkv, d])])], perm=[0, 2, 3, 1])  # [B, Hkv, D, L]
    vh = b.op("Transpose", [b.op("Reshape", [v, c([0, 0, hkv, d])])], perm=[0, 2, 1, 3])  # [B, Hkv, L, D]
    scores = b.op("MatMul", [qh, b.op("Unsqueeze", [kh, c([2])])], name=p + ".scores")  # [B, Hkv, G, Sq, L]
    scores = b.op("Mul", [scores, c(attrs.scale, dtype="float32")])
    capped = b.op("Tanh", [b.op("Div", [scores, c(softcap, dtype="float32")])], name=p + ".softcap")
    capped = b.op("Mul", [capped, c(softcap, dtype="float32")])
    masked = b.op("Add", [capped, b.op("Unsqueeze", [mask, c([2])])])  # mask [B, 1, 1, Sq, L]
    probs = b.op("Softmax", [masked], axis=-1, name=p + ".softmax")
    o = b.op("MatMul", [probs, b.op("Unsqueeze", [vh, c([2])])], name=p + ".pv")  # [B, Hkv, G, Sq, D]
    return b.op("Reshape", [b.op("Transpose", [o], perm=[0, 3, 1, 2, 4]), c([0, 0, -1])], name=p + ".attention")


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
    hq, hkv, d = (int(node_attr(node, name)) for name in ("num_heads", "num_kv_heads", "head_size"))
    scale, interleaved = float(node_attr(node, "scale")), bool(node_attr(node, "rotary_interleaved"))
    qkv, key_cache, value_cache = node.input[0], node.input[1], node.input[2]
    cos_sin = node.input[6] if len(node.input) > 6 else ""
    if cos_sin:  # one RotaryEmbedding over q and k together: the same angles for every head of a token
        cos, sin, rotary_dim = meta["rope"][cos_sin]
        qk, v = b.op_multi("Split", [qkv, c([(hq + hkv) * d, hkv * d])], outputs=2, axis=1, name=p + ".split")
        qk = b.op(
            "RotaryEmbedding",
            [b.op("Unsqueeze", [qk, c([0])]), cos, sin],
            interleaved=int(interleaved),
            num_heads=hq + hkv,
            rotary_embedding_dim=rotary_dim,
            name=p + ".rope",
        )
        qk = b.op("Squeeze", [qk, c([0])], name=p + ".rope_out")
        q, k = b.op_multi("Split", [qk, c([hq * d, hkv * d])], outputs=2, axis=1, name=p + ".split_qk")
    else:
        q, k, v = b.op_multi("Split", [qkv, c([hq * d, hkv * d, hkv * d])], outputs=3, axis=1, name=p + ".split")
    kv_type = _kv_cache_dtype(node)
    shape3 = c([0, hkv, d])
    if kv_type == KV_FLOAT:
        b.op("Reshape", [k, shape3], outputs=[new_keys], name=p + ".new_keys")
        b.op("Reshape", [v, shape3], outputs=[new_values], name=p + ".new_values")
        scales = {}
    else:  # quantize for the cache; attend over the dequantized values like every later step will
        scales = {"k": node.input[7], "v": node.input[8]}
        zero = np.array(0, dtype=ml_dtypes.float8_e4m3fn if kv_type == KV_FP8 else np.int8)
        zp = b.const(zero, dtype=zero.dtype)
        kq = b.op("QuantizeLinear", [k, scales["k"], zp], name=p + ".k_quant")  # [T, Hkv * D]
        vq = b.op("QuantizeLinear", [v, scales["v"], zp], name=p + ".v_quant")
        b.op("Reshape", [kq, shape3], outputs=[new_keys], name=p + ".new_keys")
        b.op("Reshape", [vq, shape3], outputs=[new_values], name=p + ".new_values")
        k = b.op("DequantizeLinear", [kq, scales["k"], zp], name=p + ".k_dequant")
        v = b.op("DequantizeLinear", [vq, scales["v"], zp], name=p + ".v_dequant")

    def keys(cache: str, new: str, tag: str) -> str:  # [B, Sctx + Sq, Hkv * D]: cached context, then new rows
        blocks = b.op("Gather", [cache, meta["cached_tables"]], name=f"{p}.{tag}_gather")  # [B, Mc, BS, Hkv, D]
        if kv_type != KV_FLOAT:
            blocks = _dequantize_cache(b, blocks, scales[tag], kv_type, f"{p}.{tag}")
        context = b.op("Reshape", [blocks, c([0, -1, hkv * d])], name=f"{p}.{tag}_ctx")  # [B, Sctx, Hkv * D]
        rows = b.op("Gather", [new, meta["pad_index"]], name=f"{p}.{tag}_pad")  # [B, Sq, Hkv * D]
        return b.op("Concat", [context, rows], axis=1, name=f"{p}.{tag}_all")

    qp = b.op("Gather", [q, meta["pad_index"]], name=p + ".q_pad")  # [B, Sq, Hq * D]
    attrs = _op_attrs(node)
    k_all, v_all = keys(key_cache, k, "k"), keys(value_cache, v, "v")
    if attrs.softcap is None:
        o = b.op(
            "Attention",
            [qp, k_all, v_all, meta["mask"]],
            q_num_heads=hq,
            kv_num_heads=hkv,
            scale=scale,
            name=p + ".attention",
        )  # [B, Sq, Hq * D]
    else:
        o = _softcapped_attention(b, p, qp, k_all, v_all, meta["mask"], attrs)
    b.op("GatherND", [o, meta["q_rows"]], outputs=[node.output[0]], name=p + ".out")  # [T, Hq * D]
