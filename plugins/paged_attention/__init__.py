"""``trtbuild::PagedAttention``: contract in README.md, oracle in reference.py."""

from .reference import DOMAIN, OP_TYPE, OP_VERSION, PagedAttentionAttrs, paged_attention, rotary_cos_sin_cache

__all__ = ["DOMAIN", "OP_TYPE", "OP_VERSION", "PagedAttentionAttrs", "paged_attention", "rotary_cos_sin_cache"]
