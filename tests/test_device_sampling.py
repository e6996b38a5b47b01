"""The torch backend's device sampler against the host sampler (``trtbuild/runtime/sampling.py``), on CPU tensors.

In float64 the two implement the same arithmetic, so every token must match: greedy, temperature, min-p, top-k,
top-p and their mixes, seeded and unseeded, with ties. In float32 (what a GPU engine hands it) rows may part only
where a draw lands within rounding of a boundary. Rows with penalties or logprobs go to the host sampler.
Also the default KV pool sizes (GPU: free memory less one step; CPU: the engine's limits within a memory share).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtbuild.backends.torch.sampling import DeviceSampler, on_device
from trtbuild.errors import EngineError
from trtbuild.runtime.sampling import TOP_P_CANDIDATES, Sampler, SamplingParams


class Request:
    """The fields the samplers read (``SamplingRequest``), with a fresh seeded generator per request."""

    def __init__(self, params: SamplingParams, prompt=(1, 2, 3), output=(4, 4, 5)) -> None:
        self.sampling_params, self.prompt_token_ids, self.output_token_ids = params, list(prompt), list(output)
        self.generator = None if params.seed is None else np.random.default_rng(params.seed)


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.3, top_k=5, seed=2),
    SamplingParams(temperature=1.0, top_p=0.6, seed=3),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=4),
    SamplingParams(temperature=1.0, min_p=0.05, seed=5),
    SamplingParams(temperature=2.0, min_p=0.01, top_k=200, top_p=0.95, seed=6),
    SamplingParams(temperature=1.0, top_k=1, seed=7),
]


def logits(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, vocab)) * 3
    x[:, 7] = x[:, 11] = x.max(axis=1) + 1.0  # a tie for the most likely token (the lower id wins greedy)
    x[:, 100:120] = x[:, 100:101]  # a block of equal logits straddles top-k / top-p cuts
    return x


def host_tokens(x: np.ndarray, params: list[SamplingParams], steps: int, seed: int = 9) -> list[list[int]]:
    sampler, reqs = Sampler(seed), [Request(p) for p in params]
    return [sampler.sample(x[s * len(params) : (s + 1) * len(params)], reqs).token_ids for s in range(steps)]


def device_tokens(x: torch.Tensor, params: list[SamplingParams], steps: int, seed: int = 9) -> list[list[int]]:
    sampler, reqs = DeviceSampler(seed), [Request(p) for p in params]
    return [sampler.sample(x[s * len(params) : (s + 1) * len(params)], reqs).token_ids for s in range(steps)]


def test_float64_tokens_equal_the_host_samplers():
    steps, vocab = 40, 1000
    x = logits(steps * len(PARAMS), vocab)
    host = host_tokens(x, PARAMS, steps)
    assert device_tokens(torch.from_numpy(x), PARAMS, steps) == host
    assert {row[0] for row in host} == {7}  # greedy: the lowest id of the tie
    assert len({row[1] for row in host}) > 5  # the random rows really draw


def test_float32_tokens_agree_with_the_host_samplers():
    steps, vocab = 40, 1000
    x = logits(steps * len(PARAMS), vocab, seed=1)
    host = np.array(host_tokens(x, PARAMS, steps))
    dev = np.array(device_tokens(torch.from_numpy(x.astype(np.float32)), PARAMS, steps))
    assert (dev[:, 0] == host[:, 0]).all()
    assert (dev == host).mean() >= 0.98


WIDE_PARAMS = [
    SamplingParams(temperature=0.0, top_p=0.9),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    SamplingParams(temperature=6.0, top_p=0.95, seed=2),  # nearly flat: the 1024 candidates hold too little mass
    SamplingParams(temperature=1.0, seed=3),  # top_p 1 beside top-p rows: every token stays
    SamplingParams(temperature=1.0, top_k=2000, top_p=0.99, seed=4),
    SamplingParams(temperature=1.5, top_k=50, seed=5),
]


def wide_logits(rows: int, vocab: int, seed: int) -> np.ndarray:
    """``logits`` over a vocabulary wider than ``TOP_P_CANDIDATES``, with a block of tokens tied at the value of the
    1024th largest: the candidates' boundary cuts through a tie."""
    x = logits(rows, vocab, seed)
    x[:, 3000:3500] = np.sort(x, axis=1)[:, -TOP_P_CANDIDATES][:, None]
    return x


def test_wide_vocabulary_tokens_equal_the_host_samplers():
    """Past ``TOP_P_CANDIDATES`` tokens top-p sorts only the candidates (or the whole row when they fall short):
    float64 tokens still equal the host sampler's, greedy, top_p 1 and top-k-only rows beside them."""
    steps, vocab = 30, 5000
    x = wide_logits(steps * len(WIDE_PARAMS), vocab, seed=4)
    host = host_tokens(x, WIDE_PARAMS, steps)
    assert device_tokens(torch.from_numpy(x), WIDE_PARAMS, steps) == host
    assert len({row[2] for row in host}) > 10  # the flat rows draw far and wide


@pytest.mark.parametrize("temperature", [0.5, 1.0, 6.0])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
def test_top_p_over_the_candidates_is_the_whole_sorts(temperature, top_p):
    """``_top_p`` keeps exactly the tokens a stable sort of the whole row keeps: on peaked rows (the cut among the
    candidates) and flat ones (the whole row sorted), with a tie across the candidates' boundary."""
    from trtbuild.backends.torch.sampling import _top_p, _top_p_sorted

    x = torch.from_numpy(wide_logits(16, 5000, seed=5) / temperature)
    p = torch.full((16,), top_p, dtype=x.dtype)
    assert torch.equal(_top_p(x, p), _top_p_sorted(x, p))
    top = torch.topk(x, TOP_P_CANDIDATES).values
    above = (torch.softmax(x, dim=-1) * (x > top[:, -1:])).sum(dim=-1)
    settled = (above >= top_p).float().mean()  # which path the rows took
    assert settled == (0.0 if temperature > 1 or (temperature == 1 and top_p > 0.99) else 1.0)  # both paths run


@pytest.mark.parametrize("temperature", [1.5, 3.0])
def test_top_p_widens_its_candidates_on_flat_rows(temperature):
    """Rows whose 0.9 mass needs ~4,500 of 20,000 tokens are settled by 8x the candidates; ~12,000, by the whole
    row's sort: either way the tokens kept are the whole sort's."""
    from trtbuild.backends.torch.sampling import _top_p, _top_p_sorted

    x = torch.from_numpy(wide_logits(16, 20000, seed=5) / temperature)
    p = torch.full((16,), 0.9, dtype=x.dtype)
    need = (torch.softmax(x, dim=-1).sort(dim=-1, descending=True).values.cumsum(dim=-1) < 0.9).sum(dim=-1) + 1
    wider = 8 * TOP_P_CANDIDATES
    assert bool((need > wider).all()) if temperature > 2 else bool(((need > TOP_P_CANDIDATES) & (need < wider)).all())
    assert torch.equal(_top_p(x, p), _top_p_sorted(x, p))


def test_candidates_in_any_order_come_out_by_value_then_token_id():
    """``torch.topk`` on a GPU returns tied values in no defined order: the candidates are put in sampling order."""
    from trtbuild.backends.torch.sampling import _in_sampling_order

    values = torch.tensor([[2.0, 5.0, 2.0, 5.0, 1.0, 2.0]])
    ids = torch.tensor([[9, 4, 3, 1, 0, 6]])
    got_values, got_ids = _in_sampling_order(values, ids)
    assert got_values.tolist() == [[5.0, 5.0, 2.0, 2.0, 2.0, 1.0]] and got_ids.tolist() == [[1, 4, 3, 6, 9, 0]]


def test_filters_keep_only_allowed_tokens():
    """top_k=3 over many draws: only the 3 most likely tokens (plus ties with the third) are ever drawn."""
    x = logits(1, 500, seed=2)[0]
    allowed = set(np.flatnonzero(x >= np.sort(x)[-3]))
    params = [SamplingParams(temperature=5.0, top_k=3)] * 64
    sampler = DeviceSampler(0)
    drawn = set()
    for _ in range(4):
        drawn |= set(sampler.sample(torch.from_numpy(np.tile(x, (64, 1))), [Request(p) for p in params]).token_ids)
    assert drawn <= allowed and len(drawn) >= 2


def test_a_seeded_request_draws_the_same_tokens_in_any_batch():
    x = logits(3, 300, seed=3)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone = [DeviceSampler().sample(torch.from_numpy(x[i : i + 1]), [Request(p)]).token_ids[0] for i in range(3)]
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), p]
    batched = DeviceSampler().sample(torch.from_numpy(x[[0, 1, 2]]), [Request(q) for q in others]).token_ids
    assert batched[2] == alone[2]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.0, logprobs=3),
     SamplingParams(temperature=0.8, frequency_penalty=0.5, seed=3),
     SamplingParams(temperature=0.0, presence_penalty=1.0)],
)  # fmt: skip
def test_penalties_and_logprobs_are_sampled_on_the_host(params):
    assert not on_device(params)
    x = logits(4, 200, seed=4).astype(np.float32)  # host rows leave the device as float32, the host's dtype
    mixed = [params, SamplingParams(temperature=0.0), params, SamplingParams(temperature=0.5, seed=8)]
    host = Sampler(1).sample(x, [Request(p) for p in mixed])
    dev = DeviceSampler(1).sample(torch.from_numpy(x), [Request(p) for p in mixed])
    assert dev.token_ids == host.token_ids
    assert [lp is None for lp in dev.logprobs] == [lp is None for lp in host.logprobs]
    if params.logprobs is not None:
        assert dev.logprobs[0] == host.logprobs[0]


def test_join_and_empty_batches():
    sampler = DeviceSampler()
    parts = [torch.zeros(2, 5), torch.ones(1, 5)]
    assert sampler.join(parts).shape == (3, 5)
    assert sampler.sample(torch.zeros(0, 5), []).token_ids == []
    with pytest.raises(ValueError, match="do not match"):
        sampler.sample(torch.zeros(2, 5), [Request(SamplingParams())])


def test_gpu_kv_pool_is_the_free_memory_less_one_step():
    """The default GPU pool of a Llama-3.2-1B-shaped engine: 90% of what is free, less one step's working memory."""
    from trtbuild.backends.torch.memory import KV_FREE_FRACTION, default_kv_cache_memory, step_reserve
    from trtbuild.config import BuildConfig, DType
    from trtbuild.models.registry import model_config_from_hf

    hf = dict(architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
              max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True)  # fmt: skip
    model, build = model_config_from_hf(hf, DType.BFLOAT16), BuildConfig(max_num_tokens=8192, max_batch_size=256)
    reserve = step_reserve(model, build, 2)
    assert 1 << 30 < reserve < 4 << 30  # 8k tokens of 1B activations and 256 sampled rows: a few GiB, not tens
    free = 130 << 30  # an H200 after loading 2.5 GB of weights
    assert default_kv_cache_memory(free, model, build, 2) == int(KV_FREE_FRACTION * free) - reserve
    # an EngineError, not a ValueError: LLM words those as too small a kv_cache_memory, which the user never gave
    with pytest.raises(EngineError, match="no room for a KV cache"):
        default_kv_cache_memory(reserve, model, build, 2)
    # a prompt-logprobs step returns a row for every token: 8192 bf16 rows of 128k logits, whatever few it samples
    few_rows = BuildConfig(max_num_tokens=8192, max_batch_size=1)
    grown = step_reserve(model, few_rows, 2) - step_reserve(model, BuildConfig(max_num_tokens=1, max_batch_size=1), 2)
    assert grown > 8191 * 128256 * 2 + 8191 * 2 * (3 * 8192 + 6 * 2048)


def test_prompt_rows_reach_the_host_in_float32_a_slice_at_a_time():
    """``to_host`` widens at most ``HOST_COPY_ROWS`` rows at once on the device, and gives exactly the whole copy."""
    from trtbuild.runtime.prompt_logprobs import HOST_COPY_ROWS, to_host

    logits = torch.randn(2 * HOST_COPY_ROWS + 17, 33).to(torch.bfloat16)
    got = to_host(logits)
    assert got.dtype == np.float32 and np.array_equal(got, logits.float().numpy())
    assert to_host(logits[:0]).shape == (0, 33)


def test_cpu_kv_pool_fits_the_engines_limits_within_a_share_of_memory():
    from trtbuild.config import BuildConfig, DType
    from trtbuild.models.registry import model_config_from_hf
    from trtbuild.runtime.kv_cache import (
        DEFAULT_KV_CACHE_MEMORY,
        KV_MEMORY_FRACTION,
        bytes_per_block,
        default_cpu_kv_cache_memory,
    )

    hf = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )  # fmt: skip  (SmolLM2-135M)
    model, build = model_config_from_hf(hf, DType.FLOAT32), BuildConfig()
    need = (build.max_batch_size * build.max_seq_len // build.kv_block_size + 1) * bytes_per_block(model, 16)
    assert default_cpu_kv_cache_memory(model, build, 64 << 30) == need  # a big machine: the engine's whole need
    assert default_cpu_kv_cache_memory(model, build, 8 << 30) == int(KV_MEMORY_FRACTION * (8 << 30))
    assert default_cpu_kv_cache_memory(model, build, 1 << 30) == DEFAULT_KV_CACHE_MEMORY  # never below the floor
    assert default_cpu_kv_cache_memory(model, build, None) == DEFAULT_KV_CACHE_MEMORY
    small = BuildConfig(max_batch_size=2, max_seq_len=64)
    assert default_cpu_kv_cache_memory(model, small, 64 << 30) == 9 * bytes_per_block(model, 16)  # 2 x 4 + null


class FixedDraw:
    """A generator whose every draw is ``u`` (what ``rng.random()`` returns about once in 33 million draws for u
    within 2**-25 of 1)."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize("u", [1 - 2**-24, 1 - 2**-25, 1 - 2**-40])
def test_a_draw_next_to_one_keeps_to_the_tokens_the_filters_kept(u):
    """A draw that rounds to 1 in float32 (the device's cdf) takes the last token some filter kept, as the host
    does, not the vocabulary's last token (before: a top-k row and a grammar-masked row both drew id V-1)."""
    vocab = 4096
    rows = torch.from_numpy(logits(2, vocab, seed=3).astype(np.float32)) * 3
    rows[1, 1000:] = -torch.inf  # a grammar mask: only ids < 1000
    requests = [Request(SamplingParams(temperature=0.7, top_k=40)), Request(SamplingParams(temperature=1.0))]
    for request in requests:
        request.generator = FixedDraw(u)
    device = DeviceSampler().sample(rows, requests).token_ids
    host = Sampler().sample(rows.numpy(), requests).token_ids
    for tokens in (device, host):  # (which kept token: up to float32 rounding against the host's float64)
        assert tokens[0] in set(torch.topk(rows[0], 40).indices.tolist()) and tokens[1] < 1000, tokens


def test_unseeded_draws_follow_the_rows_order_whichever_sampler_takes_them():
    """Unseeded requests draw from the sampler's one generator in row order, on the device as on the host: a
    penalised row (sampled on the host) before a plain one (on the device) gets the host sampler's tokens."""
    rows = logits(4, 300, seed=5)
    params = [
        SamplingParams(temperature=1.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.1, logprobs=1),
    ]
    assert [on_device(p) for p in params] == [False, True, True, False]
    for seed in range(5):
        device = DeviceSampler(seed).sample(torch.from_numpy(rows), [Request(p) for p in params]).token_ids
        assert device == Sampler(seed).sample(rows, [Request(p) for p in params]).token_ids


def test_a_tiny_temperature_is_sampled_where_it_does_not_overflow():
    """A temperature too small to divide float32 logits by (inf - inf is NaN) is sampled on the host in float64,
    as the host sampler does (before: the device drew the vocabulary's last token)."""
    rows = torch.from_numpy(logits(1, 1000, seed=7).astype(np.float32)) * 5
    top = set(torch.topk(rows[0], 2).indices.tolist())  # (the row's maximum is a tie of two tokens)
    for temperature in (1e-5, 1e-30, 1e-37, 1e-39):
        params = SamplingParams(temperature=temperature, seed=0)
        assert on_device(params) == (temperature >= 1e-30)
        device = DeviceSampler().sample(rows, [Request(params)]).token_ids
        assert device == Sampler().sample(rows.numpy(), [Request(params)]).token_ids and device[0] in top
