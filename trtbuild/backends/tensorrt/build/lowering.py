"""Lower the portable graph to the form TensorRT's ONNX parser turns into a network (pure onnx, no TensorRT).

Each ``trtbuild::PagedAttention`` node becomes ONE node of the TensorRT Python plugin
(``plugins/paged_attention/tensorrt_plugin.py``). TensorRT's ONNX parser sends any op it has no importer for to its
plugin fallback, which looks the creator up by ``op_type`` (the plugin name, ``PagedAttention``), the
``plugin_namespace`` attribute (``trtbuild``) and the ``plugin_version`` attribute (``"1"``: ``tensorrt.plugin``
registers every creator as version 1); the node's domain is not used for the lookup. The node gets domain
``trt.plugins`` only so that the model stays a valid ONNX model (``onnx.checker``) and says whose op it is. The
optional ``aot`` attribute (1/0) asks for the plugin's ahead-of-time (PTX) or JIT (Python) implementation; the
parser consumes the three attributes and passes the rest to the plugin as fields.

The node itself is adapted to the plugin's fixed signature:

- ``positions``, ``block_tables`` and ``query_start_loc`` are cast to int32 (one Cast per tensor, shared by all
  layers; the graph inputs stay int64 so every backend is fed the same ``StepBatch``);
- ``cos_sin_cache`` is always present and float32: a model without RoPE gets a dummy ``[1, 2]`` table and
  ``has_rope=0`` (a Python plugin cannot have optional inputs);
- the caches keep their graph inputs and their plugin outputs ``key_cache_out.{n}`` / ``value_cache_out.{n}``
  stay (or become) graph outputs. The plugin declares them aliased to the cache inputs and writes in place, so the
  runtime binds each output to the address of its input: :func:`cache_aliases` lists the pairs, and the lowering
  records them in the model's ``metadata_props`` under ``trtbuild.cache_aliases``;
- the op's optional ``sliding_window`` / ``softcap`` become the plugin fields of those names, 0 where the
  attribute is absent (a plugin field cannot be absent; the plugin reads 0 as "none");
- the cache dimension ``block_size`` is pinned to ``BuildConfig.kv_block_size``.

Each ``trtbuild::MoE`` node becomes the dense standard-op form of the op (``moe.py``: every expert on every token,
the experts' weights dequantized in TensorRT's 2-D forms). Every other node (Q/DQ included) is left exactly as it
is. :func:`profile_shapes` gives the min/opt/max shape of
every graph input for TensorRT's optimization profile.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ....config import BuildConfig
from ....errors import BuildError
from ....plugins.paged_attention import DOMAIN, OP_TYPE, PagedAttentionAttrs
from .moe import lower_moe

PLUGIN_DOMAIN = "trt.plugins"
PLUGIN_OP_TYPE = "PagedAttention"  # tensorrt_plugin.PLUGIN_NAME
PLUGIN_NAMESPACE = "trtbuild"  # tensorrt_plugin.PLUGIN_NAMESPACE
PLUGIN_CREATOR_VERSION = "1"  # tensorrt_plugin.TENSORRT_CREATOR_VERSION
NO_ROPE_TABLE = "trtbuild.tensorrt.no_rope_cos_sin"
ALIASES_KEY = "trtbuild.cache_aliases"
REQUIRED_ATTRS = ("num_heads", "num_kv_heads", "head_size", "scale")


def lower_for_tensorrt(model: onnx.ModelProto, build: BuildConfig, *, aot: bool | None = None) -> onnx.ModelProto:
    """Return a copy of the portable ``model`` with every plugin node in TensorRT's form (see the module doc).

    ``aot``: ``True``/``False`` puts ``aot=1/0`` on each plugin node (TensorRT releases with AOT Python plugins);
    ``None`` leaves it off, and the network's PREFER_AOT/PREFER_JIT flag (or the only implementation) decides.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    plugins = [n for n in graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    if not plugins:
        raise BuildError(f"the portable graph has no {DOMAIN}::{OP_TYPE} node; was it built by trtbuild?")
    lower_moe(graph, next(o.version for o in out.opset_import if o.domain in ("", "ai.onnx")))
    initializers = {init.name: init for init in graph.initializer}
    _check_whole_blocks(graph, initializers)
    _check_static_activations(graph)
    graph_inputs = {vi.name: vi for vi in graph.input}
    graph_outputs = {vi.name for vi in graph.output}
    casts: dict[tuple[str, int], str] = {}
    new_nodes: list[onnx.NodeProto] = []
    aliases: dict[str, str] = {}

    def cast(name: str, to: int, hint: str) -> str:
        if (name, to) not in casts:
            casts[name, to] = f"{name}.{hint}"
            new_nodes.append(helper.make_node("Cast", [name], [casts[name, to]], name=f"trt/cast/{name}", to=to))
        return casts[name, to]

    for node in graph.node:
        if not (node.domain == DOMAIN and node.op_type == OP_TYPE):
            new_nodes.append(node)
            continue
        if len(node.input) < 6 or len(node.output) != 3 or not all(node.output):
            raise BuildError(f"{node.name}: a {OP_TYPE} node needs 6-7 inputs and 3 outputs (see the op README)")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("kv_cache_dtype", onnx.TensorProto.FLOAT) != onnx.TensorProto.FLOAT or any(node.input[7:]):
            raise BuildError(
                "a quantized KV cache (--kv-cache-dtype int8|fp8) is not supported by the TensorRT backend yet; "
                "build this checkpoint with --backend onnxruntime, or quantize without --kv-cache-dtype"
            )
        missing = [a for a in REQUIRED_ATTRS if a not in attrs]
        if missing:
            raise BuildError(f"{node.name}: missing attribute(s) {', '.join(missing)}")
        try:
            op = PagedAttentionAttrs.from_onnx(attrs)
        except ValueError as e:
            raise BuildError(f"{node.name}: {e}") from e
        inputs = list(node.input[:3])
        inputs += [cast(name, TensorProto.INT32, "int32") for name in node.input[3:6]]
        cos_sin = node.input[6] if len(node.input) > 6 else ""
        if not cos_sin:
            if NO_ROPE_TABLE not in initializers:
                initializers[NO_ROPE_TABLE] = numpy_helper.from_array(np.zeros((1, 2), np.float32), NO_ROPE_TABLE)
                graph.initializer.append(initializers[NO_ROPE_TABLE])
            cos_sin = NO_ROPE_TABLE
        elif not (cos_sin in initializers and initializers[cos_sin].data_type == TensorProto.FLOAT):
            cos_sin = cast(cos_sin, TensorProto.FLOAT, "float32")
        inputs.append(cos_sin)
        new_nodes.append(
            helper.make_node(
                PLUGIN_OP_TYPE,
                inputs,
                list(node.output),
                name=node.name,
                domain=PLUGIN_DOMAIN,
                doc_string=f"{DOMAIN}::{OP_TYPE} as the TensorRT plugin {PLUGIN_NAMESPACE}::{PLUGIN_OP_TYPE}",
                num_heads=int(attrs["num_heads"]),
                num_kv_heads=int(attrs["num_kv_heads"]),
                head_size=int(attrs["head_size"]),
                scale=float(attrs["scale"]),
                rotary_interleaved=int(attrs.get("rotary_interleaved", 0)),
                has_rope=int(cos_sin != NO_ROPE_TABLE),
                sliding_window=op.sliding_window or 0,  # 0: absent (plugin fields cannot be)
                softcap=op.softcap or 0.0,
                plugin_namespace=PLUGIN_NAMESPACE,
                plugin_version=PLUGIN_CREATOR_VERSION,
                **({} if aot is None else {"aot": int(aot)}),
            )
        )
        for cache_in, cache_out in zip(node.input[1:3], node.output[1:3], strict=True):
            if cache_in not in graph_inputs:
                raise BuildError(f"{node.name}: cache {cache_in!r} must be a graph input (it is written in place)")
            if cache_out not in graph_outputs:
                value_info = onnx.ValueInfoProto()
                value_info.CopyFrom(graph_inputs[cache_in])
                value_info.name = cache_out
                graph.output.append(value_info)
                graph_outputs.add(cache_out)
            aliases[cache_out] = cache_in

    del graph.node[:]
    graph.node.extend(new_nodes)
    _pin_block_size(graph, set(aliases) | set(aliases.values()), build.kv_block_size)
    _set_opsets(out)
    _set_metadata(out, ALIASES_KEY, json.dumps(aliases, sort_keys=True))
    return out


def cache_aliases(model: onnx.ModelProto) -> dict[str, str]:
    """``{cache output: cache input}`` of a lowered model: bind each output to its input's device address."""
    for prop in model.metadata_props:
        if prop.key == ALIASES_KEY:
            return dict(json.loads(prop.value))
    return {}


def profile_shapes(model: onnx.ModelProto, build: BuildConfig) -> dict[str, tuple[tuple[int, ...], ...]]:
    """``{graph input: (min, opt, max)}`` shapes for TensorRT's optimization profile, from ``build``'s limits.

    Symbolic dims are resolved by name (the names ``trtbuild.graph.emit`` uses): tokens up to ``max_num_tokens``,
    sequences up to ``max_batch_size``, block-table width up to ``ceil(max_seq_len / kv_block_size)``, and a KV pool
    of up to ``max_batch_size`` full-length sequences (the sliding layers' tables and pool of a model of both
    attention kinds alike). ``opt`` is the decode-heavy middle of each range.
    """
    blocks_per_seq = math.ceil(build.max_seq_len / build.kv_block_size)
    tokens = build.max_num_tokens
    seqs = build.max_batch_size
    ranges = {
        "num_tokens": (1, min(tokens, seqs), tokens),
        "num_logits": (1, min(tokens, seqs), tokens),
        "num_seqs": (1, seqs, seqs),
        "num_seqs_plus_1": (2, seqs + 1, seqs + 1),
        "max_blocks_per_seq": (1, blocks_per_seq, blocks_per_seq),
        "num_blocks": (1, seqs * blocks_per_seq, seqs * blocks_per_seq),
        # a model of both attention kinds: the sliding layers' tables (null entries before the window included) and
        # caches, at most as wide and as large as the full layers'
        "max_sliding_blocks_per_seq": (1, blocks_per_seq, blocks_per_seq),
        "num_sliding_blocks": (1, seqs * blocks_per_seq, seqs * blocks_per_seq),
        "block_size": (build.kv_block_size,) * 3,
    }
    shapes = {}
    for vi in model.graph.input:
        if vi.name in {init.name for init in model.graph.initializer}:
            continue
        dims: list[tuple[int, int, int]] = []
        for dim in vi.type.tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                dims.append((dim.dim_value,) * 3)
            elif dim.dim_param in ranges:
                dims.append(ranges[dim.dim_param])
            else:
                raise BuildError(f"graph input {vi.name!r}: no TensorRT profile range for dimension {dim.dim_param!r}")
        shapes[vi.name] = tuple(tuple(d[i] for d in dims) for i in range(3))
    return shapes


def _check_static_activations(graph: onnx.GraphProto) -> None:
    """Refuse activations quantized with run-time scales (``--activation-scales dynamic``, computed in the graph):
    TensorRT's explicit-quantization int8 / fp8 GEMMs take a constant per-tensor activation scale."""
    for node in graph.node:
        if node.op_type == "QuantizeLinear" and any(a.name == "block_size" for a in node.attribute):
            raise BuildError(
                f"{node.name}: activations quantized with dynamic scales, which the TensorRT backend does not take; "
                "quantize with --activation-scales static, or build with --backend onnxruntime or torch"
            )


def _check_whole_blocks(graph: onnx.GraphProto, initializers: dict[str, onnx.TensorProto]) -> None:
    """Refuse blocked ``DequantizeLinear`` weights whose last block is partial (ONNX and onnxruntime allow it; the
    TensorRT block quantization this backend was written against takes whole blocks only, unverified here), int4
    weights with zero points (``uint4``; TensorRT's DequantizeLayer takes no zero point) and uint8 codes with offsets
    (``int8_min_wo``): a weight's, or an embedding's whose gathered rows it dequantizes."""
    gathered = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Gather"}  # rows -> their table
    for node in graph.node:
        source = gathered.get(node.input[0], node.input[0])
        weight = initializers.get(source) if node.op_type == "DequantizeLinear" else None
        if weight is None:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        block = attrs.get("block_size", 0)
        if not block:
            continue
        if weight.data_type == TensorProto.UINT4:
            raise BuildError(
                f"{node.name}: int4 with zero points, which TensorRT's DequantizeLayer does not take: quantize "
                "without --zero-points, or build with --backend onnxruntime or torch"
            )
        if weight.data_type == TensorProto.UINT8:
            raise BuildError(
                f"{node.name}: uint8 codes with offsets (a GGUF file's Q5_K or Q2_K, its 4- or 5-bit embedding, or "
                "a fused tensor of mixed block formats), which TensorRT's DequantizeLayer does not take: convert "
                "with --dequantize, or build with --backend onnxruntime or torch"
            )
        axis = attrs.get("axis", 1) % len(weight.dims)
        if weight.dims[axis] % block:
            raise BuildError(
                f"{node.name}: int4 groups of {block} do not divide its {weight.dims[axis]} in-features; the TensorRT "
                "backend takes whole groups only: quantize with a --group-size dividing every in-features "
                "(e.g. 64 for SmolLM2), or build with --backend onnxruntime"
            )


def _pin_block_size(graph: onnx.GraphProto, names: set[str], block_size: int) -> None:
    for vi in list(graph.input) + list(graph.output):
        if vi.name not in names:
            continue
        dims = vi.type.tensor_type.shape.dim
        if len(dims) != 4:
            raise BuildError(f"KV cache {vi.name!r} must be [num_blocks, block_size, num_kv_heads, head_size]")
        if dims[1].HasField("dim_value") and dims[1].dim_value != block_size:
            raise BuildError(f"KV cache {vi.name!r} has block size {dims[1].dim_value}, build says {block_size}")
        dims[1].dim_value = block_size


def _set_opsets(model: onnx.ModelProto) -> None:
    still_used = any(n.domain == DOMAIN for n in model.graph.node)
    kept = [(o.domain, o.version) for o in model.opset_import if still_used or o.domain != DOMAIN]
    kept = [(domain, version) for domain, version in kept if domain != PLUGIN_DOMAIN] + [(PLUGIN_DOMAIN, 1)]
    del model.opset_import[:]
    model.opset_import.extend(helper.make_opsetid(domain, version) for domain, version in kept)


def _set_metadata(model: onnx.ModelProto, key: str, value: str) -> None:
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    model.metadata_props.add(key=key, value=value)
