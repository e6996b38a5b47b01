"""Mixture-of-experts families (Mixtral, Qwen3-MoE; ``tiny_models.TINY_MOE_CONFIGS``): config reading and its
one-line refusals, the expert tensors from either transformers spelling (per-expert on disk, fused in memory), and
the engines against transformers through the paged cache (the onnxruntime engine with the native ``MoE`` kernel and
with its standard-op lowering, the torch CPU engine): logits within 1e-4, greedy tokens equal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file
from tiny_models import TINY_MOE_CONFIGS, hf_logits, make_hf_model

from trtbuild.checkpoint.layout import canonical_linears, expected_tensors
from trtbuild.config import DType, ModelConfig
from trtbuild.configio import from_dict, to_dict
from trtbuild.convert.convert import convert
from trtbuild.errors import ConvertError
from trtbuild.models import model_config_from_hf


def hf_spec(name: str, **overrides) -> dict:
    spec = {**TINY_MOE_CONFIGS[name], **overrides}
    spec.pop("model_type")
    return spec


def test_mixtral_config_and_layout():
    cfg = model_config_from_hf(hf_spec("mixtral"), DType.FLOAT32)
    assert cfg.moe is not None and cfg.moe.num_experts == 4 and cfg.moe.top_k == 2 and cfg.moe.renormalize
    assert cfg.moe.sparse_layers == [0, 1] and cfg.moe.intermediate_size == 40 and cfg.head_size == 8
    tensors = expected_tensors(cfg)
    assert tensors["layers.1.moe.router.weight"] == (4, 48)
    assert tensors["layers.1.moe.gate_up.weight"] == (4, 80, 48)
    assert tensors["layers.1.moe.down.weight"] == (4, 48, 40)
    assert not any(".mlp." in name for name in tensors)
    assert "layers.0.mlp.gate_up" not in canonical_linears(cfg)
    # a window slides every layer, as Mistral's; Qwen3-MoE's too (transformers reads no layer_types for it)
    assert model_config_from_hf(hf_spec("mixtral", sliding_window=32), DType.FLOAT32).kv_window == 32
    qwen = hf_spec("qwen3_moe", use_sliding_window=True, sliding_window=32, max_window_layers=1)
    assert model_config_from_hf(qwen, DType.FLOAT32).kv_window == 32


def test_qwen3_moe_config_and_layout():
    cfg = model_config_from_hf(hf_spec("qwen3_moe"), DType.FLOAT32)
    assert cfg.qk_norm and cfg.moe is not None and not cfg.moe.renormalize
    assert cfg.moe.sparse_layers == [0, 2] and cfg.moe.top_k == 3 and cfg.moe.intermediate_size == 24
    tensors = expected_tensors(cfg)
    assert tensors["layers.1.mlp.gate_up.weight"] == (2 * 56, 48) and "layers.1.moe.router.weight" not in tensors
    assert tensors["layers.2.moe.gate_up.weight"] == (6, 48, 48)
    stepped = model_config_from_hf(hf_spec("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[]), DType.FLOAT32)
    assert stepped.moe.sparse_layers == [1]  # (layer + 1) % step == 0, as transformers
    assert model_config_from_hf(hf_spec("qwen3_moe", norm_topk_prob=True), DType.FLOAT32).moe.renormalize
    assert model_config_from_hf(hf_spec("qwen3_moe", num_experts=0), DType.FLOAT32).moe is None  # all dense
    # transformers 5 writes num_experts as num_local_experts
    renamed = hf_spec("qwen3_moe", num_local_experts=6)
    del renamed["num_experts"]
    assert model_config_from_hf(renamed, DType.FLOAT32).moe.num_experts == 6


def test_dense_checkpoint_config_without_moe_still_reads():
    """A checkpoint written before ``moe`` existed (format 3) reads as a dense one."""
    cfg = model_config_from_hf(hf_spec("qwen3_moe", num_experts=0), DType.FLOAT32)
    data = to_dict(cfg)
    del data["moe"]
    data["format_version"] = 3
    old = from_dict(ModelConfig, data)
    assert old.moe is None and not old.is_sparse(0)


@pytest.mark.parametrize(
    ("name", "overrides", "needle"),
    [
        ("qwen3_moe", dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size=64 is not supported"),
        ("mixtral", dict(n_shared_experts=2), "n_shared_experts=2 is not supported"),
        ("qwen3_moe", dict(scoring_func="sigmoid"), "scoring_func='sigmoid' is not supported"),
        ("mixtral", dict(topk_group=2), "topk_group=2"),
        ("mixtral", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        ("qwen3_moe", dict(num_experts_per_tok=7), "top_k 7 must be between 1 and num_experts 6"),
        ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step 0"),
    ],
)
def test_unsupported_variants_are_refused_in_one_line(name, overrides, needle):
    with pytest.raises(ConvertError) as e:
        model_config_from_hf(hf_spec(name, **overrides), DType.FLOAT32)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_moe_gguf_is_refused_in_one_line(tmp_path):
    """llama.cpp keeps Mixtral as a "llama" GGUF with ``llama.expert_count``: refused, the HF folder converts."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "mixtral.gguf"), "llama")
    w.add_block_count(1)
    w.add_expert_count(8)
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConvertError) as e:
        convert(tmp_path / "mixtral.gguf", tmp_path / "ckpt")
    assert "mixture-of-experts GGUF (8 experts) is not supported" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_experts_convert_from_either_spelling(tmp_path, name):
    """Per-expert tensors (``block_sparse_moe.experts.{e}.w1`` / ``mlp.experts.{e}.gate_proj``, as checkpoints on
    disk keep them) and transformers 5's fused ``mlp.experts.gate_up_proj`` give the same canonical tensors, equal
    to the model's own."""
    model = make_hf_model(name, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    assert any(".experts.gate_up_proj" in k for k in state)  # transformers 5 holds the experts fused
    (tmp_path / "fused").mkdir()
    save_file(state, str(tmp_path / "fused" / "model.safetensors"))
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    convert(tmp_path / "fused", tmp_path / "ckpt-fused", DType.FLOAT32)
    out = load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    fused = load_file(str(tmp_path / "ckpt-fused" / "rank0.safetensors"))
    assert set(out) == set(fused) == set(expected_tensors(ModelConfig.load(tmp_path / "ckpt")))
    for key, value in out.items():
        np.testing.assert_array_equal(value, fused[key], err_msg=key)
    layer = ModelConfig.load(tmp_path / "ckpt").moe.sparse_layers[-1]
    hf = f"model.layers.{layer}.mlp."
    np.testing.assert_array_equal(out[f"layers.{layer}.moe.gate_up.weight"], state[hf + "experts.gate_up_proj"])
    np.testing.assert_array_equal(out[f"layers.{layer}.moe.down.weight"], state[hf + "experts.down_proj"])
    np.testing.assert_array_equal(out[f"layers.{layer}.moe.router.weight"], state[hf + "gate.weight"])
    assert torch.equal(torch.from_numpy(out["embed.weight"]), state["model.embed_tokens.weight"])


@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_portable_graph_has_one_moe_node_per_sparse_layer(tmp_path, name):
    """The router is a float MatMul of the normed hidden state; the node holds the stacked experts as they are."""
    import onnx
    from onnx import numpy_helper

    from trtbuild.backends.build_request import portable_graph
    from trtbuild.config import BuildConfig
    from trtbuild.plugins.moe import DOMAIN, OP_TYPE

    make_hf_model(name, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    cfg, _, _, graph = portable_graph(tmp_path / "ckpt", BuildConfig(max_seq_len=128))
    onnx.checker.check_model(graph)
    nodes = [n for n in graph.graph.node if (n.domain, n.op_type) == (DOMAIN, OP_TYPE)]
    assert [n.name for n in nodes] == [f"layers.{i}.moe.experts" for i in cfg.moe.sparse_layers]
    inits = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    producer = {o: n for n in graph.graph.node for o in n.output}
    for node in nodes:
        router = producer[node.input[1]]
        assert router.op_type == "MatMul" and router.input[0] == node.input[0]
        assert inits[router.input[1]].dtype == np.float32 and inits[router.input[1]].shape == (48, cfg.moe.num_experts)
        assert inits[node.input[2]].shape == (cfg.moe.num_experts, 2 * cfg.moe.intermediate_size, 48)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"top_k": cfg.moe.top_k, "renormalize": int(cfg.moe.renormalize), "activation": b"silu"}


def engine_forms() -> dict:
    """form -> (BuildConfig, TorchConfig or None): the native onnxruntime engine, the standard-op one (dense MoE,
    lowered attention, onnxruntime's linears) and the torch CPU engine."""
    from trtbuild.config import Backend, BuildConfig, CpuAttention, CpuLinear, TorchConfig, TorchDevice

    lowered = dict(cpu_attention=CpuAttention.LOWERED, cpu_linear=CpuLinear.ONNXRUNTIME)
    return {
        "native": (BuildConfig(max_seq_len=128, kv_block_size=4), None),
        "lowered": (BuildConfig(max_seq_len=128, kv_block_size=4, **lowered), None),
        "torch": (BuildConfig(backend=Backend.TORCH, max_seq_len=128, kv_block_size=4), TorchConfig(TorchDevice.CPU)),
    }


@pytest.fixture(scope="module")
def moe_engines(tmp_path_factory):
    """name -> (hf model, {form: engine dir}): each tiny MoE model converted once and built as an onnxruntime engine
    with the native kernels (``native``), with standard ops only (``lowered``) and as a torch CPU engine."""
    from trtbuild.build import build_engine

    root = tmp_path_factory.mktemp("moe")
    builds = engine_forms()
    out = {}
    for name in TINY_MOE_CONFIGS:
        model = make_hf_model(name, root / f"{name}-hf", seed=3)
        convert(root / f"{name}-hf", root / f"{name}-ckpt", DType.FLOAT32)
        engines = {}
        for form, (build, torch_cfg) in builds.items():
            engines[form] = root / f"{name}-{form}"
            build_engine(root / f"{name}-ckpt", engines[form], build, **({"torch": torch_cfg} if torch_cfg else {}))
        out[name] = (model, engines)
    return out


def _engine_ops(engine_dir) -> set[tuple[str, str]]:
    import onnx

    from trtbuild.config import RuntimeConfig

    path = engine_dir / RuntimeConfig.load(engine_dir).engine_file
    return {(n.domain, n.op_type) for n in onnx.load(str(path), load_external_data=False).graph.node}


@pytest.mark.parametrize("form", ["native", "lowered"])
@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_onnxruntime_engine_matches_transformers(moe_engines, name, form):
    """Ragged prefill with a chunk, mixed chunk + decode steps, scrambled block tables: logits within 1e-4."""
    from test_end_to_end import check_prefill_and_decode

    from trtbuild.backends.onnxruntime.session import OrtSession

    model, engines = moe_engines[name]
    ops = _engine_ops(engines[form])
    assert (("trtbuild.cpu", "MoE") in ops) == (form == "native") and ("trtbuild", "MoE") not in ops
    if form == "native":  # the experts are read in place every step: the session's huge-page arena holds them
        from trtbuild.backends.onnxruntime.huge_pages import read_arena_layout
        from trtbuild.config import RuntimeConfig

        runtime = RuntimeConfig.load(engines[form])
        names = {t.name for t in read_arena_layout(engines[form] / runtime.engine_file)}
        sparse = runtime.model.moe.sparse_layers
        assert names == {f"layers.{n}.moe.{w}.weight" for n in sparse for w in ("gate_up", "down")}
    check_prefill_and_decode(OrtSession(engines[form], kv_cache_memory=1 << 20), model, name)


@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_torch_engine_matches_transformers(moe_engines, name):
    """The torch CPU engine's module (``torch.ops.trtbuild.moe`` per sparse layer), run eagerly."""
    from test_end_to_end import check_prefill_and_decode

    from trtbuild.backends.torch.session import TorchSession

    model, engines = moe_engines[name]
    check_prefill_and_decode(TorchSession(engines["torch"], kv_cache_memory=1 << 20, compile=False), model, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_compiled_torch_engine_matches_transformers(moe_engines, name):
    """The same engine opened as it runs by default (``torch.compile``: the MoE op stays opaque to Inductor)."""
    from test_end_to_end import check_prefill_and_decode

    from trtbuild.backends.torch.session import TorchSession

    model, engines = moe_engines[name]
    check_prefill_and_decode(TorchSession(engines["torch"], kv_cache_memory=1 << 20), model, name)


@pytest.mark.parametrize("form", ["native", "lowered", pytest.param("torch", marks=pytest.mark.slow)])  # compiles
@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_greedy_tokens_match_transformers(moe_engines, name, form):
    from trtbuild.runtime.llm import LLM, SamplingParams

    model, engines = moe_engines[name]
    llm = LLM(engines[form])
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, llm.vocab_size, n)] for n in (5, 11, 2)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = list(prompt)
        for _ in range(10):  # argmax by hand: generate()'s min_new_tokens would mask the EOS token the engine may pick
            ids.append(int(hf_logits(model, ids)[-1].argmax()))
        assert out.token_ids == ids[len(prompt) :]
