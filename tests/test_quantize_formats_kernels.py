"""Every quantization format on onnxruntime's CPU provider: the optimized graph runs each quantized linear on an
integer kernel (trtbuild's native ``QLinear`` or onnxruntime's own), int8 weight-only and the LM head with 16-wide
activation blocks; the native kernels' weights come from the huge-page arena; a session loads the kernel library it
is given."""

from __future__ import annotations

import collections
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from quantize_helpers import CASES, PER_TOKEN, STATIC, quantized_cases, quantized_linear_count

from trtbuild.backends.onnxruntime.build.native_linear import LinearSimd, cpu_linear_simd
from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.config import BuildConfig, CpuLinear, QFormat, RuntimeConfig
from trtbuild.runtime.batch import StepBatch


def _open_engine(engine, opts: ort.SessionOptions) -> ort.InferenceSession:
    """The engine's graph in a bare onnxruntime session (its native attention kernel registered)."""
    from trtbuild.kernels.library import library_path

    opts.register_custom_ops_library(str(library_path()))
    return ort.InferenceSession(
        str(engine / "engines/onnxruntime-cpu/model.onnx"), opts, providers=["CPUExecutionProvider"]
    )


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """name -> (fake-quantized torch model, quantized checkpoint, engine) of each of quantize_helpers.CASES."""
    return quantized_cases(tmp_path_factory)


# Optimized-graph op a quantized linear must become on onnxruntime's CPU provider: trtbuild's native QLinear on a
# CPU with AVX-512 VNNI or AVX2 (int8 per channel, symmetric int4), else onnxruntime's own integer kernels.
NATIVE = None if cpu_linear_simd() is LinearSimd.NONE else "QLinear"
KERNELS = {
    QFormat.INT8_SQ: NATIVE or "MatMulNBits",  # dynamic activation scales; static ones: MatMulIntegerToFloat
    QFormat.INT8_WO: NATIVE or "MatMulNBits",
    QFormat.INT4_WO: NATIVE or "MatMulNBits",
    QFormat.INT4_AWQ: NATIVE or "MatMulNBits",
}


@pytest.mark.parametrize(
    "name",
    [
        "int8_sq",
        "int8_sq_per_token",
        "int8_sq_static",
        "int8_wo",
        "int4_wo",
        "int4_awq",
        "int4_awq_g64_partial",
        "int4_wo_zp",
        "int4_awq_zp_g64_partial",
        "fp8",
        "int8_sq+kv_fp8",
    ],
)
def test_onnxruntime_uses_integer_kernels(quantized, name, tmp_path):
    _, _, engine = quantized[name]
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    _open_engine(engine, opts)
    ops = collections.Counter(
        n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph.node
    )
    qformat, linears = CASES[name].qformat, quantized_linear_count(name)
    native_recorded = RuntimeConfig.load(engine).build.cpu_linear is CpuLinear.NATIVE
    assert native_recorded == (ops["QLinear"] > 0), dict(ops)  # the engine says what it holds
    if qformat is QFormat.FP8:  # emulated: Q/DQ stay, weights dequantized in float
        assert ops["MatMulIntegerToFloat"] == 0 and ops["MatMulNBits"] == 0
        assert ops["DequantizeLinear"] >= linears
    elif CASES[name].activations is PER_TOKEN and NATIVE:
        assert ops["QLinear"] == linears and ops["MatMulInteger"] == 0, dict(ops)
        assert ops["MatMulNBits"] == ops["DequantizeLinear"] == ops["QuantizeLinear"] == 0, dict(ops)
    elif CASES[name].activations is PER_TOKEN:  # uint8 x int8 integer GEMMs between the native row ops
        assert ops["MatMulInteger"] == ops["QuantizeRows"] == ops["RescaleRows"] == linears, dict(ops)
        assert ops["MatMulNBits"] == ops["DequantizeLinear"] == ops["QuantizeLinear"] == 0, dict(ops)
    else:
        kernel = "MatMulIntegerToFloat" if CASES[name].activations is STATIC else KERNELS[qformat]
        if CASES[name].zero_points:  # QLinear takes symmetric int4 only
            kernel = "MatMulNBits"
        assert ops[kernel] == linears, dict(ops)
        assert ops["DequantizeLinear"] == 0 or name.endswith("kv_fp8")
        assert ops["QuantizeLinear"] == 0 or name.endswith("kv_fp8") or CASES[name].activations is STATIC


def test_int8_weight_only_runs_on_16_wide_blocks(quantized, tmp_path):
    """The portable graph keeps per-channel int8 weights; the onnxruntime engine quantizes their activations in
    blocks of 16 in-features: QLinear's activation blocks, or (onnxruntime's kernels) the weight restated in blocks
    of 16 (same codes, scale repeated), which MatMulNBits also uses for its activations."""
    from trtbuild.backends.build_request import portable_graph

    _, qckpt, engine = quantized["int8_wo"]
    _, _, _, portable = portable_graph(qckpt, BuildConfig(max_seq_len=128, kv_block_size=4))
    weight_dq = [n for n in portable.graph.node if n.op_type == "DequantizeLinear" and n.name.endswith("weight_dq")]
    assert len(weight_dq) == quantized_linear_count("int8_wo")
    assert all({a.name: a.i for a in n.attribute} == {"axis": 1} for n in weight_dq)
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    _open_engine(engine, opts)
    fused = [n for n in onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph.node]
    blocks = {
        a.i
        for n in fused
        for a in n.attribute
        if (n.op_type, a.name) in {("MatMulNBits", "block_size"), ("QLinear", "block")}
    }
    assert blocks == {16}


@pytest.mark.parametrize("name", ["int4_awq+head", "int8_sq+tied_head"])
def test_quantized_lm_head_is_int8_weight_only(quantized, name, tmp_path):
    """Not excluded, the LM head is int8 per channel in every format; a tied one gets its own copy (the embedding
    stays float) and runs on QLinear (or MatMulNBits) with 16-wide activation blocks."""
    from safetensors import safe_open

    _, qckpt, engine = quantized[name]
    with safe_open(str(qckpt / "rank0.safetensors"), framework="pt") as f:
        head, scale, embed = (f.get_tensor(n) for n in ("lm_head.weight", "lm_head.weight_scale", "embed.weight"))
        assert "lm_head.input_scale" not in f.keys() and "lm_head.pre_quant_scale" not in f.keys()  # noqa: SIM118
    assert head.dtype is torch.int8 and head.shape == embed.shape and scale.shape == (embed.shape[0],)
    assert embed.dtype is torch.float32
    if name.endswith("tied_head"):  # the int8 head reproduces the shared float weight to within half a step
        err = (head.float() * scale[:, None] - embed).abs().max(dim=1).values
        assert bool((err <= scale * 0.5 + 1e-7).all())
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    _open_engine(engine, opts)
    head_ops = [n for n in onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph.node]
    head_ops = [n for n in head_ops if n.name.startswith("lm_head")]
    assert [n.op_type for n in head_ops] == [KERNELS[QFormat.INT8_WO]]
    assert {a.name: a.i for a in head_ops[0].attribute}["block" if NATIVE else "block_size"] == 16


@pytest.mark.parametrize("name", ["int4_awq", "int8_sq_per_token"])
def test_weight_arena_holds_every_native_weight(quantized, name):
    """The native kernels' weights come from the huge-page arena (huge_pages.WeightArena), byte for byte the
    engine's data file, and the session gives the logits it gives reading them from the file."""
    from onnx import numpy_helper

    from trtbuild.backends.onnxruntime import huge_pages

    _, _, engine = quantized[name]
    path = engine / "engines/onnxruntime-cpu/model.onnx"
    graph = onnx.load(str(path)).graph
    external = {t.name for t in onnx.load(str(path), load_external_data=False).graph.initializer if t.external_data}
    inits = {t.name: t for t in graph.initializer}
    weights = {i for n in graph.node if n.op_type == "QLinear" for i in n.input if i in external}  # not the inline
    assert path.with_name(huge_pages.ARENA_LAYOUT).is_file()  # the build wrote the layout: no onnx at run time
    arena = huge_pages.WeightArena(path, huge_pages.read_arena_layout(path))
    assert set(arena.arrays) == weights and len(weights) >= quantized_linear_count(name)  # at least every codes tensor
    for w in weights:
        np.testing.assert_array_equal(arena.arrays[w], numpy_helper.to_array(inits[w]))
    batch = StepBatch.build([list(range(1, 20))], [0], [[1, 2, 3, 4, 5]], all_logits=True)
    plain = OrtSession(engine, kv_cache_memory=1 << 20, huge_pages=False).step(batch)
    session = OrtSession(engine, kv_cache_memory=1 << 20)
    assert session.huge_page_bytes >= (arena.nbytes if huge_pages.supported() else 0)
    np.testing.assert_array_equal(session.step(batch), plain)
    # ... and a fresh process fills the arena from the layout the build wrote, without importing onnx
    code = (
        "import sys; from trtbuild.backends.onnxruntime.session import OrtSession\n"
        f"s = OrtSession({str(engine)!r}, kv_cache_memory=1 << 20)\n"
        "assert s._arena is not None and len(s._arena.arrays) > 0\n"
        "assert 'onnx' not in sys.modules, 'the runtime imported onnx'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_session_registers_the_kernel_library_it_is_given(quantized, tmp_path):
    """``OrtSession(kernel_library=...)`` (kernel A/B runs in one process, ``benchmarks/engine_steps.py --library``)
    runs the engine on that build: a copy of this machine's build gives the default session's logits, and a path that
    is not a library (missing, or not a shared object) is an ``EngineError``, not onnxruntime's own failure."""
    import shutil

    from trtbuild.errors import EngineError
    from trtbuild.kernels.library import library_path

    _, _, engine = quantized["int4_awq"]
    copy = tmp_path / "other-build.so"
    shutil.copyfile(library_path(), copy)
    batch = StepBatch.build([list(range(1, 20))], [0], [[1, 2, 3, 4, 5]], all_logits=True)
    default = OrtSession(engine, kv_cache_memory=1 << 20).step(batch)
    np.testing.assert_array_equal(OrtSession(engine, kv_cache_memory=1 << 20, kernel_library=copy).step(batch), default)
    with pytest.raises(EngineError, match="no such kernel library"):
        OrtSession(engine, kv_cache_memory=1 << 20, kernel_library=tmp_path / "missing.so")
    (tmp_path / "not-a-library.so").write_text("not ELF")
    with pytest.raises(EngineError, match="cannot load the kernel library"):
        OrtSession(engine, kv_cache_memory=1 << 20, kernel_library=tmp_path / "not-a-library.so")
