"""``trtbuild::MoE``: contract in README.md, oracle in reference.py."""

from .reference import ACTIVATION_SILU, DOMAIN, OP_TYPE, OP_VERSION, MoeAttrs, moe, route

__all__ = ["ACTIVATION_SILU", "DOMAIN", "OP_TYPE", "OP_VERSION", "MoeAttrs", "moe", "route"]
