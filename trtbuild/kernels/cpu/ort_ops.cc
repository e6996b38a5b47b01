// The onnxruntime glue of trtbuild's native CPU ops, domain "trtbuild.cpu": PagedAttention (paged_attention.h),
// QuantizeRows and RescaleRows (row_ops.h), QLinear (linear.h), SwiGLU (swiglu.h) and MoE (moe.h). The only file
// that knows onnxruntime beyond the opaque context the ops pass to parallel_for: it reads each node's attributes and
// tensors, allocates its outputs, calls the op's entry point, and registers the ops (RegisterCustomOps; the
// library's other exported symbols are the plain C entry points of c_api.cc).
//
// Built by trtbuild/backends/onnxruntime/kernel_library.py (g++ -O3 -march=native, every .cc of this folder in one
// command, at first use, cached per machine) and loaded with SessionOptions.register_custom_ops_library.

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "linear.h"
#include "moe.h"
#include "ort_api.h"
#include "paged_attention.h"
#include "row_ops.h"
#include "swiglu.h"

namespace trtbuild::cpu {
namespace {

const OrtApi* g_api = nullptr;  // set once by RegisterCustomOps, before any session runs a node

template <typename Fn>
Fn slot(ApiSlot s) {
  return reinterpret_cast<Fn>(reinterpret_cast<void* const*>(g_api)[s]);
}

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

// Output `index` allocated in the given shape, its data in *data (null for an empty tensor); false when onnxruntime
// refuses it.
bool output(OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t rank, void** data) {
  OrtValue* value = nullptr;
  return ok(slot<GetOutputFn>(kKernelContextGetOutput)(ctx, index, dims, rank, &value)) &&
         ok(slot<GetDataFn>(kGetTensorMutableData)(value, data));
}

// How many rows a tensor [..., width] has, seen as rows of its last axis.
int64_t leading_rows(const Tensor& t) {
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < t.rank; ++i) rows *= t.dims[i];
  return rows;
}

// ---------------------------------------------------------------------------------------------------------------
// PagedAttention.

struct AttentionKernel {
  Attrs attrs;
};

void compute_attention(void* kernel_ptr, OrtKernelContext* ctx) {
  const Attrs& a = static_cast<AttentionKernel*>(kernel_ptr)->attrs;
  const Tensor qkv = input(ctx, 0), kc = input(ctx, 1), vc = input(ctx, 2), positions = input(ctx, 3),
               tables = input(ctx, 4), qsl = input(ctx, 5), cos_sin = input(ctx, 6);
  Step s{};
  s.num_tokens = qkv.dims[0];
  const int64_t out_dims[2] = {s.num_tokens, a.num_heads * a.head_size};
  void* out_data = nullptr;
  if (!output(ctx, 0, out_dims, 2, &out_data)) return;
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
  paged_attention(ctx, a, s);
}

void* create_attention(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  auto* kernel = new AttentionKernel{};
  Attrs& a = kernel->attrs;
  auto get_int = slot<GetAttrIntFn>(kKernelInfoGetAttributeInt64);
  ok(get_int(info, "num_heads", &a.num_heads));
  ok(get_int(info, "num_kv_heads", &a.num_kv_heads));
  ok(get_int(info, "head_size", &a.head_size));
  if (!ok(get_int(info, "rotary_interleaved", &a.interleaved))) a.interleaved = 0;
  if (!ok(get_int(info, "kv_cache_dtype", &a.cache_type))) a.cache_type = kCacheFloat;
  auto get_float = slot<GetAttrFloatFn>(kKernelInfoGetAttributeFloat);
  ok(get_float(info, "scale", &a.scale));
  // optional: absent means no window / no capping (native.py refuses non-positive values at build time)
  if (!ok(get_int(info, "sliding_window", &a.window)) || a.window < 1) a.window = kNoWindow;
  if (!ok(get_float(info, "softcap", &a.softcap)) || !(a.softcap > 0.0f)) a.softcap = 0.0f;
  return kernel;
}

void destroy_attention(void* kernel) { delete static_cast<AttentionKernel*>(kernel); }
const char* attention_name(const OrtCustomOp*) { return "PagedAttention"; }
const char* op_provider(const OrtCustomOp*) { return nullptr; }  // the CPU execution provider
int attention_input(const OrtCustomOp*, size_t i) {
  return (i == 1 || i == 2) ? kUndefined : (i >= 3 && i <= 5) ? kInt64 : kFloat;
}
size_t attention_input_count(const OrtCustomOp*) { return 9; }
int output_type(const OrtCustomOp*, size_t) { return kFloat; }
int attention_input_characteristic(const OrtCustomOp*, size_t i) { return i >= 6 ? kOptional : kRequired; }
int input_memory_type(const OrtCustomOp*, size_t) { return 0; }  // OrtMemTypeDefault
size_t one(const OrtCustomOp*) { return 1; }
size_t two(const OrtCustomOp*) { return 2; }
size_t three(const OrtCustomOp*) { return 3; }
size_t four(const OrtCustomOp*) { return 4; }
int required(const OrtCustomOp*, size_t) { return kRequired; }

const OrtCustomOp kPagedAttention = {
    kCustomOpVersion, create_attention, attention_name, op_provider,  attention_input, attention_input_count,
    output_type,      one,              compute_attention, destroy_attention, attention_input_characteristic,
    required,         input_memory_type, {nullptr},
};

// ---------------------------------------------------------------------------------------------------------------
// The stateless row ops: QuantizeRows, RescaleRows, SwiGLU.

struct Stateless {};
Stateless g_stateless;  // the row ops have no attributes: every node shares this "kernel"
void* create_stateless(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*) { return &g_stateless; }
void destroy_stateless(void*) {}

void compute_quantize_rows(void*, OrtKernelContext* ctx) {
  const Tensor x = input(ctx, 0);
  if (!x.data || x.rank < 1) return;
  int64_t dims[8];
  std::copy(x.dims, x.dims + x.rank, dims);
  void *codes = nullptr, *scale = nullptr;
  if (!output(ctx, 0, dims, x.rank, &codes)) return;
  dims[x.rank - 1] = 1;
  if (!output(ctx, 1, dims, x.rank, &scale)) return;
  quantize_rows(ctx, static_cast<const float*>(x.data), static_cast<uint8_t*>(codes), static_cast<float*>(scale),
                leading_rows(x), x.dims[x.rank - 1]);
}

void compute_rescale_rows(void*, OrtKernelContext* ctx) {
  const Tensor sums = input(ctx, 0), row = input(ctx, 1), col = input(ctx, 2);
  if (!sums.data || !row.data || !col.data || sums.rank < 1) return;
  void* out = nullptr;
  if (!output(ctx, 0, sums.dims, sums.rank, &out)) return;
  rescale_rows(ctx, static_cast<const int32_t*>(sums.data), static_cast<const float*>(row.data),
               static_cast<const float*>(col.data), static_cast<float*>(out), leading_rows(sums),
               sums.dims[sums.rank - 1]);
}

void compute_swiglu(void*, OrtKernelContext* ctx) {
  const Tensor x = input(ctx, 0);
  if (!x.data || x.rank < 1 || x.dims[x.rank - 1] % 2 != 0) return;  // an odd width: refused at build time
  int64_t dims[8];
  std::copy(x.dims, x.dims + x.rank, dims);
  dims[x.rank - 1] /= 2;
  void* y = nullptr;
  if (!output(ctx, 0, dims, x.rank, &y)) return;
  swiglu(ctx, static_cast<const float*>(x.data), static_cast<float*>(y), leading_rows(x), x.dims[x.rank - 1]);
}

const char* quantize_rows_name(const OrtCustomOp*) { return "QuantizeRows"; }
const char* rescale_rows_name(const OrtCustomOp*) { return "RescaleRows"; }
const char* swiglu_name(const OrtCustomOp*) { return "SwiGLU"; }
int float_input(const OrtCustomOp*, size_t) { return kFloat; }
int quantize_rows_output(const OrtCustomOp*, size_t i) { return i == 0 ? kUint8 : kFloat; }
int rescale_rows_input(const OrtCustomOp*, size_t i) { return i == 0 ? kInt32 : kFloat; }

const OrtCustomOp kQuantizeRows = {
    kCustomOpVersion, create_stateless, quantize_rows_name, op_provider, float_input, one,
    quantize_rows_output, two, compute_quantize_rows, destroy_stateless, required, required, input_memory_type,
    {nullptr},
};
const OrtCustomOp kRescaleRows = {
    kCustomOpVersion, create_stateless, rescale_rows_name, op_provider, rescale_rows_input, three, output_type,
    one, compute_rescale_rows, destroy_stateless, required, required, input_memory_type, {nullptr},
};
const OrtCustomOp kSwiGLU = {
    kCustomOpVersion, create_stateless, swiglu_name, op_provider, float_input, one, output_type, one,
    compute_swiglu, destroy_stateless, required, required, input_memory_type, {nullptr},
};

// ---------------------------------------------------------------------------------------------------------------
// QLinear.

struct LinearKernel {
  LinearAttrs attrs;
};

void compute_linear(void* kernel_ptr, OrtKernelContext* ctx) {
  const LinearAttrs& a = static_cast<LinearKernel*>(kernel_ptr)->attrs;
  const Tensor x = input(ctx, 0), wt = input(ctx, 1), ws = input(ctx, 2), wo = input(ctx, 3);
  if (!x.data || !wt.data || !ws.data || x.rank < 1 || x.dims[x.rank - 1] != a.in_features) return;
  int64_t dims[8];
  std::copy(x.dims, x.dims + x.rank, dims);
  dims[x.rank - 1] = a.out_features;
  void* y = nullptr;
  if (!output(ctx, 0, dims, x.rank, &y)) return;
  qlinear(ctx, a, static_cast<const float*>(x.data), leading_rows(x), static_cast<const uint8_t*>(wt.data),
          static_cast<const float*>(ws.data), static_cast<const float*>(wo.data), static_cast<float*>(y));
}

void* create_linear(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  auto* kernel = new LinearKernel{};
  LinearAttrs& a = kernel->attrs;
  auto get_int = slot<GetAttrIntFn>(kKernelInfoGetAttributeInt64);
  ok(get_int(info, "bits", &a.bits));
  ok(get_int(info, "in_features", &a.in_features));
  ok(get_int(info, "out_features", &a.out_features));
  ok(get_int(info, "group", &a.group));
  ok(get_int(info, "block", &a.block));
  return kernel;
}

void destroy_linear(void* kernel) { delete static_cast<LinearKernel*>(kernel); }
const char* linear_name(const OrtCustomOp*) { return "QLinear"; }
int linear_input(const OrtCustomOp*, size_t i) { return i == 1 ? kUint8 : kFloat; }
int linear_input_characteristic(const OrtCustomOp*, size_t i) { return i == 3 ? kOptional : kRequired; }

const OrtCustomOp kQLinear = {
    kCustomOpVersion, create_linear, linear_name, op_provider, linear_input, four, output_type, one,
    compute_linear, destroy_linear, linear_input_characteristic, required, input_memory_type, {nullptr},
};

// ---------------------------------------------------------------------------------------------------------------
// MoE.

struct MoeKernel {
  int64_t top_k = 0, renormalize = 0;
  bool int4 = false;   // the node has `group_size`: its experts are int4 (uint8, two codes a byte)
  int64_t group = 0;  // with int4
  // The node has `activation_block`: packed experts (the integer path), with `bits` and `intermediate_size` (I)
  bool packed = false;
  int64_t block = 0, bits = 0, inter = 0;
};

// Whether the int4 or int8 scales `s` of a [E, rows, in] expert tensor have their shape ([E, rows, blocks] or
// [E, rows]).
bool scale_fits(const Tensor& s, int64_t experts, int64_t rows, int64_t in, const MoeKernel& k) {
  const bool rows_fit = s.dims[0] == experts && s.dims[1] == rows;
  if (k.int4) return s.rank == 3 && rows_fit && s.dims[2] == (in + k.group - 1) / k.group;
  return s.rank == 2 && rows_fit;
}

// Float, int8 or int4 experts as the portable node has them (inputs 2-5) into `a`; false where they do not fit.
bool raw_experts(OrtKernelContext* ctx, const MoeKernel& k, MoeArgs& a) {
  const Tensor gate_up = input(ctx, 2), down = input(ctx, 3);
  if (gate_up.rank != 3 || down.rank != 3 || !gate_up.data || !down.data) return false;
  a.inter = gate_up.dims[1] / 2;
  const int64_t per_byte = k.int4 ? 2 : 1;  // int4: the last dimensions hold two in-features a byte
  const Tensor gate_up_scale = input(ctx, 4), down_scale = input(ctx, 5);  // int8 / int4 experts only
  const bool scaled = gate_up_scale.data != nullptr && down_scale.data != nullptr;
  const bool consistent =
      gate_up.dims[0] == a.experts && gate_up.dims[2] * per_byte == a.hidden_size && down.dims[0] == a.experts &&
      down.dims[1] == a.hidden_size && down.dims[2] * per_byte == a.inter &&
      (!k.int4 || (scaled && k.group >= 2 && k.group % 2 == 0)) &&
      (!scaled || (scale_fits(gate_up_scale, a.experts, 2 * a.inter, a.hidden_size, k) &&
                   scale_fits(down_scale, a.experts, a.hidden_size, a.inter, k)));
  if (!consistent) return false;
  if (scaled) {
    a.gate_up_scale = static_cast<const float*>(gate_up_scale.data);
    a.down_scale = static_cast<const float*>(down_scale.data);
  }
  if (k.int4) {
    a.gate_up_q4 = static_cast<const uint8_t*>(gate_up.data);
    a.down_q4 = static_cast<const uint8_t*>(down.data);
  } else if (scaled) {
    a.gate_up_q = static_cast<const int8_t*>(gate_up.data);
    a.down_q = static_cast<const int8_t*>(down.data);
  } else {
    a.gate_up = static_cast<const float*>(gate_up.data);
    a.down = static_cast<const float*>(down.data);
  }
  return true;
}

// Whether QLinear takes these attributes (linear.h: blocks of whole packed steps, or one block a row, each within
// one weight group) and an expert tensor `w` [E, panels, steps, 64] with its scales `s` [E, groups, panels * 16].
bool packed_fits(const Tensor& w, const Tensor& s, int64_t experts, const LinearAttrs& l) {
  const int64_t step = l.bits == 8 ? 4 : 8, k = l.in_features;
  const bool blocks = l.block >= 1 && (l.block % step == 0 || l.block >= k) && (l.group >= k || l.group % l.block == 0);
  return blocks && w.data && s.data && w.rank == 4 && s.rank == 3 && w.dims[0] == experts && s.dims[0] == experts &&
         w.dims[1] * w.dims[2] * w.dims[3] == packed_bytes(l) && s.dims[1] * s.dims[2] == scale_floats(l);
}

// Packed experts (inputs 2-5: the integer path) into `a`; false where they do not fit the node's attributes.
bool packed_experts(OrtKernelContext* ctx, const MoeKernel& k, MoeArgs& a) {
  const Tensor gate_up = input(ctx, 2), down = input(ctx, 3), gate_up_scale = input(ctx, 4),
               down_scale = input(ctx, 5);
  a.inter = k.inter;
  const int64_t h = a.hidden_size, i = a.inter;
  a.gate_up_linear = LinearAttrs{k.bits, h, 2 * i, k.int4 ? k.group : h, k.block};
  a.down_linear = LinearAttrs{k.bits, i, h, k.int4 ? k.group : i, k.block};
  if ((k.bits != 8 && k.bits != 4) || i < 1 || (k.int4 != (k.bits == 4)) || (k.int4 && k.group < 2)) return false;
  if (!packed_fits(gate_up, gate_up_scale, a.experts, a.gate_up_linear) ||
      !packed_fits(down, down_scale, a.experts, a.down_linear))
    return false;
  a.gate_up_packed = static_cast<const uint8_t*>(gate_up.data);
  a.down_packed = static_cast<const uint8_t*>(down.data);
  a.gate_up_ws = static_cast<const float*>(gate_up_scale.data);
  a.down_ws = static_cast<const float*>(down_scale.data);
  return true;
}

void compute_moe(void* kernel_ptr, OrtKernelContext* ctx) {
  const MoeKernel& k = *static_cast<MoeKernel*>(kernel_ptr);
  const Tensor x = input(ctx, 0), logits = input(ctx, 1);
  if (x.rank != 2 || logits.rank != 2) return;
  void* y = nullptr;
  if (!output(ctx, 0, x.dims, 2, &y) || y == nullptr) return;
  MoeArgs a{};
  a.tokens = x.dims[0];
  a.hidden_size = x.dims[1];
  a.experts = logits.dims[1];
  a.top_k = k.top_k;
  a.renormalize = k.renormalize != 0;
  a.group = k.group;
  const bool consistent = x.data && logits.data && logits.dims[0] == a.tokens && a.top_k >= 1 &&
                          a.top_k <= a.experts && (k.packed ? packed_experts(ctx, k, a) : raw_experts(ctx, k, a));
  if (!consistent) {  // refused at build time
    std::fill(static_cast<float*>(y), static_cast<float*>(y) + a.tokens * a.hidden_size, 0.0f);
    return;
  }
  a.hidden = static_cast<const float*>(x.data);
  a.logits = static_cast<const float*>(logits.data);
  a.out = static_cast<float*>(y);
  moe(ctx, a);
}

void* create_moe(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  auto* kernel = new MoeKernel{};
  auto get_int = slot<GetAttrIntFn>(kKernelInfoGetAttributeInt64);
  ok(get_int(info, "top_k", &kernel->top_k));
  ok(get_int(info, "renormalize", &kernel->renormalize));
  kernel->int4 = ok(get_int(info, "group_size", &kernel->group));  // absent: float or int8 experts
  kernel->packed = ok(get_int(info, "activation_block", &kernel->block));  // absent: float or raw quantized experts
  if (kernel->packed) {
    ok(get_int(info, "bits", &kernel->bits));
    ok(get_int(info, "intermediate_size", &kernel->inter));
  }
  return kernel;
}

void destroy_moe(void* kernel) { delete static_cast<MoeKernel*>(kernel); }
const char* moe_name(const OrtCustomOp*) { return "MoE"; }
int moe_input(const OrtCustomOp*, size_t i) {  // experts: float, int8, uint8 (int4) or uint8 (packed)
  return (i == 2 || i == 3) ? kUndefined : kFloat;
}
size_t six(const OrtCustomOp*) { return 6; }
int moe_input_characteristic(const OrtCustomOp*, size_t i) { return i >= 4 ? kOptional : kRequired; }

const OrtCustomOp kMoE = {
    kCustomOpVersion, create_moe, moe_name, op_provider, moe_input, six, output_type, one,
    compute_moe, destroy_moe, moe_input_characteristic, required, input_memory_type, {nullptr},
};

}  // namespace

bool parallel_for(OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t tasks, void* data) {
  if (ctx == nullptr) return host_parallel_for(fn, tasks, data);  // not called by onnxruntime: c_api.cc
  return ok(slot<ParallelForFn>(kKernelContextParallelFor)(ctx, fn, tasks, tasks, data));
}

}  // namespace trtbuild::cpu

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* base) {
  using namespace trtbuild::cpu;
  g_api = base->GetApi(kApiVersion);
  if (g_api == nullptr) return nullptr;  // onnxruntime older than 1.17: the session then fails on the op
  OrtCustomOpDomain* domain = nullptr;  // lives as long as the process (sessions may outlive any owner here)
  OrtStatus* status = slot<CreateDomainFn>(kCreateCustomOpDomain)("trtbuild.cpu", &domain);
  if (status) return status;
  for (const OrtCustomOp* op : {&kPagedAttention, &kQuantizeRows, &kRescaleRows, &kQLinear, &kSwiGLU, &kMoE}) {
    status = slot<DomainAddFn>(kCustomOpDomainAdd)(domain, op);
    if (status) return status;
  }
  return slot<AddDomainFn>(kAddCustomOpDomain)(options, domain);
}
