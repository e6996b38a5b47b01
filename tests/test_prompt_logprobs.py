"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``) on the tiny engines, against transformers'
log_softmax of the full forward; their interplay with chunked prefill, the prefix cache and in-batch prefix sharing.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from tiny_models import hf_logits

from trtbuild.errors import RequestError
from trtbuild.runtime.llm import LLM, SamplingParams

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def reference(model, prompt: list[int]) -> np.ndarray:
    """transformers' log-probabilities ``[len(prompt), vocab]`` (float64): row p - 1 scores prompt token p."""
    logits = hf_logits(model, prompt).astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


def check(model, prompt: list[int], scores, k: int, first: int = 1) -> None:
    ref = reference(model, prompt)
    assert len(scores) == len(prompt)
    assert all(s is None for s in scores[:first])
    for p in range(first, len(prompt)):
        row = ref[p - 1]
        assert scores[p].logprob == pytest.approx(row[prompt[p]], abs=2e-4)
        assert [t for t, _ in scores[p].top] == np.argsort(-row, kind="stable")[:k].tolist()
        assert [lp for _, lp in scores[p].top] == pytest.approx(np.sort(row)[::-1][:k], abs=2e-4)


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3"])
def test_prompt_logprobs_match_transformers_with_chunked_prefill(tiny_engines, name):
    model, _, engine_dir = tiny_engines[name]
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 97, n).tolist() for n in (37, 5, 2, 21)]
    params = SamplingParams(max_tokens=3, prompt_logprobs=3, **GREEDY)
    plain = SamplingParams(max_tokens=5, **GREEDY)  # requests without prompt logprobs in the same steps
    for llm in (LLM(engine_dir), LLM(engine_dir, max_num_batched_tokens=16)):  # one step / chunks of <= 16 tokens
        outs = llm.generate([*prompts, prompts[0][:30]], [params] * len(prompts) + [plain])
        for prompt, out in zip(prompts, outs, strict=False):
            check(model, prompt, out.prompt_logprobs, 3)
        assert outs[-1].prompt_logprobs is None
        alone = LLM(engine_dir).generate(
            [*prompts, prompts[0][:30]], [replace(params, prompt_logprobs=None)] * 4 + [plain]
        )
        assert [o.token_ids for o in outs] == [o.token_ids for o in alone]  # the sampled tokens are unchanged


def test_prompt_logprobs_zero_lists_no_alternatives(tiny_engines):
    model, _, engine_dir = tiny_engines["llama_gqa"]
    prompt = list(range(10, 30))
    [out] = LLM(engine_dir).generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY))
    check(model, prompt, out.prompt_logprobs, 0)
    assert all(s.top == [] for s in out.prompt_logprobs[1:])


def test_cached_prefix_is_not_reused_before_the_first_scored_position(tiny_engines):
    """A prefix-cache hit computes no logits: a prompt-logprob request reuses only the blocks before
    ``prompt_logprobs_from - 1`` (block size 4 on the tiny engines)."""
    model, _, engine_dir = tiny_engines["llama_gqa"]
    prompt = np.random.default_rng(3).integers(3, 97, 30).tolist()
    llm = LLM(engine_dir)
    llm.generate([prompt], SamplingParams(max_tokens=1, **GREEDY))  # every full block of the prompt now cached
    [whole] = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2, **GREEDY))
    assert whole.metrics.num_cached_tokens == 0
    check(model, prompt, whole.prompt_logprobs, 2)
    [tail] = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2, prompt_logprobs_from=19, **GREEDY))
    assert tail.metrics.num_cached_tokens == 16  # 4 whole blocks before position 18, the first row it needs
    check(model, prompt, tail.prompt_logprobs, 2, first=19)


def test_requests_sharing_a_prefix_in_one_batch_compute_it_once(tiny_engines):
    """A waiting request whose next block another request of the step is computing waits one step for it."""
    model, _, engine_dir = tiny_engines["llama_gqa"]
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, 97, 40).tolist()
    prompts = [[*prefix, *rng.integers(3, 97, 3).tolist()] for _ in range(4)]
    params = SamplingParams(max_tokens=4, **GREEDY)
    llm = LLM(engine_dir)
    outs = llm.generate(prompts, params)
    assert llm.stats.prefix_cache_hits == 3 * 40  # 10 whole blocks of the prefix, for each later request
    assert llm.stats.num_computed_tokens == 43 + 3 * 3 + 4 * 3  # the prefix once; 3 decode steps each
    unshared = LLM(engine_dir, enable_prefix_caching=False).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in unshared]
    # Scoring several continuations of one prefix: each scored from its continuation on, the prefix computed once.
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_from=40, **GREEDY)
    llm = LLM(engine_dir)
    outs = llm.generate(prompts, scoring)
    assert llm.stats.num_computed_tokens == 43 + 3 * (43 - 36)  # the last cached block ends before position 39
    for prompt, out in zip(prompts, outs, strict=True):
        check(model, prompt, out.prompt_logprobs, 0, first=40)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("prompt_logprobs", -1, "prompt_logprobs must be >= 0"),
        ("prompt_logprobs_from", 0, "prompt_logprobs_from must be >= 1"),
        ("prompt_logprobs", "2", "prompt_logprobs must be an integer"),
    ],
)
def test_bad_prompt_logprobs_are_refused(field, value, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**{field: value})
