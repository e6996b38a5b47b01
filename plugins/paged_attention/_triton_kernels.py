"""The ``@triton.jit`` kernels of ``trtbuild::PagedAttention`` (imported only by ``triton_kernel``, on first use).

Kept apart so that importing ``triton_kernel`` never imports Triton: ``TRITON_INTERPRET=1`` only takes effect if it
is set before Triton is first imported. Kernel documentation: ``triton_kernel``'s module docstring.

Every index derived from the metadata (sequence, token, position, block id, rotary row) is clamped into the range
of the tensor it addresses, so garbage metadata (TensorRT times plugins on made-up inputs) gives garbage numbers but
never an out-of-bounds access.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 half to even in fp32
# Shape scalars that vary from step to step: not specialised (Triton would compile a variant for 1 and for
# multiples of 16). block_size stays specialised: it is fixed per engine.
_DYNAMIC = ["num_tokens", "num_seqs", "max_blocks", "num_blocks", "rot_dim", "rope_rows"]


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _tile_of(qsl, num_tokens, num_seqs, BLOCK_Q: tl.constexpr):
    """This program's query tile: ``(b, q_start, q_end, tok0)``, tokens ``tok0 .. tok0 + BLOCK_Q`` of sequence b.

    Sequence b owns tiles ``q_start // BLOCK_Q + b ...`` (at most ``T // BLOCK_Q + B`` tiles in all, so a tile
    never crosses a sequence boundary); b is found by binary search over ``query_start_loc``. Programs take the
    tiles in reverse order, so the longest causal tiles (last in their sequence) start first and the surplus
    programs (tile ids past the last sequence's) exit at once.
    """
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    lo = num_seqs * 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = _clamp(tl.load(qsl + mid), 0, num_tokens).to(tl.int32)
        ok = start // BLOCK_Q + mid <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    b = _clamp(lo, 0, num_seqs - 1)
    q_start = _clamp(tl.load(qsl + b), 0, num_tokens).to(tl.int32)
    q_end = _clamp(tl.load(qsl + b + 1), q_start, num_tokens).to(tl.int32)
    tok0 = q_start + (tile - q_start // BLOCK_Q - b) * BLOCK_Q
    return b, q_start, q_end, tok0


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
        row = cos_sin + pos.to(tl.int64) * rot
        cos = tl.load(row + fidx, mask=rmask, other=1.0).to(tl.float32)
        sin = tl.load(row + half + fidx, mask=rmask, other=0.0).to(tl.float32)
        x = tl.where(in_rot, x * cos + sign * xp * sin, x)
    return x


@triton.jit
def _to_cache(x, scale_ptr, KV_QUANT: tl.constexpr, CACHE_TY: tl.constexpr):
    """fp32 ``x`` as the cache stores it: cast (float cache), or ``QuantizeLinear(x, scale)`` (int8: round half to
    even, saturate to [-128, 127]; fp8 E4M3FN: round to nearest even, saturate to +-448)."""
    if KV_QUANT == 1:
        y = _clamp(tl.math.div_rn(x, tl.load(scale_ptr).to(tl.float32)), -128.0, 127.0)
        return ((y + ROUND_MAGIC) - ROUND_MAGIC).to(tl.int8)
    elif KV_QUANT == 2:
        y = _clamp(tl.math.div_rn(x, tl.load(scale_ptr).to(tl.float32)), -448.0, 448.0)
        # Round to the E4M3 grid in fp32 (spacing 2**(e - 3) in binade e, 2**-9 among subnormals), so the final
        # cast is exact: the same bits on every GPU and in the interpreter (whose own fp8 rounding is off).
        binade = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)
        step = ((binade - 3) << 23).to(tl.float32, bitcast=True)
        return (((y / step + ROUND_MAGIC) - ROUND_MAGIC) * step).to(tl.float8e4nv)
    else:
        return x.to(CACHE_TY)


@triton.jit
def _new_rows(
    positions, tok0, q_end, max_pos, rope_rows,
    HEAD_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_QP: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Tokens ``tok0 .. tok0 + BLOCK_Q`` (< q_end) as ``BLOCK_QP`` rows: ``(tok, pos, rope_pos, mask, d)``: the token
    rows (dead ones at ``tok0``), their clamped positions and rotary rows, the ``[BLOCK_QP, BLOCK_D]`` mask of live
    rows and head dims, and the head dims."""
    i = tl.arange(0, BLOCK_QP)
    d = tl.arange(0, BLOCK_D)
    tok = tok0 + i
    live = (i < BLOCK_Q) & (tok < q_end)
    tok = tl.where(live, tok, tok0)
    pos = _clamp(tl.load(positions + tok), 0, max_pos).to(tl.int32)
    mask = live[:, None] & (d < HEAD_SIZE)[None, :]
    return tok, pos, _clamp(pos, 0, rope_rows - 1)[:, None], mask, d


@triton.jit
def _store_new_kv(
    qkv, bt_row, cos_sin, k_scale, v_scale, k_out, v_out, kvh, tok, pos, rope_pos, mask, d,
    num_blocks, block_size, rot_dim,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HAS_ROPE: tl.constexpr,
    INTERLEAVED: tl.constexpr, KV_QUANT: tl.constexpr,
):  # fmt: skip
    """Rotate and write the keys/values of the rows ``_new_rows`` gives (kv head ``kvh``) into the cache."""
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
    k_base = qkv + tok.to(tl.int64)[:, None] * width + (NUM_HEADS + kvh) * HEAD_SIZE
    k = _load_rotated(k_base, rope_pos, d[None, :], mask, cos_sin, rot_dim, HAS_ROPE, INTERLEAVED)
    v = tl.load(k_base + NUM_KV_HEADS * HEAD_SIZE + d[None, :], mask=mask, other=0.0).to(tl.float32)
    blk = _clamp(tl.load(bt_row + pos // block_size), 0, num_blocks - 1).to(tl.int64)
    dst = ((blk * block_size + pos % block_size) * NUM_KV_HEADS + kvh)[:, None] * HEAD_SIZE + d[None, :]
    tl.store(k_out + dst, _to_cache(k, k_scale, KV_QUANT, k_out.dtype.element_ty), mask=mask)
    tl.store(v_out + dst, _to_cache(v, v_scale, KV_QUANT, v_out.dtype.element_ty), mask=mask)


@triton.jit
def _store_rotated_q(
    qkv, cos_sin, q_out, kvh, tok, rope_pos, mask, d, rot_dim,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """Rotate the queries of the rows ``_new_rows`` gives for the query heads of kv head ``kvh`` and store them, in
    qkv's dtype, as rows ``[T, NUM_HEADS * HEAD_SIZE]`` of ``q_out``."""
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    tok = tok.to(tl.int64)
    for g in tl.static_range(GROUP):
        head = kvh * GROUP + g
        q = _load_rotated(qkv + tok[:, None] * width + head * HEAD_SIZE, rope_pos, d[None, :], mask, cos_sin,
                          rot_dim, True, INTERLEAVED)  # fmt: skip
        dst = q_out + tok[:, None] * (NUM_HEADS * HEAD_SIZE) + head * HEAD_SIZE + d[None, :]
        tl.store(dst, q.to(q_out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_DYNAMIC)
def _write_kv_kernel(
    qkv, positions, block_tables, qsl, cos_sin, k_scale, v_scale,
    num_tokens, num_seqs, max_blocks, num_blocks, block_size, rot_dim, rope_rows,
    k_out, v_out, q_out,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HAS_ROPE: tl.constexpr,
    INTERLEAVED: tl.constexpr, KV_QUANT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_Q: tl.constexpr, WRITE_ROWS: tl.constexpr,
):  # fmt: skip
    """Grid ``(tiles, Hkv)``: writes one query tile's new keys/values into the cache and, with ``WRITE_Q``, its
    rotated queries of that kv head's query heads into ``q_out`` (the attention kernel then rotates nothing),
    ``WRITE_ROWS`` tokens at a time (a power of two: the tile's ``[WRITE_ROWS, BLOCK_D]`` pieces stay in
    registers, where the whole query tile spilled at head size 256)."""
    b, q_start, q_end, tok0 = _tile_of(qsl, num_tokens, num_seqs, BLOCK_Q)
    if (tok0 >= q_start) & (tok0 < q_end):
        bt_row = block_tables + b.to(tl.int64) * max_blocks
        max_pos = max_blocks * block_size - 1
        tile_end = tl.minimum(q_end, tok0 + BLOCK_Q)  # this tile's tokens only
        for c in tl.static_range(0, BLOCK_Q, WRITE_ROWS):
            tok, pos, rope_pos, mask, d = _new_rows(
                positions, tok0 + c, tile_end, max_pos, rope_rows, HEAD_SIZE, WRITE_ROWS, WRITE_ROWS, BLOCK_D
            )
            _store_new_kv(
                qkv, bt_row, cos_sin, k_scale, v_scale, k_out, v_out, tl.program_id(1), tok, pos, rope_pos, mask, d,
                num_blocks, block_size, rot_dim, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, HAS_ROPE, INTERLEAVED, KV_QUANT,
            )  # fmt: skip
            if WRITE_Q:
                _store_rotated_q(
                    qkv, cos_sin, q_out, tl.program_id(1), tok, rope_pos, mask, d, rot_dim,
                    NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, INTERLEAVED,
                )  # fmt: skip


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp2 (any backend, the interpreter included): Cephes' odd polynomial for |x| < 0.625, else
    ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` (no cancellation there); +-1 for infinite x."""
    a = tl.abs(x)
    z = a * a
    small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
             - 3.33332819422e-1) * z * a + a  # fmt: skip
    e = tl.math.exp2(a * (-2.0 * LOG2E))  # tensor first: a constexpr times a tensor stays a constexpr (interpreter)
    t = tl.where(a < 0.625, small, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_tile(
    q, kT, v, j, valid, row_pos, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One online-softmax step (base 2) over the context positions ``j`` (``valid`` marks real ones): a row at
    ``row_pos`` sees ``j <= row_pos`` (and ``j > row_pos - SLIDING_WINDOW``); scores soft-capped before the mask."""
    s = tl.dot(q, kT.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
    if (
        SOFTCAP is not None
    ):  # s is score * log2(e): cap with softcap * log2(e), the same softcap * tanh(score / softcap)
        s = _tanh(s / (SOFTCAP * LOG2E)) * (SOFTCAP * LOG2E)
    visible = valid[None, :] & (j[None, :] <= row_pos[:, None])
    if SLIDING_WINDOW is not None:
        visible = visible & (j[None, :] > row_pos[:, None] - SLIDING_WINDOW)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet (padding rows)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=_DYNAMIC)
def _paged_attention_kernel(
    qkv, k_in, v_in, positions, block_tables, qsl, cos_sin, k_scale, v_scale,
    num_tokens, num_seqs, max_blocks, num_blocks, block_size, rot_dim, rope_rows,
    out, k_out, v_out, seg_m, seg_l, seg_acc,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, SCALE: tl.constexpr,
    HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, FUSED: tl.constexpr, KV_QUANT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_QP: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, Q_ROTATED: tl.constexpr,
):  # fmt: skip
    """Grid ``(tiles, Hkv, NUM_SEGMENTS)``: one query tile (``BLOCK_Q`` tokens x the ``Hq / Hkv`` query heads of kv
    head ``program_id(1)`` = ``BLOCK_M`` rows) against one segment of its sequence's context, on tensor cores.
    With ``SLIDING_WINDOW`` the context starts at the tile's first token's window start: the blocks before it are
    never read (the op's contract lets the runner free them). ``Q_ROTATED`` (two-kernel form only): ``qkv`` holds
    the step's queries already rotated, ``[T, NUM_HEADS * HEAD_SIZE]`` (``_write_kv_kernel``'s ``q_out``; pass
    ``HAS_ROPE=False``). Rotating them here costs registers in the context loop: ptxas gives the 128 x 64 prefill
    tile of head size 128 on sm_90 255 registers and spills with the rotation, 173 and none without."""
    tl.static_assert(not (FUSED and Q_ROTATED), "the fused form reads the step's keys and values from qkv")
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    WIDTH: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
    Q_WIDTH: tl.constexpr = NUM_HEADS * HEAD_SIZE if Q_ROTATED else WIDTH
    kvh = tl.program_id(1)
    seg = tl.program_id(2)
    b, q_start, q_end, tok0 = _tile_of(qsl, num_tokens, num_seqs, BLOCK_Q)
    if (tok0 < q_start) | (tok0 >= q_end):
        return
    max_pos = max_blocks * block_size - 1  # a position must have a block-table entry
    bt_row = block_tables + b.to(tl.int64) * max_blocks
    if FUSED and seg == 0:
        new_tok, new_pos, new_rope, new_mask, new_d = _new_rows(  # the rows of the tile's new K/V
            positions, tok0, q_end, max_pos, rope_rows, HEAD_SIZE, BLOCK_Q, BLOCK_QP, BLOCK_D
        )
        _store_new_kv(
            qkv, bt_row, cos_sin, k_scale, v_scale, k_out, v_out, kvh, new_tok, new_pos, new_rope, new_mask, new_d,
            num_blocks, block_size, rot_dim, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, HAS_ROPE, INTERLEAVED, KV_QUANT,
        )  # fmt: skip

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_SIZE
    tok = tok0 + r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = (r // GROUP < BLOCK_Q) & (tok < q_end)
    tok = tl.where(row_ok, tok, tok0)
    row_pos = _clamp(tl.load(positions + tok), 0, max_pos).to(tl.int32)
    qmask = row_ok[:, None] & dmask[None, :]
    q_base = qkv + tok.to(tl.int64)[:, None] * Q_WIDTH + head[:, None] * HEAD_SIZE
    rope_pos = _clamp(row_pos, 0, rope_rows - 1)[:, None]
    q = _load_rotated(q_base, rope_pos, d[None, :], qmask, cos_sin, rot_dim, HAS_ROPE, INTERLEAVED)
    q = q.to(qkv.dtype.element_ty)
    qk_scale = SCALE * LOG2E
    if KV_QUANT != 0:
        qk_scale = qk_scale * tl.load(k_scale).to(tl.float32)

    ctx_end = tl.max(tl.where(row_ok, row_pos, -1), axis=0) + 1  # the tile's last visible position + 1
    ctx_start = ctx_end * 0  # the tile's first visible position
    if SLIDING_WINDOW is not None:
        first_pos = tl.min(tl.where(row_ok, row_pos, max_pos), axis=0)
        ctx_start = tl.minimum(tl.maximum(first_pos - SLIDING_WINDOW + 1, 0), ctx_end)
    lo = ctx_start
    hi = ctx_end
    if NUM_SEGMENTS > 1:
        seg_len = tl.cdiv(tl.cdiv(ctx_end - ctx_start, NUM_SEGMENTS), BLOCK_N) * BLOCK_N
        lo = tl.minimum(ctx_start + seg * seg_len, ctx_end)
        hi = tl.minimum(lo + seg_len, ctx_end)
    cache_hi = hi
    if FUSED:  # positions from the sequence's first new one on come from qkv (this launch writes them)
        p0 = _clamp(tl.load(positions + q_start), 0, max_pos).to(tl.int32)
        cache_hi = tl.maximum(tl.minimum(hi, p0), lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    jr = tl.arange(0, BLOCK_N)
    for start in range(lo, cache_hi, BLOCK_N):
        j = start + jr
        valid = j < cache_hi
        blk = _clamp(tl.load(bt_row + j // block_size, mask=valid, other=0), 0, num_blocks - 1).to(tl.int64)
        off = ((blk * block_size + j % block_size) * NUM_KV_HEADS + kvh) * HEAD_SIZE
        kT = tl.load(k_in + off[None, :] + d[:, None], mask=valid[None, :] & dmask[:, None], other=0.0)
        v = tl.load(v_in + off[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        m_i, l_i, acc = _attend_tile(
            q, kT, v, j, valid, row_pos, m_i, l_i, acc, qk_scale, DOT_PRECISION, SLIDING_WINDOW, SOFTCAP
        )
    if FUSED:
        for start in range(cache_hi, hi, BLOCK_N):
            j = start + jr
            valid = j < hi
            src = _clamp(q_start + j - p0, q_start, q_end - 1)  # the qkv row that holds position j
            k_col = src.to(tl.int64) * WIDTH + (NUM_HEADS + kvh) * HEAD_SIZE  # this kv head's key in row src
            jrope = _clamp(j, 0, rope_rows - 1)[None, :]
            kmask = valid[None, :] & dmask[:, None]
            kT = _load_rotated(qkv + k_col[None, :], jrope, d[:, None], kmask, cos_sin, rot_dim, HAS_ROPE, INTERLEAVED)
            kT = _to_cache(kT, k_scale, KV_QUANT, k_out.dtype.element_ty)
            v_ptr = qkv + (k_col + NUM_KV_HEADS * HEAD_SIZE)[:, None] + d[None, :]
            v = tl.load(v_ptr, mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            v = _to_cache(v, v_scale, KV_QUANT, v_out.dtype.element_ty)
            m_i, l_i, acc = _attend_tile(
                q, kT, v, j, valid, row_pos, m_i, l_i, acc, qk_scale, DOT_PRECISION, SLIDING_WINDOW, SOFTCAP
            )

    if KV_QUANT != 0:
        acc = acc * tl.load(v_scale).to(tl.float32)
    if NUM_SEGMENTS > 1:
        row = (tok.to(tl.int64) * NUM_HEADS + head) * NUM_SEGMENTS + seg
        tl.store(seg_m + row, m_i, mask=row_ok)
        tl.store(seg_l + row, l_i, mask=row_ok)
        tl.store(seg_acc + row[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptr = out + tok.to(tl.int64)[:, None] * (NUM_HEADS * HEAD_SIZE) + head[:, None] * HEAD_SIZE + d[None, :]
        tl.store(o_ptr, o.to(out.dtype.element_ty), mask=qmask)


@triton.jit
def _reduce_segments_kernel(
    seg_m, seg_l, seg_acc, out,
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid ``(T, Hq)``: merge the per-segment (max, sum, output) partials of one token and head."""
    row = tl.program_id(0).to(tl.int64) * NUM_HEADS + tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < NUM_SEGMENTS
    m = tl.load(seg_m + row * NUM_SEGMENTS + s, mask=smask, other=float("-inf"))
    m_max = tl.max(m, axis=0)
    w = tl.where(smask, tl.math.exp2(m - m_max), 0.0)
    total = tl.sum(w * tl.load(seg_l + row * NUM_SEGMENTS + s, mask=smask, other=0.0), axis=0)
    acc = tl.load(seg_acc + (row * NUM_SEGMENTS + s)[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)  # 0: only with garbage metadata
    tl.store(out + row * HEAD_SIZE + d, o.to(out.dtype.element_ty), mask=d < HEAD_SIZE)
