"""``trtbuild::PagedAttention``: contract in README.md, oracle in reference.py."""

from .reference import (
    DOMAIN,
    KV_FLOAT,
    KV_FP8,
    KV_INT8,
    OP_TYPE,
    OP_VERSION,
    PagedAttentionAttrs,
    dequantize_kv,
    paged_attention,
    quantize_kv,
    rotary_cos_sin_cache,
)

__all__ = [
    "DOMAIN",
    "KV_FLOAT",
    "KV_FP8",
    "KV_INT8",
    "OP_TYPE",
    "OP_VERSION",
    "PagedAttentionAttrs",
    "dequantize_kv",
    "paged_attention",
    "quantize_kv",
    "rotary_cos_sin_cache",
]
