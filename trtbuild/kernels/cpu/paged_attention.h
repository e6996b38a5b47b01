// trtbuild::PagedAttention's native CPU kernel (paged_attention.cc): its attributes, one call's tensors and the
// limits of its fixed scratch, as the glue (ort_ops.cc) hands them over. The op's contract is
// plugins/paged_attention/README.md; kernel_library.py mirrors the limits (MAX_*) for the build's checks.

#pragma once

#include <cstdint>

#include "common.h"

namespace trtbuild::cpu {

enum CacheType : int64_t { kCacheFloat = 1, kCacheInt8 = 3, kCacheFp8 = 17 };  // attribute kv_cache_dtype

constexpr int64_t kNoWindow = INT64_MAX;  // attribute sliding_window absent: every earlier position is in the window

struct Attrs {
  int64_t num_heads, num_kv_heads, head_size, interleaved, cache_type;
  float scale;
  int64_t window = kNoWindow;  // sliding_window: position p sees positions p - window < k <= p
  float softcap = 0.0f;  // > 0: scores -> softcap * tanh(score / softcap); 0: attribute softcap absent
};

struct Step {
  const float* qkv;
  void* key_cache;  // float, int8 or fp8 bits (Attrs::cache_type)
  void* value_cache;
  float k_scale, v_scale;  // quantized caches: stored = quantize(x / scale)
  const int64_t* positions;
  const int64_t* block_tables;
  const int64_t* query_start_loc;
  const float* cos_sin;  // nullptr: no rotary embedding
  float* out;
  int64_t num_tokens, num_seqs, max_blocks, num_blocks, block_size, rotary_dim, rotary_rows;
};

constexpr int64_t kMaxTileFloats = 8192;  // query rows x head size held on the stack by one work item
constexpr int64_t kTileRows = 32;  // aim: GQA group x tokens per work item (keys are read once per tile)
constexpr int64_t kMaxRows = 128;  // most query rows of a work item (a GQA group may exceed kTileRows)
constexpr int64_t kMaxBlockSize = 64;  // also the keys a prefill tile takes per step (paged_attention.cc's span)
constexpr int64_t kSpanTokens = 4;  // a work item of this many tokens or more (a prefill tile) takes keys in spans
constexpr int64_t kMaxSpanBlocks = kMaxBlockSize;  // blocks of one span: kMaxBlockSize keys, blocks of 1 or more
constexpr int64_t kMaxHeadSize = 512;

#pragma GCC visibility push(hidden)
// One step: q and k rotated, the step's keys and values written into the caches in place, every token attended over
// its sequence's blocks into s.out. A call beyond the limits above (refused at build time) returns false, out
// unwritten. ctx: onnxruntime's, or nullptr from the C entry point (c_api.cc), whose loops run on host threads.
bool paged_attention(OrtKernelContext* ctx, const Attrs& a, const Step& s);
#pragma GCC visibility pop

}  // namespace trtbuild::cpu
