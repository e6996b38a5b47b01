// The subset of onnxruntime's C ABI that the glue (ort_ops.cc) uses, declared by hand: no onnxruntime header ships
// in any package reachable here. OrtApi is a table of function pointers that only ever grows at its end (slot
// numbers are stable across releases), OrtCustomOp a struct that onnxruntime reads up to its `version`. The
// library links nothing: onnxruntime hands it the table when a session registers it (RegisterCustomOps).

#pragma once

#include <cstddef>
#include <cstdint>

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

namespace trtbuild::cpu {
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
enum Characteristic : int { kRequired = 0, kOptional = 1 };

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

// The signatures of the slots above.
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

}  // namespace
}  // namespace trtbuild::cpu
