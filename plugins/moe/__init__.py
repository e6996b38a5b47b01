"""``trtbuild::MoE``: contract in README.md, oracle in reference.py."""

from .reference import (
    ACTIVATION_SILU,
    DOMAIN,
    OP_TYPE,
    OP_VERSION,
    MoeAttrs,
    dequantize_int4,
    moe,
    quantize_activation_blocks,
    route,
    unpack_int4,
)

__all__ = [
    "ACTIVATION_SILU",
    "DOMAIN",
    "OP_TYPE",
    "OP_VERSION",
    "MoeAttrs",
    "dequantize_int4",
    "moe",
    "quantize_activation_blocks",
    "route",
    "unpack_int4",
]
