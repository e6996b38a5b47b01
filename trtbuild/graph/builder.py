"""A small ONNX graph builder: deterministic node names, numpy initializers, typed graph inputs/outputs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..plugins.paged_attention import DOMAIN, OP_VERSION

IR_VERSION = 10


class GraphBuilder:
    """Accumulates nodes and initializers; ``op`` returns the output name(s) of the node it adds."""

    def __init__(self, opset: int, name: str = "trtbuild", prefix: str = "") -> None:
        self.opset = opset
        self.name = name
        self.prefix = prefix  # prepended to generated node/constant names, so two builders' graphs can merge
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._counts: dict[str, int] = {}
        self._consts: dict[tuple, str] = {}

    def _fresh(self, hint: str) -> str:
        n = self._counts.get(hint, 0)
        self._counts[hint] = n + 1
        return self.prefix + (hint if n == 0 else f"{hint}_{n}")

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        *,
        outputs: int | Sequence[str] = 1,
        name: str | None = None,
        domain: str = "",
        **attrs: object,
    ) -> str:
        """Add a node with one output and return that output's name."""
        outs = self.op_multi(op_type, inputs, outputs=outputs, name=name, domain=domain, **attrs)
        if len(outs) != 1:
            raise ValueError(f"{op_type} has {len(outs)} outputs; use op_multi")
        return outs[0]

    def op_multi(
        self,
        op_type: str,
        inputs: Sequence[str],
        *,
        outputs: int | Sequence[str],
        name: str | None = None,
        domain: str = "",
        **attrs: object,
    ) -> list[str]:
        """Add a node with ``outputs`` outputs (a count, or explicit names) and return their names."""
        node_name = self._fresh(name or op_type)
        outs = [f"{node_name}/out{i}" for i in range(outputs)] if isinstance(outputs, int) else list(outputs)
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=node_name, domain=domain, **attrs))
        return outs

    def initializer(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(
        self, values: int | float | Sequence[int] | Sequence[float] | np.ndarray, dtype: str | type = np.int64
    ) -> str:
        """A small constant (deduplicated), e.g. a shape or an axis list."""
        arr = np.asarray(values, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.initializer(self._fresh("const"), arr)
        return self._consts[key]

    def add_input(self, name: str, elem_type: int, shape: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def add_output(self, name: str, elem_type: int, shape: Sequence[int | str]) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))

    def rename_output(self, current: str, new: str) -> str:
        """Make the node producing ``current`` write ``new`` instead (for graph output names)."""
        for node in self.nodes:
            for i, o in enumerate(node.output):
                if o == current:
                    node.output[i] = new
                    return new
        raise KeyError(current)

    def model(self, *, with_plugin_domain: bool = True) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", self.opset)]
        if with_plugin_domain:
            opsets.append(helper.make_opsetid(DOMAIN, OP_VERSION))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="trtbuild")
        model.ir_version = IR_VERSION
        return model


FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
