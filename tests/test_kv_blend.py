"""Blending cached chunks into prompts (``trtbuild/runtime/blend.py``) on the tiny llama engine (blocks of 4).

References: the engine's own full computation of the same tokens. Layer 0's keys and values depend on the token and
its position only, so there the reused K/V moved to its new position must equal what the full prompt computes
(within float32 rounding); deeper layers differ by design (the chunk was computed without the text before it).
Without a cached source the ranges are computed, giving the full computation's tokens exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from trtbuild.config import KVCacheDType, QFormat, QuantConfig
from trtbuild.errors import ConfigError, RequestError
from trtbuild.runtime.blend import BlendedPrompt, BlendInjector, Chunk, cache_chunks, generate_blended, plan_reuse
from trtbuild.runtime.llm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
RNG = np.random.default_rng(7)
DOCS = [Chunk(tuple(RNG.integers(3, 90, n).tolist())) for n in (13, 18, 9)]  # 3, 4 and 2 full blocks of 4
HEAD, QUESTION = [1, 5, 6], [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def engine(tiny_engines):
    return tiny_engines["llama_gqa"][2]


def prompt(order: tuple[int, ...]) -> BlendedPrompt:
    return BlendedPrompt((HEAD, *(DOCS[i] for i in order), QUESTION))


def slots_kv(llm: LLM, seq, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Layer-major (keys, values) ``[layers, T, H, D]`` of ``seq``'s cache slots at ``positions``."""
    bs = llm.session.cache.block_size
    slots = np.asarray(seq.block_ids)[positions // bs] * bs + positions % bs
    cache = llm.session.cache
    flat = cache.keys.reshape(cache.keys.shape[0], -1, *cache.keys.shape[3:])
    flat_v = cache.values.reshape(cache.values.shape[0], -1, *cache.values.shape[3:])
    return flat[:, slots].copy(), flat_v[:, slots].copy()


def test_plan_reuses_each_chunks_full_blocks_past_its_first_tokens():
    ranges = plan_reuse(prompt((2, 0, 1)), block_size=4, recompute_tokens=2)
    # HEAD 3 tokens; doc 2 (9 tokens: 8 in full blocks) at 3; doc 0 (13: 12) at 12; doc 1 (18: 16) at 25; total 48
    assert [(r.start, r.end, r.source_start, len(r.source_hashes)) for r in ranges] == [
        (5, 11, 2, 2),
        (14, 24, 2, 3),
        (27, 41, 2, 4),
    ]
    tail = plan_reuse(BlendedPrompt(([1], DOCS[0])), 4, 2)  # a chunk last: its range stops before the last token
    assert [(r.start, r.end) for r in tail] == [(3, 13)]
    assert plan_reuse(prompt((2, 0, 1)), 4, 2, recompute_last_chunks=1) == ranges[:2]  # doc 1 computed whole
    assert plan_reuse(prompt((2, 0, 1)), 4, 2, recompute_last_chunks=3) == ()
    with pytest.raises(RequestError, match="at least 1"):
        plan_reuse(prompt((0,)), 4, 0)


def test_reused_kv_is_the_sources_moved_and_layer_0_equals_the_full_computation(engine):
    llm = LLM(engine)
    cache_chunks(llm, DOCS)
    llm.scheduler.kv_injector = BlendInjector(llm)
    blended = prompt((2, 0, 1))
    [(_, [state])] = llm.add_requests([blended.token_ids()], SamplingParams(temperature=0.0, max_tokens=40))
    state.seq.kv_reuse = plan_reuse(blended, 4, recompute_tokens=2)
    while state.seq.num_computed_tokens < len(blended.token_ids()):
        llm.step()
    full = LLM(engine, enable_prefix_caching=False)
    [(_, [ref])] = full.add_requests([blended.token_ids()], SamplingParams(temperature=0.0, max_tokens=40))
    full.step()  # the whole prompt in one step
    for r in state.seq.kv_reuse:
        positions = np.arange(r.start, r.end)
        keys, values = slots_kv(llm, state.seq, positions)
        ref_keys, ref_values = slots_kv(full, ref.seq, positions)
        np.testing.assert_allclose(keys[0], ref_keys[0], rtol=0, atol=2e-5)  # moved by r.start - r.source_start
        np.testing.assert_array_equal(values[0], ref_values[0])  # values do not move
        assert not np.allclose(keys[1:], ref_keys[1:], atol=1e-3)  # deeper layers: computed without the context
    assert llm.stats.num_computed_tokens < len(blended.token_ids()) + sum(len(d.token_ids) for d in DOCS)


def test_blended_generation_computes_less_and_never_enters_the_prefix_cache(engine):
    llm = LLM(engine)
    cache_chunks(llm, DOCS)
    llm.reset_stats()
    orders = [(0, 1, 2), (2, 1, 0), (1, 2, 0)]
    outs = generate_blended(llm, [prompt(o) for o in orders], GREEDY, recompute_tokens=2, recompute_last_chunks=0)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    total = sum(len(prompt(o).token_ids()) for o in orders)
    reused = sum(r.end - r.start for o in orders for r in plan_reuse(prompt(o), 4, 2))
    assert llm.stats.num_computed_tokens == total - reused + 3 * 5  # + the decode steps' tokens
    # The blended requests registered nothing past their first reused range (at 5): asked plainly, the same prompt
    # hits only its first block (positions 0-3, computed exactly) and gets the full computation's tokens.
    llm.reset_stats()
    plain = llm.generate([prompt((0, 1, 2)).token_ids()], GREEDY)[0]
    assert llm.stats.prefix_cache_hits == 4
    exact = LLM(engine).generate([prompt((0, 1, 2)).token_ids()], GREEDY)[0]
    assert plain.outputs[0].token_ids == exact.outputs[0].token_ids


def test_reused_sources_stay_in_the_pool_while_other_requests_churn_it(engine):
    # Planning and reading a source block count as uses (the least recently used goes first): in a pool of 40
    # blocks where another request takes 17 each round, the chunks that blended requests keep reading stay.
    from trtbuild.runtime.kv_cache import bytes_per_block

    config = LLM(engine).session.config
    llm = LLM(engine, kv_cache_memory=41 * bytes_per_block(config.model, 4))
    cache_chunks(llm, DOCS)
    rng = np.random.default_rng(1)
    for _ in range(6):
        llm.generate([rng.integers(3, 90, 60).tolist()], GREEDY)  # 16 blocks of other text, registered
        llm.reset_stats()
        generate_blended(llm, [prompt((0, 1, 2))], GREEDY, recompute_tokens=2, recompute_last_chunks=0)
        reused = sum(r.end - r.start for r in plan_reuse(prompt((0, 1, 2)), 4, 2))
        hit = llm.stats.prefix_cache_hits  # its first block (exact) from the round before
        assert llm.stats.num_computed_tokens == len(prompt((0, 1, 2)).token_ids()) - reused - hit + 5


def test_without_cached_chunks_the_ranges_are_computed_exactly(engine):
    llm = LLM(engine)  # no cache_chunks: no source block anywhere
    order = (1, 0, 2)
    [out] = generate_blended(llm, [prompt(order)], GREEDY, recompute_tokens=2)
    expected = LLM(engine).generate([prompt(order).token_ids()], GREEDY)[0].outputs[0].token_ids
    assert out.outputs[0].token_ids == expected


def test_chunks_evicted_from_the_pool_come_back_from_the_offload_tier(engine):
    from trtbuild.runtime.kv_offload import KVOffloadConfig

    llm = LLM(engine, kv_offload=KVOffloadConfig(memory=1 << 22))
    cache_chunks(llm, DOCS)
    llm.offloader.flush()
    pool = llm.scheduler.kv_cache.pool
    pool.free_blocks(pool.get_new_blocks(pool.num_free_blocks))  # every free block reused: the pool forgot them
    assert all(
        pool.get_cached_block(h) is None
        for d in DOCS
        for h in plan_reuse(BlendedPrompt(([1], d, [2])), 4, 1)[0].source_hashes
    )
    llm.reset_stats()
    generate_blended(llm, [prompt((0, 1, 2))], GREEDY, recompute_tokens=2, recompute_last_chunks=0)
    reused = sum(r.end - r.start for r in plan_reuse(prompt((0, 1, 2)), 4, 2))
    assert llm.stats.num_computed_tokens == len(prompt((0, 1, 2)).token_ids()) - reused + 5


def test_engines_it_cannot_blend_are_one_line_errors(engine, tmp_path):
    from quantize_helpers import calib_file, tiny_checkpoint

    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig
    from trtbuild.quantize.quantize import quantize

    with pytest.raises(ConfigError, match="prefix caching"):
        BlendInjector(LLM(engine, enable_prefix_caching=False))
    with pytest.raises(RequestError, match="n must be 1"):
        generate_blended(LLM(engine), [prompt((0,))], SamplingParams(n=2))
    _, ckpt = tiny_checkpoint(tmp_path)
    qcfg = QuantConfig(
        QFormat.INT8_WO, kv_cache_dtype=KVCacheDType.INT8, calib_dataset=str(calib_file(tmp_path)), calib_size=2,
        calib_seq_len=24,
    )  # fmt: skip
    quantize(ckpt, tmp_path / "q", qcfg, progress=False)
    build_engine(tmp_path / "q", tmp_path / "engine", BuildConfig(max_seq_len=128, kv_block_size=4))
    with pytest.raises(ConfigError, match="float32 KV cache"):
        BlendInjector(LLM(tmp_path / "engine"))
