"""Every quantization format on a tiny random Llama: the engine agrees with modelopt's fake-quantized torch model
(for int4, the model ``quantize/awq.py`` leaves: dequantized weights and pre-quant scale hooks), through prefill
and decode steps of the paged cache; so do the torch backend's importer and its compiled engine. The integer
kernels onnxruntime runs are checked in test_quantize_formats_kernels.py, the checkpoint's tensors in
test_quantize_formats_checkpoint.py."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import torch
from quantize_helpers import CASES, PER_TOKEN, STATIC, Case, find_case, quantized_cases, quantized_linear_count
from tiny_models import hf_logits

from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.build import build_engine
from trtbuild.config import ActivationScales, BuildConfig, CpuLinear, QFormat
from trtbuild.runtime.batch import StepBatch

WEIGHT_ONLY = {QFormat.INT8_WO, QFormat.INT4_WO, QFormat.INT4_AWQ}
# Float activations inside MatMulNBits (the default, level 4, quantizes them to int8 per block: faster, not exact).
EXACT = {"session.qdq_matmulnbits_accuracy_level": "0"}


def dynamic_int8(case: Case) -> bool:
    """W8A8 with run-time scales: MatMulNBits' own int8 activations *are* the format, so the default level runs it."""
    return case.qformat is QFormat.INT8_SQ and case.activations is ActivationScales.DYNAMIC


def session_config(case: Case) -> dict[str, str]:
    return {} if dynamic_int8(case) else EXACT


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """name -> (fake-quantized torch model, quantized checkpoint, engine) of each of quantize_helpers.CASES."""
    return quantized_cases(tmp_path_factory)


def _native_linears(engine) -> int:
    graph = onnx.load(str(engine / "engines/onnxruntime-cpu/model.onnx"), load_external_data=False).graph
    return sum(n.op_type == "QLinear" for n in graph.node)


@pytest.mark.parametrize("name", list(CASES))
def test_engine_matches_modelopt_fake_quant(quantized, name, tmp_path):
    """The default engine, and for weight-only formats (whose native ``QLinear`` quantizes activations to int8 per
    block, as MatMulNBits' default level does) also an engine on onnxruntime's kernels with float activations."""
    check_engine(*quantized[name], name, tmp_path)


def check_engine(model, qckpt, engine, name: str, tmp_path) -> None:
    """``test_engine_matches_modelopt_fake_quant`` of case ``name`` (quantize_helpers.find_case): its fake-quantized
    ``model``, quantized checkpoint ``qckpt`` and default ``engine``; other engines are built under ``tmp_path``."""
    case = find_case(name)
    if _native_linears(engine) and not dynamic_int8(case) and case.activations is not PER_TOKEN:
        ort_kernels = BuildConfig(max_seq_len=128, kv_block_size=4, cpu_linear=CpuLinear.ONNXRUNTIME)
        build_engine(qckpt, tmp_path / "ort", ort_kernels)
        assert _native_linears(tmp_path / "ort") == 0
        session = OrtSession(tmp_path / "ort", kv_cache_memory=1 << 20, session_config=EXACT)
        check_against_fake_quant(session, model, name)
        # int8 activations per block of 16 (int8) or of the group (int4), as MatMulNBits' default level has them:
        # no further from the float-activation model than that level is
        ids = list(range(1, 30))
        ref = hf_logits(model, ids)
        errors = []
        batch = StepBatch.build([ids], [0], [[1, 2, 3, 4, 5, 6, 7, 8]], all_logits=True)
        for path in (tmp_path / "ort", engine):
            logits = OrtSession(path, kv_cache_memory=1 << 20).step(batch)
            errors.append(float(np.abs(logits - ref).mean()))
        assert errors[1] < 1.25 * errors[0], errors
        return
    session = OrtSession(engine, kv_cache_memory=1 << 20, session_config=session_config(case))
    # MatMulNBits (and QLinear) quantize activations with their own float arithmetic, not the graph's x / (amax /
    # 127) rounded half to even: a rare one-code flip in some block moves the tiny model's logits by ~2e-3 (the
    # torch importer, which runs the graph's own Q/DQ, is held to 1e-3 below)
    check_against_fake_quant(session, model, name, atol=5e-3 if dynamic_int8(case) else None)


class ImportedSession:
    """The torch backend's imported module (what ``torch.export`` traces), run eagerly as a session."""

    def __init__(self, ckpt, row_products=None) -> None:
        from trtbuild.backends.build_request import portable_graph
        from trtbuild.backends.torch.importer import PortableModule
        from trtbuild.backends.torch.ops import cache_dtype

        cfg, build, io, graph = portable_graph(ckpt, BuildConfig(max_seq_len=128, kv_block_size=4))
        rows = {} if row_products is None else {"row_products": row_products}
        self.module = PortableModule(graph, io, torch.float32, **rows)
        shape = (16, build.kv_block_size, cfg.num_kv_heads, cfg.head_size)
        dtype = cache_dtype(cfg, torch.float32)
        self.caches = [torch.zeros(shape).to(dtype) for _ in range(2 * cfg.num_layers)]

    def step(self, batch: StepBatch) -> np.ndarray:
        arrays = (batch.input_ids, batch.positions, batch.block_tables, batch.query_start_loc, batch.logits_indices)
        # every layer's cache has the same blocks here: a two-group model's sliding layers read the one table
        sliding = (torch.from_numpy(batch.block_tables),) if self.module.sliding else ()
        with torch.no_grad():
            return self.module(*map(torch.from_numpy, arrays), self.caches, *sliding).numpy()


# int8 per channel (+ int8 cache), int4 blocked with a partial last group (+ zero points), fp8 static (+ fp8 cache)
# and rowwise, int8 activations static (+ a quantized tied head) and dynamic: every quantized op of the graph.
TORCH_CASES = [
    "int8_wo+kv_int8",
    "qwen3_int8_wo+kv_int8",
    "phi3_int8_wo+kv_int8",
    "gemma3_int8_wo+kv_int8",
    "gemma2_int8_wo+kv_int8",
    "gemma2_fp8+kv_fp8",
    "int4_awq_g64_partial",
    "int4_awq_zp_g64_partial",
    "fp8+kv_fp8",
    "int8_sq+tied_head",
    "int8_sq_static",
    "int8_sq",
    "fp8",
]
# Not int8_sq_per_token: the importer runs it through the same blocked Q/DQ with computed scales as int8_sq and fp8
# (per token), and on this tiny model one of its activations sits 1e-6 from a rounding tie, which the torch
# attention's float order (1e-7 from modelopt's) flips: one int8 code, ~0.05 on later logits of that sequence.


@pytest.mark.parametrize("name", TORCH_CASES)
def test_torch_importer_matches_modelopt_fake_quant(quantized, name):
    """The torch backend's DequantizeLinear / QuantizeLinear (int8 per channel, int4 blocked with a partial last
    group, fp8, run-time activation scales) and quantized caches compute what modelopt's fake-quantized model
    computes."""
    model, ckpt, _ = quantized[name]
    check_against_fake_quant(ImportedSession(ckpt), model, name)


@pytest.mark.parametrize("every", [True, False], ids=["all", "quantized"])
@pytest.mark.parametrize("name", ["int8_wo+kv_int8", "int4_awq_zp_g64_partial", "fp8+kv_fp8", "int8_sq+tied_head"])
def test_one_row_products_of_quantized_weights(quantized, name, every):
    """``row_products`` (``ALL``: the torch-compile CPU engines' batch-1 form; ``QUANTIZED``: the GPU's, the
    quantized weights only) holds every MatMul weight dequantized per channel or per tensor [out, in] (its int8 /
    fp8 data transposed, the dequantizer's axis flipped) and computes one-row products as multiply-and-sum, and so
    every int4 one dequantized in blocks (codes, block scales and zero points transposed); float MatMul weights and a
    float tied head join with ``ALL`` only. A one-sequence prefill and one-token decode steps give the plain
    importer's logits (itself checked against modelopt above). A dequantized row weight's one-row product multiplies
    by its codes and scales the sums (per block for int4, several rows multiplying the weight so dequantized)."""
    from trtbuild.backends.torch.row_products import RowProducts

    model, ckpt, _ = quantized[name]
    mode = RowProducts.ALL if every else RowProducts.QUANTIZED
    plain, rows = ImportedSession(ckpt), ImportedSession(ckpt, row_products=mode)
    module, graph = rows.module, plain.module.nodes  # the graph's nodes as imported (the layout drops some)
    dequantized = {n.outputs[0] for n in graph if n.op == "DequantizeLinear"}
    blocked = {n.outputs[0] for n in graph if n.op == "DequantizeLinear" and n.attrs.get("block_size")}
    matmuls = {n.inputs[1] for n in graph if n.op == "MatMul"}
    heads = {n.inputs[1] for n in graph if n.op == "Gemm" and n.attrs.get("transB")}
    fused = (matmuls | heads) if every else (matmuls | heads) & dequantized
    assert module.row_weights == fused and bool(blocked) == ("int4" in name) and module.row_weights & dequantized
    assert set(module.row_blocks) == blocked & matmuls  # int4: scaled per block after each block's sum
    assert set(module.row_scales) == module.row_weights & dequantized - blocked  # scaled after the sum
    assert not {o for n in module.nodes for o in n.outputs} & blocked  # their dequantizers dropped
    for w in module.row_blocks.values():  # codes, scales and zero points held [out, in] / [out, blocks]
        codes, scale = getattr(module, module._buffer_names[w.codes]), getattr(module, module._buffer_names[w.scale])
        assert scale.shape == (codes.shape[0], -(-codes.shape[1] // w.block)) and ("zp" in name) == bool(w.zero_point)
    rng = np.random.default_rng(6)
    vocab = model.config.vocab_size
    done, table = 0, [1, 2, 3, 4]
    for step in range(4):  # a 6-token prompt (one logits row), then one-token steps
        tokens = [int(t) for t in rng.integers(0, vocab, 6 if step == 0 else 1)]
        batch = StepBatch.build([tokens], [done], [table])
        done += len(tokens)
        np.testing.assert_allclose(rows.step(batch), plain.step(batch), atol=1e-5, rtol=0, err_msg=f"step {step}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int4_awq_g64_partial", "fp8+kv_fp8"])
def test_compiled_torch_engine_matches_modelopt_fake_quant(quantized, name, tmp_path):
    """The same through an AOTInductor-compiled CPU engine (slow: one compile each)."""
    from trtbuild.backends.torch.session import TorchSession
    from trtbuild.config import Backend, TorchConfig, TorchDevice

    model, ckpt, _ = quantized[name]
    build = BuildConfig(backend=Backend.TORCH, max_seq_len=128, kv_block_size=4)
    build_engine(ckpt, tmp_path / "engine", build, torch=TorchConfig(device=TorchDevice.CPU))
    check_against_fake_quant(TorchSession(tmp_path / "engine", kv_cache_memory=1 << 20), model, name)


def test_per_token_int8_in_standard_ops_matches_modelopt_fake_quant(quantized, tmp_path):
    """Without the native library (``--cpu-attention lowered --cpu-linear onnxruntime``) a per-token linear is ten
    standard ops around ``MatMulInteger``: the same codes and sums as the native row ops."""
    from trtbuild.config import CpuAttention

    model, ckpt, _ = quantized["int8_sq_per_token"]
    lowered = BuildConfig(
        max_seq_len=128, kv_block_size=4, cpu_attention=CpuAttention.LOWERED, cpu_linear=CpuLinear.ONNXRUNTIME
    )
    build_engine(ckpt, tmp_path / "e", lowered)
    ops = collections.Counter(
        n.op_type
        for n in onnx.load(str(tmp_path / "e/engines/onnxruntime-cpu/model.onnx"), load_external_data=False).graph.node
    )
    linears = quantized_linear_count("int8_sq_per_token")
    assert ops["MatMulInteger"] == ops["QuantizeLinear"] == linears and ops["QuantizeRows"] == 0
    check_against_fake_quant(OrtSession(tmp_path / "e", kv_cache_memory=1 << 20), model, "int8_sq_per_token")


def near_rounding_tie(model, ids: list[int], margin: float = 5e-5) -> bool:
    """Whether an enabled input quantizer of the fake-quant model, run on ``ids``, sees a value within ``margin``
    (in units of its int8 scale: static, or per token) of a rounding tie. Such a value may round to the other code
    when its float sums run in another order (torch's GEMM for 2 rows against 11, onnxruntime's), and in these tiny
    random models one code of a per-token scale moves the logits by ~0.05: x / s = 6.4999918 in layer 0's gate_proj
    input, row 1, on a Xeon VM (2026-12-04), where every row after it then missed the reference by 0.01-0.05."""
    import torch

    hit = False

    def check(quantizer, args) -> None:
        nonlocal hit
        x = args[0].detach().double()
        if getattr(quantizer, "pre_quant_scale", None) is not None:
            x = x * quantizer.pre_quant_scale.double()
        static = getattr(quantizer, "amax", None)  # a calibrated per-tensor range, else per token
        amax = static.double() if static is not None else x.abs().amax(-1, keepdim=True)
        q = x / (amax / 127)
        hit = hit or bool(((q - q.floor() - 0.5).abs() < margin).any())

    hooks = [
        m.register_forward_pre_hook(check)
        for n, m in model.named_modules()
        if n.endswith("input_quantizer") and m.is_enabled
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return hit


def check_against_fake_quant(session, model, name: str, atol: float | None = None) -> None:
    """Ragged prefill then decode steps through the (quantized) paged cache, every row vs the fake-quant model.
    Per-token int8: token ids drawn again (seeded) while some row's activations lie at a rounding tie, where the
    engine's and the reference's float sums may round apart (``near_rounding_tie``); both round ties to even."""
    case = find_case(name)
    qformat = case.qformat
    atol = atol or (1e-4 if qformat in WEIGHT_ONLY else 1e-3)
    rng = np.random.default_rng(3)
    for _ in range(20):
        seqs = [list(map(int, rng.integers(0, 97, n))) for n in (11, 5)]
        decoded = [[int(t) for t in rng.integers(0, 97, 2)] for _ in range(3)]  # a token per sequence and step
        full = [s + [new[i] for new in decoded] for i, s in enumerate(seqs)]
        int8_activations = qformat is QFormat.INT8_SQ and case.activations in (PER_TOKEN, STATIC)
        if not int8_activations or not any(near_rounding_tie(model, s) for s in full):
            break
    else:
        pytest.fail(f"{name}: 20 draws of token ids all put an activation at a rounding tie")
    tables = [[3, 7, 1, 9, 12], [5, 2, 8, 4, 11]]
    logits = session.step(StepBatch.build(seqs, [0, 0], tables, all_logits=True))
    ref = np.concatenate([hf_logits(model, s) for s in seqs])
    np.testing.assert_allclose(logits, ref, atol=atol, rtol=0, err_msg=f"{name} prefill")
    for step, new in enumerate(decoded):  # decode through the (quantized) paged cache
        starts = [len(s) for s in seqs]
        for s, t in zip(seqs, new, strict=True):
            s.append(t)
        logits = session.step(StepBatch.build([[t] for t in new], starts, tables))
        for i, s in enumerate(seqs):
            np.testing.assert_allclose(
                logits[i],
                hf_logits(model, s)[-1],
                atol=atol,
                rtol=0,
                err_msg=f"{name} decode step {step} sequence {i}",
            )


# Largest logit error of the default session, as a fraction of the largest logit: int8 activations in blocks of 16
# (int8_wo) or of the group, 32 (int4; AWQ's explicit pre-quant Mul before attn.out widens that activation's range).
DEFAULT_SESSION_TOLERANCE = {"int8_wo": 0.05, "int4_awq": 0.1}


@pytest.mark.parametrize("name", list(DEFAULT_SESSION_TOLERANCE))
def test_default_session_is_close_to_fake_quant(quantized, name):
    """The default MatMulNBits accuracy level (int8 activations inside the kernel) stays close."""
    model, _, engine = quantized[name]
    ids = list(range(1, 30))
    logits = OrtSession(engine, kv_cache_memory=1 << 20).step(
        StepBatch.build([ids], [0], [[1, 2, 3, 4, 5, 6, 7, 8]], all_logits=True)
    )
    ref = hf_logits(model, ids)
    assert np.abs(logits - ref).max() < DEFAULT_SESSION_TOLERANCE[name] * np.abs(ref).max()
