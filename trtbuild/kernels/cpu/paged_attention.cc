// trtbuild::PagedAttention as a native onnxruntime CPU op (domain "trtbuild.cpu", op "PagedAttention"; the glue that
// reads its tensors and registers it is ort_ops.cc).
//
// One node per layer replaces the ~20-node lowering of backends/onnxruntime/build/lowering.py: it rotates q and k,
// writes the step's keys/values into the paged cache *in place* (inputs 1 and 2, which the session binds once to its
// own numpy arrays) and attends every token over its sequence's blocks straight from the pool (flash-style online
// softmax, no gather, no concat, no padding). The contract is plugins/paged_attention/README.md; the oracle is
// reference.py; tests/test_cpu_kernel.py checks this file against it. Caches may be float32, int8 or FLOAT8E4M3FN
// (attribute kv_cache_dtype 1 / 3 / 17; fp8 stored as its uint8 bit patterns), quantized with the per-tensor
// scales of inputs 7 and 8 as the reference does (kv_rows.h).
//
// Inputs: 0 qkv [T, (Hq + 2 Hkv) D], 1 key_cache [NB, BS, Hkv, D], 2 value_cache (same), 3 positions [T],
// 4 block_tables [B, M], 5 query_start_loc [B + 1] (int64), 6 cos_sin_cache [P, R] (optional), 7 k_scale and
// 8 v_scale (float scalars, quantized caches only). Output: 0 attention output [T, Hq D].
// Attributes: num_heads, num_kv_heads, head_size, scale, rotary_interleaved, kv_cache_dtype (default 1), and the
// optional sliding_window (each token sees its last sliding_window positions: the blocks wholly before the window
// of a work item's first token are skipped, never read) and softcap (scores soft-capped before the softmax).

#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention_tiles.h"
#include "common.h"
#include "kv_rows.h"

namespace trtbuild::cpu {
namespace {

inline void rotate(float* x, const float* cs, int64_t rotary_dim, bool interleaved) {
  const int64_t half = rotary_dim / 2;
  const float* cos = cs;
  const float* sin = cs + half;
  if (interleaved) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      x[2 * i] = a * cos[i] - b * sin[i];
      x[2 * i + 1] = b * cos[i] + a * sin[i];
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cos[i] - b * sin[i];
      x[i + half] = b * cos[i] + a * sin[i];
    }
  }
}

inline int64_t clamp(int64_t v, int64_t lo, int64_t hi) { return std::min(std::max(v, lo), hi); }

// Phase 1, per token of [t0, t1): rotated, scaled queries into `out` (the tiles read them back), rotated keys and
// values into their cache slots. Out-of-contract metadata is clamped so that nothing outside the tensors is touched.
// Tokens are independent (each writes its own slot), so token ranges run on the pool's threads.
void write_step(const Attrs& a, const Step& s, int64_t t0, int64_t t1) {
  const int64_t hq = a.num_heads, hkv = a.num_kv_heads, d = a.head_size, width = (hq + 2 * hkv) * d;
  // the sequence of token t0: the first whose end is past it (query_start_loc ascends)
  int64_t b = std::upper_bound(s.query_start_loc + 1, s.query_start_loc + s.num_seqs, t0) - (s.query_start_loc + 1);
  for (int64_t t = t0; t < t1; ++t) {
    while (b + 1 < s.num_seqs && t >= s.query_start_loc[b + 1]) ++b;
    const float* row = s.qkv + t * width;
    const int64_t pos = clamp(s.positions[t], 0, s.max_blocks * s.block_size - 1);
    const float* cs = s.cos_sin ? s.cos_sin + clamp(pos, 0, s.rotary_rows - 1) * s.rotary_dim : nullptr;
    float* q = s.out + t * hq * d;
    for (int64_t h = 0; h < hq; ++h) {
      std::memcpy(q + h * d, row + h * d, d * sizeof(float));
      if (cs) rotate(q + h * d, cs, s.rotary_dim, a.interleaved);
      for (int64_t i = 0; i < d; ++i) q[h * d + i] *= a.scale;
    }
    const int64_t block = clamp(s.block_tables[b * s.max_blocks + pos / s.block_size], 0, s.num_blocks - 1);
    const int64_t slot = (block * s.block_size + pos % s.block_size) * hkv * d;
    float k[kMaxTileFloats];  // hkv * d <= kMaxTileFloats (checked in paged_attention)
    std::memcpy(k, row + hq * d, hkv * d * sizeof(float));
    if (cs)
      for (int64_t h = 0; h < hkv; ++h) rotate(k + h * d, cs, s.rotary_dim, a.interleaved);
    store_row(a, s.key_cache, slot, k, hkv * d, s.k_scale);
    store_row(a, s.value_cache, slot, row + (hq + hkv) * d, hkv * d, s.v_scale);
  }
}

struct WorkItem {
  int64_t seq, first_token, num_tokens, h_lo, h_hi;  // tokens [first, first + num) x KV heads [h_lo, h_hi)
};

// A token at position pos sees positions [window_start(a, pos), pos].
inline int64_t window_start(const Attrs& a, int64_t pos) { return std::max<int64_t>(0, pos - a.window + 1); }

// The first block work item w reads: the one holding its first token's window start (0 without a window). The blocks
// before it may be freed ones (the op's contract): they are never read.
int64_t first_block(const Attrs& a, const Step& s, const WorkItem& w) {
  const int64_t pos = clamp(s.positions[w.first_token], 0, s.max_blocks * s.block_size - 1);
  return window_start(a, pos) / s.block_size;
}

// The lines of work item w's part of its sequence's block j (its KV heads' part of each of the block's rows).
BlockPrefetch item_block_lines(const Attrs& a, const Step& s, const WorkItem& w, int64_t j) {
  const int64_t bs = s.block_size, hkv = a.num_kv_heads, d = a.head_size;
  const int64_t esize = a.cache_type == kCacheFloat ? sizeof(float) : 1;  // bytes per cached value
  const int64_t* table = s.block_tables + w.seq * s.max_blocks;
  BlockPrefetch f;
  const int64_t first = (clamp(table[j], 0, s.num_blocks - 1) * bs * hkv + w.h_lo) * d * esize;
  f.keys = static_cast<const char*>(s.key_cache) + first;
  f.values = static_cast<const char*>(s.value_cache) + first;
  f.stride = hkv * d * esize;
  f.rows = bs;
  f.lines_per_row = ((w.h_hi - w.h_lo) * d * esize + 63) / 64;
  return f;
}

// Phase 2, one work item: tokens [first, first + n) of one sequence, the query heads of KV heads [h_lo, h_hi),
// over the sequence's positions from its first token's window start (0 without a sliding window) to its last
// token's position, block by block (online softmax; a prefill tile of a float cache a span of kMaxBlockSize keys
// at a time, its blocks read in place). A block's rows of all KV heads lie together ([BS, Hkv, D]),
// so an item covering every head reads (and prefetches) each block as one contiguous run. Per block and head: the
// scores of the head's rows against the block's keys in register tiles of 3 rows x 4 keys, each row's softmax
// update on 8 lanes (soft-capped first with a softcap), then the weighted values added into the rows' accumulators
// in tiles of 3 rows x 32 dims (the accumulators rescaled on the way).
// next: the item this thread attends after this one, or nullptr: its first block is prefetched during this item's
// last, as each block during the one before. first_fetched: this item's first block was prefetched so.
void attend(const Attrs& a, const Step& s, const WorkItem& w, const WorkItem* next, bool first_fetched) {
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_size, hkv = a.num_kv_heads;
  const int64_t head_rows = group * w.num_tokens, bs = s.block_size;
  const int64_t rows = head_rows * (w.h_hi - w.h_lo);
  const bool tiled = d % 8 == 0;
  // A prefill tile over a float cache takes its keys kMaxBlockSize at a time (several blocks, each read in place):
  // each row's softmax update and accumulator rescale then cover 64 keys, not one block's 16. Decode items (and
  // quantized caches, dequantized a block at a time) take one block per step.
  const int64_t span = w.num_tokens >= kSpanTokens && tiled && a.cache_type == kCacheFloat ? kMaxBlockSize / bs : 1;
  const int64_t ps = (span * bs + 7) & ~int64_t(7);  // scores per row in p: the step's keys, padded to 8
  // Per-thread scratch: rows <= kMaxRows, rows x head size <= kMaxTileFloats (both ensured by the caller), block
  // size <= kMaxBlockSize. Row r = (head - h_lo) * head_rows + token * group + query head within the group.
  static thread_local float q[kMaxTileFloats], acc[kMaxTileFloats], m[kMaxRows], l[kMaxRows], alpha[kMaxRows];
  static thread_local float p[kMaxRows * kMaxBlockSize];
  static thread_local int64_t last_pos[kMaxRows], first_pos[kMaxRows];  // a row sees [first_pos, last_pos]
  static thread_local float kq[kMaxBlockSize * kMaxHeadSize], vq[kMaxBlockSize * kMaxHeadSize];  // dequantized
  for (int64_t h = w.h_lo; h < w.h_hi; ++h)
    for (int64_t i = 0; i < w.num_tokens; ++i) {
      const int64_t t = w.first_token + i;
      const int64_t pos = clamp(s.positions[t], 0, s.max_blocks * bs - 1);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (h - w.h_lo) * head_rows + i * group + g;
        std::memcpy(q + r * d, s.out + (t * a.num_heads + h * group + g) * d, d * sizeof(float));
        last_pos[r] = pos;
        first_pos[r] = window_start(a, pos);
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.0f;
      }
    }
  std::fill(acc, acc + rows * d, 0.0f);
  const int64_t ctx = last_pos[head_rows - 1] + 1;  // positions ascend within a sequence
  const int64_t* table = s.block_tables + w.seq * s.max_blocks;
  const int64_t j0 = first_block(a, s, w);
  for (int64_t j = j0; j * bs < ctx; j += span) {
    const int64_t n = std::min(span * bs, ctx - j * bs);  // the step's keys: blocks [j, j + span)
    // Fetch the next block (elsewhere in memory) while this one is computed: at 64 sequences the float cache's
    // reads come from DRAM. The item's lines of it go out a few at a time from the tiles, evenly over this
    // block's tiles, in address order (sent in one burst per block or head they filled the core's miss buffers
    // and stalled the compute, so memory and compute time added up).
    // A head's rows that see this block: [first_row, end_row). Those before it come before the block (a prefill
    // tile's early tokens), those after it have their window start after it (rows ascend in position).
    int64_t first_row = 0, end_row = head_rows;
    while (first_row < head_rows && last_pos[first_row] < j * bs) ++first_row;
    while (end_row > first_row && first_pos[end_row - 1] >= j * bs + n) --end_row;
    const int64_t rows_here = end_row - first_row;
    if (j == j0 && !first_fetched) item_block_lines(a, s, w, j0).finish();  // at once: nothing to overlap it with
    BlockPrefetch pf;  // block j + 1 (after the last block: the next item's first), spread over this block's tiles
    const bool last = (j + span) * bs >= ctx;
    if (!last || next != nullptr) {  // (a span's step prefetches the next span's first block only)
      pf = last ? item_block_lines(a, s, *next, first_block(a, s, *next)) : item_block_lines(a, s, w, j + span);
      const int64_t steps = tiled ? (w.h_hi - w.h_lo) * tile_steps(rows_here, n, d) : 0;
      pf.per_step = (pf.rows * pf.lines_per_row + steps - 1) / std::max<int64_t>(steps, 1);
    }
    for (int64_t h = w.h_lo; h < w.h_hi; ++h) {
      // This head's first key and value of each of the step's blocks j + b (one block unless span > 1)
      const float* key_blocks[kMaxSpanBlocks];
      const float* value_blocks[kMaxSpanBlocks];
      int64_t stride = hkv * d;  // between consecutive keys
      if (a.cache_type == kCacheFloat) {
        for (int64_t b = 0; b * bs < n; ++b) {
          const int64_t at = (clamp(table[j + b], 0, s.num_blocks - 1) * bs * hkv + h) * d;
          key_blocks[b] = static_cast<const float*>(s.key_cache) + at;
          value_blocks[b] = static_cast<const float*>(s.value_cache) + at;
        }
      } else {  // dequantize the head's keys/values of this block into scratch (the same math as the reference)
        const int64_t row0 = (clamp(table[j], 0, s.num_blocks - 1) * bs * hkv + h) * d;
        dequantize_rows(a, s.key_cache, row0, n, hkv * d, d, s.k_scale, kq);
        dequantize_rows(a, s.value_cache, row0, n, hkv * d, d, s.v_scale, vq);
        key_blocks[0] = kq, value_blocks[0] = vq, stride = d;
      }
      const float* keys = key_blocks[0];
      const int64_t lo = (h - w.h_lo) * head_rows + first_row, hi = lo + rows_here;
#if defined(__AVX__)
      if (tiled && n == 16 && ps == 16) {  // a whole block of 16 (an engine's default): scores kept in registers
        int64_t fst[3], vis[3];
        const float c = a.softcap;
        for (int64_t r = lo; r < hi; r += 3) {
          const int64_t nr = std::min<int64_t>(3, hi - r);
          for (int64_t i = 0; i < nr; ++i) {
            fst[i] = std::max<int64_t>(0, first_pos[r + i] - j * bs);
            vis[i] = std::min(n, last_pos[r + i] - j * bs + 1);
          }
          const float* qr = q + r * d;
          float* pr = p + r * ps;
          float *mr = m + r, *lr = l + r, *ar = alpha + r;
          if (nr == 3) block_scores_softmax<3>(qr, d, keys, stride, pr, ps, pf, fst, vis, c, mr, lr, ar);
          else if (nr == 2) block_scores_softmax<2>(qr, d, keys, stride, pr, ps, pf, fst, vis, c, mr, lr, ar);
          else block_scores_softmax<1>(qr, d, keys, stride, pr, ps, pf, fst, vis, c, mr, lr, ar);
        }
      } else
#endif
      {
        if (!tiled) {
          scores_scalar(q + lo * d, d, keys, stride, n, rows_here, p + lo * ps, ps);  // untiled: span 1
        } else {
          for (int64_t r = lo; r < hi; r += 3) {
            const int64_t nr = std::min<int64_t>(3, hi - r);
            for (int64_t o = 0; o < n; o += bs) {  // each block of the step (one unless span > 1)
              const float* k = key_blocks[o / bs];
              const int64_t nk = std::min(bs, n - o);
              float* pr = p + r * ps + o;
              if (nr == 3) scores_rows<3>(q + r * d, d, k, stride, nk, pr, ps, pf);
              else if (nr == 2) scores_rows<2>(q + r * d, d, k, stride, nk, pr, ps, pf);
              else scores_rows<1>(q + r * d, d, k, stride, nk, pr, ps, pf);
            }
          }
        }
        for (int64_t r = lo; r < hi; ++r) {
          const int64_t fst = std::max<int64_t>(0, first_pos[r] - j * bs);
          alpha[r] = softmax_block(p + r * ps, fst, std::min(n, last_pos[r] - j * bs + 1), ps, a.softcap, m[r], l[r]);
        }
      }
      if (!tiled) {
        values_scalar(p + lo * ps, ps, value_blocks[0], stride, n, rows_here, acc + lo * d, d, alpha + lo);
      } else {
        for (int64_t r = lo; r < hi; r += 3) {
          const int64_t nr = std::min<int64_t>(3, hi - r);
          const float* pr = p + r * ps;
          float* ar = acc + r * d;
          if (span > 1) values_tile<true>(nr, pr, ps, value_blocks, bs, stride, n, ar, d, alpha + r, pf);
          else values_tile<false>(nr, pr, ps, value_blocks, bs, stride, n, ar, d, alpha + r, pf);
        }
      }
    }
    pf.finish();  // whatever the tiles left (a block of fewer than 4 keys has no score tiles)
  }
  for (int64_t h = w.h_lo; h < w.h_hi; ++h)
    for (int64_t i = 0; i < w.num_tokens; ++i) {
      const int64_t t = w.first_token + i;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (h - w.h_lo) * head_rows + i * group + g;
        const float inv = 1.0f / l[r];
        float* o = s.out + (t * a.num_heads + h * group + g) * d;
        for (int64_t x = 0; x < d; ++x) o[x] = acc[r * d + x] * inv;
      }
    }
}

struct ParallelWork {
  const Attrs* attrs;
  const Step* step;
  const WorkItem* items;
  int64_t num_items;
  std::atomic<int64_t>* claimed;  // items [0, claimed) are taken by a worker
};

constexpr int64_t kWriteTokens = 32;  // tokens per task of phase 1 (a decode of 32 sequences or fewer: one thread)

struct WriteWork {
  const Attrs* attrs;
  const Step* step;
};

void write_tokens(void* data, size_t task) {
  const auto* w = static_cast<const WriteWork*>(data);
  const int64_t t0 = int64_t(task) * kWriteTokens;
  write_step(*w->attrs, *w->step, t0, std::min(t0 + kWriteTokens, w->step->num_tokens));
}

// One worker: takes items from the shared counter until none are left, each one item ahead of the one it attends,
// so that the next item's first block is prefetched during the current one's last (a decode item is one sequence:
// its first block was otherwise fetched with nothing to overlap it; docs/decisions/attention-block-prefetch.md).
void run_worker(void* data, size_t) {
  auto* w = static_cast<ParallelWork*>(data);
  int64_t cur = w->claimed->fetch_add(1);
  bool fetched = false;
  while (cur < w->num_items) {
    const int64_t nxt = w->claimed->fetch_add(1);
    const WorkItem* next = nxt < w->num_items ? &w->items[nxt] : nullptr;
    attend(*w->attrs, *w->step, w->items[cur], next, fetched);
    fetched = next != nullptr;
    cur = nxt;
  }
}

}  // namespace

bool paged_attention(OrtKernelContext* ctx, const Attrs& a, const Step& s) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  if (s.num_seqs <= 0 || s.max_blocks <= 0 || s.block_size > kMaxBlockSize || group > kMaxRows ||
      group * a.head_size > kMaxTileFloats || a.num_kv_heads * a.head_size > kMaxTileFloats ||
      a.head_size > kMaxHeadSize)
    return false;  // refused at build time (backends/onnxruntime/build/native.py); the C entry's caller falls back
  WriteWork ww{&a, &s};
  const int64_t write_tasks = (s.num_tokens + kWriteTokens - 1) / kWriteTokens;
  if (write_tasks < 2 || !parallel_for(ctx, write_tokens, size_t(write_tasks), &ww)) write_step(a, s, 0, s.num_tokens);

  // Work items: tiles of each sequence's tokens, all KV heads together (contiguous block reads) unless there are
  // too few tiles to keep the threads busy (a decode of one or two sequences), then one item per KV head.
  const int64_t per_head = group * a.head_size;
  const int64_t tile_all =
      std::min({kTileRows / group, kMaxRows / a.num_heads, kMaxTileFloats / (a.num_kv_heads * per_head)});
  int64_t tiles = 0;
  for (int64_t b = 0; b < s.num_seqs; ++b) {
    const int64_t n = s.query_start_loc[b + 1] - s.query_start_loc[b];
    tiles += (n + std::max<int64_t>(tile_all, 1) - 1) / std::max<int64_t>(tile_all, 1);
  }
  const bool split_heads = tile_all < 1 || tiles < 4;
  const int64_t tile =
      split_heads ? std::max<int64_t>(1, std::min(kTileRows / group, kMaxTileFloats / per_head)) : tile_all;
  const int64_t heads_per_item = split_heads ? 1 : a.num_kv_heads;
  int64_t num_items = 0;
  for (int64_t b = 0; b < s.num_seqs; ++b) {
    const int64_t n = s.query_start_loc[b + 1] - s.query_start_loc[b];
    num_items += (a.num_kv_heads / heads_per_item) * ((n + tile - 1) / tile);
  }
  WorkItem* items = new WorkItem[num_items];
  int64_t k = 0;
  double work = 0;  // query rows x keys, to decide whether threads pay
  for (int64_t b = 0; b < s.num_seqs; ++b) {
    const int64_t lo = s.query_start_loc[b], hi = s.query_start_loc[b + 1];
    const double ctx = double(s.positions[hi - 1] + 1);  // a window bounds each token's keys
    work += double(hi - lo) * std::min(ctx, double(a.window)) * a.num_heads;
    for (int64_t first = lo; first < hi; first += tile)
      for (int64_t h = 0; h < a.num_kv_heads; h += heads_per_item)
        items[k++] = {b, first, std::min(tile, hi - first), h, h + heads_per_item};
  }
  std::atomic<int64_t> claimed{0};
  ParallelWork pw{&a, &s, items, num_items, &claimed};
  // Workers (not one task per item): each runs until the items are gone, so more tasks than the pool's threads
  // just return. A parallel loop costs a few microseconds to start: below ~1k query-key pairs one thread is faster.
  const int64_t workers = std::min<int64_t>(num_items, 16);
  if (work < 1024.0 || num_items < 2 || !parallel_for(ctx, run_worker, size_t(workers), &pw)) {
    claimed = 0;
    run_worker(&pw, 0);
  }
  delete[] items;
  return true;
}

}  // namespace trtbuild::cpu
