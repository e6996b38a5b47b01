// trtbuild::PagedAttention as a native onnxruntime CPU custom op (domain "trtbuild.cpu", op "PagedAttention"), and
// the two row ops of per-token int8 linears (QuantizeRows, RescaleRows: see their section at the end), the
// integer linear QLinear (cpu_linear.inc, included at the end) and the gated MLP's SwiGLU (cpu_swiglu.inc).
//
// One node per layer replaces the ~20-node lowering of backends/onnxruntime/lowering.py: it rotates q and k, writes the
// step's keys/values into the paged cache *in place* (inputs 1 and 2, which the session binds once to its own
// numpy arrays) and attends every token over its sequence's blocks straight from the pool (flash-style online
// softmax, no gather, no concat, no padding). The contract is plugins/paged_attention/README.md; the oracle is
// reference.py; tests/test_cpu_kernel.py checks this file against it. Caches may be float32, int8 or FLOAT8E4M3FN
// (attribute kv_cache_dtype 1 / 3 / 17; fp8 stored as its uint8 bit patterns), quantized with the per-tensor
// scales of inputs 7 and 8 as the reference does.
//
// Inputs: 0 qkv [T, (Hq + 2 Hkv) D], 1 key_cache [NB, BS, Hkv, D], 2 value_cache (same), 3 positions [T],
// 4 block_tables [B, M], 5 query_start_loc [B + 1] (int64), 6 cos_sin_cache [P, R] (optional), 7 k_scale and
// 8 v_scale (float scalars, quantized caches only). Output: 0 attention output [T, Hq D].
// Attributes: num_heads, num_kv_heads, head_size, scale, rotary_interleaved, kv_cache_dtype (default 1).
//
// Built by trtbuild/backends/onnxruntime/native.py (g++ -O3 -march=native, at first use, cached per machine) and loaded
// with SessionOptions.register_custom_ops_library. No onnxruntime header ships in any package reachable here, so
// the few parts of onnxruntime's C ABI this uses are declared below: OrtApi is a table of function pointers that
// only ever grows at its end (slot numbers are stable across releases), OrtCustomOp a struct read up to `version`.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>  // arch_prctl: the AMX permission request (cpu_linear.inc)
#include <unistd.h>
#endif

extern "C" {
struct OrtStatus;
struct OrtApi;
struct OrtValue;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtTensorTypeAndShapeInfo;
struct OrtSessionOptions;
struct OrtCustomOpDomain;

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};
}

namespace {

// Slot numbers of the OrtApi functions used here (onnxruntime's C API, MIT licence; append-only).
enum ApiSlot : size_t {
  kCreateStatus = 0,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttributeFloat = 85,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetInputCount = 88,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelContextParallelFor = 274,  // API version 17 (onnxruntime 1.17) and later
};
constexpr uint32_t kApiVersion = 17;  // the oldest API version that has every slot above
constexpr uint32_t kCustomOpVersion = 13;  // OrtCustomOp fields read by onnxruntime: up to GetInputMemoryType
enum ElementType : int { kUndefined = 0, kFloat = 1, kUint8 = 2, kInt32 = 6, kInt64 = 7 };  // kUndefined: any type
enum CacheType : int64_t { kCacheFloat = 1, kCacheInt8 = 3, kCacheFp8 = 17 };
enum Characteristic : int { kRequired = 0, kOptional = 1 };

const OrtApi* g_api = nullptr;

template <typename Fn>
Fn slot(ApiSlot s) {
  return reinterpret_cast<Fn>(reinterpret_cast<void* const*>(g_api)[s]);
}

// The OrtCustomOp struct: a version then 25 callbacks, in onnxruntime's order.
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const OrtCustomOp*);
  int (*GetInputType)(const OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const OrtCustomOp*);
  int (*GetOutputType)(const OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetOutputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetInputMemoryType)(const OrtCustomOp*, size_t);
  void* unused[13];  // variadic arity (4), kernel V2 (2), shape inference, opset range (2), in-place (2), aliases (2)
};

// ---------------------------------------------------------------------------------------------------------------
// The kernel proper (no onnxruntime types below this line until the glue).

struct Attrs {
  int64_t num_heads, num_kv_heads, head_size, interleaved, cache_type;
  float scale;
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
constexpr int64_t kMaxBlockSize = 64;
constexpr int64_t kMaxHeadSize = 512;

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

// FLOAT8E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7F / 0xFF are NaN, 448 the largest.
// Decoded without a table, so that a row's loop vectorises: a normal code's 7 exponent/mantissa bits placed at
// float32's exponent/mantissa boundary, exponent rebased by 127 - 7; a subnormal (e = 0) is m * 2^-9. No float32
// subnormal is formed on the way (they cost a microcode assist per operation). Exact: every E4M3 value is a float32.
inline float from_fp8(uint8_t c) {
  const uint32_t mag = c & 0x7F, bits = (mag << 20) + (120u << 23);
  float normal;
  std::memcpy(&normal, &bits, sizeof(normal));
  const float v = mag == 0x7F ? std::numeric_limits<float>::quiet_NaN() : mag < 8 ? float(mag) * 0x1p-9f : normal;
  return c & 0x80 ? -v : v;
}

// x -> E4M3FN, rounding to nearest even and saturating to +-448 (ONNX QuantizeLinear with saturate=1). Normal
// results by integer rounding of float32's bits (no libm calls: one row per token and layer is stored).
inline uint8_t to_fp8(float x) {
  if (std::isnan(x)) return 0x7F;
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = uint8_t((bits >> 24) & 0x80);
  const float a = std::fabs(x);
  if (a >= 448.0f) return sign | 0x7E;
  if (a < 0x1p-6f) return sign | uint8_t(std::nearbyint(a * 512.0f));  // subnormal m * 2^-9 (m = 8: min normal)
  bits &= 0x7FFFFFFFu;
  bits += 0x7FFFFu + ((bits >> 20) & 1);  // round the 20 dropped mantissa bits to nearest even
  return sign | uint8_t((bits >> 20) - (120u << 3));  // float32 exponent 127-biased -> 7-biased, 3 mantissa bits
}

// One cache row of `n` values of a head: stored quantized (or copied) from float.
void store_row(const Attrs& a, void* cache, int64_t offset, const float* x, int64_t n, float scale) {
  if (a.cache_type == kCacheFloat) {
    std::memcpy(static_cast<float*>(cache) + offset, x, n * sizeof(float));
  } else if (a.cache_type == kCacheInt8) {
    int8_t* dst = static_cast<int8_t*>(cache) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = int8_t(std::clamp(std::nearbyint(x[i] / scale), -128.0f, 127.0f));
  } else {
    uint8_t* dst = static_cast<uint8_t*>(cache) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = to_fp8(x[i] / scale);
  }
}

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
    float k[kMaxTileFloats];  // hkv * d <= kMaxTileFloats (checked in compute)
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

// Eight floats: GCC/Clang lower it to AVX (or two SSE / NEON registers); loads and stores may be unaligned.
typedef float v8 __attribute__((vector_size(32), aligned(4)));
inline v8 load8(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline void store8(float* p, v8 x) { *reinterpret_cast<v8*>(p) = x; }
inline float hsum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }
// The eight sums of eight vectors, as one vector (lane i: the sum of x_i's lanes).
inline v8 hsum8(v8 x0, v8 x1, v8 x2, v8 x3, v8 x4, v8 x5, v8 x6, v8 x7) {
#if defined(__AVX__)
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(__m256(x0), __m256(x1)), _mm256_hadd_ps(__m256(x2), __m256(x3)));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(__m256(x4), __m256(x5)), _mm256_hadd_ps(__m256(x6), __m256(x7)));
  return v8(_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#else
  return v8{hsum(x0), hsum(x1), hsum(x2), hsum(x3), hsum(x4), hsum(x5), hsum(x6), hsum(x7)};
#endif
}

// Cephes' expf polynomial: exp(r) for the reduced argument (|r| <= ln 2 / 2), on a float or on eight lanes.
template <typename T>
inline T exp_poly(T r) {
  T y = T{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  return y * r * r + r + 1.0f;
}

// exp(x) for x <= 0 (a score minus its row's running maximum), Cephes' expf polynomial, within 2 ulp; a plain
// loop over it vectorises (libm's expf does not), which matters: every score takes one.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float y = exp_poly(r);
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// Eight int32s beside v8, for the exponent arithmetic of exp8.
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

// exp_nonpositive on eight lanes: the same steps (floor by truncation, corrected where it rounded up).
inline v8 exp8_nonpositive(v8 x) {
  x = x < -87.3f ? v8{} - 87.3f : x;
  const v8 t = x * 1.44269504088896341f + 0.5f;
  v8 n = __builtin_convertvector(__builtin_convertvector(t, v8i), v8);
  n = n > t ? n - 1.0f : n;
  const v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const v8 y = exp_poly(r);
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

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

// R rows' accumulators (row r at acc + r * d), dims [0, 8C): acc = acc * alpha[r] + sum_o p[r * ps + o] * v_o, over
// the block's n values (value o at v + o * stride). Each value vector is loaded once for the R rows.
template <int R, int C>
inline void values_xc(const float* p, int64_t ps, const float* v, int64_t stride, int64_t n, float* acc, int64_t d,
                      const float* alpha) {
  v8 a[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) a[r][c] = load8(acc + r * d + 8 * c) * alpha[r];
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
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) store8(acc + r * d + 8 * c, a[r][c]);
}

// `n` cache rows of one head (row i at offset + i * row_stride, `d` values) -> float rows of `d` in `out`.
void dequantize_rows(const Attrs& a, const void* cache, int64_t offset, int64_t n, int64_t row_stride, int64_t d,
                     float scale, float* __restrict out) {
  if (a.cache_type == kCacheInt8) {
    const int8_t* src = static_cast<const int8_t*>(cache) + offset;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < d; ++c) out[i * d + c] = float(src[i * row_stride + c]) * scale;
    return;
  }
  const uint8_t* src = static_cast<const uint8_t*>(cache) + offset;
  for (int64_t i = 0; i < n; ++i) {
    int64_t c = 0;
#if defined(__F16C__)
    // 8 codes at a time through the CPU's half-precision conversion: E4M3 s.eeee.mmm placed as binary16
    // s.0eeee.mmm0000000 is 2^(e-15) * (1 + m/8), or m * 2^-17 for e = 0 (a binary16 subnormal, which the
    // conversion handles exactly at full speed); times 2^8 both are the E4M3 value. Code 0x7F gets binary16's
    // all-ones exponent (NaN).
    const __m256 scaled = _mm256_set1_ps(scale * 256.0f);
    for (; c + 8 <= d; c += 8) {
      const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i * row_stride + c)));
      const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7F));
      const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7E00));
      const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
      const __m128i half = _mm_or_si128(_mm_or_si128(sign, _mm_slli_epi16(mag, 7)), nan);
      _mm256_storeu_ps(out + i * d + c, _mm256_mul_ps(_mm256_cvtph_ps(half), scaled));
    }
#endif
    for (; c < d; ++c) out[i * d + c] = from_fp8(src[i * row_stride + c]) * scale;
  }
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

template <int R>
void values_rows(const float* p, int64_t ps, const float* v, int64_t stride, int64_t n, float* acc, int64_t d,
                 const float* alpha, BlockPrefetch& pf) {
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) {
    pf.step();
    values_xc<R, 4>(p, ps, v + c, stride, n, acc + c, d, alpha);
  }
  if (c + 16 <= d) {
    pf.step();
    values_xc<R, 2>(p, ps, v + c, stride, n, acc + c, d, alpha);
    c += 16;
  }
  if (c + 8 <= d) {
    pf.step();
    values_xc<R, 1>(p, ps, v + c, stride, n, acc + c, d, alpha);
  }
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

// One row's scores of a block (the first `visible` of its ps, a multiple of 8, count) -> probabilities in place, the
// row's running max m and sum l updated; returns the factor the row's accumulator is rescaled by.
inline float softmax_block(float* pr, int64_t visible, int64_t ps, float& m, float& l) {
  const float ninf = -std::numeric_limits<float>::infinity();
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
// visible[r]: row r's keys that are not masked (a prefill row may see part of the block).
template <int R>
inline void block_scores_softmax(const float* q, int64_t d, const float* keys, int64_t stride, float* p, int64_t ps,
                                 BlockPrefetch& pf, const int64_t* visible, float* m, float* l, float* alpha) {
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
    const int32_t vis = int32_t(visible[r]);
    x0 = lane < vis ? x0 : v8{} + ninf;
    x1 = lane + 8 < vis ? x1 : v8{} + ninf;
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
// over the sequence's positions 0 ..= its last token's position, block by block (online softmax). A block's rows
// of all KV heads lie together ([BS, Hkv, D]), so an item covering every head reads (and prefetches) each block
// as one contiguous run. Per block and head: the scores of the head's rows against the block's keys in register
// tiles of 3 rows x 4 keys, each row's softmax update on 8 lanes, then the weighted values added into the rows'
// accumulators in tiles of 3 rows x 32 dims (the accumulators rescaled on the way).
// next: the item this thread attends after this one, or nullptr: its first block is prefetched during this item's
// last, as each block during the one before. first_fetched: this item's first block was prefetched so.
void attend(const Attrs& a, const Step& s, const WorkItem& w, const WorkItem* next, bool first_fetched) {
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_size, hkv = a.num_kv_heads;
  const int64_t head_rows = group * w.num_tokens, bs = s.block_size, ps = (bs + 7) & ~int64_t(7);
  const int64_t rows = head_rows * (w.h_hi - w.h_lo);
  const bool tiled = d % 8 == 0;
  // Per-thread scratch: rows <= kMaxRows, rows x head size <= kMaxTileFloats (both ensured by the caller), block
  // size <= kMaxBlockSize. Row r = (head - h_lo) * head_rows + token * group + query head within the group.
  static thread_local float q[kMaxTileFloats], acc[kMaxTileFloats], m[kMaxRows], l[kMaxRows], alpha[kMaxRows];
  static thread_local float p[kMaxRows * kMaxBlockSize];
  static thread_local int64_t last_pos[kMaxRows];
  static thread_local float kq[kMaxBlockSize * kMaxHeadSize], vq[kMaxBlockSize * kMaxHeadSize];  // dequantized
  for (int64_t h = w.h_lo; h < w.h_hi; ++h)
    for (int64_t i = 0; i < w.num_tokens; ++i) {
      const int64_t t = w.first_token + i;
      const int64_t pos = clamp(s.positions[t], 0, s.max_blocks * bs - 1);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (h - w.h_lo) * head_rows + i * group + g;
        std::memcpy(q + r * d, s.out + (t * a.num_heads + h * group + g) * d, d * sizeof(float));
        last_pos[r] = pos;
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.0f;
      }
    }
  std::fill(acc, acc + rows * d, 0.0f);
  const int64_t ctx = last_pos[head_rows - 1] + 1;  // positions ascend within a sequence
  const int64_t* table = s.block_tables + w.seq * s.max_blocks;
  for (int64_t j = 0; j * bs < ctx; ++j) {
    const int64_t block = clamp(table[j], 0, s.num_blocks - 1);
    const int64_t n = std::min(bs, ctx - j * bs);
    // Fetch the next block (elsewhere in memory) while this one is computed: at 64 sequences the float cache's
    // reads come from DRAM. The item's lines of it go out a few at a time from the tiles, evenly over this
    // block's tiles, in address order (sent in one burst per block or head they filled the core's miss buffers
    // and stalled the compute, so memory and compute time added up).
    int64_t first_row = 0;  // a head's rows before it come before this block (a prefill tile's early tokens)
    while (first_row < head_rows && last_pos[first_row] < j * bs) ++first_row;
    const int64_t rows_here = head_rows - first_row;
    if (j == 0 && !first_fetched) item_block_lines(a, s, w, 0).finish();  // at once: nothing to overlap it with
    BlockPrefetch pf;  // block j + 1 (after the last block: the next item's first), spread over this block's tiles
    const bool last = (j + 1) * bs >= ctx;
    if (!last || next != nullptr) {
      pf = last ? item_block_lines(a, s, *next, 0) : item_block_lines(a, s, w, j + 1);
      const int64_t steps = tiled ? (w.h_hi - w.h_lo) * tile_steps(rows_here, n, d) : 0;
      pf.per_step = (pf.rows * pf.lines_per_row + steps - 1) / std::max<int64_t>(steps, 1);
    }
    for (int64_t h = w.h_lo; h < w.h_hi; ++h) {
      const int64_t row0 = (block * bs * hkv + h) * d;  // the head's first key of the block
      const float* keys;
      const float* values;
      int64_t stride = hkv * d;  // between consecutive keys
      if (a.cache_type == kCacheFloat) {
        keys = static_cast<const float*>(s.key_cache) + row0;
        values = static_cast<const float*>(s.value_cache) + row0;
      } else {  // dequantize the head's keys/values of this block into scratch (the same math as the reference)
        dequantize_rows(a, s.key_cache, row0, n, hkv * d, d, s.k_scale, kq);
        dequantize_rows(a, s.value_cache, row0, n, hkv * d, d, s.v_scale, vq);
        keys = kq, values = vq, stride = d;
      }
      const int64_t lo = (h - w.h_lo) * head_rows + first_row, hi = lo + rows_here;
#if defined(__AVX__)
      if (tiled && n == 16 && ps == 16) {  // a whole block of 16 (an engine's default): scores kept in registers
        int64_t vis[3];
        for (int64_t r = lo; r < hi; r += 3) {
          const int64_t nr = std::min<int64_t>(3, hi - r);
          for (int64_t i = 0; i < nr; ++i) vis[i] = std::min(n, last_pos[r + i] - j * bs + 1);
          const float* qr = q + r * d;
          float* pr = p + r * ps;
          if (nr == 3) block_scores_softmax<3>(qr, d, keys, stride, pr, ps, pf, vis, m + r, l + r, alpha + r);
          else if (nr == 2) block_scores_softmax<2>(qr, d, keys, stride, pr, ps, pf, vis, m + r, l + r, alpha + r);
          else block_scores_softmax<1>(qr, d, keys, stride, pr, ps, pf, vis, m + r, l + r, alpha + r);
        }
      } else
#endif
      {
        if (!tiled) {
          scores_scalar(q + lo * d, d, keys, stride, n, rows_here, p + lo * ps, ps);
        } else {
          for (int64_t r = lo; r < hi; r += 3) {
            const int64_t nr = std::min<int64_t>(3, hi - r);
            float* pr = p + r * ps;
            if (nr == 3) scores_rows<3>(q + r * d, d, keys, stride, n, pr, ps, pf);
            else if (nr == 2) scores_rows<2>(q + r * d, d, keys, stride, n, pr, ps, pf);
            else scores_rows<1>(q + r * d, d, keys, stride, n, pr, ps, pf);
          }
        }
        for (int64_t r = lo; r < hi; ++r)
          alpha[r] = softmax_block(p + r * ps, std::min(n, last_pos[r] - j * bs + 1), ps, m[r], l[r]);
      }
      if (!tiled) {
        values_scalar(p + lo * ps, ps, values, stride, n, rows_here, acc + lo * d, d, alpha + lo);
      } else {
        for (int64_t r = lo; r < hi; r += 3) {
          const int64_t nr = std::min<int64_t>(3, hi - r);
          const float* pr = p + r * ps;
          if (nr == 3) values_rows<3>(pr, ps, values, stride, n, acc + r * d, d, alpha + r, pf);
          else if (nr == 2) values_rows<2>(pr, ps, values, stride, n, acc + r * d, d, alpha + r, pf);
          else values_rows<1>(pr, ps, values, stride, n, acc + r * d, d, alpha + r, pf);
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

// ---------------------------------------------------------------------------------------------------------------
// onnxruntime glue.

using GetInputFn = OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**);
using GetOutputFn = OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**);
using GetDataFn = OrtStatus* (*)(OrtValue*, void**);
using GetShapeInfoFn = OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**);
using GetDimsCountFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*);
using GetDimsFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t);
using ReleaseShapeInfoFn = void (*)(OrtTensorTypeAndShapeInfo*);
using ReleaseStatusFn = void (*)(OrtStatus*);
using ParallelForFn = OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
using GetAttrIntFn = OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*);
using GetAttrFloatFn = OrtStatus* (*)(const OrtKernelInfo*, const char*, float*);
using CreateStatusFn = OrtStatus* (*)(int, const char*);
using CreateDomainFn = OrtStatus* (*)(const char*, OrtCustomOpDomain**);
using DomainAddFn = OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*);
using AddDomainFn = OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*);

// Every status an onnxruntime call returns here is released; a failure leaves the value/array empty.
bool ok(OrtStatus* status) {
  if (status == nullptr) return true;
  slot<ReleaseStatusFn>(kReleaseStatus)(status);
  return false;
}

struct Tensor {
  void* data = nullptr;
  int64_t dims[8] = {0};
  size_t rank = 0;
};

Tensor input(OrtKernelContext* ctx, size_t index) {
  Tensor t;
  const OrtValue* value = nullptr;
  if (!ok(slot<GetInputFn>(kKernelContextGetInput)(ctx, index, &value)) || value == nullptr) return t;
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (ok(slot<GetShapeInfoFn>(kGetTensorTypeAndShape)(value, &info))) {
    if (ok(slot<GetDimsCountFn>(kGetDimensionsCount)(info, &t.rank)) && t.rank <= 8)
      ok(slot<GetDimsFn>(kGetDimensions)(info, t.dims, t.rank));
    slot<ReleaseShapeInfoFn>(kReleaseTensorTypeAndShapeInfo)(info);
  }
  ok(slot<GetDataFn>(kGetTensorMutableData)(const_cast<OrtValue*>(value), &t.data));
  return t;
}

struct Kernel {
  Attrs attrs;
};

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
// its first block was otherwise fetched with nothing to overlap it, ~5% of a 64-sequence call from DRAM).
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

void compute(void* kernel_ptr, OrtKernelContext* ctx) {
  const Attrs& a = static_cast<Kernel*>(kernel_ptr)->attrs;
  const Tensor qkv = input(ctx, 0), kc = input(ctx, 1), vc = input(ctx, 2), positions = input(ctx, 3),
               tables = input(ctx, 4), qsl = input(ctx, 5), cos_sin = input(ctx, 6);
  Step s{};
  s.num_tokens = qkv.dims[0];
  const int64_t out_dims[2] = {s.num_tokens, a.num_heads * a.head_size};
  OrtValue* out_value = nullptr;
  if (!ok(slot<GetOutputFn>(kKernelContextGetOutput)(ctx, 0, out_dims, 2, &out_value))) return;
  void* out_data = nullptr;
  if (!ok(slot<GetDataFn>(kGetTensorMutableData)(out_value, &out_data))) return;
  if (s.num_tokens == 0 || !qkv.data || !kc.data || !vc.data || kc.rank != 4 || tables.rank != 2) return;
  s.qkv = static_cast<const float*>(qkv.data);
  s.key_cache = kc.data;
  s.value_cache = vc.data;
  if (a.cache_type != kCacheFloat) {
    const Tensor k_scale = input(ctx, 7), v_scale = input(ctx, 8);
    if (!k_scale.data || !v_scale.data) return;
    s.k_scale = *static_cast<const float*>(k_scale.data);
    s.v_scale = *static_cast<const float*>(v_scale.data);
  }
  s.positions = static_cast<const int64_t*>(positions.data);
  s.block_tables = static_cast<const int64_t*>(tables.data);
  s.query_start_loc = static_cast<const int64_t*>(qsl.data);
  s.out = static_cast<float*>(out_data);
  s.num_seqs = qsl.dims[0] - 1;
  s.num_blocks = kc.dims[0];
  s.block_size = kc.dims[1];
  s.max_blocks = tables.dims[1];
  if (cos_sin.data && cos_sin.rank == 2) {
    s.cos_sin = static_cast<const float*>(cos_sin.data);
    s.rotary_rows = cos_sin.dims[0];
    s.rotary_dim = cos_sin.dims[1];
  }
  const int64_t group = a.num_heads / a.num_kv_heads;
  if (s.num_seqs <= 0 || s.max_blocks <= 0 || s.block_size > kMaxBlockSize || group > kMaxRows ||
      group * a.head_size > kMaxTileFloats || a.num_kv_heads * a.head_size > kMaxTileFloats ||
      a.head_size > kMaxHeadSize)
    return;  // refused at build time (backends/onnxruntime/native.py): never reached from a trtbuild engine
  WriteWork ww{&a, &s};
  const int64_t write_tasks = (s.num_tokens + kWriteTokens - 1) / kWriteTokens;
  if (write_tasks < 2 ||
      !ok(slot<ParallelForFn>(kKernelContextParallelFor)(ctx, write_tokens, size_t(write_tasks), size_t(write_tasks),
                                                         &ww)))
    write_step(a, s, 0, s.num_tokens);

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
    work += double(hi - lo) * double(s.positions[hi - 1] + 1) * a.num_heads;
    for (int64_t first = lo; first < hi; first += tile)
      for (int64_t h = 0; h < a.num_kv_heads; h += heads_per_item)
        items[k++] = {b, first, std::min(tile, hi - first), h, h + heads_per_item};
  }
  std::atomic<int64_t> claimed{0};
  ParallelWork pw{&a, &s, items, num_items, &claimed};
  // Workers (not one task per item): each runs until the items are gone, so more tasks than the pool's threads
  // just return. A parallel loop costs a few microseconds to start: below ~1k query-key pairs one thread is faster.
  const int64_t workers = std::min<int64_t>(num_items, 16);
  if (work < 1024.0 || num_items < 2 ||
      !ok(slot<ParallelForFn>(kKernelContextParallelFor)(ctx, run_worker, size_t(workers), size_t(workers), &pw))) {
    claimed = 0;
    run_worker(&pw, 0);
  }
  delete[] items;
}

void* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  auto* kernel = new Kernel{};
  Attrs& a = kernel->attrs;
  auto get_int = slot<GetAttrIntFn>(kKernelInfoGetAttributeInt64);
  ok(get_int(info, "num_heads", &a.num_heads));
  ok(get_int(info, "num_kv_heads", &a.num_kv_heads));
  ok(get_int(info, "head_size", &a.head_size));
  if (!ok(get_int(info, "rotary_interleaved", &a.interleaved))) a.interleaved = 0;
  if (!ok(get_int(info, "kv_cache_dtype", &a.cache_type))) a.cache_type = kCacheFloat;
  ok(slot<GetAttrFloatFn>(kKernelInfoGetAttributeFloat)(info, "scale", &a.scale));
  return kernel;
}

void destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }
const char* op_name(const OrtCustomOp*) { return "PagedAttention"; }
const char* op_provider(const OrtCustomOp*) { return nullptr; }  // the CPU execution provider
int input_type(const OrtCustomOp*, size_t i) {
  return (i == 1 || i == 2) ? kUndefined : (i >= 3 && i <= 5) ? kInt64 : kFloat;
}
size_t input_count(const OrtCustomOp*) { return 9; }
int output_type(const OrtCustomOp*, size_t) { return kFloat; }
size_t output_count(const OrtCustomOp*) { return 1; }
int input_characteristic(const OrtCustomOp*, size_t i) { return i >= 6 ? kOptional : kRequired; }
int output_characteristic(const OrtCustomOp*, size_t) { return kRequired; }
int input_memory_type(const OrtCustomOp*, size_t) { return 0; }  // OrtMemTypeDefault

const OrtCustomOp kOp = {
    kCustomOpVersion, create_kernel,         op_name,         op_provider,     input_type, input_count,
    output_type,      output_count,          compute,         destroy_kernel,  input_characteristic,
    output_characteristic, input_memory_type, {nullptr},
};

// ---------------------------------------------------------------------------------------------------------------
// Per-token int8 linears (backends/onnxruntime/weights.integer_gemms_per_token): the two ends around onnxruntime's
// MatMulInteger, each one pass over its tensor instead of five / three standard ops.
//
// QuantizeRows: x float [..., K] -> codes uint8 [..., K], scale float [..., 1]. Per row s = max(amax / 127, FLT_MIN)
// and codes = round_half_even(x / s) + 128 (the graph's int8 codes plus MatMulInteger's zero point 128; |x / s|
// <= 127, so nothing saturates). The division is a true division (no reciprocal), as the graph's Div.
// RescaleRows: sums int32 [M, N], row scale float [M, 1], column scale float [N] -> float [M, N] =
// (float(sums) * row) * col, the graph's Cast -> Mul -> Mul in the same order.

constexpr int64_t kRowsPerTask = 16;

struct RowsWork {
  const float* x;
  uint8_t* codes;
  float* scale;
  const int32_t* sums;
  const float* col;
  float* out;
  int64_t rows, width;
};

// max |x| (NaNs skipped): exact in any order, so vectorised by hand (GCC leaves std::max of floats scalar without
// -ffinite-math-only: a 4-cycle dependency chain, 16% of a 2048-row QLinear's time). vmaxps returns its second
// operand when either is NaN, as std::max(amax, nan) keeps amax.
float row_amax(const float* x, int64_t n) {
  float amax = 0.0f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), m);
  amax = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float v : lanes) amax = std::max(amax, v);
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

// The per-element arithmetic in exact IEEE order: a true division (no reciprocal of the loop-invariant scale) and
// the two products unreassociated. Builtins only: a function of other optimisation flags inlines no std:: calls.
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math", "no-associative-math")
float row_scale(float amax) {  // the graph's max(amax / 127, FLT_MIN)
  const float s = amax / 127.0f;
  return s > __FLT_MIN__ ? s : __FLT_MIN__;
}

void encode_row(const float* x, float s, uint8_t* codes, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float q = __builtin_nearbyintf(x[i] / s);  // the current rounding mode: to nearest, ties to even
    q = q > 127.0f ? 127.0f : (q < -128.0f ? -128.0f : q);
    codes[i] = uint8_t(int32_t(q) + 128);
  }
}

void rescale_row(const int32_t* sums, float row, const float* col, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = (float(sums[i]) * row) * col[i];
}
#pragma GCC pop_options

void quantize_rows(void* data, size_t task) {
  const auto* w = static_cast<const RowsWork*>(data);
  const int64_t lo = int64_t(task) * kRowsPerTask, hi = std::min(w->rows, lo + kRowsPerTask);
  for (int64_t r = lo; r < hi; ++r) {
    const float* x = w->x + r * w->width;
    const float s = row_scale(row_amax(x, w->width));
    w->scale[r] = s;
    encode_row(x, s, w->codes + r * w->width, w->width);
  }
}

void rescale_rows(void* data, size_t task) {
  const auto* w = static_cast<const RowsWork*>(data);
  const int64_t lo = int64_t(task) * kRowsPerTask, hi = std::min(w->rows, lo + kRowsPerTask);
  for (int64_t r = lo; r < hi; ++r)
    rescale_row(w->sums + r * w->width, w->scale[r], w->col, w->out + r * w->width, w->width);
}

// fn(data, t) for t < tasks on onnxruntime's pool; all in this thread when `parallel` is false, there is one task,
// or the pool refuses.
void run_tasks(OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t tasks, void* data, bool parallel = true) {
  if (!parallel || tasks < 2 || !ok(slot<ParallelForFn>(kKernelContextParallelFor)(ctx, fn, tasks, tasks, data)))
    for (size_t t = 0; t < tasks; ++t) fn(data, t);
}

// Rows in tasks of kRowsPerTask on onnxruntime's pool when there is enough work for a second thread.
void for_rows(OrtKernelContext* ctx, void (*fn)(void*, size_t), RowsWork* w) {
  const size_t tasks = size_t((w->rows + kRowsPerTask - 1) / kRowsPerTask);
  run_tasks(ctx, fn, tasks, w, w->rows * w->width >= (int64_t(1) << 15));
}

// A tensor [..., width] seen as rows of its last axis.
RowsWork rows_of(const Tensor& t) {
  RowsWork w{};
  w.width = t.dims[t.rank - 1];
  w.rows = 1;
  for (size_t i = 0; i + 1 < t.rank; ++i) w.rows *= t.dims[i];
  return w;
}

void compute_quantize_rows(void*, OrtKernelContext* ctx) {
  const Tensor x = input(ctx, 0);
  if (!x.data || x.rank < 1) return;
  int64_t dims[8];
  std::copy(x.dims, x.dims + x.rank, dims);
  RowsWork w = rows_of(x);
  OrtValue *codes = nullptr, *scale = nullptr;
  void *codes_data = nullptr, *scale_data = nullptr;
  if (!ok(slot<GetOutputFn>(kKernelContextGetOutput)(ctx, 0, dims, x.rank, &codes))) return;
  dims[x.rank - 1] = 1;
  if (!ok(slot<GetOutputFn>(kKernelContextGetOutput)(ctx, 1, dims, x.rank, &scale))) return;
  if (!ok(slot<GetDataFn>(kGetTensorMutableData)(codes, &codes_data)) ||
      !ok(slot<GetDataFn>(kGetTensorMutableData)(scale, &scale_data)))
    return;
  w.x = static_cast<const float*>(x.data);
  w.codes = static_cast<uint8_t*>(codes_data);
  w.scale = static_cast<float*>(scale_data);
  if (w.rows > 0 && w.width > 0) for_rows(ctx, quantize_rows, &w);
}

void compute_rescale_rows(void*, OrtKernelContext* ctx) {
  const Tensor sums = input(ctx, 0), row = input(ctx, 1), col = input(ctx, 2);
  if (!sums.data || !row.data || !col.data || sums.rank < 1) return;
  RowsWork w = rows_of(sums);
  OrtValue* out = nullptr;
  void* out_data = nullptr;
  if (!ok(slot<GetOutputFn>(kKernelContextGetOutput)(ctx, 0, sums.dims, sums.rank, &out)) ||
      !ok(slot<GetDataFn>(kGetTensorMutableData)(out, &out_data)))
    return;
  w.sums = static_cast<const int32_t*>(sums.data);
  w.scale = static_cast<float*>(row.data);
  w.col = static_cast<const float*>(col.data);
  w.out = static_cast<float*>(out_data);
  if (w.rows > 0 && w.width > 0) for_rows(ctx, rescale_rows, &w);
}

Kernel g_stateless{};  // the row ops have no attributes: every node shares this "kernel"
void* create_stateless(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*) { return &g_stateless; }
void destroy_stateless(void*) {}
const char* quantize_rows_name(const OrtCustomOp*) { return "QuantizeRows"; }
const char* rescale_rows_name(const OrtCustomOp*) { return "RescaleRows"; }
int quantize_rows_input(const OrtCustomOp*, size_t) { return kFloat; }
size_t one(const OrtCustomOp*) { return 1; }
size_t two(const OrtCustomOp*) { return 2; }
size_t three(const OrtCustomOp*) { return 3; }
int quantize_rows_output(const OrtCustomOp*, size_t i) { return i == 0 ? kUint8 : kFloat; }
int rescale_rows_input(const OrtCustomOp*, size_t i) { return i == 0 ? kInt32 : kFloat; }
int required(const OrtCustomOp*, size_t) { return kRequired; }

const OrtCustomOp kQuantizeRows = {
    kCustomOpVersion, create_stateless, quantize_rows_name, op_provider, quantize_rows_input, one,
    quantize_rows_output, two, compute_quantize_rows, destroy_stateless, required, required, input_memory_type,
    {nullptr},
};
const OrtCustomOp kRescaleRows = {
    kCustomOpVersion, create_stateless, rescale_rows_name, op_provider, rescale_rows_input, three, output_type,
    one, compute_rescale_rows, destroy_stateless, required, required, input_memory_type, {nullptr},
};

#include "cpu_linear.inc"
#include "cpu_swiglu.inc"

size_t four(const OrtCustomOp*) { return 4; }
int linear_input_characteristic(const OrtCustomOp*, size_t i) { return i == 3 ? kOptional : kRequired; }
const OrtCustomOp kQLinear = {
    kCustomOpVersion, create_linear, linear_name, op_provider, linear_input, four, output_type, one,
    compute_linear, destroy_linear, linear_input_characteristic, required, input_memory_type, {nullptr},
};
const OrtCustomOp kSwiGLU = {
    kCustomOpVersion, create_stateless, swiglu_name, op_provider, quantize_rows_input, one, output_type, one,
    compute_swiglu, destroy_stateless, required, required, input_memory_type, {nullptr},
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* base) {
  g_api = base->GetApi(kApiVersion);
  if (g_api == nullptr) return nullptr;  // onnxruntime older than 1.17: the session then fails on the op
  OrtCustomOpDomain* domain = nullptr;  // lives as long as the process (sessions may outlive any owner here)
  OrtStatus* status = slot<CreateDomainFn>(kCreateCustomOpDomain)("trtbuild.cpu", &domain);
  if (status) return status;
  for (const OrtCustomOp* op : {&kOp, &kQuantizeRows, &kRescaleRows, &kQLinear, &kSwiGLU}) {
    status = slot<DomainAddFn>(kCustomOpDomainAdd)(domain, op);
    if (status) return status;
  }
  return slot<AddDomainFn>(kAddCustomOpDomain)(options, domain);
}
