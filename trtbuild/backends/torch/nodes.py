"""The portable graph's nodes as the torch importer interprets them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx
from onnx import helper


@dataclass(frozen=True)
class Node:
    """One ONNX node: ``op`` is ``"Op"`` in the default domain, ``"domain::Op"`` otherwise; string attributes are
    ``str`` (ONNX gives bytes, which torch ops and Dynamo do not take)."""

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]

    @classmethod
    def of(cls, node: onnx.NodeProto) -> Node:
        """``node`` as the importer holds it."""
        return cls(op_name(node), tuple(node.input), tuple(node.output), {a.name: _value(a) for a in node.attribute})


def op_name(node: onnx.NodeProto) -> str:
    """``node``'s op as ``Node.op`` names it."""
    return f"{node.domain}::{node.op_type}" if node.domain else node.op_type


def _value(attr: onnx.AttributeProto) -> Any:
    value = helper.get_attribute_value(attr)
    return value.decode() if isinstance(value, bytes) else value
