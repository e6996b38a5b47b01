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
// widened to float in the dot products and each product scaled by its row's scale; int4 experts are unpacked to
// float in the dot products, each block of `group` in-features summed apart and scaled by its block's scale (the
// dot products: moe_rows.h). A batch-1 decode step of int4 experts reads the k routed experts' packed bytes only.
//
// Packed experts (the integer path, the node's `activation_block`) replace steps 2 and 3: the slots' hidden rows are
// gathered in slot order (an expert's rows one block), and per routed expert QLinear (linear.h) runs its gate_up on
// its rows, quantized to int8 per activation block, then SwiGLU (swiglu.h) over every slot, then QLinear its down:
// exact integer products on VNNI / AVX2 / AMX. The thread split is QLinear's (over output columns, so a one-token
// step runs on every thread), one expert after another.

#include "moe.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "linear.h"
#include "moe_rows.h"
#include "swiglu.h"

namespace trtbuild::cpu {
namespace {

constexpr int64_t kTokensPerPass = 256;  // bounds the scratch: pass slots x (I + H) floats
constexpr int64_t kMoeRowsPerTask = 16;  // the least rows a task takes (and the multiple it takes)
constexpr int64_t kTargetTasks = 32;     // per step kind: more tasks of fewer rows each cost dispatch, not work

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
  std::vector<float> x;        // packed experts: [slots, H], each slot's hidden row
  std::vector<float> gate_up;  // packed experts: [slots, 2I], QLinear's gate_up output
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

// Step 2, one task: gate rows [r0, r1) of an expert and their up rows, over every slot of the expert; `w`: the
// expert's gate_up rows (with_expert_rows).
template <typename Rows>
void gate_up_rows(Pass& p, size_t task, const Rows& w) {
  const MoeArgs& a = *p.a;
  const int64_t e = p.task_expert[task], r0 = p.task_row[task];
  const int64_t r1 = std::min(a.inter, r0 + p.rows_per_task);
  for (int64_t b0 = r0; b0 < r1; b0 += kMoeRowsPerTask) {  // a block of rows stays in cache over the slots
    const int64_t b1 = std::min(r1, b0 + kMoeRowsPerTask);
    for (int64_t s0 = p.begin[e]; s0 < p.begin[e + 1]; s0 += 4) {
      const int n = int(std::min<int64_t>(4, p.begin[e + 1] - s0));
      const float* x[4];
      for (int j = 0; j < n; ++j) x[j] = a.hidden + p.slot_token[s0 + j] * a.hidden_size;
      for (int64_t r = b0; r < b1; ++r) {
        float g[4], u[4];
        w.dots(r, a.inter + r, x, n, g, u);
        for (int j = 0; j < n; ++j) p.act[(s0 + j) * a.inter + r] = silu_times(g[j], u[j]);
      }
    }
  }
}

void gate_up_task(void* data, size_t task) {
  Pass& p = *static_cast<Pass*>(data);
  with_expert_rows(*p.a, true, p.task_expert[task], [&](const auto& w) { gate_up_rows(p, task, w); });
}

// Step 3, one task: down rows [r0, r1) of an expert over every slot of the expert (`w` as step 2's).
template <typename Rows>
void down_rows(Pass& p, size_t task, const Rows& w) {
  const MoeArgs& a = *p.a;
  const int64_t e = p.task_expert[task], r0 = p.task_row[task];
  const int64_t r1 = std::min(a.hidden_size, r0 + p.rows_per_task);
  for (int64_t b0 = r0; b0 < r1; b0 += kMoeRowsPerTask) {  // a block of rows stays in cache over the slots
    const int64_t b1 = std::min(r1, b0 + kMoeRowsPerTask);
    for (int64_t s0 = p.begin[e]; s0 < p.begin[e + 1]; s0 += 4) {
      const int n = int(std::min<int64_t>(4, p.begin[e + 1] - s0));
      const float* x[4];
      for (int j = 0; j < n; ++j) x[j] = p.act.data() + (s0 + j) * a.inter;
      for (int64_t r = b0; r < b1; r += 2) {  // rows in pairs (an odd last row is paired with itself)
        const int64_t r_next = std::min(r + 1, b1 - 1);
        float y0[4], y1[4];
        w.dots(r, r_next, x, n, y0, y1);
        for (int j = 0; j < n; ++j) {
          p.y[(s0 + j) * a.hidden_size + r] = y0[j];
          p.y[(s0 + j) * a.hidden_size + r_next] = y1[j];
        }
      }
    }
  }
}

void down_task(void* data, size_t task) {
  Pass& p = *static_cast<Pass*>(data);
  with_expert_rows(*p.a, false, p.task_expert[task], [&](const auto& w) { down_rows(p, task, w); });
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

// Steps 2 and 3 for packed experts (the header): p.act and p.y of every slot of the pass.
void integer_experts(OrtKernelContext* ctx, Pass& p) {
  const MoeArgs& a = *p.a;
  const int64_t h = a.hidden_size, i2 = 2 * a.inter, slots = p.begin[a.experts];
  const int64_t gu_bytes = packed_bytes(a.gate_up_linear), gu_floats = scale_floats(a.gate_up_linear);
  const int64_t d_bytes = packed_bytes(a.down_linear), d_floats = scale_floats(a.down_linear);
  p.x.resize(slots * h);
  p.gate_up.resize(slots * i2);
  for (int64_t s = 0; s < slots; ++s) std::memcpy(&p.x[s * h], a.hidden + p.slot_token[s] * h, h * sizeof(float));
  for (int64_t e = 0; e < a.experts; ++e) {
    const int64_t b = p.begin[e], n = p.begin[e + 1] - b;  // n == 0: qlinear returns at once
    qlinear(ctx, a.gate_up_linear, &p.x[b * h], n, a.gate_up_packed + e * gu_bytes, a.gate_up_ws + e * gu_floats,
            nullptr, &p.gate_up[b * i2]);
  }
  swiglu(ctx, p.gate_up.data(), p.act.data(), slots, i2);
  for (int64_t e = 0; e < a.experts; ++e) {
    const int64_t b = p.begin[e], n = p.begin[e + 1] - b;
    qlinear(ctx, a.down_linear, &p.act[b * a.inter], n, a.down_packed + e * d_bytes, a.down_ws + e * d_floats,
            nullptr, &p.y[b * h]);
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
    if (a.gate_up_packed != nullptr) {
      integer_experts(ctx, p);
    } else {
      make_tasks(p, a.inter);
      run_tasks(ctx, gate_up_task, p.task_expert.size(), &p, parallel);
      make_tasks(p, a.hidden_size);
      run_tasks(ctx, down_task, p.task_expert.size(), &p, parallel);
    }
    run_tasks(ctx, combine_task, size_t((n + kRowsPerTask - 1) / kRowsPerTask), &p, parallel);
  }
}

}  // namespace trtbuild::cpu
