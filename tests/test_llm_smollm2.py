"""``trtbuild.LLM`` on the real SmolLM2-135M-Instruct: tokenizer, chat template and greedy text vs transformers."""

from __future__ import annotations

import pytest
import torch

from trtbuild.runtime.llm import LLM, SamplingParams
from trtbuild.runtime.sequence import FinishReason

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village, there lived an old clockmaker who",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "List three fruits:",
    "In 1969, the first humans",
    "Translate to French: good morning",
    "The quick brown fox",
    "Photosynthesis is the process by which plants",
    "A haiku about winter:\n",
    "import numpy as np\n\ndef mean(xs):",
    "Q: What is the tallest mountain on Earth?\nA:",
    "The most important rule of writing is",
    "Dear Sir or Madam,",
    "Ingredients for pancakes:",
]


@pytest.fixture(scope="module")
def llm(smollm2) -> LLM:
    return LLM(smollm2[2], kv_cache_memory=256 << 20)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def hf_chat_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def test_tokenizer_and_chat_template_match_transformers(smollm2, llm):
    _, tok, _ = smollm2
    for text in [*PROMPTS, "héllo wörld 日本語 🙂", "  leading spaces\tand\ttabs\n\n"]:
        assert llm.tokenizer.encode(text) == tok(text).input_ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    for msgs in (messages, messages[1:]):
        assert llm.chat_prompt(msgs) == hf_chat_ids(tok, msgs)


def test_16_concurrent_greedy_equal_alone_and_transformers(smollm2, llm):
    model, tok, engine = smollm2
    params = [SamplingParams(temperature=0.0, max_tokens=8 + i % 9) for i in range(len(PROMPTS))]
    together = llm.generate(PROMPTS, params)
    alone = LLM(engine, enable_prefix_caching=False, kv_cache_memory=64 << 20)
    for prompt, sp, out in zip(PROMPTS, params, together, strict=True):
        assert out.token_ids == alone.generate([prompt], sp)[0].token_ids
        ref = hf_greedy(model, tok(prompt).input_ids, sp.max_tokens)
        assert out.token_ids == ref, f"{prompt!r}: {out.text!r} != {tok.decode(ref)!r}"
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_chat_reply_matches_transformers(smollm2, llm):
    model, tok, _ = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=40))[0]
    ref = hf_greedy(model, hf_chat_ids(tok, messages), 40)
    assert out.token_ids == ref
    assert out.finish_reason is FinishReason.STOP and out.token_ids[-1] == tok.eos_token_id
    assert out.text == tok.decode(ref, skip_special_tokens=True) and "Paris" in out.text


def test_stop_strings_and_stream_on_real_text(llm):
    prompt = "Once upon a time, in a small village, there lived an old clockmaker who"
    greedy = dict(temperature=0.0, max_tokens=48, ignore_eos=True)
    full = llm.generate([prompt], SamplingParams(**greedy))[0].text
    stop = full.split()[4]  # a word in the middle, cut wherever it first appears (even inside another word)
    cut = llm.generate([prompt], SamplingParams(stop=[stop], **greedy))[0]
    assert cut.text == full[: full.index(stop)] and cut.stop_reason == stop
    stream = llm.generate_stream(prompt, SamplingParams(stop=[stop], **greedy))
    deltas = list(stream)
    assert "".join(deltas) == cut.text == stream.output.text and len(deltas) > 3


def test_shared_prefix_cached_and_output_unchanged(smollm2, llm):
    _, tok, engine = smollm2
    prefix = " ".join(PROMPTS) * 3
    prompts = [prefix + " Question: " + q for q in ("what is it?", "why?", "who wrote this?")]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    llm.reset_stats()
    first = llm.generate(prompts[:1], params)[0]
    computed = llm.stats.num_computed_tokens
    llm.reset_stats()
    rest = llm.generate(prompts[1:], params)
    n_prefix = len(tok(prefix).input_ids)
    assert all(o.metrics.num_cached_tokens >= n_prefix - 32 for o in rest)
    assert llm.stats.num_computed_tokens < computed  # two requests computed fewer tokens than one did
    no_cache = LLM(engine, enable_prefix_caching=False, kv_cache_memory=64 << 20)
    assert [o.token_ids for o in no_cache.generate(prompts, params)] == [first.token_ids] + [o.token_ids for o in rest]


def test_small_pool_preempts_with_unchanged_outputs(smollm2, llm):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    small = LLM(smollm2[2], kv_cache_memory=24 * 720 * 1024)  # 23 usable blocks of 16 tokens for 16 requests
    outs = small.generate(PROMPTS, params)
    assert small.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
