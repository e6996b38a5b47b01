"""Convert -> build -> onnxruntime engine: logits equal transformers' through the paged cache (float32)."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import TINY_CONFIGS, hf_logits

from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.runtime.batch import StepBatch

ATOL = 1e-4


class BlockTables:
    """Test-side allocation: scrambled block ids handed out as sequences grow (block 0 is never used)."""

    def __init__(self, num_blocks: int, block_size: int, seed: int) -> None:
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}

    def ensure(self, seq: int, length: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < length:
            table.append(int(self.free.pop()))
        return table


@pytest.fixture(scope="module")
def lowered_engines(tiny_engines, tmp_path_factory):
    """name -> engine_dir of each tiny model built with attention as standard ONNX ops (``--cpu-attention lowered``)."""
    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig, CpuAttention

    root = tmp_path_factory.mktemp("lowered")
    for name, (_, ckpt, _) in tiny_engines.items():
        build_engine(
            ckpt, root / name, BuildConfig(max_seq_len=128, kv_block_size=4, cpu_attention=CpuAttention.LOWERED)
        )
    return {name: root / name for name in tiny_engines}


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_prefill_and_decode_match_transformers(tiny_engines, name):
    """The default engine: native attention kernel, KV cache written in the graph."""
    model, _, engine_dir = tiny_engines[name]
    check_prefill_and_decode(OrtSession(engine_dir, kv_cache_memory=1 << 20), model, name)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_lowered_attention_matches_transformers(tiny_engines, lowered_engines, name):
    """The lowered form (standard ops; the session stores the step's K/V) matches transformers just as well."""
    model, _, _ = tiny_engines[name]
    check_prefill_and_decode(OrtSession(lowered_engines[name], kv_cache_memory=1 << 20), model, name)


def check_prefill_and_decode(session, model, name: str, atol: float = ATOL) -> None:
    """A ragged prefill with a chunk, then mixed chunk + decode steps: every logit row equals transformers'."""
    vocab = model.config.vocab_size
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, vocab, n)) for n in (7, 1, 13, 4)]
    seqs = [list(map(int, p)) for p in prompts]
    alloc = BlockTables(session.num_blocks, session.config.build.kv_block_size, seed=2)

    # Step 1: prefill sequences 0, 1, 3 fully and the first 5 tokens of sequence 2 (a chunk), all logits.
    chunk = {0: seqs[0], 1: seqs[1], 2: seqs[2][:5], 3: seqs[3]}
    batch = StepBatch.build(
        list(chunk.values()), [0] * 4, [alloc.ensure(s, len(t)) for s, t in chunk.items()], all_logits=True
    )
    logits = session.step(batch)
    offset = 0
    for toks in chunk.values():
        ref = hf_logits(model, toks)
        assert ref.std() > 0.05  # the random model produces non-trivial logits
        np.testing.assert_allclose(logits[offset : offset + len(toks)], ref, atol=atol, rtol=0)
        offset += len(toks)

    # Step 2: the rest of sequence 2's prompt alongside decode tokens of the others (mixed ragged batch),
    # then 8 decode steps for everyone; the next token is drawn at random so every path is exercised.
    done = {0: len(seqs[0]), 1: 1, 2: 5, 3: len(seqs[3])}
    for step in range(9):
        new: dict[int, list[int]] = {}
        for s in range(4):
            if step == 0 and s == 2:
                new[s] = seqs[2][5:]
            else:
                tok = int(rng.integers(0, vocab))
                seqs[s].append(tok)
                new[s] = [tok]
        batch = StepBatch.build(
            list(new.values()), [done[s] for s in new], [alloc.ensure(s, done[s] + len(t)) for s, t in new.items()]
        )
        logits = session.step(batch)
        for i, s in enumerate(new):
            done[s] += len(new[s])
            np.testing.assert_allclose(
                logits[i], hf_logits(model, seqs[s])[-1], atol=atol, rtol=0, err_msg=f"{name} step {step} sequence {s}"
            )


def _engine_graph(engine_dir):
    import onnx

    from trtbuild.config import RuntimeConfig

    return onnx.load(str(engine_dir / RuntimeConfig.load(engine_dir).engine_file), load_external_data=False).graph


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_engine_graph_holds_one_native_attention_node_per_layer(tiny_engines, name):
    """Native attention: each layer's plugin node became one ``trtbuild.cpu`` node; no K/V leaves the graph."""
    from trtbuild.config import CpuAttention, CpuLinear, RuntimeConfig

    model, _, engine_dir = tiny_engines[name]
    graph = _engine_graph(engine_dir)
    native = [n for n in graph.node if n.op_type == "PagedAttention"]
    assert {n.domain for n in native} == {"trtbuild.cpu"}
    assert len(native) == model.config.num_hidden_layers
    assert {"Attention", "RotaryEmbedding"}.isdisjoint(n.op_type for n in graph.node)
    # no K/V concatenated in the graph (Qwen3's q | k | v after its per-head norms is the model's own Concat)
    assert all(n.name.endswith(".qk_norm.concat") for n in graph.node if n.op_type == "Concat")
    assert [o.name for o in graph.output] == ["logits"]
    assert RuntimeConfig.load(engine_dir).build.cpu_attention is CpuAttention.NATIVE
    # a float model has no linear for QLinear: the engine records onnxruntime's kernels
    assert RuntimeConfig.load(engine_dir).build.cpu_linear is CpuLinear.ONNXRUNTIME


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_lowered_engine_graph_uses_fused_onnxruntime_ops(lowered_engines, name):
    """The lowering's opset-23 forms are what a lowered engine holds (the logits tests above check their numerics)."""
    ops = {n.op_type for n in _engine_graph(lowered_engines[name]).node}
    assert "Attention" in ops and ("RotaryEmbedding" in ops) == (name != "gpt2")
    assert "ScatterND" not in ops and "Transpose" not in ops and "PagedAttention" not in ops
