"""Two KV-cache groups (``runtime/kv_groups.py``): a model of sliding and full layers keeps its sliding layers' blocks
in their own pool, released as they leave the window, while the full layers keep every block.

The scheduler is driven by ``TwoGroupModel`` (the two-table version of ``test_scheduler.FakeModel``): full layers
read every earlier token through ``block_tables``, sliding layers the last W through ``sliding_block_tables``, and
the next token depends on both, so a wrong table in either group, or a sliding block released too early, changes
the output. The tiny Gemma 3 (window 6; layers sliding, sliding, full) then runs through ``LLM`` on the onnxruntime
native and lowered engines and the torch CPU engine, its greedy tokens compared with transformers' forward.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_llm_window import transformers_greedy
from test_scheduler import VOCAB, next_token

from trtbuild.checkpoint.files import load_checkpoint
from trtbuild.config import AttentionKind, BuildConfig, EngineIO
from trtbuild.errors import ConfigError, RequestError
from trtbuild.graph.emit import emit_portable_graph
from trtbuild.runtime.batch import StepBatch
from trtbuild.runtime.kv_cache import bytes_per_block, default_cpu_kv_cache_memory
from trtbuild.runtime.kv_cache_manager import KVCacheManager, max_blocks_held
from trtbuild.runtime.kv_groups import group_bytes_per_block, sliding_blocks_cap, split_kv_blocks
from trtbuild.runtime.kv_offload import KVOffloadConfig
from trtbuild.runtime.llm import LLM, SamplingParams
from trtbuild.runtime.scheduler import Scheduler, SchedulerConfig
from trtbuild.runtime.sequence import FinishReason, RequestStatus, Sequence


def reference(prompt: list[int], max_tokens: int, window: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append((next_token(tokens) + 3 * next_token(tokens[-window:])) % VOCAB)
    return tokens[len(prompt) :]


class TwoGroupModel:
    """Test driver of a two-group engine: each group's slots hold token ids written through its own tables."""

    def __init__(self, config: SchedulerConfig) -> None:
        assert config.sliding_window is not None and config.num_sliding_blocks is not None
        self.bs, self.window = config.block_size, config.sliding_window
        self.full = np.full(config.num_blocks * self.bs, -1, dtype=np.int64)
        self.sliding = np.full(config.num_sliding_blocks * self.bs, -1, dtype=np.int64)

    def step(self, batch: StepBatch) -> np.ndarray:
        assert batch.sliding_block_tables is not None
        bs, qsl = self.bs, batch.query_start_loc
        seq_of = np.repeat(np.arange(batch.num_seqs), np.diff(qsl))
        for slots, tables in ((self.full, batch.block_tables), (self.sliding, batch.sliding_block_tables)):
            where = tables[seq_of, batch.positions // bs] * bs + batch.positions % bs
            assert (where >= bs).all(), "a step wrote the null block"
            for b in range(batch.num_seqs):  # no other sequence may hold a block written this step (prefix sharing)
                written = set((where[qsl[b] : qsl[b + 1]] // bs).tolist())
                assert all(c == b or not written & set(tables[c].tolist()) for c in range(batch.num_seqs))
            slots[where] = batch.input_ids
        logits = np.zeros((len(batch.logits_indices), VOCAB), dtype=np.float32)
        for row, t in enumerate(batch.logits_indices):
            b, p = int(seq_of[t]), int(batch.positions[t])
            q = np.arange(p + 1)
            full = self.full[batch.block_tables[b, q // bs] * bs + q % bs].tolist()
            q = q[max(0, p - self.window + 1) :]
            recent = self.sliding[batch.sliding_block_tables[b, q // bs] * bs + q % bs].tolist()
            assert -1 not in full and -1 not in recent, "read a slot never written"
            logits[row, (next_token(full) + 3 * next_token(recent)) % VOCAB] = 1.0
        return logits


def make(**kw) -> tuple[Scheduler, TwoGroupModel]:
    config = SchedulerConfig(**kw)
    return Scheduler(config), TwoGroupModel(config)


def step(sched: Scheduler, model: TwoGroupModel) -> list[Sequence]:
    out = sched.schedule()
    assert not out.is_empty and out.sliding_group
    logits = model.step(out.to_step_batch())
    return sched.update_from_output(out, logits[out.sample_rows].argmax(axis=1).tolist())


def held(sched: Scheduler, seq: Sequence) -> tuple[int, int]:
    """Blocks ``seq`` holds in the (full, sliding) group."""
    assert sched.sliding_kv_cache is not None
    return sched.kv_cache.num_held_blocks(seq), sched.sliding_kv_cache.num_held_blocks(seq)


def test_4096_token_sequence_keeps_its_sliding_group_bounded() -> None:
    # W 512, blocks of 16, chunks of 16: a 4,000-token prompt and 96 decodes hold at most 34 sliding blocks (a
    # sliding pool of exactly that) while the full group grows to all 256 blocks of the sequence.
    sched, model = make(
        max_num_seqs=1, max_num_batched_tokens=16, max_seq_len=4096, block_size=16, num_blocks=257,
        sliding_window=512, num_sliding_blocks=35,
    )  # fmt: skip
    assert sched.sliding_kv_cache is not None and sched.sliding_kv_cache.max_blocks_held(4095, 16) == 34
    seq = sched.add_request("long", [(7 * i) % VOCAB for i in range(4000)], SamplingParams(max_tokens=96))
    trace = []
    while sched.has_unfinished():
        out = sched.schedule()
        batch = out.to_step_batch()
        trace.append(held(sched, seq))
        assert sched.sliding_kv_cache.num_used_blocks == trace[-1][1]
        # the sliding row's entries before the window of the step's first token are the null block
        row, first = batch.sliding_block_tables[0], max(0, int(batch.positions[0]) - 511) // 16
        assert (row[:first] == 0).all() and (row[first : len(seq.sliding_block_ids)] != 0).all()
        assert (batch.block_tables[0, : len(seq.block_ids)] != 0).all()  # the full group keeps every block
        logits = model.step(batch)
        sched.update_from_output(out, logits[out.sample_rows].argmax(1).tolist())
    assert max(s for _, s in trace) <= 34 and trace[-1] == (256, 33)  # a decode: ceil((512 - 1) / 16) + 1
    assert [f for f, _ in trace] == sorted(f for f, _ in trace) and max(f for f, _ in trace) == 256
    assert seq.output_token_ids == reference(seq.prompt_token_ids, 96, 512) and sched.num_preemptions == 0
    assert sched.kv_cache.num_used_blocks == sched.sliding_kv_cache.num_used_blocks == 0
    assert not seq.block_ids and not seq.sliding_block_ids
    with pytest.raises(RequestError, match=r"need 35 KV-cache blocks .* \(sliding layers\)"):
        make(
            max_num_seqs=1, max_num_batched_tokens=18 + 1, max_seq_len=4096, block_size=16, num_blocks=257,
            sliding_window=512, num_sliding_blocks=35,
        )[0].add_request("chunks of 19", [1] * 4000, SamplingParams(max_tokens=96))  # fmt: skip


def test_preemption_and_abort_free_both_groups() -> None:
    # 14 full blocks of 4 for two 24-token prompts growing to 36: the later one is preempted, and its blocks leave
    # both groups; an abort frees both too. Both complete with the reference tokens.
    sched, model = make(
        max_num_seqs=2, max_num_batched_tokens=8, max_seq_len=64, block_size=4, num_blocks=15,
        sliding_window=6, num_sliding_blocks=9,
    )  # fmt: skip
    a = sched.add_request("a", [1 + i % 5 for i in range(24)], SamplingParams(temperature=0, max_tokens=12))
    b = sched.add_request("b", [2 + i % 7 for i in range(24)], SamplingParams(temperature=0, max_tokens=12))
    preempted_seen = False
    while sched.has_unfinished():
        step(sched, model)
        for seq in (a, b):
            full, sliding = held(sched, seq)
            assert (full == 0) == (sliding == 0) == (seq.status is not RequestStatus.RUNNING)
            assert sliding <= max_blocks_held(36, 4, 6, 8) and sliding <= full
        preempted_seen |= b.status is RequestStatus.PREEMPTED
        used = sum(held(sched, s)[1] for s in (a, b))
        assert sched.sliding_kv_cache.num_used_blocks == used
    assert preempted_seen and sched.num_preemptions >= 1
    for seq in (a, b):
        assert seq.output_token_ids == reference(seq.prompt_token_ids, 12, 6)
    assert sched.kv_cache.num_used_blocks == sched.sliding_kv_cache.num_used_blocks == 0

    c = sched.add_request("c", list(range(1, 20)), SamplingParams(max_tokens=5))
    step(sched, model)
    assert held(sched, c) == (2, 2)  # its first chunk of 8 tokens: blocks 0 and 1 in each group
    assert sched.abort("c") and c.finish_reason is FinishReason.ABORT
    assert sched.kv_cache.num_used_blocks == sched.sliding_kv_cache.num_used_blocks == 0
    assert not c.block_ids and not c.sliding_block_ids


def test_admission_is_all_or_nothing_across_groups() -> None:
    # The sliding pool (4 usable blocks) is scarcer than the full one here: the second request fits the full
    # group but not the sliding one, so it takes nothing from either and waits; it runs once the first finishes.
    sched, model = make(
        max_num_seqs=2, max_num_batched_tokens=24, max_seq_len=64, block_size=4, num_blocks=40,
        sliding_window=6, num_sliding_blocks=5,
    )  # fmt: skip
    a = sched.add_request("a", list(range(1, 13)), SamplingParams(temperature=0, max_tokens=3))
    b = sched.add_request("b", list(range(2, 10)), SamplingParams(temperature=0, max_tokens=3))
    step(sched, model)
    assert held(sched, a) == (3, 3) and held(sched, b) == (0, 0) and b.status is RequestStatus.WAITING
    assert sched.kv_cache.num_used_blocks == 3 and sched.sliding_kv_cache.num_used_blocks == 3
    while sched.has_unfinished():
        step(sched, model)
    for seq in (a, b):
        assert seq.output_token_ids == reference(seq.prompt_token_ids, 3, 6)


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 20), st.integers(1, 10), st.integers(0, 8)), min_size=1, max_size=6
    ),
    block_size=st.sampled_from([1, 2, 4]),
    window=st.sampled_from([1, 2, 3, 5, 8]),
    seqs=st.integers(1, 4),
    tokens=st.integers(1, 12),
    extra=st.integers(0, 6),
    caching=st.booleans(),
)
def test_random_workloads_complete_correctly(requests, block_size, window, seqs, tokens, extra, caching) -> None:
    """Requests (shared-prefix kind, prompt length, max_tokens, arrival step) under random limits, with or without
    prefix caching; pools as small as the largest request allows (each group's own bound), plus ``extra`` blocks
    in each."""
    full = max(max_blocks_held(n + m - 1, block_size, None, tokens) for _, n, m, _ in requests)
    sliding = max(max_blocks_held(n + m - 1, block_size, window, tokens) for _, n, m, _ in requests)
    sched, model = make(
        max_num_seqs=seqs, max_num_batched_tokens=tokens, max_seq_len=32, block_size=block_size,
        num_blocks=1 + full + extra, sliding_window=window, num_sliding_blocks=1 + sliding + extra,
        enable_prefix_caching=caching,
    )  # fmt: skip
    pending = sorted(enumerate(requests), key=lambda r: r[1][3])
    added: list[tuple[Sequence, int]] = []
    for n_step in range(1000):
        while pending and pending[0][1][3] <= n_step:
            i, (kind, n, m, _) = pending.pop(0)
            prompt = [(kind * 5 + j) % VOCAB for j in range(n)]
            added.append((sched.add_request(f"r{i}", prompt, SamplingParams(max_tokens=m)), m))
        if not pending and not sched.has_unfinished():
            break
        if sched.has_unfinished():
            step(sched, model)
        for seq in sched.running:
            assert held(sched, seq)[1] <= sched.sliding_kv_cache.max_blocks_held(seq.num_tokens + 1, tokens)
    assert not sched.has_unfinished() and not pending
    assert sched.kv_cache.num_used_blocks == sched.sliding_kv_cache.num_used_blocks == 0
    for seq, m in added:
        assert seq.output_token_ids == reference(seq.prompt_token_ids, m, window)


def test_prefix_cache_hit_needs_both_groups() -> None:
    # Window 6, blocks of 4: "a" computes a 40-token prompt (10 blocks) and leaves; both groups keep its blocks
    # cached. "b" shares its first 36 tokens: it hits 9 blocks in both groups, the sliding hit only the blocks of
    # positions 31.. (7, 8), the rest null. Evicting the sliding group's blocks 7 and 8 then leaves no sliding hit
    # within the full group's 9 blocks but the one ending at block 6 (positions 23..27: blocks 5, 6 still cached).
    config = dict(max_num_seqs=1, max_num_batched_tokens=64, max_seq_len=64, block_size=4, num_blocks=40)
    sched, model = make(**config, sliding_window=6, num_sliding_blocks=40)
    sliding = sched.sliding_kv_cache
    prompt = [(5 * i + 1) % VOCAB for i in range(40)]
    a = sched.add_request("a", prompt, SamplingParams(max_tokens=1))
    out = sched.schedule()  # the whole prompt in one step, which finishes it
    a_blocks, a_sliding = list(a.block_ids), list(a.sliding_block_ids)
    logits = model.step(out.to_step_batch())
    assert sched.update_from_output(out, logits[out.sample_rows].argmax(1).tolist()) == [a]
    b = sched.add_request("b", [*prompt[:36], 9, 9, 9], SamplingParams(max_tokens=4))
    step(sched, model)
    assert b.num_cached_tokens == 36 and b.sliding_block_ids[:7] == [0] * 7
    assert b.block_ids[:9] == a_blocks[:9] and b.sliding_block_ids[7:9] == a_sliding[7:9]
    while sched.has_unfinished():
        step(sched, model)
    assert b.output_token_ids == reference(b.prompt_token_ids, 4, 6)
    # evict the sliding blocks of positions 28..35: take every free block but the others (evicting their hashes)
    keep = [blk for blk in sliding.pool.free_queue if blk.block_id not in a_sliding[7:9]]
    sliding.pool.touch(keep)
    sliding.pool.free_blocks(sliding.pool.get_new_blocks(sliding.pool.num_free_blocks) + keep)
    assert all(sliding.pool.blocks[i].block_hash is None for i in a_sliding[7:9])
    c = sched.add_request("c", [*prompt[:36], 7, 7], SamplingParams(max_tokens=3))
    step(sched, model)
    assert c.num_cached_tokens == 28  # sliding blocks 5, 6 cover the window of position 28
    while sched.has_unfinished():
        step(sched, model)
    assert c.output_token_ids == reference(c.prompt_token_ids, 3, 6)
    assert sched.kv_cache.prefix_cache_hits == 36 + 28


def test_scheduler_config_of_two_groups_is_checked() -> None:
    base = dict(max_num_seqs=1, max_num_batched_tokens=8, max_seq_len=64, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="go together"):
        SchedulerConfig(**base, sliding_window=6)
    with pytest.raises(ValueError, match="do not all slide"):
        SchedulerConfig(**base, kv_window=6, sliding_window=6, num_sliding_blocks=8)
    sched = Scheduler(SchedulerConfig(**base, sliding_window=6, num_sliding_blocks=8))
    assert sched.kv_cache.window is None and sched.sliding_kv_cache.window == 6
    assert sched.kv_cache.enable_prefix_caching and sched.sliding_kv_cache.enable_prefix_caching
    assert Scheduler(SchedulerConfig(**base)).sliding_kv_cache is None


# ------------------------------------------------------------------------------------------- the tiny Gemma 3


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(transformers' tiny Gemma 3, its checkpoint, {form: engine}) for the onnxruntime native and lowered forms and
    the torch CPU engine (torch-compile)."""
    from tiny_models import make_hf_model

    from trtbuild.build import build_engine
    from trtbuild.config import Backend, CpuAttention, DType, TorchConfig, TorchDevice, TorchRuntime
    from trtbuild.convert.convert import convert

    root = tmp_path_factory.mktemp("gemma3-groups")
    model = make_hf_model("gemma3", root / "hf")
    assert convert(root / "hf", root / "ckpt", DType.FLOAT32).config.has_sliding_kv_group
    build = BuildConfig(max_seq_len=128, kv_block_size=4)
    engines = {}
    for form in (CpuAttention.NATIVE, CpuAttention.LOWERED):
        engines[form.value] = root / form.value
        build_engine(root / "ckpt", engines[form.value], replace(build, cpu_attention=form))
    engines["torch"] = root / "torch"
    torch_cfg = TorchConfig(TorchDevice.CPU, torch_runtime=TorchRuntime.TORCH_COMPILE)
    build_engine(root / "ckpt", engines["torch"], replace(build, backend=Backend.TORCH), torch=torch_cfg)
    return model, root / "ckpt", engines


def test_graph_gives_the_sliding_layers_their_own_tables(gemma3) -> None:
    _, ckpt, _ = gemma3
    cfg, weights = load_checkpoint(ckpt)
    build, io = BuildConfig(max_seq_len=128, kv_block_size=4), EngineIO()
    graph = emit_portable_graph(cfg, weights, build, io).graph
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    step_inputs = ("input_ids", "positions", "block_tables", "query_start_loc", "logits_indices")
    assert [i.name for i in graph.input][:6] == [*(getattr(io, n) for n in step_inputs), io.sliding_block_tables]
    assert inputs["sliding_block_tables"] == ["num_seqs", "max_sliding_blocks_per_seq"]
    plugins = [n for n in graph.node if n.op_type == "PagedAttention"]
    assert [n.input[4] for n in plugins] == ["sliding_block_tables", "sliding_block_tables", "block_tables"]
    assert [inputs[f"key_cache.{n}"][0] for n in range(3)] == ["num_sliding_blocks"] * 2 + ["num_blocks"]
    # a model of one kind: no new input, every layer on block_tables
    for kinds in ([AttentionKind.FULL] * 3, [AttentionKind.SLIDING] * 3):
        sliding = kinds[0] is AttentionKind.SLIDING
        one = replace(
            cfg,
            layer_types=kinds,
            sliding_window=6 if sliding else None,
            local_rope=cfg.local_rope if sliding else None,
        )
        assert not one.has_sliding_kv_group
        graph = emit_portable_graph(one, weights, build, io).graph
        assert io.sliding_block_tables not in {i.name for i in graph.input}
        assert {n.input[4] for n in graph.node if n.op_type == "PagedAttention"} == {"block_tables"}


def test_tensorrt_lowering_takes_both_tables(gemma3) -> None:
    # Pure onnx (no TensorRT): the sliding layers' plugin nodes read the int32 cast of sliding_block_tables, and the
    # optimization profile covers the new input and the sliding caches.
    from trtbuild.backends.tensorrt.build.lowering import lower_for_tensorrt, profile_shapes

    _, ckpt, _ = gemma3
    cfg, weights = load_checkpoint(ckpt)
    build = BuildConfig(max_batch_size=4, max_seq_len=128, kv_block_size=4)
    lowered = lower_for_tensorrt(emit_portable_graph(cfg, weights, build, EngineIO()), build)
    plugins = [n for n in lowered.graph.node if n.op_type == "PagedAttention"]
    assert [n.input[4] for n in plugins] == ["sliding_block_tables.int32"] * 2 + ["block_tables.int32"]
    shapes = profile_shapes(lowered, build)
    assert shapes["sliding_block_tables"] == ((1, 1), (4, 32), (4, 32))
    assert shapes["key_cache.0"][2] == shapes["key_cache.2"][2] == (4 * 32, 4, 2, 16)


@pytest.mark.parametrize("form", ["native", "lowered", "torch"])
def test_llm_greedy_tokens_match_transformers_with_a_bounded_sliding_group(gemma3, form: str) -> None:
    # Prompts of 30-48 tokens (window 6, blocks of 4) in chunks of 8, 20 tokens each: every step, each request holds
    # at most max_blocks_held sliding blocks (4) while its full-layer blocks grow to all of its positions.
    model, _, engines = gemma3
    llm = LLM(engines[form], max_num_batched_tokens=8)
    kv, sliding = llm.scheduler.kv_cache, llm.scheduler.sliding_kv_cache
    assert sliding is not None and sliding.window == 6 and kv.window is None
    assert llm.session.num_sliding_blocks == sliding.pool.num_blocks and llm.stats.num_sliding_blocks is not None
    bound = sliding.max_blocks_held(127, 8)
    assert bound == 4  # ceil((6 + 8 - 2) / 4) + 1
    prompts = [[3 + (7 * i + k) % 100 for i in range(30 + 9 * k)] for k in range(3)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    added = llm.add_requests(prompts, params)
    most_full = 0
    while llm.scheduler.has_unfinished():
        llm.step()
        for seq in llm.scheduler.running:
            full_held, sliding_held = kv.num_held_blocks(seq), sliding.num_held_blocks(seq)
            assert 0 < sliding_held <= bound and full_held == len(seq.block_ids) >= seq.num_computed_tokens / 4
            most_full = max(most_full, full_held)
    got = [states[0].seq.output_token_ids for _, states in added]
    assert got == [transformers_greedy(model, p, 20) for p in prompts]
    assert most_full >= -(-(48 + 19) // 4) > bound  # the longest request's full group held all 17 of its blocks
    stats = llm.stats
    assert 0 < stats.peak_used_sliding_blocks <= 3 * bound < stats.peak_used_blocks
    assert kv.num_used_blocks == sliding.num_used_blocks == 0


@pytest.mark.parametrize("form", ["native", "lowered"])
def test_prefix_cache_hits_in_both_groups(gemma3, form: str) -> None:
    # A second request sharing a 40-token prefix hits it in both groups and still gets transformers' tokens.
    model, _, engines = gemma3
    llm = LLM(engines[form], max_num_batched_tokens=8)
    prompt = [3 + (5 * i) % 90 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([prompt], params)
    llm.reset_stats()
    longer = [*prompt, 7, 8, 9]
    [out] = llm.generate([longer], params)
    assert out.outputs[0].token_ids == transformers_greedy(model, longer, 6)
    assert llm.stats.prefix_cache_hits == 40 and llm.stats.num_computed_tokens == 3 + 5


def test_kv_offload_restores_both_groups(gemma3, tmp_path) -> None:
    # An LLM stores a 40-token prompt's blocks in both groups on a disk tier; a fresh one (an empty pool, as after a
    # restart) asked the prompt plus 3 tokens loads the full group's 10 blocks and the sliding group's window at
    # their end (blocks 8 and 9: positions 32-39 cover the window of 6 before position 40), computes only the rest,
    # and still gets transformers' tokens.
    model, _, engines = gemma3
    config = KVOffloadConfig(disk_dir=tmp_path, disk=1 << 24)
    prompt = [3 + (5 * i) % 90 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = LLM(engines["native"], kv_offload=config)
    first.generate([prompt], params)
    first.offloader.flush()
    assert all(t.blocks_stored == 2 * 11 for t in first.stats.kv_offload)  # 45 computed tokens, both groups
    llm = LLM(engines["native"], max_num_batched_tokens=8, kv_offload=config)
    longer = [*prompt, 7, 8, 9]
    [out] = llm.generate([longer], params)
    assert out.outputs[0].token_ids == transformers_greedy(model, longer, 6)
    stats = llm.stats
    assert stats.kv_offload_loaded_blocks == 10 + 2 and stats.prefix_cache_hits == 40
    assert stats.num_computed_tokens == 3 + 5


def test_bench_and_serve_metrics_report_the_sliding_group(gemma3) -> None:
    # `trtbuild bench` and serve's /metrics give the sliding group's blocks beside the full layers' (whose gauges
    # keep their names); the sliding peak stays within the bound per request while the full group's grows.
    from test_serve import metric, request, running_server

    from trtbuild.cli.bench import BenchWorkload, run_bench
    from trtbuild.serve.config import ServeConfig
    from trtbuild.serve.metrics import EngineSnapshot, ServerMetrics

    _, _, engines = gemma3
    llm = LLM(engines["native"], max_num_batched_tokens=8)
    r = run_bench(llm, BenchWorkload(num_requests=3, input_len=40, output_len=8))
    sliding = llm.scheduler.sliding_kv_cache
    assert r.kv_sliding_blocks_total == sliding.num_usable_blocks and r.kv_blocks_total == llm.num_kv_blocks
    assert 0 < r.kv_sliding_blocks_peak <= 3 * sliding.max_blocks_held(127, 8) < r.kv_blocks_peak
    with running_server(engines["native"], ServeConfig()) as url:
        assert metric(url, "trtbuild_kv_cache_sliding_total_blocks") == sliding.num_usable_blocks
        body = json.dumps({"prompt": list(range(3, 40)), "max_tokens": 4}).encode()
        status, _, _ = request(url, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
        assert status == 200 and metric(url, "trtbuild_kv_cache_sliding_used_blocks") == 0  # idle: all free
        assert metric(url, "trtbuild_kv_cache_total_blocks") == llm.num_kv_blocks
    assert "sliding" not in ServerMetrics().render(EngineSnapshot(kv_total_blocks=8))  # one group: no such gauges


def test_memory_split_between_the_groups(gemma3) -> None:
    _, ckpt, engines = gemma3
    cfg, _ = load_checkpoint(ckpt)
    build = BuildConfig(max_batch_size=2, max_seq_len=128, max_num_tokens=8, kv_block_size=4)
    full, sliding = group_bytes_per_block(cfg, 4, 4)
    assert (full, sliding) == (bytes_per_block(cfg, 4) // 3, 2 * bytes_per_block(cfg, 4) // 3)
    cap = sliding_blocks_cap(cfg, build)
    assert cap == 2 * 4 + 1  # 2 requests of ceil((6 + 8 - 2) / 4) + 1 blocks, and the null block
    assert split_kv_blocks(cfg, build, 7 * (full + sliding), 4) == (7, 7)  # below the cap: as many in each
    assert split_kv_blocks(cfg, build, 100 * full + 9 * sliding, 4) == (100, 9)  # the rest goes to the full group
    need = default_cpu_kv_cache_memory(cfg, build, 64 << 30)
    assert need == (2 * 32 + 1) * full + cap * sliding  # 2 full-length requests in each group
    assert split_kv_blocks(cfg, build, need, 4) == (65, 9)
    with pytest.raises(ConfigError, match="too small"):  # one block per group is no cache
        LLM(engines["native"], kv_cache_memory=full + sliding)


def test_session_step_without_sliding_tables_reads_block_tables(gemma3) -> None:
    # A caller driving the session directly with one table (trtbuild eval, the end-to-end tests) gets the same
    # logits as with the same ids passed as both tables; ids outside the sliding pool are refused.
    from trtbuild.backends.onnxruntime.session import OrtSession
    from trtbuild.config import RuntimeConfig

    _, _, engines = gemma3
    memory = 100 * bytes_per_block(RuntimeConfig.load(engines["native"]).model, 4)  # 100 blocks in each group
    prompt, blocks = list(range(3, 23)), [1, 2, 3, 4, 5]
    one = OrtSession(engines["native"], kv_cache_memory=memory).step(StepBatch.build([prompt], [0], [blocks]))
    session = OrtSession(engines["native"], kv_cache_memory=memory)
    assert session.num_blocks == session.num_sliding_blocks == 100
    both = session.step(StepBatch.build([prompt], [0], [blocks], sliding_block_tables=[blocks]))
    np.testing.assert_array_equal(one, both)
    with pytest.raises(ValueError, match="pass sliding_block_tables"):
        session.step(StepBatch.build([prompt], [0], [[1, 2, 3, 4, 100]]))


def test_engine_built_before_kv_groups_is_refused(gemma3, tmp_path) -> None:
    # A Gemma engine whose graph predates the sliding_block_tables input (its sliding layers read block_tables)
    # would read the full layers' block ids in the sliding pool: opening it says to rebuild.
    import shutil

    import onnx

    from trtbuild.backends.onnxruntime.session import OrtSession
    from trtbuild.errors import EngineError

    _, _, engines = gemma3
    old = tmp_path / "old"
    shutil.copytree(engines["native"], old)
    path = old / "engines" / "onnxruntime-cpu" / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    kept = [i for i in model.graph.input if i.name != "sliding_block_tables"]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    for node in model.graph.node:
        node.input[:] = ["block_tables" if name == "sliding_block_tables" else name for name in node.input]
    onnx.save(model, str(path))
    with pytest.raises(EngineError, match=r"built before KV-cache groups .* rebuild it"):
        OrtSession(old)


def test_kv_cache_manager_of_the_sliding_group_owns_sliding_block_ids() -> None:
    from trtbuild.runtime.kv_cache_manager import KVCacheGroup

    kv = KVCacheManager(8, 4, enable_prefix_caching=False, window=6, group=KVCacheGroup.SLIDING)
    seq = Sequence("a", list(range(20)), SamplingParams(), 0)
    assert kv.allocate_slots(seq, 20) and seq.sliding_block_ids == [1, 2, 3, 4, 5] and not seq.block_ids
    seq.num_computed_tokens = 20
    assert kv.free_outside_window(seq) == 3 and seq.sliding_block_ids == [0, 0, 0, 4, 5]
    kv.free(seq)
    assert not seq.sliding_block_ids and kv.num_used_blocks == 0
