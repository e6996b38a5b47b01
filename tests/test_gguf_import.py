"""GGUF import: Q8_0 / Q6_K / Q5_0 / Q4_0 / Q4_1 / Q4_K tensors stay quantized through convert and build, equal to
llama.cpp's weights.

Small Llama GGUFs are written here with ``gguf.GGUFWriter``, their tensors quantized by ``gguf.quants.quantize``
(llama.cpp's own Python port); the reference weights are ``gguf.quants.dequantize`` of the same tensors (what
``convert --dequantize`` writes). The engines of the quantized checkpoint are held to the engine of that float
checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from safetensors import safe_open

from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.build import build_engine
from trtbuild.checkpoint.files import load_any_checkpoint, load_checkpoint
from trtbuild.config import BuildConfig, CpuLinear, DType, EngineIO, ModelConfig, QFormat
from trtbuild.convert.convert import convert
from trtbuild.graph.emit import emit_portable_graph
from trtbuild.runtime.batch import StepBatch

T = gguf.GGMLQuantizationType
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 64, 96, 4, 2, 64, 2
# Per source linear: its GGUF type (every kept type, and a fused qkv / gate_up of one type each).
MIXED = {"attn_q": T.Q4_1, "attn_k": T.Q4_1, "attn_v": T.Q4_1, "attn_output": T.Q4_0}
MIXED |= {"ffn_gate": T.Q8_0, "ffn_up": T.Q8_0, "ffn_down": T.Q4_1}


def random_q4_k(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K super-blocks of a ``shape`` tensor (gguf-py cannot quantize to Q4_K): random 6-bit scales and
    mins and 4-bit codes, ``d`` and ``dmin`` small float16s of either sign; uint8 ``[rows, cols / 256 * 144]``."""
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    factors = rng.uniform(-2e-3, 4e-3, (rows * cols // 256, 2)).astype(np.float16)  # d, dmin
    blocks[:, :4] = factors.view(np.uint8)
    return blocks.reshape(rows, -1)


def random_q6_k(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random Q6_K super-blocks of a ``shape`` tensor (gguf-py cannot quantize to Q6_K): random 6-bit codes and int8
    scales, ``d`` a small float16 of either sign; uint8 ``[rows, cols / 256 * 210]``."""
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows * cols // 256, 210), dtype=np.uint8)
    blocks[:, 208:] = rng.uniform(-1.5e-4, 1.5e-4, (rows * cols // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def random_q5_k(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random Q5_K super-blocks of a ``shape`` tensor (gguf-py cannot quantize to Q5_K) whose weights centre on 0,
    as a quantized model's do: random 5-bit codes, every 6-bit scale and min 32, ``dmin = 15.5 * d`` (d a small
    float16 of either sign), so ``w = 32 * d * (q - 15.5)``; uint8 ``[rows, cols / 256 * 176]``. (Random scale bytes,
    as ``random_q4_k``'s, give weights far off 0 and a model whose logits swing under any rounding: the reader's
    unit test takes those.)"""
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows * cols // 256, 176), dtype=np.uint8)
    d = rng.uniform(-2e-4, 2e-4, (rows * cols // 256, 1)).astype(np.float16)
    blocks[:, :4] = np.concatenate([d, (d.astype(np.float32) * 15.5).astype(np.float16)], axis=1).view(np.uint8)
    blocks[:, 4:16] = [0xA0] * 8 + [0x00] * 4  # get_scale_min: sc = m = 32 for all eight sub-blocks
    return blocks.reshape(rows, -1)


def random_q3_k(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random Q3_K super-blocks (random 3-bit codes and 6-bit scales, ``d`` a small float16 of either sign: weights
    ``d * (sc - 32) * q`` centre on 0); uint8 ``[rows, cols / 256 * 110]``."""
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows * cols // 256, 110), dtype=np.uint8)
    blocks[:, 108:] = rng.uniform(-3e-3, 3e-3, (rows * cols // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def random_q2_k(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random Q2_K super-blocks whose weights centre on 0: random 2-bit codes, each block's 4-bit scale and min one
    random value ``v``, ``dmin = 1.5 * d``, so ``w = d * v * (q - 1.5)``; uint8 ``[rows, cols / 256 * 84]``."""
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows * cols // 256, 84), dtype=np.uint8)
    v = rng.integers(0, 16, (rows * cols // 256, 16), dtype=np.uint8)
    blocks[:, :16] = v | (v << 4)
    d = rng.uniform(-8e-3, 8e-3, (rows * cols // 256, 1)).astype(np.float16)
    blocks[:, 80:] = np.concatenate([d, (d.astype(np.float32) * 1.5).astype(np.float16)], axis=1).view(np.uint8)
    return blocks.reshape(rows, -1)


RANDOM_K_QUANTS = {T.Q2_K: random_q2_k, T.Q3_K: random_q3_k, T.Q4_K: random_q4_k, T.Q5_K: random_q5_k}
RANDOM_K_QUANTS |= {T.Q6_K: random_q6_k}


def write_gguf(
    path: Path,
    types: dict[str, T],
    *,
    embed: T = T.Q8_0,
    tied: bool = True,
    seed: int = 0,
    scores: bool = True,
    hidden: int = HIDDEN,
    inter: int = INTER,
) -> Path:
    """A 2-layer Llama GGUF with random weights, each linear quantized to ``types[name]`` (F32: float); without
    ``scores`` its tokenizer metadata is one transformers cannot read. The K-quants need ``hidden`` and ``inter``
    multiples of 256."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")  # a token list transformers can turn into a tokenizer.json
    w.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26) for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    if scores:  # transformers' GGUF tokenizer reader needs merges, or scores to make them from
        w.add_token_scores([0.0] * VOCAB)
        w.add_token_merges(["a a"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def tensor(name: str, shape: tuple[int, ...], kind: T, std: float = 0.15) -> None:
        a = (rng.standard_normal(shape) * std).astype(np.float32)
        if kind is T.F32:
            w.add_tensor(name, a)
        elif kind in RANDOM_K_QUANTS:
            w.add_tensor(name, RANDOM_K_QUANTS[kind](shape, rng), raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)

    tensor("token_embd.weight", (VOCAB, hidden), embed, 0.5)
    if not tied:
        tensor("output.weight", (VOCAB, hidden), T.Q8_0)
    w.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    kv = hidden // HEADS * KV_HEADS
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden)}
    shapes |= {"attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden)}
    shapes |= {"ffn_down": (hidden, inter)}
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        for name, shape in shapes.items():
            tensor(f"blk.{i}.{name}.weight", shape, types[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the mixed GGUF, its default checkpoint, its ``--dequantize`` float checkpoint)."""
    root = tmp_path_factory.mktemp("gguf")
    src = write_gguf(root / "mixed.gguf", MIXED)
    convert(src, root / "ckpt")
    convert(src, root / "float", dequantize=True)
    return src, root / "ckpt", root / "float"


def dequantized(weights: dict[str, np.ndarray], prefix: str) -> np.ndarray:
    """``q * scale (+ offset)`` per block (32 in-features, Q6_K's 16), in gguf-py's float32 order, from a quantized
    checkpoint's tensors."""
    q, scale = weights[prefix + ".weight"].astype(np.float32), weights[prefix + ".weight_scale"]
    rows, cols = q.shape
    w = q.reshape(rows, scale.shape[1], -1) * scale[..., None]
    if prefix + ".weight_offset" in weights:
        w = w + weights[prefix + ".weight_offset"][..., None]
    return w.reshape(rows, cols)


def stored(ckpt: Path) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (safetensors dtype: ``F16``, ``U8``, ..., shape) as the checkpoint's weights file stores it."""
    with safe_open(str(ckpt / "rank0.safetensors"), framework="np") as f:
        return {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


def test_checkpoint_keeps_block_formats_and_weights_equal_gguf_dequantization(mixed):
    _, ckpt, float_ckpt = mixed
    cfg, weights = load_any_checkpoint(ckpt)
    q = cfg.quantization
    assert q is not None and q.group_size == 32 and q.exclude == []
    assert q.qformat is QFormat.INT4_MIN_WO  # the most common linear format: qkv and down
    assert q.tensor_formats == {
        "embed": QFormat.INT8_GROUP_WO,
        **{f"layers.{i}.attn.out": QFormat.INT4_WO for i in range(LAYERS)},
        **{f"layers.{i}.mlp.gate_up": QFormat.INT8_GROUP_WO for i in range(LAYERS)},
    }
    _, reference = load_checkpoint(float_ckpt)  # gguf.quants.dequantize of every tensor (GGUFReader.get)
    for prefix in [
        "embed",
        *(f"layers.{i}.{m}" for i in range(LAYERS) for m in ("attn.qkv", "attn.out", "mlp.gate_up", "mlp.down")),
    ]:
        np.testing.assert_array_equal(dequantized(weights, prefix), reference[prefix + ".weight"], err_msg=prefix)
    for name in ("final_norm.weight", "layers.0.input_norm.weight"):
        np.testing.assert_array_equal(weights[name], reference[name])
    # scales and offsets are GGUF's float16 values, stored as they are
    tensors = stored(ckpt)
    assert tensors["layers.0.attn.qkv.weight_offset"][0] == "F16"
    assert tensors["layers.0.attn.qkv.weight"][0] == "U8"  # two codes a byte
    assert tensors["embed.weight"][0] == "I8"


def test_portable_graph_weights_equal_gguf_dequantization(mixed):
    """The graph's own weight expressions (DequantizeLinear, + offset for Q4_1), run by onnxruntime."""
    _, ckpt, float_ckpt = mixed
    cfg, weights = load_any_checkpoint(ckpt)
    portable = emit_portable_graph(cfg, weights, BuildConfig(max_seq_len=128), EngineIO())
    wanted = {"layers.0.attn.qkv": "layers.0.attn.qkv.weight_rows", "layers.1.attn.out": "layers.1.attn.out.weight_dq"}
    wanted |= {"layers.0.mlp.gate_up": "layers.0.mlp.gate_up.weight_dq", "lm_head": "lm_head.weight_dq"}
    outputs = {}
    for node in portable.graph.node:
        if node.name in wanted.values():
            outputs[node.name] = node.output[0]
    results = dict(zip(outputs, run_subgraph(portable, list(outputs.values())), strict=True))
    _, reference = load_checkpoint(float_ckpt)
    for prefix, node in wanted.items():
        ref = reference["embed.weight" if prefix == "lm_head" else prefix + ".weight"]
        got = results[node] if prefix == "lm_head" else results[node].T  # linears are [in, out] in the graph
        np.testing.assert_array_equal(got, ref, err_msg=prefix)


def run_subgraph(model: onnx.ModelProto, names: list[str]) -> list[np.ndarray]:
    """Run the nodes of ``model`` that ``names`` need (weights only: no graph inputs) with onnxruntime."""
    producer = {o: n for n in model.graph.node for o in n.output}
    needed, stack = {}, list(names)
    while stack:
        node = producer.get(stack.pop())
        if node is not None and node.name not in needed:
            needed[node.name] = node
            stack.extend(node.input)
    nodes = [n for n in model.graph.node if n.name in needed]  # in graph order
    used = {i for n in nodes for i in n.input}
    inits = [t for t in model.graph.initializer if t.name in used]
    outputs = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in names]
    graph = onnx.helper.make_graph(nodes, "weights", [], outputs, inits)
    sub = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    sub.ir_version = model.ir_version
    return ort.InferenceSession(sub.SerializeToString()).run(names, {})


def step_logits(engine: Path, tokens: list[int], kv_cache_memory: int = 1 << 20) -> np.ndarray:
    session = OrtSession(engine, kv_cache_memory=kv_cache_memory)
    blocks = list(range(1, 1 + -(-len(tokens) // session.config.build.kv_block_size)))
    return session.step(StepBatch.build([tokens], [0], [blocks], all_logits=True))


def close_to_float_engine(engine: Path, float_engine: Path) -> tuple[np.ndarray, np.ndarray]:
    """The logits (engine's, float engine's) of 24 random tokens; the quantized engine's within 5% of the float
    engine's largest logit (its activations int8 per block of 32 where they meet the GGUF blocks)."""
    tokens = list(map(int, np.random.default_rng(1).integers(0, VOCAB, 24)))
    ref, got = step_logits(float_engine, tokens), step_logits(engine, tokens)
    assert ref.std() > 0.3
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max(), np.abs(got - ref).max()
    return got, ref


def both_cpu_linears_close_to_float(root: Path) -> dict[str, dict[str, int]]:
    """Engines of ``root/float`` and of ``root/ckpt`` with each CPU linear (native ``QLinear``, onnxruntime's),
    each close to the float one (``close_to_float_engine``). Returns the native engine's ``QLinear`` nodes by name:
    their attributes and ``inputs``, their input count (4 with offsets)."""
    build_engine(root / "float", root / "f", BuildConfig(max_seq_len=128, kv_block_size=4))
    for cpu_linear in (CpuLinear.NATIVE, CpuLinear.ONNXRUNTIME):
        engine = root / cpu_linear.value
        build_engine(root / "ckpt", engine, BuildConfig(max_seq_len=128, kv_block_size=4, cpu_linear=cpu_linear))
        close_to_float_engine(engine, root / "f")
    nodes = [n for n in _engine_graph(root / CpuLinear.NATIVE.value).node if n.op_type == "QLinear"]
    return {n.name: {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} | {"inputs": len(n.input)}
            for n in nodes}  # fmt: skip


def torch_logits_are_the_float_checkpoints(ckpt: Path, float_ckpt: Path) -> dict[str, tuple[int, bool]]:
    """The torch importer on ``ckpt``: its graph's dequantized weights are ``float_ckpt``'s (equal logits), and its
    one-row products (``RowProducts.QUANTIZED``, which read the blocks' codes and factors) give them within 1e-4,
    for a 7-token prompt and two one-token steps. Returns codes name -> (block size, has offsets) of those products."""
    from test_quantize_formats import ImportedSession

    from trtbuild.backends.torch.row_products import RowProducts

    plain, float_ = ImportedSession(ckpt), ImportedSession(float_ckpt)
    rows = ImportedSession(ckpt, row_products=RowProducts.QUANTIZED)
    done = 0
    for step, tokens in enumerate([[5, 9, 2, 33, 17, 8, 40], [3], [61]]):
        batch = StepBatch.build([tokens], [done], [[1, 2, 3, 4, 5, 6]])
        done += len(tokens)
        want = float_.step(batch)
        np.testing.assert_array_equal(plain.step(batch), want, err_msg=f"step {step}")
        np.testing.assert_allclose(rows.step(batch), want, atol=1e-4, rtol=0, err_msg=f"one-row products, step {step}")
    return {w.codes: (w.block, w.offset is not None) for w in rows.module.row_blocks.values()}


@pytest.mark.parametrize("cpu_linear", [CpuLinear.NATIVE, CpuLinear.ONNXRUNTIME])
def test_engine_logits_match_the_dequantized_float_engine(mixed, tmp_path, cpu_linear):
    """Native ``QLinear`` and onnxruntime both quantize activations to int8 per block of 32 where they multiply
    quantized weights (as llama.cpp does), so the logits are close, not equal."""
    _, ckpt, float_ckpt = mixed
    build = BuildConfig(max_seq_len=128, kv_block_size=4, cpu_linear=cpu_linear)
    build_engine(ckpt, tmp_path / "q", build)
    build_engine(float_ckpt, tmp_path / "f", BuildConfig(max_seq_len=128, kv_block_size=4))
    got, ref = close_to_float_engine(tmp_path / "q", tmp_path / "f")
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8
    kinds = {(n.domain, n.op_type) for n in _engine_graph(tmp_path / "q").node}
    assert ("com.microsoft", "MatMulNBits") in kinds  # the tied head on the embedding's int8 codes
    if cpu_linear is CpuLinear.NATIVE:
        assert ("trtbuild.cpu", "QLinear") in kinds


def test_torch_one_row_products_read_the_gguf_blocks(mixed, tmp_path):
    """The torch engine's batch-1 products (``backends/torch/row_products.py``) read every GGUF block format as codes
    and factors: Q4_1 linears (codes, scales and offsets), Q4_0 and Q8_0 ones and the Q8_0 tied head, their
    dequantizing nodes dropped. A prefill's logits row and one-token steps, eager and compiled by the torch-compile
    runtime, give the plain importer's logits (the weights dequantized by the graph's own nodes)."""
    from test_quantize_formats import ImportedSession

    from trtbuild.backends.torch.row_products import RowProducts
    from trtbuild.backends.torch.session import TorchSession
    from trtbuild.config import Backend, TorchConfig, TorchDevice, TorchRuntime

    _, ckpt, _ = mixed
    plain, rows = ImportedSession(ckpt), ImportedSession(ckpt, row_products=RowProducts.QUANTIZED)
    blocks = rows.module.row_blocks
    products = {n.inputs[1] for n in plain.module.nodes if n.op in ("MatMul", "Gemm")}
    assert set(blocks) == products and rows.module.row_weights == products
    assert {w.codes.removesuffix(".weight") for w in blocks.values() if w.offset} == {
        f"layers.{i}.{m}" for i in range(LAYERS) for m in ("attn.qkv", "mlp.down")
    }  # Q4_1
    assert [w.codes for n, w in blocks.items() if "lm_head" in n] == ["embed.weight"]  # the embedding's codes
    assert not {o for n in rows.module.nodes for o in n.outputs} & set(blocks)
    build_engine(ckpt, tmp_path / "engine", BuildConfig(backend=Backend.TORCH, max_seq_len=128, kv_block_size=4),
                 torch=TorchConfig(device=TorchDevice.CPU, torch_runtime=TorchRuntime.TORCH_COMPILE))  # fmt: skip
    compiled = TorchSession(tmp_path / "engine", kv_cache_memory=1 << 20, row_products=RowProducts.QUANTIZED)
    assert compiled._runner._orig_mod.row_blocks.keys() == blocks.keys()
    rng = np.random.default_rng(3)
    done, table = 0, [1, 2, 3, 4, 5, 6]
    for step in range(4):  # a 7-token prompt (one logits row), then one-token steps
        tokens = [int(t) for t in rng.integers(0, VOCAB, 7 if step == 0 else 1)]
        batch = StepBatch.build([tokens], [done], [table])
        done += len(tokens)
        want = plain.step(batch)
        np.testing.assert_allclose(rows.step(batch), want, atol=1e-4, rtol=0, err_msg=f"step {step}")
        got = compiled.step(batch)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"compiled, step {step}")


def test_native_lowering_takes_the_exact_codes_scales_and_offsets(mixed):
    """Each GGUF linear's ``QLinear`` holds the checkpoint's integers and GGUF's scales / offsets (the kernel's
    arithmetic on them is ``qlinear_reference``'s, bit for bit: tests/test_cpu_linear.py)."""
    from trtbuild.backends.onnxruntime.build.native_linear import native_linears, pack_weight, pad_scales

    _, ckpt, _ = mixed
    cfg, weights = load_any_checkpoint(ckpt)
    engine = native_linears(emit_portable_graph(cfg, weights, BuildConfig(max_seq_len=128), EngineIO()))
    nodes = {n.name: n for n in engine.graph.node if n.op_type == "QLinear"}
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in engine.graph.initializer}
    cases = {"layers.0.attn.qkv": (4, -8), "layers.0.attn.out": (4, 0), "layers.1.mlp.gate_up": (8, 0)}
    for prefix, (bits, shift) in cases.items():
        node = nodes[prefix + ".q"]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["bits"], attrs["group"], attrs["block"]) == (bits, 32, 32), prefix
        codes = weights[prefix + ".weight"].astype(np.int8).T + np.int8(shift)  # Q4_1 codes u packed as u - 8
        np.testing.assert_array_equal(inits[node.input[1]], pack_weight(codes, bits), err_msg=prefix)
        np.testing.assert_array_equal(inits[node.input[2]], pad_scales(weights[prefix + ".weight_scale"].T))
        if prefix + ".weight_offset" in weights:
            np.testing.assert_array_equal(inits[node.input[3]], pad_scales(weights[prefix + ".weight_offset"].T))
        else:
            assert len(node.input) == 3


def _engine_graph(engine: Path) -> onnx.GraphProto:
    return onnx.load(str(engine / "engines/onnxruntime-cpu/model.onnx"), load_external_data=False).graph


def test_engine_stores_the_embedding_codes_once(mixed, tmp_path):
    _, ckpt, _ = mixed
    build_engine(ckpt, tmp_path / "q", BuildConfig(max_seq_len=128))
    inits = {t.name: t for t in _engine_graph(tmp_path / "q").initializer}
    vocab_sized = [n for n, t in inits.items() if t.dims and t.dims[0] == VOCAB and len(t.dims) >= 2]
    assert sorted(vocab_sized) == ["embed.weight.u8", "embed.weight_scale"]


def test_dequantize_gives_the_float_checkpoint(mixed):
    src, _, float_ckpt = mixed
    cfg = ModelConfig.load(float_ckpt)
    assert cfg.quantization is None and cfg.dtype is DType.FLOAT32
    _, weights = load_checkpoint(float_ckpt)
    reader = gguf.GGUFReader(str(src))
    raw = {t.name: t for t in reader.tensors}["blk.1.ffn_down.weight"]
    ref = gguf.quants.dequantize(raw.data, raw.tensor_type).reshape(HIDDEN, INTER)
    np.testing.assert_array_equal(weights["layers.1.mlp.down.weight"], ref)


def test_untied_head_and_float_linears(tmp_path):
    """An untied Q8_0 ``output.weight`` stays int8 per group; F32 linears stay float (listed in ``exclude``); Q5_0
    is kept as int8 codes (-16..15), so a Q5_0 gate fuses with a Q8_0 up."""
    types = dict(MIXED, attn_output=T.F32, ffn_gate=T.Q5_0)
    src = write_gguf(tmp_path / "untied.gguf", types, tied=False)
    convert(src, tmp_path / "ckpt")
    convert(src, tmp_path / "float", dequantize=True)
    cfg, weights = load_any_checkpoint(tmp_path / "ckpt")
    assert cfg.quantization.tensor_formats["lm_head"] is QFormat.INT8_GROUP_WO
    assert cfg.quantization.exclude == [f"layers.{i}.attn.out" for i in range(LAYERS)]
    _, reference = load_checkpoint(tmp_path / "float")
    for prefix in ("lm_head", "layers.0.mlp.gate_up", "layers.1.mlp.gate_up"):
        np.testing.assert_array_equal(dequantized(weights, prefix), reference[prefix + ".weight"], err_msg=prefix)
    assert cfg.quantization.tensor_formats["layers.0.mlp.gate_up"] is QFormat.INT8_GROUP_WO
    build_engine(tmp_path / "ckpt", tmp_path / "q", BuildConfig(max_seq_len=128, kv_block_size=4))
    build_engine(tmp_path / "float", tmp_path / "f", BuildConfig(max_seq_len=128, kv_block_size=4))
    tokens = list(range(2, 20))
    ref, got = step_logits(tmp_path / "f", tokens), step_logits(tmp_path / "q", tokens)
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_unsupported_types_are_dequantized_with_one_line(tmp_path):
    """Q5_1 has no trtbuild format: dequantized, and its fused partners (Q4_1 q and k) with it: one line."""
    from click.testing import CliRunner

    from trtbuild.cli import cli

    src = write_gguf(tmp_path / "q5.gguf", dict(MIXED, attn_v=T.Q5_1))
    inspected = CliRunner().invoke(cli, ["inspect", str(src)])  # says so before converting
    assert "dequantized by convert: Q5_1 (" in inspected.output, inspected.output
    result = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("dequantized")]
    assert len(lines) == 1, result.output
    assert "2 Q5_1 (blk.0.attn_v.weight, blk.1.attn_v.weight)" in lines[0] and "4 Q4_1" in lines[0]
    cfg = ModelConfig.load(tmp_path / "ckpt")
    assert cfg.quantization.exclude == [f"layers.{i}.attn.qkv" for i in range(LAYERS)]
    assert (
        "dequantized"
        not in CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "f"), "--dequantize"]).output
    )


def with_float_embedding(ckpt: Path, out: Path) -> Path:
    """A copy of the GGUF checkpoint ``ckpt`` whose embedding is its float32 weights (a tied head reading them as a
    float ``Gemm``), every other tensor as it is."""
    import shutil
    from dataclasses import replace

    import torch
    from safetensors.torch import load_file

    from trtbuild.checkpoint.files import save_checkpoint

    shutil.copytree(ckpt, out)
    cfg, weights = load_any_checkpoint(ckpt)
    tensors = {n: t for n, t in load_file(str(ckpt / "rank0.safetensors")).items() if not n.startswith("embed.")}
    tensors["embed.weight"] = torch.from_numpy(dequantized(weights, "embed"))
    q = cfg.quantization
    formats = {n: f for n, f in q.tensor_formats.items() if n != "embed"}
    exclude = [*q.exclude, "lm_head"] if cfg.tie_word_embeddings else q.exclude
    save_checkpoint(out, replace(cfg, quantization=replace(q, tensor_formats=formats, exclude=exclude)), tensors)
    return out


@pytest.mark.parametrize(
    ("embed", "tied", "top"), [(T.Q4_K, True, 15), (T.Q4_1, False, 15), (T.Q4_0, True, 15), (T.Q5_K, True, 31)]
)
def test_a_4_or_5_bit_embedding_is_gathered_from_a_byte_a_code(tmp_path, embed, tied, top):
    """A Q4_0 / Q4_1 / Q4_K / Q5_K embedding (a Q4_K_M file's ``token_embd`` where the head is untied) stays
    quantized as ``int8_min_wo`` rows: uint8 codes with a float32 scale and offset per block of 32, exact (Q4_0's
    codes + 8 with offset ``-8 * scale``), where it was dequantized to float32 before; nothing is reported as
    dequantized. Its engine's logits equal those of the same checkpoint with a float32 embedding, but for a tied
    head on the native linears: ``QLinear`` of the same codes with offsets (its activations int8 per block, and no
    float copy of the vocabulary in the engine); on onnxruntime's linears a float ``Gemm``. The torch importer's
    one-row product of the tied head reads the codes too."""
    from click.testing import CliRunner

    from trtbuild.cli import cli

    types = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), T.Q4_K)
    src = write_gguf(tmp_path / "e.gguf", types, embed=embed, tied=tied, hidden=256, inter=512)
    assert "dequantized" not in CliRunner().invoke(cli, ["inspect", str(src)]).output
    assert convert(src, tmp_path / "ckpt").dequantized_line() is None
    convert(src, tmp_path / "float", dequantize=True)
    cfg, weights = load_any_checkpoint(tmp_path / "ckpt")
    assert cfg.quantization.tensor_formats["embed"] is QFormat.INT8_MIN_WO
    _, reference = load_checkpoint(tmp_path / "float")
    np.testing.assert_array_equal(dequantized(weights, "embed"), reference["embed.weight"])
    assert stored(tmp_path / "ckpt")["embed.weight"] == ("U8", [VOCAB, 256])
    assert weights["embed.weight"].max() == top
    with_float_embedding(tmp_path / "ckpt", tmp_path / "ref")
    tokens = list(map(int, np.random.default_rng(1).integers(0, VOCAB, 24)))
    for cpu_linear in (CpuLinear.NATIVE, CpuLinear.ONNXRUNTIME):
        build = BuildConfig(max_seq_len=128, kv_block_size=4, cpu_linear=cpu_linear)
        engine, ref_engine = tmp_path / cpu_linear.value, tmp_path / f"ref-{cpu_linear.value}"
        build_engine(tmp_path / "ckpt", engine, build)
        build_engine(tmp_path / "ref", ref_engine, build)
        got, want = step_logits(engine, tokens), step_logits(ref_engine, tokens)
        graph = _engine_graph(engine)
        inits = {t.name: list(t.dims) for t in graph.initializer}
        if not tied or cpu_linear is CpuLinear.ONNXRUNTIME:
            np.testing.assert_array_equal(got, want, err_msg=cpu_linear.value)
            # a tied head on onnxruntime's linears: one float table, its Gemm's weight, which the embedding gathers
            tables = sorted(n for n in inits if n.startswith("embed."))
            assert tables == ([] if tied else ["embed.weight", "embed.weight_offset", "embed.weight_scale"]), tables
            assert not tied or inits["lm_head.weight"] == [VOCAB, 256]
            continue
        assert inits["embed.weight"] == [VOCAB, 256] and inits["embed.weight_offset"] == [VOCAB, 8, 1]
        assert np.abs(got - want).max() < 0.02 * np.abs(want).max(), np.abs(got - want).max()
        head = next(n for n in graph.node if n.name == "lm_head.q")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in head.attribute}
        assert (head.op_type, len(head.input)) == ("QLinear", 4)  # with the offsets
        assert (attrs["bits"], attrs["group"], attrs["block"]) == (8, 32, 32)
        assert not [n for n, dims in inits.items() if dims == [VOCAB, 256] and n != "embed.weight"]
    if tied:
        blocks = torch_logits_are_the_float_checkpoints(tmp_path / "ckpt", tmp_path / "float")
        assert blocks["embed.weight"] == (32, True)
    else:  # the embedding's uint8 rows: the first thing TensorRT's lowering meets
        from trtbuild.backends.build_request import portable_graph
        from trtbuild.backends.tensorrt.build.lowering import lower_for_tensorrt
        from trtbuild.errors import BuildError

        build = BuildConfig(max_seq_len=128, kv_block_size=4)
        with pytest.raises(BuildError, match=r"^embed.dq: uint8 codes with offsets .* 4- or 5-bit embedding"):
            lower_for_tensorrt(portable_graph(tmp_path / "ckpt", build)[3], build)


def test_q4_k_stays_quantized_and_equals_gguf_dequantization(tmp_path):
    """Q4_K (llama.cpp's K-quant of Q4_K_M files: super-blocks of 256, 6-bit scales and mins per 32) is kept as
    ``int4_min_wo`` blocks of 32 whose float32 scales and offsets reproduce gguf-py's dequantization exactly; its
    engine's logits are close to the dequantized float engine's, as Q4_1's (activations int8 per block of 32)."""
    types = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), T.Q4_K)
    src = write_gguf(tmp_path / "q4k.gguf", types, hidden=256, inter=512)
    result = convert(src, tmp_path / "ckpt")
    assert result.dequantized_line() is None
    convert(src, tmp_path / "float", dequantize=True)
    cfg, weights = load_any_checkpoint(tmp_path / "ckpt")
    q = cfg.quantization
    assert q is not None and q.qformat is QFormat.INT4_MIN_WO and q.group_size == 32 and q.exclude == []
    assert q.tensor_formats == {"embed": QFormat.INT8_GROUP_WO}
    _, reference = load_checkpoint(tmp_path / "float")  # gguf.quants.dequantize of every tensor
    for prefix in (
        f"layers.{i}.{m}" for i in range(LAYERS) for m in ("attn.qkv", "attn.out", "mlp.gate_up", "mlp.down")
    ):
        np.testing.assert_array_equal(dequantized(weights, prefix), reference[prefix + ".weight"], err_msg=prefix)
    tensors = stored(tmp_path / "ckpt")
    assert tensors["layers.0.attn.qkv.weight_scale"][0] == "F32"  # d * sc: exact in float32, not in float16
    assert tensors["layers.0.attn.qkv.weight"][0] == "U8"
    assert tensors["layers.0.mlp.down.weight"][1] == [256, 256]  # two codes a byte
    build = BuildConfig(max_seq_len=128, kv_block_size=4)
    build_engine(tmp_path / "ckpt", tmp_path / "q", build)
    build_engine(tmp_path / "float", tmp_path / "f", build)
    close_to_float_engine(tmp_path / "q", tmp_path / "f")
    assert ("trtbuild.cpu", "QLinear") in {(n.domain, n.op_type) for n in _engine_graph(tmp_path / "q").node}


def test_q6_k_stays_quantized_as_int8_blocks_of_16(tmp_path):
    """Q6_K (Q4_K_M files' ffn_down in half the layers, attn_v, often the embedding: super-blocks of 256, an int8
    scale per 16) is kept as ``int8_group_wo`` blocks of 16 beside the other formats' blocks of 32
    (``tensor_group_sizes``), its float32 scales reproducing gguf-py's dequantization exactly. A fused qkv of Q8_0 q /
    k and a Q6_K v (one format, two block sizes) becomes one ``int8_min_wo`` tensor in blocks of 16 (Q8_0's codes
    shifted by 128, Q6_K's by 32, offsets ``-shift * scale``: exact). The engine's logits are close to the float
    engine's on both CPU linears. (Q4_0, not Q4_K, beside it: random Q4_K mins make a model whose logits swing at a
    few positions under any activation rounding.)"""
    types = {"attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q6_K, "attn_output": T.Q4_0}
    types |= {"ffn_gate": T.Q4_0, "ffn_up": T.Q4_0, "ffn_down": T.Q6_K}
    src = write_gguf(tmp_path / "k.gguf", types, embed=T.Q6_K, hidden=256, inter=512)
    assert convert(src, tmp_path / "ckpt").dequantized_line() is None
    convert(src, tmp_path / "float", dequantize=True)
    cfg, weights = load_any_checkpoint(tmp_path / "ckpt")
    q = cfg.quantization
    qkvs, downs = [f"layers.{i}.attn.qkv" for i in range(LAYERS)], [f"layers.{i}.mlp.down" for i in range(LAYERS)]
    assert q is not None and q.qformat is QFormat.INT4_WO and q.group_size == 32 and q.exclude == []
    assert q.tensor_formats == dict.fromkeys(["embed", *downs], QFormat.INT8_GROUP_WO) | dict.fromkeys(
        qkvs, QFormat.INT8_MIN_WO
    )
    assert q.tensor_group_sizes == dict.fromkeys(["embed", *qkvs, *downs], 16)
    _, reference = load_checkpoint(tmp_path / "float")
    for prefix in ["embed", *qkvs, *downs]:
        np.testing.assert_array_equal(dequantized(weights, prefix), reference[prefix + ".weight"], err_msg=prefix)
    qkv = weights["layers.0.attn.qkv.weight"]
    assert qkv[384:].max() <= 63 and qkv[:384].max() > 200  # Q6_K v + 32, Q8_0 q and k + 128
    tensors = stored(tmp_path / "ckpt")
    assert tensors["layers.0.mlp.down.weight"] == ("I8", [256, 512])
    assert tensors["layers.0.mlp.down.weight_scale"] == ("F32", [256, 32])
    assert tensors["layers.0.attn.out.weight_scale"][1] == [256, 8]  # Q4_0 beside it: blocks of 32
    assert tensors["embed.weight_scale"] == ("F32", [VOCAB, 16])
    down = weights["layers.0.mlp.down.weight"]
    assert down.min() >= -32 and down.max() <= 31
    qlinears = both_cpu_linears_close_to_float(tmp_path)
    attrs = qlinears["layers.0.mlp.down.q"]
    assert (attrs["bits"], attrs["group"], attrs["block"]) == (8, 16, 16)
    blocks = torch_logits_are_the_float_checkpoints(tmp_path / "ckpt", tmp_path / "float")
    assert {codes: size for codes, (size, _) in blocks.items() if size != 32} == dict.fromkeys(
        ["embed.weight", *(p + ".weight" for p in [*qkvs, *downs])], 16
    )


@pytest.mark.parametrize("kind", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K])
def test_k_quant_blocks_of_random_bytes_equal_gguf_dequantization(kind):
    """Every byte of the K-quants' super-blocks read as gguf-py reads it: random bytes (scales, mins, codes, and
    float16 factors of either sign) dequantize bit for bit as ``gguf.quants.dequantize`` does."""
    from trtbuild.convert.readers import _block_tensor

    rng = np.random.default_rng(7)
    size = gguf.GGML_QUANT_SIZES[kind][1]
    data = rng.integers(0, 256, (6, 3 * size), dtype=np.uint8).reshape(6, 3, size)
    at = {T.Q6_K: slice(208, 210), T.Q3_K: slice(108, 110), T.Q2_K: slice(80, 84)}.get(kind, slice(0, 4))  # float16s
    data[..., at] = rng.uniform(-3e-3, 3e-3, (6, 3, (at.stop - at.start) // 2)).astype(np.float16).view(np.uint8)
    got = _block_tensor(data.reshape(6, -1), kind).dequantize().numpy()
    want = gguf.quants.dequantize(data.reshape(6, -1), kind).reshape(6, -1).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_q5_k_and_fused_mixed_blocks_stay_quantized(tmp_path):
    """Q5_K (the bulk of Q5_K_M files: codes 0..31, 6-bit scales and mins per 32) is kept as ``int8_min_wo``
    (uint8 codes, float32 scales and offsets: exact). A fused qkv of Q5_K q / k and a Q6_K v is one
    ``int8_min_wo`` tensor in blocks of 16: Q5_K's factors repeated, Q6_K's codes ``q - 32`` shifted by 32 with
    offset ``-32 * scale`` (exact), where it was dequantized before. The engine's logits are close to the float
    engine's on both CPU linears."""
    types = dict.fromkeys(("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"), T.Q5_K)
    types |= {"attn_v": T.Q6_K, "ffn_down": T.Q6_K}
    src = write_gguf(tmp_path / "q5km.gguf", types, embed=T.Q6_K, hidden=256, inter=512)
    result = convert(src, tmp_path / "ckpt")
    assert result.dequantized_line() is None
    convert(src, tmp_path / "float", dequantize=True)
    cfg, weights = load_any_checkpoint(tmp_path / "ckpt")
    q = cfg.quantization
    qkvs, downs = [f"layers.{i}.attn.qkv" for i in range(LAYERS)], [f"layers.{i}.mlp.down" for i in range(LAYERS)]
    assert q is not None and q.qformat is QFormat.INT8_MIN_WO and q.group_size == 32 and q.exclude == []
    assert q.tensor_formats == dict.fromkeys(["embed", *downs], QFormat.INT8_GROUP_WO)
    assert q.tensor_group_sizes == dict.fromkeys(["embed", *qkvs, *downs], 16)
    _, reference = load_checkpoint(tmp_path / "float")
    linears = [f"layers.{i}.{m}" for i in range(LAYERS) for m in ("attn.qkv", "attn.out", "mlp.gate_up", "mlp.down")]
    for prefix in ["embed", *linears]:
        np.testing.assert_array_equal(dequantized(weights, prefix), reference[prefix + ".weight"], err_msg=prefix)
    tensors = stored(tmp_path / "ckpt")
    assert tensors["layers.0.mlp.gate_up.weight"] == ("U8", [1024, 256])  # Q5_K: a byte a code
    assert tensors["layers.0.mlp.gate_up.weight_offset"] == ("F32", [1024, 8])
    assert tensors["layers.0.attn.qkv.weight_scale"] == ("F32", [512, 16])  # [q | k | v rows, 256 / 16]
    qkv = weights["layers.0.attn.qkv.weight"]
    assert qkv.dtype == np.uint8 and qkv[:384].max() <= 31 and qkv[384:].max() <= 63  # Q5_K rows, Q6_K's + 32
    qlinears = both_cpu_linears_close_to_float(tmp_path)
    for prefix, group in (("layers.0.attn.qkv", 16), ("layers.0.mlp.gate_up", 32)):
        attrs = qlinears[prefix + ".q"]
        assert (attrs["bits"], attrs["group"], attrs["block"], attrs["inputs"]) == (8, group, group, 4), prefix
    blocks = torch_logits_are_the_float_checkpoints(tmp_path / "ckpt", tmp_path / "float")
    assert blocks["layers.0.attn.qkv.weight"] == (16, True) and blocks["layers.0.mlp.gate_up.weight"] == (32, True)
    from trtbuild.backends.build_request import portable_graph
    from trtbuild.backends.tensorrt.build.lowering import lower_for_tensorrt
    from trtbuild.errors import BuildError

    build = BuildConfig(max_seq_len=128, kv_block_size=4)
    with pytest.raises(BuildError, match=r"uint8 codes with offsets .* which TensorRT's DequantizeLayer does not take"):
        lower_for_tensorrt(portable_graph(tmp_path / "ckpt", build)[3], build)


def test_q3_k_and_q2_k_stay_quantized(tmp_path):
    """Q3_K (codes -4..3, a signed 6-bit scale per 16) is kept as ``int8_group_wo`` blocks of 16 and Q2_K (codes
    0..3, a 4-bit scale and min per 16) as ``int8_min_wo`` blocks of 16: 8 bits a code where the file has 3.4 and
    2.6, exact, at int8 speed. The engine's logits are close to the float engine's."""
    types = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"), T.Q3_K)
    src = write_gguf(tmp_path / "q3k.gguf", types | {"ffn_down": T.Q2_K}, hidden=256, inter=512)
    assert convert(src, tmp_path / "ckpt").dequantized_line() is None
    convert(src, tmp_path / "float", dequantize=True)
    cfg, weights = load_any_checkpoint(tmp_path / "ckpt")
    q = cfg.quantization
    downs = [f"layers.{i}.mlp.down" for i in range(LAYERS)]
    linears = [f"layers.{i}.{m}" for i in range(LAYERS) for m in ("attn.qkv", "attn.out", "mlp.gate_up", "mlp.down")]
    assert q is not None and q.qformat is QFormat.INT8_GROUP_WO and q.exclude == []
    assert q.tensor_formats == {"embed": QFormat.INT8_GROUP_WO} | dict.fromkeys(downs, QFormat.INT8_MIN_WO)
    assert q.tensor_group_sizes == dict.fromkeys(linears, 16)
    _, reference = load_checkpoint(tmp_path / "float")
    for prefix in linears:
        np.testing.assert_array_equal(dequantized(weights, prefix), reference[prefix + ".weight"], err_msg=prefix)
    assert weights["layers.0.attn.qkv.weight"].min() == -4 and weights["layers.0.mlp.down.weight"].max() == 3
    build_engine(tmp_path / "ckpt", tmp_path / "q", BuildConfig(max_seq_len=128, kv_block_size=4))
    build_engine(tmp_path / "float", tmp_path / "f", BuildConfig(max_seq_len=128, kv_block_size=4))
    close_to_float_engine(tmp_path / "q", tmp_path / "f")


def test_format_4_quantized_checkpoint_config_still_reads(mixed):
    """A checkpoint written before ``tensor_group_sizes`` existed (format 4) reads with every block of 32."""
    from trtbuild.configio import from_dict, to_dict

    _, ckpt, _ = mixed
    data = to_dict(ModelConfig.load(ckpt))
    del data["quantization"]["tensor_group_sizes"]
    data["format_version"] = 4
    old = from_dict(ModelConfig, data)
    assert old.quantization.tensor_group_sizes == {} and old.quantization.group_size == 32


def test_hf_folder_keeps_its_dtype_by_default(tmp_path):
    from tiny_models import make_hf_model

    make_hf_model("llama_gqa", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    convert(tmp_path / "hf", tmp_path / "ckpt")
    assert ModelConfig.load(tmp_path / "ckpt").dtype is DType.BFLOAT16
    convert(tmp_path / "hf", tmp_path / "f32", DType.FLOAT32)
    assert ModelConfig.load(tmp_path / "f32").dtype is DType.FLOAT32
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildConfig(max_seq_len=128, kv_block_size=4))
    assert np.isfinite(step_logits(tmp_path / "engine", [1, 2, 3])).all()


@pytest.mark.slow
def test_smollm2_q4_1_engine_is_small_and_close_to_the_float_engine(tmp_path):
    from trtbuild import LLM, SamplingParams
    from trtbuild.cli.eval import evaluate
    from trtbuild.config import EvalConfig
    from trtbuild.demo import smollm2_gguf_path

    src = smollm2_gguf_path()
    convert(src, tmp_path / "ckpt")
    convert(src, tmp_path / "float", dequantize=True)
    build_engine(tmp_path / "ckpt", tmp_path / "q", BuildConfig(max_seq_len=512))
    build_engine(tmp_path / "float", tmp_path / "f", BuildConfig(max_seq_len=512))
    size = sum(p.stat().st_size for p in (tmp_path / "q").rglob("*") if p.is_file())
    assert size <= 120e6, size
    # the weights are the float engine's; int8 activations per block of 32 (llama.cpp's too) cost ~2% (measured)
    cfg = EvalConfig(windows=2)
    ppl = {e: evaluate(tmp_path / e, cfg).perplexity for e in ("q", "f")}
    assert ppl["q"] <= 1.03 * ppl["f"], ppl
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    texts = [LLM(tmp_path / e).generate(prompt, greedy)[0].outputs[0].text for e in ("q", "f")]
    assert "Paris" in texts[0] and "Paris" in texts[1], texts


def test_quantize_refuses_the_gguf_block_formats(mixed, tmp_path):
    """They are what convert keeps from GGUF files; quantize neither makes them nor requantizes such a checkpoint."""
    from click.testing import CliRunner

    from trtbuild.cli import cli

    _, ckpt, float_ckpt = mixed
    for qformat in ("int4_min_wo", "int8_group_wo"):
        result = CliRunner().invoke(
            cli, ["quantize", str(float_ckpt), "-o", str(tmp_path / qformat), "--qformat", qformat]
        )
        assert "trtbuild convert` keeps from GGUF files" in str(result.exception)  # main() prints it as one line
    result = CliRunner().invoke(cli, ["quantize", str(ckpt), "-o", str(tmp_path / "q"), "--qformat", "int8_wo"])
    assert "already quantized (int4_min_wo)" in str(result.exception)
    assert not (tmp_path / "q").exists()


def test_a_tokenizer_transformers_cannot_read_is_one_error(tmp_path):
    from trtbuild.errors import ConvertError

    src = write_gguf(tmp_path / "notok.gguf", MIXED, scores=False)
    with pytest.raises(ConvertError, match="transformers cannot rebuild its tokenizer"):
        convert(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
