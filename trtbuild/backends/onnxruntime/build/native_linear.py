"""onnxruntime lowering of quantized linears onto the native library's ``trtbuild.cpu::QLinear``.

``QLinear`` (``trtbuild/kernels/cpu/linear.cc``) multiplies float rows by packed 8- or 4-bit weights on
AMX tiles (many rows), AVX-512 VNNI or AVX2 (``cpu_linear_simd``): the activations are quantized to int8 per block
inside the op, the products summed exactly in int32.
It replaces onnxruntime's ``MatMulNBits`` and ``MatMulInteger`` for the three linears trtbuild's formats emit:

- an int8 per-channel weight ``DequantizeLinear`` feeding a ``MatMul`` of float activations (``int8_wo``, the int8
  LM heads, and ``int8_sq``'s linears once ``weights.hand_activations_to_kernel`` has handed their blocks-of-16
  activation Q/DQ to the kernel): activation blocks of ``weights.ACTIVATION_BLOCK``, as ``MatMulNBits`` ran them;
- the same weight behind a per-token activation Q/DQ (``--activation-scales per_token``): one block per row, the
  exact integers and float order of ``QuantizeRows -> MatMulInteger -> RescaleRows`` (bit-identical output);
- a symmetric int4 weight blocked along in-features (``int4_wo`` / ``int4_awq`` without zero points, GGUF Q4_0):
  activation blocks of the weight's group, as ``MatMulNBits``' accuracy level 4 ran them;
- an int8 weight blocked along in-features (GGUF Q8_0, ``int8_group_wo``): activation blocks of the group;
- GGUF Q4_1 / Q4_K (``int4_min_wo``) and Q5_K (``int8_min_wo``): unsigned int4 / uint8 codes blocked along in-features
  whose dequantized weight gets a float offset per group (``checkpoint.graph.emit_weight_offset``: ``Reshape -> Add ->
  Reshape``): the codes as they are (zero point 0) and the offsets as ``QLinear``'s fourth input (the offset term:
  ``linear.h``).

Why: at one row the kernel streams its weights at close to the machine's read bandwidth, and at 64 rows it runs
the int4 product on the integer units where ``MatMulNBits`` is nearly as slow as float32
(docs/decisions/native-quantized-linear.md).
On AVX2 without VNNI it is also exact where onnxruntime's ``MatMulInteger`` is not: MLAS's AVX2 uint8 x int8
kernel sums pairs of products in saturating int16 (``vpmaddubsw``), which is why the GEMMs left to onnxruntime
take uint8 weights (``weights.WEIGHT_ZERO_POINT``).
``qlinear_reference`` states the op's arithmetic in numpy; ``tests/test_cpu_linear.py`` holds the kernel to it.
Weights with zero points and any other Q/DQ stay with onnxruntime's kernels.

Pass contract (``passes.PASSES``: ``native-linears``, after ``activations-to-kernel``): int8 / int4 weight
``DequantizeLinear -> MatMul`` (and a per-token ``QuantizeLinear``'s nodes, a Q4_1 offset's ``Reshape -> Add ->
Reshape``) -> ``trtbuild.cpu::QLinear``; every other node is kept.
"""

from __future__ import annotations

import collections
import enum

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ....kernels.library import NATIVE_DOMAIN, QLINEAR_OP
from .graph_edit import dynamic_linears, emitted_quantization, import_domain, node_attrs, replace_nodes
from .weights import ACTIVATION_BLOCK, offset_weight

PANEL = 16  # output columns per packed panel (one AVX-512 register of int32 sums, two AVX2 ones)
ZERO_POINT = {8: 128, 4: 8}  # the unsigned weight code is c + ZERO_POINT[bits]
STEP = {8: 4, 4: 8}  # in-features per 64-byte packed step


class LinearSimd(enum.Enum):
    """Which of ``QLinear``'s product loops this CPU runs (``linear_work.h``: one per ``#if`` branch)."""

    AMX = "amx"  # AMX int8 tiles (tdpbsud: 32 rows x 32 columns x 64 in-features) for many rows, VNNI for few
    AVX512_VNNI = "avx512_vnni"  # vpdpbusd: 4 products summed per int32 lane, 16 columns a register
    AVX2 = "avx2"  # vpmaddubsw + vpmaddwd: the same integers, 8 columns a register
    NONE = "none"  # plain loops: correct, several times slower than onnxruntime's kernels


def cpu_linear_simd() -> LinearSimd:
    """The product loop ``QLinear`` compiled with ``-march=native`` runs here (read from /proc/cpuinfo's flags).

    With ``NONE`` a build keeps onnxruntime's kernels (``BuildConfig.cpu_linear`` recorded ``ONNXRUNTIME``)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return LinearSimd.NONE
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return LinearSimd.AMX if {"amx_tile", "amx_int8"} <= flags else LinearSimd.AVX512_VNNI
    if {"avx2", "fma"} <= flags:
        return LinearSimd.AVX2
    return LinearSimd.NONE


def pack_weight(codes: np.ndarray, bits: int) -> np.ndarray:
    """``codes`` int ``[K, N]`` (int8, or int4 values in [-8, 7]) -> ``QLinear``'s packed uint8 ``[panels, steps,
    64]`` (layout: ``linear.h``)."""
    k, n = codes.shape
    step, panels = STEP[bits], -(-n // PANEL)
    steps = -(-k // step)
    u = np.zeros((steps * step, panels * PANEL), np.int32)
    u[:k, :n] = codes.astype(np.int32) + ZERO_POINT[bits]  # padding stays 0
    if bits == 8:
        # [steps, 4, panels, 16] -> [panels, steps, 16, 4]
        return np.ascontiguousarray(u.reshape(steps, 4, panels, PANEL).transpose(2, 0, 3, 1).astype(np.uint8))
    halves = u.reshape(steps, 2, 4, panels, PANEL)  # [steps, low/high, i, panels, 16]
    byte = halves[:, 0] | (halves[:, 1] << 4)  # [steps, 4, panels, 16]
    return np.ascontiguousarray(byte.transpose(2, 0, 3, 1).astype(np.uint8))


def pad_scales(scale: np.ndarray) -> np.ndarray:
    """Weight scales ``[N]`` or ``[groups, N]`` -> ``[groups, panels * 16]`` float32, padded columns zero."""
    scale = np.atleast_2d(np.asarray(scale, np.float32))
    out = np.zeros((scale.shape[0], -(-scale.shape[1] // PANEL) * PANEL), np.float32)
    out[:, : scale.shape[1]] = scale
    return out


def qlinear_reference(
    x: np.ndarray,
    codes: np.ndarray,
    scale: np.ndarray,
    *,
    bits: int,
    group: int,
    block: int,
    offset: np.ndarray | None = None,
) -> np.ndarray:
    """``QLinear`` in numpy: float32 rows ``x [M, K]``, weight ``codes [K, N]`` and scales ``[N]`` (per channel)
    or ``[ceil(K / group), N]`` -> ``[M, N]`` float32, with the kernel's integers and float order (bits only
    decides which codes are valid). With ``offset`` ``[K / group, N]`` the codes are unsigned (0..2^bits - 1) and
    ``w = codes * scale + offset``."""
    if offset is None:
        assert codes.min() >= -(1 << (bits - 1)) and codes.max() < (1 << (bits - 1))
    else:
        assert codes.min() >= 0 and codes.max() < (1 << bits)
    x = np.asarray(x, np.float32)
    k = x.shape[1]
    scale = np.atleast_2d(np.asarray(scale, np.float32))
    grouped = group < k
    acc = np.zeros((x.shape[0], codes.shape[1]), np.float32)
    block_sums = []  # s * float(sum of the block's codes): the offset term's factors
    for b, k0 in enumerate(range(0, k, block)):
        xb = x[:, k0 : k0 + block]
        s = np.maximum(np.abs(xb).max(axis=1, keepdims=True) / np.float32(127), np.finfo(np.float32).tiny)
        q = np.clip(np.rint(xb / s), -127, 127).astype(np.int64)
        block_sums.append((s[:, 0] * q.sum(axis=1).astype(np.float32)).astype(np.float32))
        d = (q @ codes[k0 : k0 + block].astype(np.int64)).astype(np.float32)
        factor = (scale[k0 // group][None, :] * s).astype(np.float32) if grouped else s
        # after the first block the kernel's fused multiply-add: the float32 product is exact in float64
        first = b == 0
        acc = (d * factor).astype(np.float32) if first else (d.astype(np.float64) * factor + acc).astype(np.float32)
    y = acc if grouped else (acc * scale[0][None, :]).astype(np.float32)
    if offset is not None:  # the offset term: the quantized rows' block sums, one fma per block in order
        offset = np.asarray(offset, np.float32)
        for b, k0 in enumerate(range(0, k, block)):
            y = (block_sums[b][:, None].astype(np.float64) * offset[k0 // group][None, :] + y).astype(np.float32)
    return y


def qlinear_weights(
    name: str, codes: np.ndarray, scale: np.ndarray, *, bits: int, offset: np.ndarray | None = None
) -> list[onnx.TensorProto]:
    """The initializers of ``qlinear_node(name, ...)``: weight ``codes`` ``[K, N]`` packed and ``scale`` (``[N]`` or
    ``[groups, N]``) padded, signed codes; with ``offset`` ``[groups, N]`` (GGUF Q4_1, Q4_K, ``int8_min_wo``) the
    codes are unsigned (0..2^bits - 1, zero point 0), packed as they are, and the offsets padded as the scales."""
    if offset is not None:  # packed as c = u - 8 (int4) or u - 128 (int8): the packing adds it back
        codes = np.asarray(codes, np.int32) - ZERO_POINT[bits]
    weights = [
        numpy_helper.from_array(pack_weight(codes, bits), name + ".packed"),
        numpy_helper.from_array(pad_scales(scale), name + ".scales"),
    ]
    if offset is not None:
        weights.append(numpy_helper.from_array(pad_scales(offset), name + ".offsets"))
    return weights


def qlinear_node(
    name: str, x: str, y: str, *, k: int, n: int, bits: int, group: int, block: int, offsets: bool = False
) -> onnx.NodeProto:
    """The ``QLinear`` node of ``name`` (its packed weight and padded scales are ``{name}.packed`` / ``.scales``,
    its offsets, with ``offsets``, ``{name}.offsets``)."""
    return helper.make_node(
        QLINEAR_OP,
        [x, name + ".packed", name + ".scales", *([name + ".offsets"] if offsets else [])],
        [y],
        name=name,
        domain=NATIVE_DOMAIN,
        bits=bits,
        in_features=k,
        out_features=n,
        group=group,
        block=block,
    )


def _weight_form(
    dq: onnx.NodeProto, inits: dict[str, onnx.TensorProto], *, unsigned: bool = False
) -> tuple[int, int, np.ndarray] | None:
    """(bits, group, scales) of a weight ``DequantizeLinear`` ``QLinear`` takes, else None: int8 per output
    channel (``axis=1``, scales ``[N]``), or int8 / int4 blocked along in-features (``axis=0``), no zero points;
    ``unsigned``: uint8 / uint4 codes (GGUF Q5_K / Q4_1, whose offsets follow the DequantizeLinear) instead."""
    if dq.op_type != "DequantizeLinear" or len(dq.input) > 2:
        return None
    weight, scale = inits.get(dq.input[0]), inits.get(dq.input[1])
    if weight is None or scale is None or len(weight.dims) != 2:
        return None
    k, n = weight.dims
    attrs = node_attrs(dq)
    per_channel = attrs.get("axis") == 1 and "block_size" not in attrs and list(scale.dims) == [n]
    if weight.data_type == TensorProto.INT8 and per_channel and not unsigned:
        return 8, k, numpy_helper.to_array(scale)
    int4, int8 = (TensorProto.UINT4, TensorProto.UINT8) if unsigned else (TensorProto.INT4, TensorProto.INT8)
    if weight.data_type in (int4, int8) and attrs.get("axis") == 0:
        bits, group = 8 if weight.data_type == int8 else 4, attrs.get("block_size", 0)
        if group % STEP[bits] == 0 and list(scale.dims) == [-(-k // group), n]:
            return bits, group, numpy_helper.to_array(scale)
    return None


def native_linears(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite, in place, every linear ``QLinear`` takes (module docstring) as one ``QLinear`` node; returns
    ``model``. Run after ``hand_activations_to_kernel`` and before ``integer_gemms_per_token``."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    consumers = collections.Counter(i for n in graph.node for i in n.input)
    replaced = collections.Counter()  # weight DequantizeLinear name -> how many of its MatMuls were replaced
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    replacements: dict[str, list[onnx.NodeProto]] = {}
    dead: set[str] = set()
    packed: list[onnx.TensorProto] = []

    def replace(
        matmul: onnx.NodeProto,
        dq: onnx.NodeProto,
        x: str,
        form: tuple[int, int, np.ndarray],
        block: int,
        offset: np.ndarray | None = None,
    ):
        bits, group, scale = form
        codes = numpy_helper.to_array(inits[dq.input[0]]).astype(np.int32)
        k, n = codes.shape
        name = matmul.name + ".q"
        packed.extend(qlinear_weights(name, codes, scale, bits=bits, offset=offset))
        node = qlinear_node(
            name, x, matmul.output[0], k=k, n=n, bits=bits, group=group, block=block, offsets=offset is not None
        )
        replacements[matmul.name] = [node]
        replaced[dq.name] += 1
        if replaced[dq.name] == consumers[dq.output[0]]:  # no reader left (a shared weight: after its last one)
            dead.add(dq.name)

    for node, q, weight_dq, x in dynamic_linears(graph):  # per-token int8 activations: one block per row
        form = _weight_form(weight_dq, inits)
        qattrs = node_attrs(q)
        if form is None or form[0] != 8 or qattrs.get("output_dtype") != TensorProto.INT8:
            continue
        k = form[1]  # an int8 weight's group: all its in-features
        if qattrs.get("block_size") != k:
            continue
        replace(node, weight_dq, x, form, block=k)
        dead |= emitted_quantization(graph, q)
    for node in graph.node:  # weight-only: float activations
        if node.op_type != "MatMul" or node.name in replacements or node.input[0] in dequantized:
            continue
        dq = producer.get(node.input[1])
        found = offset_weight(dq, producer, inits) if dq is not None else None
        offset = None
        if found is not None:  # GGUF Q4_1: codes, scales, offsets
            dq, offset, pattern = found
            form = _weight_form(dq, inits, unsigned=True)
            if form is None or offset.shape != form[2].shape:
                continue
            dead.update(pattern)
        else:
            form = _weight_form(dq, inits) if dq is not None else None
        if form is None:
            continue
        per_channel_int8 = form[0] == 8 and form[1] >= int(inits[dq.input[0]].dims[0])
        replace(node, dq, node.input[0], form, ACTIVATION_BLOCK if per_channel_int8 else form[1], offset)
    if not replacements:
        return model
    graph.initializer.extend(packed)
    replace_nodes(graph, dead, replacements)
    import_domain(model, NATIVE_DOMAIN)
    return model
