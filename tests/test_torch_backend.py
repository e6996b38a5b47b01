"""The torch backend on the CPU, both runtimes: torch-compile (graph + weights, ``torch.compile`` at open) and
AOTInductor (``model.pt2``).

One engine per architecture and runtime is built per session, when a test first asks for it (``torch_engines``; an
AOTInductor build takes ~20 s here, a torch-compile one compiles at open: ~10 s cold, a few warm) and reused. The
default suite builds one AOTInductor engine (llama_gqa); the other architectures' packages are the slow suite's. Checked
for both: logits equal transformers' through the paged cache (ragged prefill, chunks, decode; one-row products as fused
reductions), the runner on top (continuous batching, chunked prefill, prefix hits); the custom op against the numpy
oracle (its CPU kernel, the native kernel it calls, the torch code, and the CUDA implementation's Triton kernel under
``TRITON_INTERPRET=1``); the AOTInductor package's load check in a child process and the fallback when it fails; and the
errors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_cli_errors import assert_clean_failure, run_cli
from test_end_to_end import BlockTables, check_prefill_and_decode
from test_llm import mixed_requests
from tiny_models import hf_logits

from trtbuild.backends.build_request import portable_graph
from trtbuild.backends.torch import ops
from trtbuild.backends.torch.aoti_package import DECODE_MODEL, STEP_MODEL, WEIGHTS_FILE, AotiRunner, package_models
from trtbuild.backends.torch.importer import PortableModule
from trtbuild.backends.torch.native_ops import paged_attention_native
from trtbuild.backends.torch.row_products import RowProducts
from trtbuild.backends.torch.session import TorchSession
from trtbuild.build import build_engine
from trtbuild.config import Backend, BuildConfig, TorchConfig, TorchDevice, TorchRuntime
from trtbuild.errors import BuildError, EngineError
from trtbuild.plugins.paged_attention import KV_FLOAT, KV_FP8, KV_INT8, PagedAttentionAttrs, rotary_cos_sin_cache
from trtbuild.plugins.paged_attention.reference import paged_attention as oracle
from trtbuild.runtime.batch import StepBatch
from trtbuild.runtime.llm import LLM, SamplingParams

ARCHS = ["llama_gqa", "qwen2_bias", "gpt2"]
RUNTIMES = [TorchRuntime.TORCH_COMPILE, TorchRuntime.AOT_INDUCTOR]
# (architecture, runtime) of every engine checked against transformers: each architecture on both runtimes (the
# AOTInductor packages but llama_gqa's in the slow suite: ~20 s each to build), Qwen3 (whose q/k norms are standard
# ops the importer covers), Phi-3 (rotary over part of each head) and Gemma 3 (sandwich norms, GeGLU, two rotary
# tables, sliding layers) on torch-compile only, to keep the suite short
ENGINES = [
    (name, runtime)
    if runtime is TorchRuntime.TORCH_COMPILE or name == "llama_gqa"
    else pytest.param(name, runtime, marks=pytest.mark.slow)
    for name in ARCHS
    for runtime in RUNTIMES
] + [(name, TorchRuntime.TORCH_COMPILE) for name in ("qwen3", "phi3", "gemma3")]
TINY_BUILD = BuildConfig(backend=Backend.TORCH, max_seq_len=128, kv_block_size=4)


class TorchEngines:
    """(name, runtime) -> (hf model, ckpt, torch CPU engine dir), each engine built the first time it is asked for
    (so a run of some tests builds only theirs) and kept for the session."""

    def __init__(self, tiny_engines: dict, root) -> None:
        self.tiny_engines, self.root, self.built = tiny_engines, root, {}

    def __getitem__(self, key: tuple[str, TorchRuntime]):
        if key not in self.built:
            name, runtime = key
            model, ckpt, _ = self.tiny_engines[name]
            engine = self.root / f"{name}-{runtime.value}"
            result = build_engine(ckpt, engine, TINY_BUILD, torch=TorchConfig(TorchDevice.CPU, torch_runtime=runtime))
            assert result.warnings == ()  # the AOTInductor package loaded and ran in its child-process check
            self.built[key] = (model, ckpt, engine)
        return self.built[key]


@pytest.fixture(scope="session")
def torch_engines(tiny_engines, tmp_path_factory):
    return TorchEngines(tiny_engines, tmp_path_factory.mktemp("torch"))


@pytest.mark.parametrize(("name", "runtime"), ENGINES, ids=lambda v: v.value if isinstance(v, TorchRuntime) else v)
def test_compiled_engine_matches_transformers(torch_engines, name, runtime):
    model, _, engine = torch_engines[name, runtime]
    session = TorchSession(engine, kv_cache_memory=1 << 20)
    assert session.runtime is runtime and session.load_seconds > 0
    check_prefill_and_decode(session, model, name)
    manifest = json.loads((engine / "manifest.json").read_text())
    (entry,) = manifest["engines"]
    assert entry["backend"] == "torch" and entry["torch_runtime"] == runtime.value
    assert entry["torch_version"] == torch.__version__ and (engine / entry["path"]).stat().st_size > 0
    if runtime is TorchRuntime.AOT_INDUCTOR:
        assert entry["path"].startswith("engines/torch-cpu-") and entry["path"].endswith("model.pt2")
    else:  # the graph's structure and the weights in the engine's dtype: no compiled code
        assert entry["target"] == "compile-cpu" and entry["path"] == "engines/torch-compile-cpu/graph.onnx"
        assert (engine / "engines/torch-compile-cpu/weights.safetensors").stat().st_size > 0


def one_token_steps_match_transformers(session: TorchSession, model) -> None:
    """A prompt (one logits row), then four one-token decode steps: each step's logits row equals transformers'."""
    rng = np.random.default_rng(4)
    tokens = [int(t) for t in rng.integers(0, model.config.vocab_size, 6)]
    alloc = BlockTables(session.num_blocks, session.config.build.kv_block_size, seed=5)
    done = 0
    for step in range(5):
        new = tokens if step == 0 else [int(rng.integers(0, model.config.vocab_size))]
        tokens = tokens if step == 0 else [*tokens, *new]
        batch = StepBatch.build([new], [done], [alloc.ensure(0, done + len(new))])
        done += len(new)
        logits = session.step(batch)
        assert logits.shape[0] == 1
        np.testing.assert_allclose(logits[0], hf_logits(model, tokens)[-1], atol=1e-4, rtol=0, err_msg=f"step {step}")


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3"])
def test_one_row_products_match_transformers(torch_engines, name):
    """A torch-compile CPU engine computes one-row products (a batch-1 prefill's logits row, batch-1 decode steps) as
    fused multiply-and-sum reductions over its MatMul weights held [out, in] and its tied head: the logits still
    equal transformers'."""
    model, _, engine = torch_engines[name, TorchRuntime.TORCH_COMPILE]
    session = TorchSession(engine, kv_cache_memory=1 << 20)
    module = session._runner._orig_mod  # the compiled PortableModule
    matmuls = {n.inputs[1] for n in module.nodes if n.op == "MatMul"}
    heads = {n.inputs[1] for n in module.nodes if n.op == "Gemm" and n.attrs.get("transB")}  # a tied head, [out, in]
    assert module.row_products is RowProducts.ALL and module.row_weights == matmuls | heads  # every weight's
    stored = load_file(str(engine / "engines/torch-compile-cpu/weights.safetensors"))  # [in, out], as the graph's
    for weight in matmuls:  # held transposed, [out, in]
        assert getattr(module, module._buffer_names[weight]).shape == stored[weight].shape[::-1]
    one_token_steps_match_transformers(session, model)


def test_aoti_decode_program_runs_one_token_steps(torch_engines):
    """An AOTInductor CPU engine holds two programs over one weights file: every one-token, one-logits-row step
    runs the decode program (its one-row products fused), every other step the general one, and both give
    transformers' logits."""
    model, _, engine = torch_engines["llama_gqa", TorchRuntime.AOT_INDUCTOR]
    (entry,) = json.loads((engine / "manifest.json").read_text())["engines"]
    package = engine / entry["path"]
    assert package_models(package) == {STEP_MODEL, DECODE_MODEL}
    session = TorchSession(engine, kv_cache_memory=1 << 20)
    runner = session._runner
    assert isinstance(runner, AotiRunner) and runner.decode_program is not None
    stored = load_file(str(package.parent / WEIGHTS_FILE))
    assert set(runner.decode_program.get_constant_fqns()) == set(runner.step_program.get_constant_fqns()) == set(stored)
    calls = {"decode": 0, "step": 0}

    def counting(program, key):
        def run(*args):
            calls[key] += 1
            return program(*args)

        return run

    runner.decode_program = counting(runner.decode_program, "decode")
    runner.step_program = counting(runner.step_program, "step")
    one_token_steps_match_transformers(session, model)  # one prefill of 6 tokens, four decode steps
    assert calls == {"decode": 4, "step": 1}
    check_prefill_and_decode(session, model, "llama_gqa")  # batched and ragged steps: the general program
    assert calls["step"] > 1


def test_opening_traces_each_graph_once(torch_engines):
    """Opening a torch-compile engine traces each of its graphs (one token; one sequence; several) once: with the
    nodes' float attributes unspecialised, Inductor restarted every graph's analysis to specialise them, which
    doubled the open (SmolLM2 warm: 57 s against 14 s)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # else the graphs an earlier session of this engine compiled in this process serve it
    counters.clear()
    TorchSession(torch_engines["llama_gqa", TorchRuntime.TORCH_COMPILE][2], kv_cache_memory=1 << 20)
    assert counters["stats"]["unique_graphs"] == 3
    assert counters["aot_autograd"]["total"] == 3, dict(counters["aot_autograd"])  # 6 when every graph restarted


def test_compiled_graphs_are_not_shared_between_modules(torch_engines, tmp_path):
    """A compiled module's graphs are not guarded on its own attributes (``runners.load_compiled``: ~6,000 guards a
    graph, 13% of a SmolLM2 decode step on 2 cores), so each module compiles through a code object of its own: a
    second engine in the process whose buffers have the same shapes but whose nodes differ (here every norm's
    epsilon) runs its own graphs, not the first one's, and both give their eager modules' logits."""
    import shutil

    import onnx

    from trtbuild.backends.torch.module_files import GRAPH_FILE

    engine = torch_engines["llama_gqa", TorchRuntime.TORCH_COMPILE][2]
    other = tmp_path / "other"
    shutil.copytree(engine, other)
    graph_path = next(other.glob(f"engines/torch-compile-*/{GRAPH_FILE}"))
    model = onnx.load(str(graph_path))
    norms = [n for n in model.graph.node if n.op_type == "RMSNormalization"]
    for node in norms:
        kept = [a for a in node.attribute if a.name != "epsilon"]
        del node.attribute[:]
        node.attribute.extend([*kept, onnx.helper.make_attribute("epsilon", 0.5)])
    assert norms
    onnx.save(model, str(graph_path))
    tokens = list(range(5, 14))
    logits = {}
    for name, directory in (("first", engine), ("other", other)):
        for compiled in (True, False):
            session = TorchSession(directory, kv_cache_memory=1 << 20, compile=compiled)
            logits[name, compiled] = session.step(StepBatch.build([tokens], [0], [[1, 2, 3]]))
    for name in ("first", "other"):
        np.testing.assert_allclose(logits[name, True], logits[name, False], atol=1e-4, rtol=0, err_msg=name)
    assert np.abs(logits["first", True] - logits["other", True]).max() > 1e-2


def test_eager_module_matches_transformers(torch_engines):
    """The torch-compile engine's module run without compiling (``compile=False``) gives the same logits."""
    model, _, engine = torch_engines["gpt2", TorchRuntime.TORCH_COMPILE]
    session = TorchSession(engine, kv_cache_memory=1 << 20, compile=False)
    assert isinstance(session._runner, PortableModule)
    check_prefill_and_decode(session, model, "gpt2")


@pytest.mark.parametrize(
    ("name", "runtime"),
    [
        ("qwen2_bias", TorchRuntime.TORCH_COMPILE),
        ("llama_gqa", TorchRuntime.AOT_INDUCTOR),
        ("gemma3", TorchRuntime.TORCH_COMPILE),
    ],
    ids=lambda v: v.value if isinstance(v, TorchRuntime) else v,
)
def test_padded_decode_steps_match_transformers(torch_engines, name, runtime):
    """Decode steps padded to preset batch sizes (the CUDA-graph path, here without graphs) give the same logits;
    Gemma 3's sliding layers read block tables of their own (the padded inputs' sixth tensor)."""
    model, _, engine = torch_engines[name, runtime]
    session = TorchSession(engine, kv_cache_memory=1 << 20, decode_batch_sizes=[2, 8])
    assert session._decode.sliding == (name == "gemma3")
    check_prefill_and_decode(session, model, name)
    assert session._decode.sizes == [2, 8] and 8 in session._decode._static  # (the warm-up may use size 2)


@pytest.mark.parametrize("sliding", [False, True])
def test_padded_inputs_are_aligned_views_rewritten_whole(sliding):
    """A padded size's inputs are views of one tensor, each 16 bytes in (an AOTInductor package copies a misaligned
    input before every call); a step writes all of every view: its rows, then padding (token 0, position 0, the
    null block, each padding row's own logits index)."""
    from trtbuild.backends.torch.decode_graphs import PaddedInputs

    for size in (1, 2, 3, 4):
        inputs = PaddedInputs(size, 3, sliding, torch.device("cpu"))
        base = inputs.on_device.data_ptr()
        assert len(inputs.tensors) == 5 + sliding
        assert all((t.data_ptr() - base) % 16 == 0 and t.is_contiguous() for t in inputs.tensors)
        assert [tuple(t.shape) for t in inputs.tensors[:5]] == [(size,), (size,), (size, 3), (size + 1,), (size,)]
        inputs.tensors[0].fill_(7), inputs.tensors[1].fill_(7), inputs.tensors[2].fill_(7)  # a larger batch's rows
        tables = [[1, 2]]
        inputs.fill(StepBatch.build([[5]], [9], tables, sliding_block_tables=tables if sliding else None))
        ids, positions, table, qsl, logits_idx = (t.tolist() for t in inputs.tensors[:5])
        assert ids == [5] + [0] * (size - 1) and positions == [9] + [0] * (size - 1)
        assert table == [[1, 2, 0]] + [[0, 0, 0]] * (size - 1)
        assert qsl == list(range(size + 1)) and logits_idx == list(range(size))
        if sliding:
            assert inputs.tensors[5].tolist() == table


def test_padded_decode_rows_a_smaller_batch_leaves_write_nothing(torch_engines):
    """A decode step padded to a size that a larger batch used before: the rows past the batch are padding again
    (token 0 at position 0 of the null block), not the departed sequence's, whose block may belong to another
    sequence by then. Here Y leaves, its block 2 goes to Z, X decodes alone padded to 2, then Z decodes: its
    logits equal an unpadded session's (Y's stale row wrote into Z's block before: 3.0 apart)."""
    engine = torch_engines["llama_gqa", TorchRuntime.TORCH_COMPILE][2]
    steps = [
        StepBatch.build([[1, 2, 3], [4, 5, 6]], [0, 0], [[1], [2]]),  # X in block 1, Y in block 2
        StepBatch.build([[7], [8]], [3, 3], [[1], [2]]),  # both decode (size 2): Y writes position 3 of block 2
        StepBatch.build([[9, 10, 11, 12]], [0], [[2]]),  # Y has finished; Z fills block 2
        StepBatch.build([[13]], [4], [[1, 3]]),  # X alone, padded to 2
        StepBatch.build([[14]], [4], [[2, 4]]),  # Z decodes, reading block 2
    ]
    logits = {}
    for sizes in ([2], []):
        session = TorchSession(engine, kv_cache_memory=1 << 20, decode_batch_sizes=sizes, compile=False)
        assert session._decode.sizes == sizes
        logits[len(sizes)] = [session.step(batch) for batch in steps]
    for step, (padded, plain) in enumerate(zip(logits[1], logits[0], strict=True)):
        np.testing.assert_allclose(padded, plain, atol=1e-5, rtol=0, err_msg=f"step {step}")


@pytest.mark.parametrize("runtime", RUNTIMES, ids=lambda r: r.value)
def test_runner_on_the_torch_engine(torch_engines, tiny_engines, runtime):
    """LLM on the torch engine: the same greedy tokens as the onnxruntime engine, batched, chunked, prefix-cached."""
    model, _, engine = torch_engines["llama_gqa", runtime]
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

    model, _, engine = torch_engines["llama_gqa", TorchRuntime.TORCH_COMPILE]
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
    # Prompt logprobs: the device's logits rows copied to the host, in steps of several engine calls.
    scoring = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    chunked = LLM(engine, max_num_batched_tokens=16)
    for got, want in zip(chunked.generate(prompts, scoring), ort.generate(prompts, scoring), strict=True):
        assert got.prompt_logprobs[0] is None and want.prompt_logprobs[0] is None
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def random_step(hq: int, hkv: int, d: int, block_size: int = 4, seed: int = 0, lens=(5, 3, 1)):
    """A ragged step (prefill, chunk continuation, decode; or ``lens`` tokens each) over a cache whose earlier
    positions are filled."""
    rng = np.random.default_rng(seed)
    starts, lens = [0, 6, 9], list(lens)
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


IMPLS = ["op", "native", "torch-code", "cuda"]


def run_op(impl: str, qkv, k_cache, v_cache, positions, tables, qsl, cos_sin, attrs: PagedAttentionAttrs, scales):
    """The op on numpy step arrays (caches: torch tensors, written in place) by one implementation: ``op`` the
    registered op (dispatched to its CPU kernel), ``native`` the native kernel (which must take the call),
    ``torch-code`` the torch code every device can run, ``cuda`` the CUDA implementation (the Triton kernel, here
    in Triton's interpreter)."""
    steps = [torch.from_numpy(a) for a in (qkv, positions, tables, qsl)]
    rope = None if cos_sin is None else torch.from_numpy(cos_sin)
    k_scale, v_scale = (None if s is None else torch.tensor(s) for s in scales)
    if impl == "op":
        return torch.ops.trtbuild.paged_attention(
            steps[0], k_cache, v_cache, *steps[1:], rope, k_scale, v_scale, attrs.num_heads, attrs.num_kv_heads,
            attrs.head_size, attrs.scale, attrs.rotary_interleaved, attrs.kv_cache_dtype, attrs.sliding_window,
            attrs.softcap,
        )  # fmt: skip
    if impl == "cuda":
        pytest.importorskip("triton")
        return ops.paged_attention_cuda(
            steps[0], k_cache, v_cache, *steps[1:], rope, k_scale, v_scale, attrs.num_heads, attrs.num_kv_heads,
            attrs.head_size, attrs.scale, attrs.rotary_interleaved, attrs.kv_cache_dtype, attrs.sliding_window,
            attrs.softcap,
        )  # fmt: skip
    args = (steps[0], k_cache, v_cache, *steps[1:], rope, attrs, k_scale, v_scale)
    if impl == "torch-code":
        return ops.paged_attention_torch(*args)
    out = paged_attention_native(*args)
    assert out is not None, "the native kernel refused a call within its limits"
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lens", [(5, 3, 1), (1, 1, 1)], ids=["ragged", "decode"])
@pytest.mark.parametrize(
    ("heads", "rope", "kv"),
    [((4, 2), "halves", KV_FLOAT), ((6, 6), "interleaved", KV_FLOAT), ((4, 1), None, KV_FLOAT),
     ((4, 2), "halves", KV_INT8), ((4, 2), "partial", KV_FP8)],
)  # fmt: skip
def test_custom_op_cpu_matches_oracle(heads, rope, kv, lens, impl):
    hq, hkv = heads
    d = 8
    qkv, kc, vc, positions, tables, qsl = random_step(hq, hkv, d, lens=lens)
    cos_sin = None if rope is None else rotary_cos_sin_cache(64, d if rope != "partial" else 4, 10000.0)
    attrs = PagedAttentionAttrs(hq, hkv, d, 0.3, rope == "interleaved", kv)
    scales = (0.05, 0.04) if kv != KV_FLOAT else (None, None)
    kc_t, vc_t = torch.from_numpy(kc.copy()), torch.from_numpy(vc.copy())
    if kv != KV_FLOAT:
        (kc, kc_t), (vc, vc_t) = quantized_cache(kc, scales[0], kv), quantized_cache(vc, scales[1], kv)
    ref_out, ref_k, ref_v = oracle(qkv, kc, vc, positions, tables, qsl, cos_sin, attrs, *scales)
    out = run_op(impl, qkv, kc_t, vc_t, positions, tables, qsl, cos_sin, attrs, scales)
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-5, rtol=0)
    for got, want in ((kc_t, ref_k), (vc_t, ref_v)):  # written in place
        got = got.view(torch.uint8) if kv == KV_FP8 else got
        want = want.view(np.uint8) if kv == KV_FP8 else want
        np.testing.assert_allclose(got.numpy().astype(np.float64), want.astype(np.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("threads", [2, 3])
def test_native_op_parallel_loops_match_oracle(threads):
    """A step with work for several threads (a 140-token ragged prefill: its cache writes and its attention both
    split into tasks) runs its loops on the native library's persistent workers (``c_api.cc``'s ``HostPool``) beside
    the calling thread, as many threads as torch's: calls in a row and from two Python threads at once (which take
    turns) all match the oracle."""
    from concurrent.futures import ThreadPoolExecutor

    hq, hkv, d = 4, 2, 16
    qkv, kc, vc, positions, tables, qsl = random_step(hq, hkv, d, block_size=32, seed=5, lens=(70, 40, 30))
    cos_sin = rotary_cos_sin_cache(160, d, 10000.0)
    attrs = PagedAttentionAttrs(hq, hkv, d, 0.25, False, KV_FLOAT)
    ref = oracle(qkv, kc, vc, positions, tables, qsl, cos_sin, attrs, None, None)

    def call(_: int) -> tuple[np.ndarray, ...]:
        kc_t, vc_t = torch.from_numpy(kc.copy()), torch.from_numpy(vc.copy())
        out = run_op("native", qkv, kc_t, vc_t, positions, tables, qsl, cos_sin, attrs, (None, None))
        return out.numpy(), kc_t.numpy(), vc_t.numpy()

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = [call(i) for i in range(3)]
        with ThreadPoolExecutor(2) as pool:
            results += list(pool.map(call, range(6)))
    finally:
        torch.set_num_threads(before)
    for got in results:
        for g, want in zip(got, ref, strict=True):
            np.testing.assert_allclose(g, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lens", [(5, 3, 1), (1, 1, 1), (5, 6, 3)], ids=["ragged", "decode", "chunks"])
@pytest.mark.parametrize(
    ("heads", "kv", "window", "softcap"),
    [((4, 2), KV_FLOAT, 3, None), ((6, 1), KV_FLOAT, 6, None), ((4, 2), KV_FLOAT, None, 0.9),
     ((4, 4), KV_FLOAT, 4, 1.7), ((4, 2), KV_INT8, 5, 1.2)],
)  # fmt: skip
def test_custom_op_window_and_softcap_match_oracle(heads, kv, window, softcap, lens, impl):
    """Sliding windows (across block boundaries, GQA) and soft-capping; with a window, the block-table entries of
    blocks wholly before each sequence's window then point at block 0 holding NaN: the output does not change."""
    hq, hkv = heads
    d = 8
    qkv, kc, vc, positions, tables, qsl = random_step(hq, hkv, d, seed=3, lens=lens)
    cos_sin = rotary_cos_sin_cache(64, d, 10000.0)
    attrs = PagedAttentionAttrs(hq, hkv, d, 0.3, False, kv, sliding_window=window, softcap=softcap)
    scales = (0.05, 0.04) if kv != KV_FLOAT else (None, None)
    kc_t, vc_t = torch.from_numpy(kc.copy()), torch.from_numpy(vc.copy())
    if kv != KV_FLOAT:
        (kc, kc_t), (vc, vc_t) = quantized_cache(kc, scales[0], kv), quantized_cache(vc, scales[1], kv)
    ref_out, ref_k, ref_v = oracle(qkv, kc, vc, positions, tables, qsl, cos_sin, attrs, *scales)
    fresh = kc_t.clone(), vc_t.clone()

    def run(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: np.ndarray) -> torch.Tensor:
        return run_op(impl, qkv, k_cache, v_cache, positions, block_tables, qsl, cos_sin, attrs, scales)

    out = run(kc_t, vc_t, tables)
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-5, rtol=0)
    for got, want in ((kc_t, ref_k), (vc_t, ref_v)):  # written in place
        np.testing.assert_allclose(got.numpy().astype(np.float64), want.astype(np.float64), atol=1e-6, rtol=0)
    if window is None:
        return
    first = positions[qsl[:-1]]
    before = np.arange(tables.shape[1])[None, :] < (np.maximum(first - window + 1, 0) // 4)[:, None]
    assert before.any()
    k_null, v_null = fresh
    if kv == KV_FLOAT:
        k_null[0], v_null[0] = float("nan"), float("nan")
    moved = run(k_null, v_null, np.where(before, 0, tables))
    np.testing.assert_array_equal(moved.numpy(), out.numpy())


def test_native_op_runs_long_steps_on_host_threads():
    """A step with enough work for the kernel's parallel loops (its writes and its attention, on threads the C entry
    starts: no onnxruntime pool here) equals the oracle, and a shape beyond the kernel's limits (block size 128) is
    refused, nothing written, so the op runs its torch code."""
    hq, hkv, d = 8, 2, 16
    rng = np.random.default_rng(7)
    lens, block = [70, 45], 16
    tables = np.arange(1, 1 + 2 * 8, dtype=np.int64).reshape(2, 8)
    qsl = np.array([0, *np.cumsum(lens)], dtype=np.int64)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
    qkv = rng.standard_normal((sum(lens), (hq + 2 * hkv) * d)).astype(np.float32)
    cache = np.zeros((2, 17, block, hkv, d), dtype=np.float32)
    cos_sin = rotary_cos_sin_cache(128, d, 10000.0)
    attrs = PagedAttentionAttrs(hq, hkv, d, 0.25)
    ref_out, ref_k, _ = oracle(qkv, cache[0], cache[1], positions, tables, qsl, cos_sin, attrs)
    kc_t, vc_t = torch.from_numpy(cache[0].copy()), torch.from_numpy(cache[1].copy())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = run_op("native", qkv, kc_t, vc_t, positions, tables, qsl, cos_sin, attrs, (None, None))
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(kc_t.numpy(), ref_k, atol=1e-6, rtol=0)
    wide = torch.zeros((17, 128, hkv, d))
    args = [torch.from_numpy(a) for a in (qkv, positions, tables, qsl)]
    refused = paged_attention_native(args[0], wide, wide.clone(), *args[1:], torch.from_numpy(cos_sin), attrs)
    assert refused is None and not wide.any()


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (3, 1.1)], ids=["plain", "window-softcap"])
def test_custom_op_cuda_implementation_under_triton_interpreter(window, softcap):
    """The op's CUDA implementation (the Triton kernel) on CPU tensors in Triton's interpreter equals the oracle."""
    pytest.importorskip("triton")
    hq, hkv, d = 4, 2, 8
    qkv, kc, vc, positions, tables, qsl = random_step(hq, hkv, d, seed=5)
    cos_sin = rotary_cos_sin_cache(64, d, 10000.0)
    attrs = PagedAttentionAttrs(hq, hkv, d, 0.3, sliding_window=window, softcap=softcap)
    ref_out, ref_k, _ = oracle(qkv, kc, vc, positions, tables, qsl, cos_sin, attrs)
    kc_t, vc_t = torch.from_numpy(kc.copy()), torch.from_numpy(vc.copy())
    out = ops.paged_attention_cuda(
        torch.from_numpy(qkv), kc_t, vc_t, *(torch.from_numpy(a) for a in (positions, tables, qsl)),
        torch.from_numpy(cos_sin), None, None, hq, hkv, d, 0.3, False, KV_FLOAT, window, softcap,
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
    """An AOTInductor CUDA build needs the GPU; a torch-compile CUDA engine builds anywhere and is refused with one
    line where there is no GPU to open it on."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "engine"
    ckpt = tiny_engines["gpt2"][1]
    aot = ("--backend", "torch", "--device", "cuda", "--torch-runtime", "aot-inductor")
    proc = run_cli("build", ckpt, "-o", out, *aot)
    assert_clean_failure(proc, "--device cuda needs an NVIDIA GPU")
    assert not out.exists()
    proc = run_cli("build", ckpt, "-o", out, "--device", "cpu")
    assert_clean_failure(
        proc, "torch options (--device, --dtype, --torch-runtime, --max-autotune) need --backend torch"
    )
    assert not out.exists()
    proc = run_cli("build", ckpt, "-o", out, "--backend", "torch", "--device", "cuda", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    (entry,) = json.loads((out / "manifest.json").read_text())["engines"]
    assert entry["target"] == "compile-cuda" and entry["torch_runtime"] == "torch-compile"
    with pytest.raises(EngineError, match="compile-cuda: this machine has no NVIDIA GPU"):
        LLM(out)


def test_isolated_run_reports_a_segfault_and_goes_on():
    """A child that segfaults is an exit status (-11) and its fault's Python stack, not a dead parent."""
    from trtbuild.backends.torch.build.isolate import report, run_isolated

    crash = run_isolated("import ctypes\nprint('before')\nctypes.string_at(0)", timeout=60)
    assert not crash.ok and crash.rc == -11
    assert "before" in crash.trace and any("Segmentation fault" in line for line in crash.trace)
    assert crash.summary().startswith("segmentation fault (exit status -11)")
    assert report is not None
    code = "import sys\nfrom trtbuild.backends.torch.build.isolate import report\nreport({'n': int(sys.argv[1])})"
    done = run_isolated(code, args=["7"], timeout=60)
    assert done.ok and done.results == [{"n": 7}]
    slow = run_isolated("import time\ntime.sleep(30)", timeout=2)
    assert not slow.ok and slow.rc == 124 and slow.summary().startswith("timed out")


@pytest.mark.parametrize("failure", ["load", "compile"])
def test_aoti_package_that_does_not_run_falls_back_to_torch_compile(tiny_engines, tmp_path, monkeypatch, failure):
    """Where the package's child-process check fails (here: the child really segfaults), or Inductor cannot compile
    the package on this machine (here: its compile raises as a C++ compiler error would), the build writes the
    torch-compile engine instead and says so in one warning line; the engine it leaves runs."""
    from trtbuild.backends.torch.build import isolate, writer

    def crashing_check(*args, **kwargs):
        return isolate.run_isolated("import ctypes\nctypes.string_at(0)", timeout=60)

    def failing_compile(*args, **kwargs):
        raise RuntimeError("C++ compile error\nsecond line")

    if failure == "load":
        monkeypatch.setattr(writer, "aoti_load_check", crashing_check)
    else:
        monkeypatch.setattr(torch._inductor, "aot_compile", failing_compile)
    model, ckpt, _ = tiny_engines["gpt2"]
    out = tmp_path / "engine"
    cfg = TorchConfig(TorchDevice.CPU, torch_runtime=TorchRuntime.AOT_INDUCTOR)
    result = build_engine(ckpt, out, TINY_BUILD, torch=cfg)
    (warning,) = result.warnings
    expected = {
        "load": "the AOTInductor package: it does not run on this machine (segmentation fault",
        "compile": "the AOTInductor package: it does not build on this machine (RuntimeError: C++ compile error):",
    }
    assert warning.startswith(expected[failure]), warning
    assert warning.endswith("the engine uses the torch-compile runtime instead (docs/gpu.md)")
    (entry,) = json.loads((out / "manifest.json").read_text())["engines"]
    assert entry["torch_runtime"] == "torch-compile" and not list(out.rglob("*.pt2"))
    check_prefill_and_decode(TorchSession(out, kv_cache_memory=1 << 20, compile=False), model, "gpt2")


def test_mismatched_package_is_refused_with_the_rebuild_command(torch_engines, tmp_path):
    import shutil

    from trtbuild.artifacts.manifest import manifest_digest

    engine = shutil.copytree(torch_engines["llama_gqa", TorchRuntime.AOT_INDUCTOR][2], tmp_path / "engine")
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["engines"][0]["target"] = "cpu-sse9"
    manifest["engines"][0]["torch_version"] = "1.0.0"
    manifest["digest"] = manifest_digest(manifest)  # a consistent manifest of another target, not a tampered one
    (engine / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match=r"built for cpu-sse9.*built with torch 1.0.0.*--backend torch --device cpu"):
        LLM(engine)


def test_a_format_2_package_still_loads(torch_engines, tmp_path):
    """An AOTInductor package of engine format 2 (one program for every step, its weights inside, no weights file)
    opens and runs: the runner takes it as a step program alone."""
    import shutil

    from trtbuild.backends.torch.build.writer import dynamic_shapes, example_step
    from trtbuild.config import RuntimeConfig

    model, ckpt, engine = torch_engines["llama_gqa", TorchRuntime.AOT_INDUCTOR]
    old = shutil.copytree(engine, tmp_path / "engine")
    config = RuntimeConfig.load(old)
    (entry,) = json.loads((old / "manifest.json").read_text())["engines"]
    package = old / entry["path"]
    (package.parent / WEIGHTS_FILE).unlink()
    module = PortableModule(portable_graph(ckpt, TINY_BUILD)[3], config.io, torch.float32).eval()  # as format 2 did
    example = example_step(config.model, TINY_BUILD.kv_block_size, torch.float32, "cpu")
    with torch.no_grad():
        program = torch.export.export(module, example.args, dynamic_shapes=dynamic_shapes(config.model, TINY_BUILD))
    torch._inductor.aoti_compile_and_package(program, package_path=str(package))
    config = RuntimeConfig(config.model, config.build, config.engine_file, config.io, format_version=2)
    config.save(old)
    session = TorchSession(old, kv_cache_memory=1 << 20)
    assert package_models(package) == {STEP_MODEL} and session._runner.decode_program is None
    check_prefill_and_decode(session, model, "llama_gqa")
