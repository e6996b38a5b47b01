"""``LLM`` on an engine whose every layer slides (``ModelConfig.kv_window``): the runner releases the KV blocks
that fall out of the window, so a long request holds a bounded number of blocks and fits a small pool, and its
greedy tokens stay transformers' (a tiny Mistral with a window of 8, far shorter than its requests). The KV
offload's loading is checked against a windowed cache manager directly.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tiny_models import hf_logits, make_hf_model

from trtbuild.config import AttentionKind, BuildConfig, RuntimeConfig
from trtbuild.errors import RequestError
from trtbuild.runtime.kv_cache import PagedKVCache, bytes_per_block, default_cpu_kv_cache_memory
from trtbuild.runtime.kv_cache_manager import KVCacheManager
from trtbuild.runtime.kv_offload import KVOffloadConfig, KVOffloader
from trtbuild.runtime.llm import LLM, SamplingParams
from trtbuild.runtime.sequence import Sequence

WINDOW, BLOCK = 8, 4


@pytest.fixture(scope="module")
def window_model(tmp_path_factory):
    """(the transformers Mistral with a window of 8, its engine)."""
    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig, DType
    from trtbuild.convert.convert import convert

    root = tmp_path_factory.mktemp("window")
    model = make_hf_model("mistral", root / "hf", sliding_window=WINDOW)
    assert convert(root / "hf", root / "ckpt", DType.FLOAT32).config.kv_window == WINDOW
    build_engine(root / "ckpt", root / "engine", BuildConfig(max_seq_len=128, kv_block_size=BLOCK))
    return model, root / "engine"


@pytest.fixture(scope="module")
def window_engine(window_model) -> Path:
    return window_model[1]


def transformers_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of transformers' model, each from a full forward pass over the sequence so far: ``generate``'s
    cached path on this windowed Mistral disagrees with the model's own forward (it diverges at the first token)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def test_llm_releases_blocks_outside_the_window(window_model) -> None:
    model, window_engine = window_model
    llm = LLM(window_engine, max_num_batched_tokens=8)
    assert llm.config.kv_window == WINDOW and llm.scheduler.kv_cache.window == WINDOW
    per_request = llm.scheduler.kv_cache.max_blocks_held(127, 8)
    assert per_request == 5  # ceil((8 + 8 - 2) / 4) + 1
    prompts = [[3 + (7 * i + k) % 80 for i in range(40 + 10 * k)] for k in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [transformers_greedy(model, p, 30) for p in prompts]
    assert 0 < llm.stats.peak_used_blocks <= 3 * per_request  # without the window: 3 x 20 blocks at the end
    assert llm.scheduler.kv_cache.num_used_blocks == 0


def test_long_request_fits_a_pool_of_the_window(window_engine: Path) -> None:
    # 5 usable blocks: a 100-token prompt + 27 tokens would need 32 without the window.
    per_block = bytes_per_block(RuntimeConfig.load(window_engine).model, BLOCK)
    llm = LLM(window_engine, kv_cache_memory=6 * per_block, max_num_batched_tokens=8)
    assert llm.num_kv_blocks == 5
    [out] = llm.generate([[3 + i % 80 for i in range(100)]], SamplingParams(temperature=0, max_tokens=27))
    assert len(out.outputs[0].token_ids) == 27 and llm.stats.num_preemptions == 0
    assert llm.stats.peak_used_blocks == 4  # chunks of 8 from multiples of 8: positions c - 7 .. c + 7
    with pytest.raises(RequestError, match="need 6 KV-cache blocks"):  # a step of 12 tokens would not fit
        LLM(window_engine, kv_cache_memory=6 * per_block, max_num_batched_tokens=12).generate([[3] * 100])


def test_kv_offload_stores_blocks_before_the_window_releases_them(window_engine: Path) -> None:
    # 12 usable blocks, chunks of 8: a 100-token prompt's 25 blocks are all stored as they are computed, though it
    # never holds more than 4; after another prompt evicts them, the same prompt loads its prefix back.
    per_block = bytes_per_block(RuntimeConfig.load(window_engine).model, BLOCK)
    offload = KVOffloadConfig(memory=1 << 20)
    llm = LLM(window_engine, kv_cache_memory=13 * per_block, max_num_batched_tokens=8, kv_offload=offload)
    prompt, other = [3 + i % 80 for i in range(100)], [4 + (3 * i) % 80 for i in range(100)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([prompt], params)
    llm.offloader.flush()
    assert llm.offloader.memory.stats.blocks_stored == 25  # every full block of the 103 computed positions
    llm.generate([other], params)
    llm.reset_stats()
    [out] = llm.generate([prompt], params)
    assert len(out.outputs[0].token_ids) == 4 and llm.stats.kv_offload_loaded_blocks > 0
    assert llm.stats.num_preemptions == 0 and llm.scheduler.kv_cache.num_used_blocks == 0


def test_default_cpu_pool_is_sized_for_the_window(window_engine: Path) -> None:
    model = RuntimeConfig.load(window_engine).model
    full = replace(model, layer_types=[AttentionKind.FULL] * model.num_layers, sliding_window=None)
    build = BuildConfig(max_batch_size=2, max_seq_len=128, max_num_tokens=8, kv_block_size=BLOCK)
    per_block = bytes_per_block(model, BLOCK)
    # 2 sequences of at most 5 blocks each (chunks of 8) plus the null block, instead of 2 x 32 + 1
    assert default_cpu_kv_cache_memory(model, build, 64 << 30) == (2 * 5 + 1) * per_block
    assert default_cpu_kv_cache_memory(full, build, 64 << 30) == (2 * 32 + 1) * per_block


def test_offload_load_keeps_the_pools_window_hit(window_engine: Path) -> None:
    # Window 6, blocks of 4: a 21-token request hitting 20 tokens reads only blocks 3 and 4 (positions 15..20).
    model = RuntimeConfig.load(window_engine).model
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK, window=6)
    offloader = KVOffloader(KVOffloadConfig(memory=1 << 20), PagedKVCache(model, 10, BLOCK), "window-test")
    kv.on_block_cached = offloader.store
    a = Sequence("a", list(range(20)), SamplingParams(), 0)
    assert kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    kv.cache_blocks(a)
    offloader.flush()
    assert a.block_ids == [1, 2, 3, 4, 5] and offloader.memory.stats.blocks_stored == 5
    kv.free(a)

    def evict(*block_ids: int) -> None:  # evict free cached blocks, keeping the others
        keep = [blk for blk in kv.pool.free_queue if blk.block_id not in block_ids]
        kv.pool.touch(keep)
        kv.pool.free_blocks(kv.pool.get_new_blocks(kv.pool.num_free_blocks) + keep)

    evict(1, 2)  # the prefix's first two blocks: the pool alone still hits all 20 tokens, so nothing is loaded
    b = Sequence("b", [*range(20), 99], SamplingParams(), 1)
    assert kv.get_computed_blocks(b)[1] == 20 and offloader.load_prefix([kv], b) == 0
    evict(5)  # the last: the pool hits 16 (blocks 3, 4); loading fills blocks 0, 1 and 4 and keeps 3, 4 in the pool
    computed, hit = kv.get_computed_blocks(b)
    assert hit == 16 and [blk.block_id for blk in computed.blocks] == [0, 0, 3, 4]
    assert offloader.load_prefix([kv], b) == 3 and kv.get_computed_blocks(b)[1] == 20
    assert kv.num_used_blocks == 0 and kv.pool.get_cached_block(b.block_hashes[2]).block_id == 3
    offloader.close()
