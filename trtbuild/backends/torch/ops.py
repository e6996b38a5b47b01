"""``torch.ops.trtbuild.paged_attention``: the ``trtbuild::PagedAttention`` plugin as a torch custom op.

It writes this step's keys/values into ``key_cache`` / ``value_cache`` IN PLACE (declared mutable in its schema,
``SCHEMA``, so ``torch.export`` and AOTInductor keep the caches as the engine's mutated inputs) and returns the
attention output.
On CUDA (float caches) the implementation is the project's Triton kernel, through its public launcher
``plugins/paged_attention/triton_kernel.paged_attention_triton`` (the one the TensorRT plugin uses); on the CPU it is
the onnxruntime engine's native kernel (``native_ops.py``) where that takes the call; elsewhere, and for quantized
caches on CUDA, it is :func:`paged_attention_torch`, checked against the numpy oracle
(``plugins/paged_attention/reference.py``).
AOTInductor calls the op through its proxy executor, so a process running a torch engine imports this module first
(``TorchSession`` does).
"""

import torch
from torch import Tensor

from ...config import KVCacheDType, ModelConfig
from ...plugins.paged_attention import KV_FLOAT, KV_FP8, KV_INT8, PagedAttentionAttrs
from ...plugins.paged_attention.reference import FP8_MAX

# ONNX element type of a quantized cache -> its torch storage dtype.
QUANTIZED_CACHE_DTYPES = {KV_INT8: torch.int8, KV_FP8: torch.float8_e4m3fn}


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x [T, H, D]`` (as ``reference.apply_rotary``)."""
    rot = 2 * cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    head, tail = x[..., :rot], x[..., rot:]
    if interleaved:  # pairs (2i, 2i + 1)
        even, odd = head[..., 0::2], head[..., 1::2]
        rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    else:  # halves (i, i + R/2)
        first, second = head.chunk(2, dim=-1)
        rotated = torch.cat((first * c - second * s, second * c + first * s), dim=-1)
    return torch.cat((rotated, tail), dim=-1)


def cache_dtype(model: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of a torch engine's KV cache: the compute dtype, or the quantized cache's int8 / float8."""
    return {KVCacheDType.INT8: torch.int8, KVCacheDType.FP8: torch.float8_e4m3fn}.get(model.kv_cache_dtype, dtype)


def quantize_kv(x: Tensor, scale: Tensor, kv_cache_dtype: int) -> Tensor:
    """``x / scale`` in the cache format: int8 rounds half to even and saturates; fp8 E4M3FN saturates to +-448."""
    y = x.float() / scale.float()
    if kv_cache_dtype == KV_INT8:
        return torch.round(y).clamp(-128, 127).to(torch.int8)
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _attend(q: Tensor, keys: Tensor, vals: Tensor, mask: Tensor, attrs: PagedAttentionAttrs) -> Tensor:
    """``softmax(q @ keys^T * scale, masked) @ vals`` over the last two dims (``mask`` True where a key is visible,
    broadcast to the scores); the scores soft-capped before the mask when ``attrs.softcap`` is set."""
    if attrs.softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=attrs.scale)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * attrs.scale
    scores = torch.tanh(scores / attrs.softcap) * attrs.softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, vals)


def paged_attention_torch(
    qkv: Tensor, key_cache: Tensor, value_cache: Tensor, positions: Tensor, block_tables: Tensor,
    query_start_loc: Tensor, cos_sin_cache: Tensor | None, attrs: PagedAttentionAttrs,
    k_scale: Tensor | None = None, v_scale: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """The op in plain torch (any device): writes the caches in place, returns ``[T, Hq * D]`` in ``qkv``'s dtype.

    Computes in float32. A decode step (one token per sequence) is one ``scaled_dot_product_attention`` call over
    every sequence's context gathered from its blocks (padded to the longest, masked); other steps take one call
    per sequence with a causal mask. The query heads sharing a KV head ride along the query-length dimension, so
    the keys and values are never repeated per head. With ``attrs.sliding_window`` each sequence gathers only the
    positions from its first token's window start on (earlier blocks are never read); with ``attrs.softcap`` the
    attention is computed as plain matmuls and softmax (``sdpa`` cannot cap its scores). Reads ``positions``'
    largest value on the host."""
    hq, hkv, d = attrs.num_heads, attrs.num_kv_heads, attrs.head_size
    t = qkv.shape[0]
    x = qkv.float()
    q = x[:, : hq * d].reshape(t, hq, d)
    k = x[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    v = x[:, (hq + hkv) * d :].reshape(t, hkv, d)
    if cos_sin_cache is not None:
        table = cos_sin_cache[positions].float()
        half = table.shape[1] // 2
        cos, sin = table[:, :half], table[:, half:]
        q = _rotate(q, cos, sin, attrs.rotary_interleaved)
        k = _rotate(k, cos, sin, attrs.rotary_interleaved)
    block_size = key_cache.shape[1]
    num_seqs = query_start_loc.shape[0] - 1
    lens = query_start_loc[1:] - query_start_loc[:-1]
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=qkv.device), lens, output_size=t)
    slots = block_tables[seq, positions // block_size] * block_size + positions % block_size
    flat_k, flat_v = key_cache.view(-1, hkv, d), value_cache.view(-1, hkv, d)
    quantized = attrs.kv_cache_dtype != KV_FLOAT
    if quantized:
        assert k_scale is not None and v_scale is not None
        flat_k[slots] = quantize_kv(k, k_scale, attrs.kv_cache_dtype)
        flat_v[slots] = quantize_kv(v, v_scale, attrs.kv_cache_dtype)
    else:
        flat_k[slots] = k.to(key_cache.dtype)
        flat_v[slots] = v.to(value_cache.dtype)
    group = hq // hkv

    def context(rows: Tensor, ctx_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values ``[..., Hkv, L, D]`` (float32) at ``ctx_pos [..., L]`` of the sequences whose tables are
        ``rows [..., M]``."""
        ctx_slots = rows.gather(-1, ctx_pos // block_size) * block_size + ctx_pos % block_size
        keys, vals = flat_k[ctx_slots].float(), flat_v[ctx_slots].float()
        if quantized:
            keys, vals = keys * k_scale.float(), vals * v_scale.float()  # type: ignore[union-attr]
        return keys.transpose(-3, -2), vals.transpose(-3, -2)

    window = attrs.sliding_window

    def window_start(pos: Tensor) -> Tensor:
        """The first position a token at ``pos`` sees."""
        return pos * 0 if window is None else (pos - window + 1).clamp(min=0)

    if t == num_seqs:  # decode: [B, Hkv, G, D] queries over [B, Hkv, L, D] contexts
        length = int(positions.max()) + 1 if window is None else min(window, int(positions.max()) + 1)
        ctx_pos = window_start(positions)[:, None] + torch.arange(length, device=qkv.device)  # [B, L]
        mask = (ctx_pos <= positions[:, None])[:, None, None, :]
        keys, vals = context(block_tables, torch.minimum(ctx_pos, positions[:, None]))  # past the end: masked
        out = _attend(q.view(t, hkv, group, d), keys, vals, mask, attrs)
        return out.reshape(t, hq * d).to(qkv.dtype)
    out = torch.empty((t, hq * d), dtype=torch.float32, device=qkv.device)
    bounds = query_start_loc.tolist()
    for b in range(num_seqs):
        lo, hi = bounds[b], bounds[b + 1]
        if hi == lo:
            continue
        pos = positions[lo:hi]
        ctx_pos = torch.arange(int(window_start(pos[:1])), int(pos[-1]) + 1, device=qkv.device)
        keys, vals = context(block_tables[b], ctx_pos)  # [Hkv, L, D]
        n = hi - lo
        queries = q[lo:hi].view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)
        visible = (ctx_pos[None, :] <= pos[:, None]) & (ctx_pos[None, :] >= window_start(pos)[:, None])
        mask = visible.repeat(group, 1)  # row g * n + i: query i of head g
        o = _attend(queries, keys, vals, mask, attrs)  # [Hkv, G * n, D]
        out[lo:hi] = o.view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq * d)
    return out.to(qkv.dtype)


# The op is defined from its schema with the low-level ``torch.library`` API, not ``torch.library.custom_op``: that
# adds a Python ADInplaceOrView kernel to every op that mutates an input (a version-counter bump whose argument
# handling costs ~75 us a call in torch 2.13, measured: 30 layers x 75 us of a 26 ms CPU decode step, and of
# every prefill on a GPU), and an engine runs under inference mode, where those counters serve nothing. The schema
# is the one ``custom_op`` inferred before, so packages built then still find the op.
SCHEMA = (
    "paged_attention(Tensor qkv, Tensor(a1!) key_cache, Tensor(a2!) value_cache, Tensor positions, "
    "Tensor block_tables, Tensor query_start_loc, Tensor? cos_sin_cache, Tensor? k_scale, Tensor? v_scale, "
    "SymInt num_heads, SymInt num_kv_heads, SymInt head_size, float scale, bool rotary_interleaved, "
    "SymInt kv_cache_dtype, SymInt? sliding_window=None, float? softcap=None) -> Tensor"
)
_LIB = torch.library.Library("trtbuild", "FRAGMENT")
_LIB.define(SCHEMA)


def paged_attention_any(
    qkv: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    positions: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    cos_sin_cache: Tensor | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    rotary_interleaved: bool,
    kv_cache_dtype: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """``trtbuild::PagedAttention`` (plugins/paged_attention/README.md): writes the caches, returns ``[T, Hq*D]``.

    This body is the implementation for every device but the CPU and CUDA (:func:`paged_attention_cpu`,
    :func:`paged_attention_cuda`)."""
    attrs = PagedAttentionAttrs(
        num_heads, num_kv_heads, head_size, scale, rotary_interleaved, kv_cache_dtype, sliding_window, softcap
    )
    return paged_attention_torch(
        qkv, key_cache, value_cache, positions, block_tables, query_start_loc, cos_sin_cache, attrs, k_scale, v_scale
    )


def paged_attention_cpu(
    qkv, key_cache, value_cache, positions, block_tables, query_start_loc, cos_sin_cache, k_scale, v_scale,
    num_heads, num_kv_heads, head_size, scale, rotary_interleaved, kv_cache_dtype, sliding_window=None, softcap=None,
):  # fmt: skip
    """The CPU implementation: the native kernel the onnxruntime engine runs (``native_ops.py``), else (no
    compiler, bf16 activations, a shape beyond the kernel's limits) the torch code."""
    from .native_ops import paged_attention_native

    attrs = PagedAttentionAttrs(
        num_heads, num_kv_heads, head_size, scale, rotary_interleaved, kv_cache_dtype, sliding_window, softcap
    )
    args = (qkv, key_cache, value_cache, positions, block_tables, query_start_loc, cos_sin_cache, attrs, k_scale,
            v_scale)  # fmt: skip
    out = paged_attention_native(*args)
    return paged_attention_torch(*args) if out is None else out.to(qkv.dtype)


def paged_attention_cuda(
    qkv, key_cache, value_cache, positions, block_tables, query_start_loc, cos_sin_cache, k_scale, v_scale,
    num_heads, num_kv_heads, head_size, scale, rotary_interleaved, kv_cache_dtype, sliding_window=None, softcap=None,
):  # fmt: skip
    """The CUDA implementation: the Triton kernel, float and quantized (int8 / fp8, with their scales) caches alike:
    no host synchronisation, so a decode step with it can be captured in a CUDA graph. Runs on CPU tensors too under
    ``TRITON_INTERPRET=1`` (how the tests check it)."""
    attrs = PagedAttentionAttrs(
        num_heads, num_kv_heads, head_size, scale, rotary_interleaved, kv_cache_dtype, sliding_window, softcap
    )
    from ...plugins.paged_attention.triton_kernel import paged_attention_triton

    return paged_attention_triton(
        qkv, key_cache, value_cache, positions, block_tables, query_start_loc, cos_sin_cache, attrs,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def _paged_attention_fake(
    qkv, key_cache, value_cache, positions, block_tables, query_start_loc, cos_sin_cache, k_scale, v_scale,
    num_heads, num_kv_heads, head_size, scale, rotary_interleaved, kv_cache_dtype, sliding_window=None, softcap=None,
):  # fmt: skip
    return qkv.new_empty((qkv.shape[0], num_heads * head_size))


_LIB.impl("paged_attention", paged_attention_any, "CompositeExplicitAutograd")
_LIB.impl("paged_attention", paged_attention_cpu, "CPU")
_LIB.impl("paged_attention", paged_attention_cuda, "CUDA")
torch.library.register_fake("trtbuild::paged_attention", _paged_attention_fake, lib=_LIB)
paged_attention = torch.ops.trtbuild.paged_attention  # what the importer calls (positional, as the schema)
