"""The native CPU kernel of ``trtbuild::PagedAttention`` for onnxruntime: its place in the graph (a build step).

The kernel is ``trtbuild/kernels/cpu/paged_attention.cc``, an onnxruntime custom-op library (domain
``trtbuild.cpu``) compiled for the machine at first use: ``trtbuild/kernels/library.py`` (no ``onnx``).

``lower_to_native`` turns each plugin node into one ``trtbuild.cpu::PagedAttention`` node (float32, int8 or fp8
cache, as the plugin's ``kv_cache_dtype`` says; its optional ``sliding_window`` and ``softcap`` carried over) with a
single output: the cache inputs are written in place, so
the graph has no ``new_keys`` / ``new_values`` outputs and the session stores nothing after a step
(``OrtSession``).

``fuse_swiglu`` turns each gated MLP's ``Split -> Sigmoid -> Mul -> Mul`` into one ``trtbuild.cpu::SwiGLU`` node
(``trtbuild/kernels/cpu/swiglu.cc``): one pass over the gate/up rows and no intermediate tensor, where
onnxruntime ran ``Split``, ``QuickGelu`` (its fusion of the sigmoid product) and ``Mul`` (2.6 ms a layer at a
2048-token prefill chunk of SmolLM2, 1.3 ms fused).

Pass contracts (``passes.PASSES``): ``native-attention``: ``trtbuild::PagedAttention`` -> ``trtbuild.cpu::
PagedAttention`` (the cache outputs dropped); ``fuse-swiglu``: ``Split, Sigmoid, Mul, Mul`` -> ``trtbuild.cpu::
SwiGLU``. Every other node is kept.
"""

from __future__ import annotations

from collections import defaultdict

import onnx
from onnx import helper, numpy_helper

from ....config import ORT_LOWERED_NODE_PREFIX
from ....kernels.library import (
    MAX_BLOCK_SIZE,
    MAX_GQA_GROUP,
    MAX_GROUP_X_HEAD_SIZE,
    MAX_HEAD_SIZE,
    NATIVE_DOMAIN,
    SWIGLU_OP,
)
from ....plugins.paged_attention import DOMAIN, KV_FLOAT, KV_FP8, KV_INT8, OP_TYPE, PagedAttentionAttrs
from .graph_edit import import_domain, node_attr, node_attrs

# The native op's cache element type per kv_cache_dtype: an fp8 cache is held as its E4M3 bit patterns (numpy has
# no float8), so its graph inputs are uint8.
CACHE_ELEM_TYPES = {KV_FLOAT: onnx.TensorProto.FLOAT, KV_INT8: onnx.TensorProto.INT8, KV_FP8: onnx.TensorProto.UINT8}


def native_supports(model: onnx.ModelProto, block_size: int) -> str | None:
    """Why the native kernel cannot run ``model``'s attention (one line), or None when it can."""
    for node in model.graph.node:
        if node.domain != DOMAIN or node.op_type != OP_TYPE:
            continue
        hq, hkv, d = (int(node_attr(node, n)) for n in ("num_heads", "num_kv_heads", "head_size"))
        too_big = max(hq // hkv, hkv) * d > MAX_GROUP_X_HEAD_SIZE or d > MAX_HEAD_SIZE
        if hq // hkv > MAX_GQA_GROUP or too_big:
            return f"{hq // hkv} query heads per KV head of size {d}"
    if block_size > MAX_BLOCK_SIZE:
        return f"KV blocks of more than {MAX_BLOCK_SIZE} tokens"
    return None


def lower_to_native(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the portable ``model`` with each plugin node replaced by the native op (any KV cache dtype)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    cache_outs: set[str] = set()
    fp8_caches: set[str] = set()
    nodes = []
    for node in out.graph.node:
        if node.domain != DOMAIN or node.op_type != OP_TYPE:
            nodes.append(node)
            continue
        cache_outs.update(node.output[1:])
        attrs = PagedAttentionAttrs.from_onnx(node_attrs(node))  # validated (sliding_window, softcap > 0)
        if attrs.kv_cache_dtype == KV_FP8:
            fp8_caches.update(node.input[1:3])
        inputs = list(node.input[:9])
        while inputs and not inputs[-1]:
            inputs.pop()
        nodes.append(
            helper.make_node(
                OP_TYPE,
                inputs,
                [node.output[0]],
                name=ORT_LOWERED_NODE_PREFIX + node.name,
                domain=NATIVE_DOMAIN,
                **attrs.onnx_attributes(),
            )
        )
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    kept = [o for o in out.graph.output if o.name not in cache_outs]
    del out.graph.output[:]
    out.graph.output.extend(kept)
    for value in out.graph.input:
        if value.name in fp8_caches:
            value.type.tensor_type.elem_type = CACHE_ELEM_TYPES[KV_FP8]
    opsets = [o for o in out.opset_import if o.domain != DOMAIN]
    del out.opset_import[:]
    out.opset_import.extend([*opsets, helper.make_opsetid(NATIVE_DOMAIN, 1)])
    return out


def fuse_swiglu(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every ``y = (g * Sigmoid(g)) * u`` over ``g, u = Split(x)`` (two equal halves of the
    last axis; the products in either operand order) replaced by ``y = trtbuild.cpu::SwiGLU(x)``.

    A pattern is fused only when its intermediate tensors feed nothing else and are not graph outputs."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    outputs = {o.name for o in graph.output}

    def only(name: str, op_type: str) -> list[onnx.NodeProto] | None:
        """[the one node that reads ``name``] when it is a standard ``op_type`` and ``name`` is no graph output."""
        users = consumers[name]
        if name in outputs or len(users) != 1 or users[0].op_type != op_type or users[0].domain:
            return None
        return users

    def halves(split: onnx.NodeProto) -> bool:
        if split.domain or len(split.input) != 2 or len(split.output) != 2 or split.input[1] not in inits:
            return False
        sizes = numpy_helper.to_array(inits[split.input[1]])
        return int(node_attr(split, "axis", 0)) == -1 and sizes.shape == (2,) and sizes[0] == sizes[1]

    fused: dict[int, onnx.NodeProto | None] = {}  # id(node) -> its replacement (None: dropped)
    orphans: set[str] = set()  # the fused splits' size inputs
    for split in graph.node:
        if split.op_type != "Split" or not halves(split):
            continue
        gate, up = split.output
        gate_users = consumers[gate]
        sigmoid = next((n for n in gate_users if n.op_type == "Sigmoid" and not n.domain), None)
        silu = next((n for n in gate_users if n.op_type == "Mul" and not n.domain), None)
        if len(gate_users) != 2 or sigmoid is None or silu is None or gate in outputs:
            continue
        if sorted(silu.input) != sorted([gate, sigmoid.output[0]]) or only(sigmoid.output[0], "Mul") != [silu]:
            continue
        gated = only(silu.output[0], "Mul")
        if gated is None or only(up, "Mul") != gated or sorted(gated[0].input) != sorted([silu.output[0], up]):
            continue
        node = helper.make_node(SWIGLU_OP, [split.input[0]], [gated[0].output[0]], name=split.name + ".swiglu")
        node.domain = NATIVE_DOMAIN
        fused[id(split)] = node
        orphans.add(split.input[1])
        fused.update({id(sigmoid): None, id(silu): None, id(gated[0]): None})
    if not fused:
        return out
    nodes = [fused.get(id(n), n) for n in graph.node]
    del graph.node[:]
    graph.node.extend(n for n in nodes if n is not None)
    # the splits' size constants, unless something else reads them (onnxruntime warns of unused initializers)
    used = {name for node in graph.node for name in node.input} | outputs
    kept = [t for t in graph.initializer if t.name in used or t.name not in orphans]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    import_domain(out, NATIVE_DOMAIN)
    return out


def single_node_model(attrs: PagedAttentionAttrs, rotary: bool) -> onnx.ModelProto:
    """A model of one native op (kernel tests and benchmarks): inputs ``qkv``, ``key_cache``, ``value_cache``,
    ``positions``, ``block_tables``, ``query_start_loc``, ``cos_sin`` when ``rotary``, ``k_scale`` and ``v_scale``
    for a quantized cache; output ``out``. Register ``library_path()`` to run it."""
    cache = CACHE_ELEM_TYPES[attrs.kv_cache_dtype]
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    names = [("qkv", f32), ("key_cache", cache), ("value_cache", cache), ("positions", i64)]
    names += [("block_tables", i64), ("query_start_loc", i64), ("cos_sin", f32)]
    if attrs.kv_cache_dtype != KV_FLOAT:
        names += [("k_scale", f32), ("v_scale", f32)]
    node = helper.make_node(
        OP_TYPE,
        [n if rotary or n != "cos_sin" else "" for n, _ in names],
        ["out"],
        domain=NATIVE_DOMAIN,
        **attrs.onnx_attributes(),
    )
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in names if rotary or n != "cos_sin"]
    graph = helper.make_graph([node], "paged_attention", inputs, [helper.make_tensor_value_info("out", f32, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(NATIVE_DOMAIN, 1)])
