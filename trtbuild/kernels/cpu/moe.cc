// MoE: the routed mixture of SwiGLU experts of `trtbuild::MoE` (plugins/moe/README.md) for onnxruntime's CPU engines
// (domain "trtbuild.cpu", glue in ort_ops.cc; backends/onnxruntime/build/moe.py places it; tests/test_cpu_moe.py
// checks it against the numpy oracle).
//
// Tokens are routed in passes of at most kTokensPerPass. A pass:
// 1. routes each token (softmax over all experts in double, the top k by descending logit, ties to the lower
//    expert, weights renormalised when asked) and gives each (token, kept expert) pair a *slot*, slots grouped by
//    expert, tokens ascending within an expert;
// 2. per routed expert, in tasks of a few dozen gate rows (about kTargetTasks tasks in all): each gate row and its
//    up row are read once and dotted with every slot's token, four slots at a time, and the slot's activation
//    silu(g) * u written (the gate/up product never stored);
// 3. per routed expert, in tasks of down rows likewise (rows in pairs): each row is read once and dotted with every
//    slot's activation;
// 4. per token: out = the weighted sum of its k slots' outputs, in the order the router ranked them.
// Experts no token chose are never read: a batch-1 decode step reads k of E experts. Each expert's weights are read
// once per pass, whatever its number of tokens. Results do not depend on the number of threads. Int8 experts are
// widened to float in the dot products and each product scaled by its row's scale.

#include "moe.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace trtbuild::cpu {
namespace {

constexpr int64_t kTokensPerPass = 256;  // bounds the scratch: pass slots x (I + H) floats
constexpr int64_t kMoeRowsPerTask = 16;  // the least rows a task takes (and the multiple it takes)
constexpr int64_t kTargetTasks = 32;     // per step kind: more tasks of fewer rows each cost dispatch, not work

// Eight int8 weights widened to floats (int8 experts): one sign-extending load and a conversion with AVX2 (GCC
// lowers the generic form to a byte-by-byte insert, 3x slower a decode step).
inline v8 load8(const int8_t* p) {
  v8 out;
#if defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &f, sizeof(out));
#else
  typedef int8_t v8b __attribute__((vector_size(8)));
  v8b b;
  std::memcpy(&b, p, sizeof(b));
  out = __builtin_convertvector(b, v8);
#endif
  return out;
}

inline float hsum(v8 v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// The dot products of two weight rows w0, w1 with N vectors x[j], each of length len: out0[j], out1[j]. Each load
// of a row serves every vector and each load of a vector both rows; N is a constant so that the 2 N accumulators
// stay in registers.
template <int N, typename W>
inline void dots2_n(const W* w0, const W* w1, const float* const* x, int64_t len, float* out0, float* out1) {
  v8 a0[N] = {}, a1[N] = {};
  const float* xs[N];
  for (int j = 0; j < N; ++j) xs[j] = x[j];
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const v8 u0 = load8(w0 + i), u1 = load8(w1 + i);
    for (int j = 0; j < N; ++j) {
      const v8 xv = load8(xs[j] + i);
      a0[j] += u0 * xv;
      a1[j] += u1 * xv;
    }
  }
  for (int j = 0; j < N; ++j) {
    float s0 = hsum(a0[j]), s1 = hsum(a1[j]);
    for (int64_t k = i; k < len; ++k) {
      s0 += float(w0[k]) * x[j][k];
      s1 += float(w1[k]) * x[j][k];
    }
    out0[j] = s0;
    out1[j] = s1;
  }
}

// dots2_n for n = 1..4 vectors; W: float or int8 weights (the products then want the rows' scales).
template <typename W>
inline void dots2(const W* w0, const W* w1, const float* const* x, int n, int64_t len, float* out0, float* out1) {
  switch (n) {
    case 1: return dots2_n<1>(w0, w1, x, len, out0, out1);
    case 2: return dots2_n<2>(w0, w1, x, len, out0, out1);
    case 3: return dots2_n<3>(w0, w1, x, len, out0, out1);
    default: return dots2_n<4>(w0, w1, x, len, out0, out1);
  }
}

inline float silu_times(float g, float u) {
  const float e = exp_nonpositive(-std::fabs(g));
  const float s = (g < 0.0f ? e : 1.0f) / (e + 1.0f);
  return (g * s) * u;
}

struct Pass {
  const MoeArgs* a;
  std::vector<int64_t> begin;       // [E + 1]: expert e's slots are [begin[e], begin[e + 1])
  std::vector<int64_t> slot_token;  // slot -> token
  std::vector<int64_t> token_slot;  // [tokens of the pass, k]: the slot of each kept expert, in rank order
  std::vector<float> token_weight;  // [tokens of the pass, k]
  std::vector<int64_t> task_expert, task_row;
  int64_t rows_per_task = kMoeRowsPerTask;
  std::vector<float> act;  // [slots, I]
  std::vector<float> y;    // [slots, H]
  int64_t first_token = 0, tokens = 0;
};

// Step 1 for tokens [first, first + n).
void route(Pass& p, int64_t first, int64_t n) {
  const MoeArgs& a = *p.a;
  const int64_t e_count = a.experts, k = a.top_k;
  p.first_token = first;
  p.tokens = n;
  std::vector<int64_t> chosen(n * k);
  std::vector<double> prob(e_count);
  std::vector<char> taken(e_count);
  p.token_weight.assign(n * k, 0.0f);
  p.begin.assign(e_count + 1, 0);
  for (int64_t t = 0; t < n; ++t) {
    const float* l = a.logits + (first + t) * e_count;
    const float top = *std::max_element(l, l + e_count);
    double total = 0.0;
    for (int64_t e = 0; e < e_count; ++e) total += prob[e] = std::exp(double(l[e]) - double(top));
    std::fill(taken.begin(), taken.end(), 0);
    double kept = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < e_count; ++e)
        if (!taken[e] && (best < 0 || l[e] > l[best])) best = e;
      taken[best] = 1;
      chosen[t * k + j] = best;
      kept += prob[best];
      p.begin[best + 1] += 1;
    }
    const double norm = a.renormalize ? kept : total;
    for (int64_t j = 0; j < k; ++j) p.token_weight[t * k + j] = float(prob[chosen[t * k + j]] / norm);
  }
  for (int64_t e = 0; e < e_count; ++e) p.begin[e + 1] += p.begin[e];
  std::vector<int64_t> cursor(p.begin.begin(), p.begin.end() - 1);
  p.slot_token.resize(n * k);
  p.token_slot.resize(n * k);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t slot = cursor[chosen[t * k + j]]++;
      p.slot_token[slot] = first + t;
      p.token_slot[t * k + j] = slot;
    }
}

// Tasks of rows_per_task rows of `rows` per routed expert: about kTargetTasks in all, at least kMoeRowsPerTask rows
// each (a multiple of it), a task within one expert.
void make_tasks(Pass& p, int64_t rows) {
  p.task_expert.clear();
  p.task_row.clear();
  int64_t routed = 0;
  for (int64_t e = 0; e < p.a->experts; ++e) routed += p.begin[e + 1] > p.begin[e];
  const int64_t want = (routed * rows + kTargetTasks - 1) / kTargetTasks;
  p.rows_per_task = std::max<int64_t>(1, (want + kMoeRowsPerTask - 1) / kMoeRowsPerTask) * kMoeRowsPerTask;
  for (int64_t e = 0; e < p.a->experts; ++e) {
    if (p.begin[e + 1] == p.begin[e]) continue;
    for (int64_t r = 0; r < rows; r += p.rows_per_task) {
      p.task_expert.push_back(e);
      p.task_row.push_back(r);
    }
  }
}

// Step 2, one task: gate rows [r0, r1) of an expert and their up rows, over every slot of the expert; `base`: the
// float or int8 gate_up, `scales` the int8 rows' scales (null for float).
template <typename W>
void gate_up_rows(Pass& p, size_t task, const W* base, const float* scales) {
  const MoeArgs& a = *p.a;
  const int64_t e = p.task_expert[task], r0 = p.task_row[task];
  const int64_t r1 = std::min(a.inter, r0 + p.rows_per_task);
  const W* w = base + e * 2 * a.inter * a.hidden_size;
  const float* scale = scales ? scales + e * 2 * a.inter : nullptr;
  for (int64_t b0 = r0; b0 < r1; b0 += kMoeRowsPerTask) {  // a block of rows stays in cache over the slots
    const int64_t b1 = std::min(r1, b0 + kMoeRowsPerTask);
    for (int64_t s0 = p.begin[e]; s0 < p.begin[e + 1]; s0 += 4) {
      const int n = int(std::min<int64_t>(4, p.begin[e + 1] - s0));
      const float* x[4];
      for (int j = 0; j < n; ++j) x[j] = a.hidden + p.slot_token[s0 + j] * a.hidden_size;
      for (int64_t r = b0; r < b1; ++r) {
        float g[4], u[4];
        dots2(w + r * a.hidden_size, w + (a.inter + r) * a.hidden_size, x, n, a.hidden_size, g, u);
        const float gs = scale ? scale[r] : 1.0f, us = scale ? scale[a.inter + r] : 1.0f;
        for (int j = 0; j < n; ++j) p.act[(s0 + j) * a.inter + r] = silu_times(g[j] * gs, u[j] * us);
      }
    }
  }
}

void gate_up_task(void* data, size_t task) {
  Pass& p = *static_cast<Pass*>(data);
  if (p.a->gate_up_q)
    gate_up_rows(p, task, p.a->gate_up_q, p.a->gate_up_scale);
  else
    gate_up_rows(p, task, p.a->gate_up, nullptr);
}

// Step 3, one task: down rows [r0, r1) of an expert over every slot of the expert (`base`, `scales` as step 2's).
template <typename W>
void down_rows(Pass& p, size_t task, const W* base, const float* scales) {
  const MoeArgs& a = *p.a;
  const int64_t e = p.task_expert[task], r0 = p.task_row[task];
  const int64_t r1 = std::min(a.hidden_size, r0 + p.rows_per_task);
  const W* w = base + e * a.hidden_size * a.inter;
  const float* scale = scales ? scales + e * a.hidden_size : nullptr;
  for (int64_t b0 = r0; b0 < r1; b0 += kMoeRowsPerTask) {  // a block of rows stays in cache over the slots
    const int64_t b1 = std::min(r1, b0 + kMoeRowsPerTask);
    for (int64_t s0 = p.begin[e]; s0 < p.begin[e + 1]; s0 += 4) {
      const int n = int(std::min<int64_t>(4, p.begin[e + 1] - s0));
      const float* x[4];
      for (int j = 0; j < n; ++j) x[j] = p.act.data() + (s0 + j) * a.inter;
      for (int64_t r = b0; r < b1; r += 2) {  // rows in pairs (an odd last row is paired with itself)
        const int64_t r_next = std::min(r + 1, b1 - 1);
        float y0[4], y1[4];
        dots2(w + r * a.inter, w + r_next * a.inter, x, n, a.inter, y0, y1);
        const float c0 = scale ? scale[r] : 1.0f, c1 = scale ? scale[r_next] : 1.0f;
        for (int j = 0; j < n; ++j) {
          p.y[(s0 + j) * a.hidden_size + r] = y0[j] * c0;
          p.y[(s0 + j) * a.hidden_size + r_next] = y1[j] * c1;
        }
      }
    }
  }
}

void down_task(void* data, size_t task) {
  Pass& p = *static_cast<Pass*>(data);
  if (p.a->down_q)
    down_rows(p, task, p.a->down_q, p.a->down_scale);
  else
    down_rows(p, task, p.a->down, nullptr);
}

// Step 4, one task: kRowsPerTask tokens of the pass.
void combine_task(void* data, size_t task) {
  Pass& p = *static_cast<Pass*>(data);
  const MoeArgs& a = *p.a;
  const int64_t h = a.hidden_size, k = a.top_k;
  const int64_t lo = int64_t(task) * kRowsPerTask, hi = std::min(p.tokens, lo + kRowsPerTask);
  for (int64_t t = lo; t < hi; ++t) {
    float* out = a.out + (p.first_token + t) * h;
    std::fill(out, out + h, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const float w = p.token_weight[t * k + j];
      const float* y = p.y.data() + p.token_slot[t * k + j] * h;
      for (int64_t i = 0; i < h; ++i) out[i] += w * y[i];
    }
  }
}

}  // namespace

void moe(OrtKernelContext* ctx, const MoeArgs& a) {
  Pass p;
  p.a = &a;
  for (int64_t first = 0; first < a.tokens; first += kTokensPerPass) {
    const int64_t n = std::min(kTokensPerPass, a.tokens - first);
    route(p, first, n);
    const int64_t slots = n * a.top_k;
    const bool parallel = slots * a.inter * a.hidden_size >= (int64_t(1) << 15);
    p.act.resize(slots * a.inter);
    p.y.resize(slots * a.hidden_size);
    make_tasks(p, a.inter);
    run_tasks(ctx, gate_up_task, p.task_expert.size(), &p, parallel);
    make_tasks(p, a.hidden_size);
    run_tasks(ctx, down_task, p.task_expert.size(), &p, parallel);
    run_tasks(ctx, combine_task, size_t((n + kRowsPerTask - 1) / kRowsPerTask), &p, parallel);
  }
}

}  // namespace trtbuild::cpu
