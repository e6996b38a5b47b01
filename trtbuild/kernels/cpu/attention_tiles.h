// The paged attention's inner loops (paged_attention.cc's attend): register tiles of query rows against one KV
// block's keys, the online softmax's per-block update, the weighted values added into the rows' accumulators, and
// the spread-out prefetch of the next block. Included by paged_attention.cc only.

#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common.h"

namespace trtbuild::cpu {
namespace {

// The sum of x's lanes, pairwise in a fixed order.
inline float hsum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

// The four sums of four vectors, stored to out[0..3].
inline void hsum4(v8 x0, v8 x1, v8 x2, v8 x3, float* out) {
#if defined(__AVX__)
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(__m256(x0), __m256(x1)), _mm256_hadd_ps(__m256(x2), __m256(x3)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  out[0] = hsum(x0), out[1] = hsum(x1), out[2] = hsum(x2), out[3] = hsum(x3);
#endif
}

// The accumulators of scores_x4 below: acc[r][j] sums to row r's score of key j.
template <int R>
inline void scores_acc_x4(const float* q, int64_t d, const float* k, int64_t stride, v8 (&acc)[R][4]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = v8{};
  for (int64_t c = 0; c < d; c += 8) {
    v8 qv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) qv[r] = load8(q + r * d + c);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const v8 kv = load8(k + j * stride + c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][j] += qv[r] * kv;
    }
  }
}

// Register tiles of one block and KV head (head size a multiple of 8). R query rows (row r at q + r * d) against
// 4 keys (key j at k + j * stride): each key vector is loaded once for the R rows, 4R independent FMA chains
// (R = 3: 12 accumulators, 3 query vectors and a key, AVX2's 16 registers). Scores to p + r * ps + 0..3.
template <int R>
inline void scores_x4(const float* q, int64_t d, const float* k, int64_t stride, float* p, int64_t ps) {
  v8 acc[R][4];
  scores_acc_x4<R>(q, d, k, stride, acc);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], p + r * ps);
}

// One key's scores for R rows (a block's last n % 4 keys).
template <int R>
inline void scores_x1(const float* q, int64_t d, const float* k, float* p, int64_t ps) {
  v8 acc[R] = {};
  for (int64_t c = 0; c < d; c += 8) {
    const v8 kv = load8(k + c);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] += load8(q + r * d + c) * kv;
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) p[r * ps] = hsum(acc[r]);
}

// R rows' accumulators a (row r's dims [0, 8C) of acc) += sum_o p[r * ps + o] * v_o over n values (value o at
// v + o * stride). Each value vector is loaded once for the R rows.
template <int R, int C>
inline void values_acc(const float* p, int64_t ps, const float* v, int64_t stride, int64_t n, v8 (&a)[R][C]) {
  for (int64_t o = 0; o < n; ++o) {
    v8 pr[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) pr[r] = v8{} + p[r * ps + o];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const v8 vv = load8(v + o * stride + 8 * c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a[r][c] += pr[r] * vv;
    }
  }
}

// R rows' accumulators (row r at acc + r * d), dims [0, 8C): acc = acc * alpha[r] + sum_o p[r * ps + o] * v_o over
// the step's n values. One block (Span false): value o at blocks[0] + o * stride. A span (Span true): blocks of bs
// values, value o at blocks[o / bs] + (o % bs) * stride, the accumulators kept in registers over all of them.
template <int R, int C, bool Span>
inline void values_xc(const float* p, int64_t ps, const float* const* blocks, int64_t bs, int64_t stride, int64_t n,
                      float* acc, int64_t d, const float* alpha) {
  v8 a[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) a[r][c] = load8(acc + r * d + 8 * c) * alpha[r];
  if constexpr (Span) {
    for (int64_t o = 0; o < n; o += bs) values_acc<R, C>(p + o, ps, blocks[o / bs], stride, std::min(bs, n - o), a);
  } else {
    values_acc<R, C>(p, ps, blocks[0], stride, n, a);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) store8(acc + r * d + 8 * c, a[r][c]);
}

// The next KV block's lines for one work item (its heads' part of each of the block's rows, keys and values), in
// address order, prefetched a few at a time from inside the compute loops. Issued in one burst per block (or per
// head) they filled the core's miss buffers and stalled the compute, so memory and compute time added up; spread
// over the block's work they overlap (see the comment at its use). Into L2 (prefetcht2), not L1: the L1's few
// miss buffers capped the lines in flight.
struct BlockPrefetch {
  const char* keys = nullptr;  // the block's first byte of this item's heads (nullptr: nothing to fetch)
  const char* values = nullptr;
  int64_t stride = 0, rows = 0, lines_per_row = 0;  // bytes between rows; rows; 64-byte lines of a row
  int64_t row = 0, line = 0, per_step = 0;  // the next line to fetch; lines fetched by each step()
  void issue(int64_t count) {
    for (; count > 0 && row < rows; --count) {
      __builtin_prefetch(keys + row * stride + line * 64, 0, 1);
      __builtin_prefetch(values + row * stride + line * 64, 0, 1);
      if (++line == lines_per_row) line = 0, ++row;
    }
  }
  void step() { issue(per_step); }
  void finish() { issue(rows * lines_per_row); }
};

// The rows [lo, hi) of one head against the block's n keys / values, in tiles of 3 rows (a GQA group of 3 decoding,
// or a prefill tile's rows 3 at a time); one prefetch step per tile.
template <int R>
void scores_rows(const float* q, int64_t d, const float* keys, int64_t stride, int64_t n, float* p, int64_t ps,
                 BlockPrefetch& pf) {
  int64_t o = 0;
  for (; o + 4 <= n; o += 4) {
    pf.step();
    scores_x4<R>(q, d, keys + o * stride, stride, p + o, ps);
  }
  for (; o < n; ++o) scores_x1<R>(q, d, keys + o * stride, p + o, ps);
}

// The values of the step's n keys (see values_xc) for R rows, dims 32, then 16, then 8 at a time; blocks[b] + c is
// block b's dim c.
template <int R, bool Span>
void values_rows(const float* p, int64_t ps, const float* const* blocks, int64_t bs, int64_t stride, int64_t n,
                 float* acc, int64_t d, const float* alpha, BlockPrefetch& pf) {
  const float* at[kMaxSpanBlocks];
  const int64_t nb = Span ? (n + bs - 1) / bs : 1;
  const auto shifted = [&](int64_t c) {  // the blocks' pointers at dim c
    for (int64_t b = 0; b < nb; ++b) at[b] = blocks[b] + c;
    return at;
  };
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) {
    pf.step();
    values_xc<R, 4, Span>(p, ps, shifted(c), bs, stride, n, acc + c, d, alpha);
  }
  if (c + 16 <= d) {
    pf.step();
    values_xc<R, 2, Span>(p, ps, shifted(c), bs, stride, n, acc + c, d, alpha);
    c += 16;
  }
  if (c + 8 <= d) {
    pf.step();
    values_xc<R, 1, Span>(p, ps, shifted(c), bs, stride, n, acc + c, d, alpha);
  }
}

// values_rows for a tile of nr (1 to 3) rows.
template <bool Span>
void values_tile(int64_t nr, const float* p, int64_t ps, const float* const* blocks, int64_t bs, int64_t stride,
                 int64_t n, float* acc, int64_t d, const float* alpha, BlockPrefetch& pf) {
  if (nr == 3) values_rows<3, Span>(p, ps, blocks, bs, stride, n, acc, d, alpha, pf);
  else if (nr == 2) values_rows<2, Span>(p, ps, blocks, bs, stride, n, acc, d, alpha, pf);
  else values_rows<1, Span>(p, ps, blocks, bs, stride, n, acc, d, alpha, pf);
}

// The prefetch steps scores_rows and values_rows take for `rows` rows of one head and a block of n keys.
int64_t tile_steps(int64_t rows, int64_t n, int64_t d) {
  const int64_t passes = d / 32 + (d % 32) / 16 + (d % 16) / 8;
  return (rows + 2) / 3 * (n / 4 + passes);
}

// Head sizes that are not a multiple of 8 (GPT-2 tiny's 12): plain loops, same sums.
void scores_scalar(const float* q, int64_t d, const float* keys, int64_t stride, int64_t n, int64_t rows, float* p,
                   int64_t ps) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < n; ++o) {
      float t = 0.0f;
      for (int64_t c = 0; c < d; ++c) t += q[r * d + c] * keys[o * stride + c];
      p[r * ps + o] = t;
    }
}

void values_scalar(const float* p, int64_t ps, const float* v, int64_t stride, int64_t n, int64_t rows, float* acc,
                   int64_t d, const float* alpha) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) {
      float t = acc[r * d + c] * alpha[r];
      for (int64_t o = 0; o < n; ++o) t += p[r * ps + o] * v[o * stride + c];
      acc[r * d + c] = t;
    }
}

// tanh on eight lanes, within a few ulp: Cephes' tanhf (an odd polynomial for |x| < 0.625, else
// (1 - e) / (1 + e) with e = exp(-2|x|), which has no cancellation there); +-1 for infinite x.
inline v8 tanh8(v8 x) {
  const v8 a = x < 0.0f ? -x : x;
  const v8 s = a * a;
  v8 y = -5.70498872745e-3f * s + 2.06390887954e-2f;
  y = y * s - 5.37397155531e-2f;
  y = y * s + 1.33314422036e-1f;
  y = y * s - 3.33332819422e-1f;
  const v8 small = y * s * a + a;
  const v8 e = exp8_nonpositive(-2.0f * a);
  const v8 large = (1.0f - e) / (1.0f + e);
  const v8 r = a < 0.625f ? small : large;
  return x < 0.0f ? -r : r;
}

// Attention-logit soft-capping (attribute softcap c > 0): c * tanh(x / c) on eight scores.
inline v8 softcap8(v8 x, float c) { return c * tanh8(x * (1.0f / c)); }

// One row's scores of a block (ps of them, a multiple of 8; the row sees keys [first, visible)) -> probabilities in
// place, soft-capped first when softcap > 0, the row's running max m and sum l updated; returns the factor the row's
// accumulator is rescaled by. The row sees at least one key of the block unless m is finite already.
inline float softmax_block(float* pr, int64_t first, int64_t visible, int64_t ps, float softcap, float& m, float& l) {
  const float ninf = -std::numeric_limits<float>::infinity();
  if (softcap > 0.0f)
    for (int64_t o = 0; o < ps; o += 8) store8(pr + o, softcap8(load8(pr + o), softcap));
  for (int64_t o = 0; o < first; ++o) pr[o] = ninf;
  for (int64_t o = visible; o < ps; ++o) pr[o] = ninf;
  v8 mx = load8(pr);
  for (int64_t o = 8; o < ps; o += 8) {
    const v8 x = load8(pr + o);
    mx = x > mx ? x : mx;
  }
  float block_max = mx[0];
  for (int i = 1; i < 8; ++i) block_max = std::max(block_max, mx[i]);
  const float m_new = std::max(m, block_max);
  const float alpha = exp_nonpositive(m - m_new);
  v8 sum = {};
  for (int64_t o = 0; o < ps; o += 8) {
    const v8 x = load8(pr + o);
    const v8 e = x == ninf ? v8{} : exp8_nonpositive(x - m_new);
    store8(pr + o, e);
    sum += e;
  }
  l = l * alpha + hsum(sum);
  m = m_new;
  return alpha;
}

#if defined(__AVX__)
// A whole block of 16 keys (n = ps = 16) for R rows of one head: the scores (scores_x4's tiles, one prefetch step
// each) stay in registers, two vectors of 8 a row, and go through softmax_block's steps there, the probabilities
// stored to p + r * ps for the value tiles. The same operations in the same order as scores_x4 -> softmax_block,
// without the scores' trip through memory (their 16-byte stores read back as 32-byte loads: a store-forwarding
// stall each); outputs agree with that path to 1-2 ulp, as GCC contracts and reassociates the two forms apart.
// Row r sees keys [first[r], visible[r]) of the block (a prefill row may see part of it; a sliding window may hide
// its start); softcap > 0 soft-caps the scores first.
template <int R>
inline void block_scores_softmax(const float* q, int64_t d, const float* keys, int64_t stride, float* p, int64_t ps,
                                 BlockPrefetch& pf, const int64_t* first, const int64_t* visible, float softcap,
                                 float* m, float* l, float* alpha) {
  __m128 t[4][R];
#pragma GCC unroll 4
  for (int tile = 0; tile < 4; ++tile) {
    pf.step();
    v8 acc[R][4];
    scores_acc_x4<R>(q, d, keys + 4 * tile * stride, stride, acc);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(__m256(acc[r][0]), __m256(acc[r][1])),
                                      _mm256_hadd_ps(__m256(acc[r][2]), __m256(acc[r][3])));
      t[tile][r] = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    }
  }
  const float ninf = -std::numeric_limits<float>::infinity();
  const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    v8 x0 = v8(_mm256_set_m128(t[1][r], t[0][r])), x1 = v8(_mm256_set_m128(t[3][r], t[2][r]));
    const int32_t lo = int32_t(first[r]), vis = int32_t(visible[r]);
    if (softcap > 0.0f) x0 = softcap8(x0, softcap), x1 = softcap8(x1, softcap);
    x0 = (lane >= lo) & (lane < vis) ? x0 : v8{} + ninf;
    x1 = (lane + 8 >= lo) & (lane + 8 < vis) ? x1 : v8{} + ninf;
    const v8 mx = x1 > x0 ? x1 : x0;
    float block_max = mx[0];
    for (int i = 1; i < 8; ++i) block_max = std::max(block_max, mx[i]);
    const float m_new = std::max(m[r], block_max);
    alpha[r] = exp_nonpositive(m[r] - m_new);
    const v8 e0 = x0 == ninf ? v8{} : exp8_nonpositive(x0 - m_new);
    const v8 e1 = x1 == ninf ? v8{} : exp8_nonpositive(x1 - m_new);
    store8(p + r * ps, e0);
    store8(p + r * ps + 8, e1);
    v8 sum = {};
    sum += e0;
    sum += e1;
    l[r] = l[r] * alpha[r] + hsum(sum);
    m[r] = m_new;
  }
}
#endif

}  // namespace
}  // namespace trtbuild::cpu
