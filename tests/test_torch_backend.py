"""The torch backend on the CPU: the portable graph imported into torch, exported and compiled by AOTInductor.

One compiled engine per architecture is built per session (``torch_engines``; each compile takes ~30-60 s here)
and reused. Checked: logits equal transformers' through the paged cache (ragged prefill, chunks, decode), the
runner on top (continuous batching, chunked prefill, prefix hits), the custom op against the numpy oracle (torch
implementation, and the CUDA implementation's Triton kernel under ``TRITON_INTERPRET=1``), and the errors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_cli_errors import assert_clean_failure, run_cli
from test_end_to_end import check_prefill_and_decode
from test_llm import mixed_requests

from trtbuild.backends.torch import ops
from trtbuild.backends.torch.importer import PortableModule
from trtbuild.backends.torch.session import TorchSession
from trtbuild.build import build_engine, portable_graph
from trtbuild.config import Backend, BuildConfig, TorchConfig, TorchDevice
from trtbuild.errors import BuildError, EngineError
from trtbuild.plugins.paged_attention import KV_FLOAT, KV_FP8, KV_INT8, PagedAttentionAttrs, rotary_cos_sin_cache
from trtbuild.plugins.paged_attention.reference import paged_attention as oracle
from trtbuild.runtime.llm import LLM, SamplingParams

ARCHS = ["llama_gqa", "qwen2_bias", "gpt2"]
TINY_BUILD = BuildConfig(backend=Backend.TORCH, max_seq_len=128, kv_block_size=4)


@pytest.fixture(scope="session")
def torch_engines(tiny_engines, tmp_path_factory):
    """name -> (hf model, ckpt, torch CPU engine dir): one AOTInductor compile per architecture per session."""
    root = tmp_path_factory.mktemp("torch")
    out = {}
    for name in ARCHS:
        model, ckpt, _ = tiny_engines[name]
        build_engine(ckpt, root / name, TINY_BUILD, torch=TorchConfig(device=TorchDevice.CPU))
        out[name] = (model, ckpt, root / name)
    return out


@pytest.mark.parametrize("name", ARCHS)
def test_compiled_engine_matches_transformers(torch_engines, name):
    model, _, engine = torch_engines[name]
    session = TorchSession(engine, kv_cache_memory=1 << 20)
    check_prefill_and_decode(session, model, name)
    manifest = json.loads((engine / "manifest.json").read_text())
    (entry,) = manifest["engines"]
    assert entry["backend"] == "torch" and entry["path"].startswith("engines/torch-cpu-")
    assert entry["torch_version"] == torch.__version__ and (engine / entry["path"]).stat().st_size > 0


def test_padded_decode_steps_match_transformers(torch_engines):
    """Decode steps padded to preset batch sizes (the CUDA-graph path, here without graphs) give the same logits."""
    model, _, engine = torch_engines["qwen2_bias"]
    session = TorchSession(engine, kv_cache_memory=1 << 20, decode_batch_sizes=[2, 8])
    check_prefill_and_decode(session, model, "qwen2_bias")
    assert session._decode.sizes == [2, 8] and set(session._decode._static) == {8}


def test_runner_on_the_torch_engine(torch_engines, tiny_engines):
    """LLM on the torch engine: the same greedy tokens as the onnxruntime engine, batched, chunked, prefix-cached."""
    model, _, engine = torch_engines["llama_gqa"]
    prompts, params = mixed_requests(model.config.vocab_size, n=8)
    ort_out = LLM(tiny_engines["llama_gqa"][2]).generate(prompts, params)
    llm = LLM(engine)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in ort_out]
    chunked = LLM(engine, max_num_batched_tokens=16, max_num_seqs=3)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == [o.token_ids for o in ort_out]
    prefix = list(range(3, 43))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([[*prefix, 5, 6]], greedy)
    second = llm.generate([[*prefix, 9]], greedy)[0]
    assert second.metrics.num_cached_tokens == 40
    with torch.no_grad():
        ref = model.generate(torch.tensor([[*prefix, 9]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert second.token_ids == ref[0, 41:].tolist()


def test_runner_samples_on_the_engines_device(torch_engines, tiny_engines):
    """The torch engine's LLM samples with the device sampler: seeded top-k/top-p/min-p draws equal the host's on
    the onnxruntime engine (penalised rows go to the host sampler); the KV pool defaults to the CPU size."""
    from trtbuild.backends.torch.sampling import DeviceSampler
    from trtbuild.runtime.kv_cache import DEFAULT_KV_CACHE_MEMORY

    model, _, engine = torch_engines["llama_gqa"]
    prompts, _ = mixed_requests(model.config.vocab_size, n=6)
    params = [
        SamplingParams(temperature=0.8, top_k=20, max_tokens=8, seed=1, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=2, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=0.05, max_tokens=8, seed=3, ignore_eos=True),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, max_tokens=8, seed=4, ignore_eos=True),
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=8, seed=5, ignore_eos=True),
    ]
    llm = LLM(engine)
    assert isinstance(llm.sampler, DeviceSampler)
    assert llm.session.kv_cache_memory == DEFAULT_KV_CACHE_MEMORY
    ort = LLM(tiny_engines["llama_gqa"][2])
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in ort.generate(prompts, params)]


def random_step(hq: int, hkv: int, d: int, block_size: int = 4, seed: int = 0):
    """A ragged step (prefill, chunk continuation, decode) over a cache whose earlier positions are filled."""
    rng = np.random.default_rng(seed)
    starts, lens = [0, 6, 9], [5, 3, 1]
    tables = np.array([[3, 7, 1, 0], [5, 2, 8, 4], [9, 11, 6, 10]], dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens, strict=True)]).astype(np.int64)
    qkv = rng.standard_normal((int(qsl[-1]), (hq + 2 * hkv) * d)).astype(np.float32)
    cache = rng.standard_normal((2, 12, block_size, hkv, d)).astype(np.float32)
    return qkv, cache[0], cache[1], positions, tables, qsl


def quantized_cache(cache: np.ndarray, scale: float, kv: int) -> tuple[np.ndarray, torch.Tensor]:
    from trtbuild.plugins.paged_attention import quantize_kv

    q = quantize_kv(cache, scale, kv)
    t = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn) if kv == KV_FP8 else torch.from_numpy(q)
    return q, t.clone()


@pytest.mark.parametrize(
    ("heads", "rope", "kv"),
    [((4, 2), "halves", KV_FLOAT), ((6, 6), "interleaved", KV_FLOAT), ((4, 1), None, KV_FLOAT),
     ((4, 2), "halves", KV_INT8), ((4, 2), "partial", KV_FP8)],
)  # fmt: skip
def test_custom_op_cpu_matches_oracle(heads, rope, kv):
    hq, hkv = heads
    d = 8
    qkv, kc, vc, positions, tables, qsl = random_step(hq, hkv, d)
    cos_sin = None if rope is None else rotary_cos_sin_cache(64, d if rope != "partial" else 4, 10000.0)
    attrs = PagedAttentionAttrs(hq, hkv, d, 0.3, rope == "interleaved", kv)
    scales = (0.05, 0.04) if kv != KV_FLOAT else (None, None)
    kc_t, vc_t = torch.from_numpy(kc.copy()), torch.from_numpy(vc.copy())
    if kv != KV_FLOAT:
        (kc, kc_t), (vc, vc_t) = quantized_cache(kc, scales[0], kv), quantized_cache(vc, scales[1], kv)
    ref_out, ref_k, ref_v = oracle(qkv, kc, vc, positions, tables, qsl, cos_sin, attrs, *scales)
    out = torch.ops.trtbuild.paged_attention(
        torch.from_numpy(qkv), kc_t, vc_t, *(torch.from_numpy(a) for a in (positions, tables, qsl)),
        None if cos_sin is None else torch.from_numpy(cos_sin),
        *(None if s is None else torch.tensor(s) for s in scales),
        hq, hkv, d, 0.3, rope == "interleaved", kv,
    )  # fmt: skip
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-5, rtol=0)
    for got, want in ((kc_t, ref_k), (vc_t, ref_v)):  # written in place
        got = got.view(torch.uint8) if kv == KV_FP8 else got
        want = want.view(np.uint8) if kv == KV_FP8 else want
        np.testing.assert_allclose(got.numpy().astype(np.float64), want.astype(np.float64), atol=1e-6, rtol=0)


def test_custom_op_cuda_implementation_under_triton_interpreter():
    """The op's CUDA implementation (the Triton kernel) on CPU tensors in Triton's interpreter equals the oracle."""
    pytest.importorskip("triton")
    hq, hkv, d = 4, 2, 8
    qkv, kc, vc, positions, tables, qsl = random_step(hq, hkv, d, seed=5)
    cos_sin = rotary_cos_sin_cache(64, d, 10000.0)
    attrs = PagedAttentionAttrs(hq, hkv, d, 0.3)
    ref_out, ref_k, _ = oracle(qkv, kc, vc, positions, tables, qsl, cos_sin, attrs)
    kc_t, vc_t = torch.from_numpy(kc.copy()), torch.from_numpy(vc.copy())
    out = ops.paged_attention_cuda(
        torch.from_numpy(qkv), kc_t, vc_t, *(torch.from_numpy(a) for a in (positions, tables, qsl)),
        torch.from_numpy(cos_sin), None, None, hq, hkv, d, 0.3, False, KV_FLOAT,
    )  # fmt: skip
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(kc_t.numpy(), ref_k, atol=1e-6, rtol=0)


def test_importer_refuses_an_unknown_op(tiny_engines):
    import onnx

    _, _, io, graph = portable_graph(tiny_engines["llama_gqa"][1], BuildConfig(max_seq_len=128))
    node = graph.graph.node[3]
    graph.graph.node.insert(4, onnx.helper.make_node("Softmax", [node.output[0]], ["extra"], name="extra"))
    with pytest.raises(BuildError, match="cannot import op\\(s\\) Softmax of the portable graph"):
        PortableModule(graph, io, torch.float32)


def test_cuda_without_gpu_is_one_line(tiny_engines, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "engine"
    proc = run_cli("build", tiny_engines["gpt2"][1], "-o", out, "--backend", "torch", "--device", "cuda")
    assert_clean_failure(proc, "--device cuda needs an NVIDIA GPU")
    assert not out.exists()
    proc = run_cli("build", tiny_engines["gpt2"][1], "-o", out, "--device", "cpu")
    assert_clean_failure(proc, "torch options (--device, --dtype, --max-autotune) need --backend torch")
    proc = run_cli(
        "build", tiny_engines["gpt2"][1], "-o", out, "--backend", "torch", "--device", "cpu", "--max-autotune"
    )
    assert_clean_failure(proc, "--max-autotune tunes Triton templates for a GPU: it needs --device cuda")
    assert not out.exists()


def test_mismatched_package_is_refused_with_the_rebuild_command(torch_engines, tmp_path):
    import shutil

    from trtbuild.artifacts.manifest import manifest_digest

    engine = shutil.copytree(torch_engines["gpt2"][2], tmp_path / "engine")
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["engines"][0]["target"] = "cpu-sse9"
    manifest["engines"][0]["torch_version"] = "1.0.0"
    manifest["digest"] = manifest_digest(manifest)  # a consistent manifest of another target, not a tampered one
    (engine / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match=r"built for cpu-sse9.*built with torch 1.0.0.*--backend torch --device cpu"):
        LLM(engine)
