"""The onnxruntime build's graph rewrites, in the order they run: ``PASSES``.

The portable graph (``graph/emit.py``: standard ONNX ops, one ``trtbuild::PagedAttention`` node per layer, one
``trtbuild::MoE`` node per sparse layer, the quantized formats' Q/DQ patterns) enters the first pass; the graph the
last one leaves is the engine: standard and ``com.microsoft`` ops onnxruntime runs, plus the native library's
``trtbuild.cpu`` ops where the build chose them.
Each pass's module states its contract (the ops it rewrites, into what); a pass that finds nothing to rewrite
leaves the graph as it is.

What the engine holds is recorded in its runtime config: ``settle_options`` falls back before the passes (no
native kernel for this attention, no SIMD for ``QLinear``), and a pass with a ``settle`` step falls back after it
(``native_linears`` that replaced nothing: a float model), so the passes after it see the options as recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import onnx

from ....config import BuildConfig, CpuAttention, CpuLinear, EngineIO, ModelConfig
from ....kernels.library import NATIVE_DOMAIN, QLINEAR_OP
from .embedding import offset_embedding_head, shared_int8_embedding
from .lowering import lower_for_onnxruntime
from .moe import lowered_moe, native_moe, quantized_experts
from .native import fuse_swiglu, lower_to_native, native_supports
from .native_linear import LinearSimd, cpu_linear_simd, native_linears
from .weights import (
    hand_activations_to_kernel,
    integer_gemms_per_token,
    offset_linears,
    reblock_int8_weights,
    unsigned_static_int8_weights,
)


@dataclass(frozen=True)
class Target:
    """What the passes lower for: the build options as the engine records them, the model, its I/O names."""

    build: BuildConfig
    model: ModelConfig
    io: EngineIO


@dataclass(frozen=True)
class Pass:
    """One rewrite of the graph: ``run`` when ``applies`` to the target; ``settle``, when given, revises the
    recorded build options from the rewritten graph (the passes after it see the revised ones)."""

    name: str
    applies: Callable[[Target], bool]
    run: Callable[[onnx.ModelProto, Target], onnx.ModelProto]
    settle: Callable[[onnx.ModelProto, BuildConfig], BuildConfig] | None = None


def _always(target: Target) -> bool:
    return True


def _native_attention(target: Target) -> bool:
    return target.build.cpu_attention is CpuAttention.NATIVE


def _native_library(target: Target) -> bool:
    return target.build.uses_native_cpu_library


def _no_linear_to_run(graph: onnx.ModelProto, build: BuildConfig) -> BuildConfig:
    """``QLinear`` replaced nothing and has no quantized experts to run (``native-moe``, after: a float model): the
    engine runs onnxruntime's linears, and says so."""
    if any((n.domain, n.op_type) == (NATIVE_DOMAIN, QLINEAR_OP) or quantized_experts(n) for n in graph.graph.node):
        return build
    return replace(build, cpu_linear=CpuLinear.ONNXRUNTIME)


PASSES: tuple[Pass, ...] = (
    Pass("native-attention", _native_attention, lambda g, t: lower_to_native(g)),
    Pass("lowered-attention", lambda t: not _native_attention(t), lambda g, t: lower_for_onnxruntime(g, t.io)),
    Pass("activations-to-kernel", _always, lambda g, t: hand_activations_to_kernel(g)),
    Pass("shared-int8-embedding", _always, lambda g, t: shared_int8_embedding(g)),
    Pass(
        "offset-embedding-head",
        _always,
        lambda g, t: offset_embedding_head(g, native=t.build.cpu_linear is CpuLinear.NATIVE),
    ),
    Pass(
        "native-linears",
        lambda t: t.build.cpu_linear is CpuLinear.NATIVE,
        lambda g, t: native_linears(g),
        settle=_no_linear_to_run,
    ),
    # the engine loads the library (options settled): experts routed natively (quantized ones on QLinear's integer
    # products where it runs the linears), else dense standard ops
    Pass("native-moe", _native_library, lambda g, t: native_moe(g, t.build.cpu_linear)),
    Pass("lowered-moe", lambda t: not _native_library(t), lambda g, t: lowered_moe(g)),
    Pass(  # GGUF Q4_1 linears QLinear did not take
        "offset-linears",
        lambda t: t.model.quantization is not None,
        lambda g, t: offset_linears(g, t.model.quantization.group_size),
    ),
    Pass("fuse-swiglu", _native_library, lambda g, t: fuse_swiglu(g)),  # the engine loads the library: row ops too
    Pass("integer-gemms-per-token", _always, lambda g, t: integer_gemms_per_token(g, t.build.uses_native_cpu_library)),
    Pass("unsigned-static-int8-weights", _always, lambda g, t: unsigned_static_int8_weights(g)),
    Pass("reblock-int8-weights", _always, lambda g, t: reblock_int8_weights(g)),
)


def settle_options(portable: onnx.ModelProto, build: BuildConfig) -> BuildConfig:
    """``build`` with the native kernels this machine and model cannot run replaced by onnxruntime's: attention
    the native kernel does not take (``native_supports``), ``QLinear`` on a CPU without its SIMD."""
    if build.cpu_attention is CpuAttention.NATIVE and native_supports(portable, build.kv_block_size) is not None:
        build = replace(build, cpu_attention=CpuAttention.LOWERED)
    if build.cpu_linear is CpuLinear.NATIVE and cpu_linear_simd() is LinearSimd.NONE:
        build = replace(build, cpu_linear=CpuLinear.ONNXRUNTIME)
    return build


def run_passes(graph: onnx.ModelProto, target: Target) -> tuple[onnx.ModelProto, BuildConfig]:
    """The engine graph of the portable ``graph`` (``PASSES`` in order; some rewrite it in place) and the build
    options it was lowered with."""
    for p in PASSES:
        if p.applies(target):
            graph = p.run(graph, target)
            if p.settle is not None:
                target = replace(target, build=p.settle(graph, target.build))
    return graph, target.build
