"""Blending cached chunks into a prompt: reuse a document's K/V wherever it appears, not only as a shared prefix.

RAG prompts hold the same documents in different orders, so their K/V is never a shared prefix and the prefix cache
(and the KV offload tiers below it) cannot serve it. LMCache's CacheBlend reuses each document's K/V computed on its
own and recomputes the few tokens whose K/V the new context disturbs most; trtbuild does this in EPIC's form
(LegoLink, arXiv 2410.15332): a chunk's first ``recompute_tokens`` tokens are recomputed in place. Computed alone they
were the start of a sequence (the attention sink) and saw none of the text before them, which is where the deviation
concentrates; selecting tokens per layer as CacheBlend does would need the engine to stop between layers.

- ``cache_chunks(llm, chunks)`` computes each chunk alone from position 0 (a one-token request), so its full blocks
  are registered in the prefix cache, and stored in the KV offload tiers when they are on, under the hashes of the
  chunk's own tokens.
- ``generate_blended(llm, prompts, params, recompute_tokens=...)``: a ``BlendedPrompt`` is parts, token lists and
  ``Chunk``s, concatenated. A chunk at position p (but the last ``recompute_last_chunks``, the nearest to the
  question, computed whole) takes the K/V of its full blocks from its own computation for its tokens from
  ``recompute_tokens`` on (``Sequence.kv_reuse``; found in the pool or the offload tiers when the request
  reaches them, else computed). Keys are stored after the rotary embedding, and RoPE composes, so a key moves from
  position j to p + j by rotating it by p (``rotate_keys``); values do not move. Every other token is computed:
  text parts, each chunk's first tokens and its tail past its last full block, in steps that read the reused K/V
  before them (the scheduler computes up to each reused range, writes it, and goes on).

Approximate by design: a blended request's K/V is not what the full prompt computes, so it never enters the prefix
cache (``Sequence.prefix_cache_limit``). Float32 KV caches of onnxruntime engines, models whose every layer has
full attention and a plain rotary embedding (linear scaling at most); anything else is a one-line ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..config import KVCacheDType, PositionKind, RopeConfig
from ..errors import ConfigError, RequestError
from .block_pool import BlockHash
from .kv_cache import PagedKVCache
from .kv_cache_manager import hash_block_tokens
from .outputs import RequestOutput
from .sampling import SamplingParams
from .sequence import KVReuse
from .sequence import Sequence as Seq

if TYPE_CHECKING:
    from .llm import LLM

# Per chunk, its first tokens recomputed, and the last chunks (those nearest the question) recomputed whole: on
# SmolLM2 with 4 documents of 500 tokens, 32 and 1 keep the answer's perplexity within 1.5% of a full recompute at
# 0.48x its TTFT (benchmarks/kv_blend.py, benchmarks/results/2026-12-05-cpu2-kv-blend.md).
DEFAULT_RECOMPUTE_TOKENS = 32
DEFAULT_RECOMPUTE_LAST_CHUNKS = 1


@dataclass(frozen=True)
class Chunk:
    """A part of a ``BlendedPrompt`` whose K/V is reused from its own computation (``cache_chunks``): ``token_ids``
    computed after ``context`` (e.g. the prompts' common head, so that the chunk's first tokens are not the start
    of a sequence; empty: from position 0)."""

    token_ids: tuple[int, ...]
    context: tuple[int, ...] = ()

    def source(self) -> tuple[int, ...]:
        """The tokens of its own computation: the context, then the chunk."""
        return self.context + self.token_ids


@dataclass(frozen=True)
class BlendedPrompt:
    """A prompt of parts: token lists, computed as usual, and ``Chunk``s, reused; their concatenation is the prompt."""

    parts: tuple[Sequence[int] | Chunk, ...]

    def token_ids(self) -> list[int]:
        return [t for p in self.parts for t in (p.token_ids if isinstance(p, Chunk) else p)]


def chunk_hashes(chunk: Chunk, block_size: int) -> tuple[BlockHash, ...]:
    """The prefix-cache keys of the full blocks of ``chunk``'s own computation (its context and it, no cache salt)."""
    source, hashes = chunk.source(), []
    for i in range(len(source) // block_size):
        tokens = source[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens, None))
    return tuple(hashes)


def plan_reuse(
    prompt: BlendedPrompt, block_size: int, recompute_tokens: int, recompute_last_chunks: int = 0
) -> tuple[KVReuse, ...]:
    """The ranges of ``prompt`` whose K/V comes from its chunks' own blocks: each chunk's tokens from
    ``recompute_tokens`` on that its computation left in full blocks, except the last ``recompute_last_chunks``
    chunks (computed whole), the last range ending before the prompt's last token (whose logits the step needs)."""
    if recompute_tokens < 1:
        raise RequestError("recompute_tokens must be at least 1 (each chunk's first token is computed in place)")
    if recompute_last_chunks < 0:
        raise RequestError("recompute_last_chunks must be >= 0")
    chunks = [i for i, p in enumerate(prompt.parts) if isinstance(p, Chunk)]
    reused = set(chunks[: len(chunks) - recompute_last_chunks])
    last, position, ranges = len(prompt.token_ids()) - 1, 0, []
    for index, part in enumerate(prompt.parts):
        if isinstance(part, Chunk) and index in reused:
            context = len(part.context)
            in_full_blocks = len(part.source()) // block_size * block_size - context  # the chunk's tokens in them
            start, end = position + recompute_tokens, min(position + in_full_blocks, last)
            if start < end:
                ranges.append(KVReuse(start, end, chunk_hashes(part, block_size), context + recompute_tokens))
        position += len(part.token_ids) if isinstance(part, Chunk) else len(part)
    return tuple(ranges)


def rotate_keys(keys: np.ndarray, rope: RopeConfig, delta: int) -> np.ndarray:
    """``keys [..., T, H, D]`` embedded at positions j, moved to j + ``delta``: rotated by ``delta`` positions (in
    float32, as the engine applies its rotary table)."""
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, rope.rotary_dim, 2, dtype=np.float64) / rope.rotary_dim))
    angles = (delta / rope.scaling) * inv_freq
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    half, out = rope.rotary_dim // 2, keys.astype(np.float32, copy=True)
    if rope.interleaved:
        x1, x2 = keys[..., 0 : rope.rotary_dim : 2], keys[..., 1 : rope.rotary_dim : 2]
        out[..., 0 : rope.rotary_dim : 2] = x1 * cos - x2 * sin
        out[..., 1 : rope.rotary_dim : 2] = x2 * cos + x1 * sin
    else:
        x1, x2 = keys[..., :half], keys[..., half : rope.rotary_dim]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half : rope.rotary_dim] = x2 * cos + x1 * sin
    return out


class BlendInjector:
    """The scheduler's ``KVInjector`` for ``Sequence.kv_reuse``: reads a range's source blocks (pool, else the KV
    offload tiers), moves the keys, and returns the writer of the request's slots."""

    def __init__(self, llm: LLM) -> None:
        model = llm.session.config.model
        cache = getattr(llm.session, "cache", None)
        if not isinstance(cache, PagedKVCache):
            raise ConfigError("blending needs an engine whose KV cache is in host memory (the onnxruntime backend)")
        if model.kv_cache_dtype is not KVCacheDType.FLOAT32:
            raise ConfigError(f"blending needs a float32 KV cache (the engine's is {model.kv_cache_dtype.value})")
        if model.position is not PositionKind.ROPE or model.kv_window is not None or model.has_sliding_kv_group:
            raise ConfigError("blending needs full attention in every layer and a rotary position embedding")
        if not llm.config.enable_prefix_caching:
            raise ConfigError("blending needs prefix caching (chunks are found by their blocks' hashes)")
        self.llm, self.cache, self.model = llm, cache, model
        self.layers_by_rope: dict[RopeConfig, list[int]] = {}  # layers without one (NoPE) keep their keys
        for n in range(model.num_layers):
            if (rope := model.layer_rope(n)) is not None:
                self.layers_by_rope.setdefault(rope, []).append(n)

    def __call__(self, seq: Seq, reuse: KVReuse) -> Callable[[], None] | None:
        bs = self.cache.block_size
        count = reuse.end - reuse.start
        first, last = reuse.source_start // bs, (reuse.source_start + count - 1) // bs
        blocks = []
        for j in range(first, last + 1):
            block = self._source_block(reuse.source_hashes[j])
            if block is None:
                return None
            blocks.append(block)
        offset = reuse.source_start - first * bs
        keys = np.concatenate([k for k, _ in blocks], axis=1)[:, offset : offset + count]
        values = np.concatenate([v for _, v in blocks], axis=1)[:, offset : offset + count]
        delta = reuse.start - reuse.source_start
        for rope, layers in self.layers_by_rope.items():  # one rotation per rotary embedding (Llama: one for all)
            keys[layers] = rotate_keys(keys[layers], rope, delta)

        def write() -> None:
            positions = np.arange(reuse.start, reuse.end)
            slots = np.asarray(seq.block_ids)[positions // bs] * bs + positions % bs
            self.cache.write_layers(slots, keys, values)

        return write

    def _source_block(self, block_hash: BlockHash) -> tuple[np.ndarray, np.ndarray] | None:
        """(keys, values) ``[layers, block_size, H, D]`` of the block registered under ``block_hash``: a copy from
        the pool, else from the KV offload tiers; None when neither has it."""
        pool = self.llm.scheduler.kv_cache.pool
        block = pool.get_cached_block(block_hash)
        if block is not None:
            pool.touch([block])  # used now: to the most recently used end of the free queue, as a prefix hit goes
            pool.free_blocks([block])
            return self.cache.keys[:, block.block_id].copy(), self.cache.values[:, block.block_id].copy()
        offloader = self.llm.offloader
        data = None if offloader is None else offloader.lookup(block_hash, self.cache.block_nbytes)
        if data is None:
            return None
        keys, values = self.cache.split_block(data)
        return keys.copy(), values.copy()


def cache_chunks(llm: LLM, chunks: Sequence[Chunk]) -> None:
    """Compute each chunk after its context so the full blocks are in the prefix cache (and the KV offload tiers,
    when on)."""
    llm.generate([list(c.source()) for c in chunks], SamplingParams(temperature=0.0, max_tokens=1))


def generate_blended(
    llm: LLM,
    prompts: Sequence[BlendedPrompt],
    params: SamplingParams,
    *,
    recompute_tokens: int = DEFAULT_RECOMPUTE_TOKENS,
    recompute_last_chunks: int = DEFAULT_RECOMPUTE_LAST_CHUNKS,
) -> list[RequestOutput]:
    """Complete each blended prompt (``n`` must be 1), its chunks' K/V reused where their blocks are cached: all
    but each chunk's first ``recompute_tokens`` tokens, and but the last ``recompute_last_chunks`` chunks."""
    if params.n != 1:
        raise RequestError("generate_blended makes one completion per prompt: n must be 1")
    scheduler = llm.scheduler
    if scheduler.kv_injector is None:
        scheduler.kv_injector = BlendInjector(llm)
    plans = [plan_reuse(p, scheduler.config.block_size, recompute_tokens, recompute_last_chunks) for p in prompts]
    pool = scheduler.kv_cache.pool
    sources = [b for plan in plans for r in plan for h in r.source_hashes if (b := pool.get_cached_block(h))]
    pool.touch(sources)  # used now: to the free queue's most recently used end, so the requests' own allocations
    pool.free_blocks(sources)  # take older blocks before them (read again, and refreshed, when written)
    added = llm.add_requests([p.token_ids() for p in prompts], params)
    for (_, [state]), plan in zip(added, plans, strict=True):
        state.seq.kv_reuse = plan
    states = [state for _, [state] in added]
    while not all(s.finished for s in states):
        llm.step()
    return [llm._request_output(rid, None, [state]) for (rid, [state]) in added]
