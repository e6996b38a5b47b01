"""The ``@triton.jit`` kernels of ``trtbuild::PagedAttention`` (imported only by ``triton_kernel``, on first use).

Kept apart so that importing ``triton_kernel`` never imports Triton: ``TRITON_INTERPRET=1`` only takes effect if it
is set before Triton is first imported. Kernel documentation: ``triton_kernel``'s module docstring.
"""

import triton
import triton.language as tl


@triton.jit
def _seq_of(qsl_ptr, t, num_seqs, BLOCK_B: tl.constexpr):
    """Index of the sequence that owns token ``t``: the number of sequence ends ``<= t``."""
    b = 0
    for start in range(0, num_seqs, BLOCK_B):
        offs = start + tl.arange(0, BLOCK_B)
        live = offs < num_seqs
        ends = tl.load(qsl_ptr + 1 + offs, mask=live, other=0)
        b += tl.sum((live & (ends <= t)).to(tl.int32), axis=0)
    return b


@triton.jit
def _load_rotated(base, pos, d, mask, cos_sin, rot, HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Load ``base + d`` as fp32, rotating its first ``rot`` dims by the angle of ``pos`` (broadcasts)."""
    x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    if HAS_ROPE:
        half = rot // 2
        if INTERLEAVED:
            partner = d + 1 - 2 * (d % 2)
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
            fidx = d // 2
        else:
            partner = tl.where(d < half, d + half, d - half)
            sign = tl.where(d < half, -1.0, 1.0)
            fidx = tl.where(d < half, d, d - half)
        in_rot = d < rot
        rmask = mask & in_rot
        xp = tl.load(base + partner, mask=rmask, other=0.0).to(tl.float32)
        row = cos_sin + pos * rot
        cos = tl.load(row + fidx, mask=rmask, other=1.0).to(tl.float32)
        sin = tl.load(row + half + fidx, mask=rmask, other=0.0).to(tl.float32)
        x = tl.where(in_rot, x * cos + sign * xp * sin, x)
    return x


@triton.jit
def _write_kv_kernel(
    qkv, positions, block_tables, qsl, cos_sin,
    num_seqs, max_blocks, block_size, rot_dim,
    k_out, v_out,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
    b = _seq_of(qsl, t, num_seqs, BLOCK_B).to(tl.int64)
    p = tl.load(positions + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_SIZE
    k_base = qkv + t.to(tl.int64) * width + (NUM_HEADS + kvh) * HEAD_SIZE
    k = _load_rotated(k_base, p, d, dmask, cos_sin, rot_dim, HAS_ROPE, INTERLEAVED)
    v = tl.load(k_base + NUM_KV_HEADS * HEAD_SIZE + d, mask=dmask, other=0.0)
    blk = tl.load(block_tables + b * max_blocks + p // block_size).to(tl.int64)
    dst = ((blk * block_size + p % block_size) * NUM_KV_HEADS + kvh) * HEAD_SIZE + d
    tl.store(k_out + dst, k.to(k_out.dtype.element_ty), mask=dmask)
    tl.store(v_out + dst, v.to(v_out.dtype.element_ty), mask=dmask)


@triton.jit
def _paged_attention_kernel(
    qkv, k_in, v_in, positions, block_tables, qsl, cos_sin,
    num_seqs, max_blocks, block_size, rot_dim,
    out, k_out, v_out,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, SCALE: tl.constexpr,
    HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, FUSED: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    group = NUM_HEADS // NUM_KV_HEADS
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
    b = _seq_of(qsl, t, num_seqs, BLOCK_B).to(tl.int64)
    p = tl.load(positions + t).to(tl.int64)
    t64 = t.to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_SIZE
    qmask = (g < group)[:, None] & dmask[None, :]
    heads = kvh * group + g
    q_base = qkv + t64 * width + heads[:, None] * HEAD_SIZE
    q = _load_rotated(q_base, p, d[None, :], qmask, cos_sin, rot_dim, HAS_ROPE, INTERLEAVED)
    bt_row = block_tables + b * max_blocks
    kv_col = (NUM_HEADS + kvh) * HEAD_SIZE  # column of this kv head's key in a qkv row
    first_row = tl.load(qsl + b).to(tl.int64)
    p0 = tl.load(positions + first_row).to(tl.int64)  # first position written in this step
    if FUSED:
        k_new = _load_rotated(qkv + t64 * width + kv_col, p, d, dmask, cos_sin, rot_dim, HAS_ROPE, INTERLEAVED)
        v_new = tl.load(qkv + t64 * width + kv_col + NUM_KV_HEADS * HEAD_SIZE + d, mask=dmask, other=0.0)
        own_blk = tl.load(bt_row + p // block_size).to(tl.int64)
        dst = ((own_blk * block_size + p % block_size) * NUM_KV_HEADS + kvh) * HEAD_SIZE + d
        tl.store(k_out + dst, k_new.to(k_out.dtype.element_ty), mask=dmask)
        tl.store(v_out + dst, v_new.to(v_out.dtype.element_ty), mask=dmask)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, p + 1, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N).to(tl.int64)
        valid = j <= p
        blk = tl.load(bt_row + j // block_size, mask=valid, other=0).to(tl.int64)
        kv_off = ((blk * block_size + j % block_size) * NUM_KV_HEADS + kvh)[:, None] * HEAD_SIZE + d[None, :]
        kvmask = valid[:, None] & dmask[None, :]
        if FUSED:
            cached = (j < p0)[:, None]
            cmask = kvmask & cached
            nmask = kvmask & (~cached)
            new_base = qkv + (first_row + j - p0)[:, None] * width + kv_col
            k = tl.load(k_in + kv_off, mask=cmask, other=0.0).to(tl.float32)
            k += _load_rotated(new_base, j[:, None], d[None, :], nmask, cos_sin, rot_dim, HAS_ROPE, INTERLEAVED)
            v = tl.load(v_in + kv_off, mask=cmask, other=0.0).to(tl.float32)
            v += tl.load(new_base + NUM_KV_HEADS * HEAD_SIZE + d[None, :], mask=nmask, other=0.0).to(tl.float32)
        else:
            k = tl.load(k_in + kv_off, mask=kvmask, other=0.0).to(tl.float32)
            v = tl.load(v_in + kv_off, mask=kvmask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * SCALE  # [G, N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        prob = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        acc = acc * alpha[:, None] + tl.sum(prob[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    o = acc / l_i[:, None]
    o_ptr = out + t64 * (NUM_HEADS * HEAD_SIZE) + heads[:, None] * HEAD_SIZE + d[None, :]
    tl.store(o_ptr, o.to(out.dtype.element_ty), mask=qmask)
