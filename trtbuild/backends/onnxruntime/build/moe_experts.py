"""The integer path of the native ``trtbuild.cpu::MoE`` node: quantized experts packed for ``QLinear``.

With int8 or int4 experts the native kernel (``trtbuild/kernels/cpu/moe.cc``) runs each routed expert's two
products as ``QLinear`` (``trtbuild/kernels/cpu/linear.h``) runs a dense linear: the input quantized to int8 per
block of ``activation_block`` in-features at run time, the products exact in int32. ``packed_experts`` turns each
expert's ``gate_up [2I, H]`` and ``down [H, I]`` into ``QLinear``'s packed weight (``native_linear.pack_weight`` of
the transposed codes), stacked over the experts as ``[E, panels, steps, 64]``, with the scales in its
``[groups, panels * 16]`` form stacked as ``[E, groups, panels * 16]``.

Which block (``activation_block``): the portable node's own when it has one (``int8_sq``'s experts: 16); for
weight-only experts the block the dense weight-only linears get (``native_linear``): ``weights.ACTIVATION_BLOCK``
in-features for int8 rows, the group for int4 blocks; so the engine runs weight-only experts with int8 activations
as it runs its dense weight-only linears. ``QLinear`` takes blocks of whole packed steps (``native_linear.STEP``:
4 in-features for int8, 8 for int4) or one block per row; int4 experts whose group is neither stay on the kernel's
float-activation path (``None``), as such dense linears stay on onnxruntime's kernels, and a portable
``activation_block`` ``QLinear`` does not take is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from ....errors import BuildError
from ....plugins.moe import unpack_int4
from .graph_edit import node_attrs
from .native_linear import PANEL, STEP, pack_weight, pad_scales
from .weights import ACTIVATION_BLOCK


@dataclass(frozen=True)
class PackedExperts:
    """A quantized ``trtbuild::MoE`` node's experts in ``QLinear``'s form: the native node's inputs 2-5 (named
    ``{weight}.packed`` / ``{weight}.scales``), their initializers, and the attributes the kernel reads them by
    (``activation_block``, ``bits``, ``intermediate_size``, for int4 ``group_size``)."""

    inputs: list[str]
    initializers: list[onnx.TensorProto]
    attributes: dict[str, int]


def _fits(block: int, bits: int, in_features: tuple[int, ...]) -> bool:
    """Whether ``QLinear`` takes activation blocks of ``block`` for linears of these in-feature counts."""
    return all(block % STEP[bits] == 0 or block >= k for k in in_features)


def _block(node: onnx.NodeProto, bits: int, group: int | None, hidden: int, inter: int) -> int | None:
    """The native node's ``activation_block`` (module doc); None: float activations (an int4 group ``QLinear``
    does not take)."""
    attrs = node_attrs(node)
    if "activation_block" in attrs:
        block = int(attrs["activation_block"])
        if block < 1 or (group is not None and group % block) or not _fits(block, bits, (hidden, inter)):
            divides = "" if group is None else f" dividing group_size {group}"
            raise BuildError(
                f"{node.name}: activation_block {block} is not one the native MoE kernel takes (a multiple of "
                f"{STEP[bits]}{divides}, or at least the experts' in-features {hidden} and {inter})"
            )
        return block
    block = ACTIVATION_BLOCK if group is None else group
    return block if _fits(block, bits, (hidden, inter)) else None


def _codes(weight: np.ndarray, int4: bool) -> np.ndarray:
    """Expert rows ``[E, out, in]`` (int8) or ``[E, out, in/2]`` (packed int4) -> int8 codes ``[E, out, in]``."""
    return unpack_int4(weight) if int4 else np.asarray(weight, np.int8)


def _scales(scale: np.ndarray, int4: bool) -> np.ndarray:
    """Expert scales ``[E, out]`` (int8 rows) or ``[E, out, groups]`` (int4) -> ``[E, groups, panels * 16]``."""
    scale = np.asarray(scale, np.float32)
    return np.stack([pad_scales(s.T if int4 else s) for s in scale])


def packed_experts(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> PackedExperts | None:
    """The integer path's experts of the quantized ``node`` (6 inputs, weights and scales initializers), or None
    where they stay on the float-activation path (module doc)."""
    gate_up, down, gate_up_scale, down_scale = node.input[2:6]
    if any(name not in inits for name in (gate_up, down, gate_up_scale, down_scale)):
        raise BuildError(f"{node.name}: the native MoE kernel needs its quantized experts as initializers")
    group = node_attrs(node).get("group_size")
    int4 = group is not None
    bits = 4 if int4 else 8
    _, rows, width = inits[gate_up].dims
    inter, hidden = rows // 2, width * (2 if int4 else 1)
    block = _block(node, bits, group, hidden, inter)
    if block is None:
        return None
    packed, scales = [], []
    for weight, scale in ((gate_up, gate_up_scale), (down, down_scale)):
        codes = _codes(numpy_helper.to_array(inits[weight]), int4)
        stacked = np.stack([pack_weight(c.T, bits).reshape(-1, 64) for c in codes])  # [E, panels * steps, 64]
        panels = -(-codes.shape[1] // PANEL)
        packed.append(numpy_helper.from_array(stacked.reshape(len(codes), panels, -1, 64), weight + ".packed"))
        scales.append(numpy_helper.from_array(_scales(numpy_helper.to_array(inits[scale]), int4), weight + ".scales"))
    tensors = packed + scales
    attributes = {"activation_block": block, "bits": bits, "intermediate_size": inter}
    if int4:
        attributes["group_size"] = int(group)
    return PackedExperts([t.name for t in tensors], tensors, attributes)
