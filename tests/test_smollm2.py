"""The real SmolLM2-135M (GGUF -> checkpoint -> engine) against transformers loading the same GGUF."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import hf_logits

from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.runtime.batch import StepBatch

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
]


def test_prefill_logits_match(smollm2):
    model, tok, engine = smollm2
    ids = tok(PROMPTS[1]).input_ids
    session = OrtSession(engine, kv_cache_memory=32 << 20)
    logits = session.step(StepBatch.build([ids], [0], [list(range(1, 4))], all_logits=True))
    ref = hf_logits(model, ids)
    assert np.abs(logits - ref).max() < 1e-3  # 30 layers, 49k vocab: float32 accumulation-order noise only


def test_greedy_32_tokens_match_transformers_batched(smollm2):
    """All five prompts run as one ragged batch (prefill together, decode together) through the paged cache."""
    model, tok, engine = smollm2
    n_new = 32
    session = OrtSession(engine, kv_cache_memory=64 << 20)
    prompts = [tok(p).input_ids for p in PROMPTS]
    blocks_per_seq = (max(map(len, prompts)) + n_new) // session.cache.block_size + 1
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))[::-1] for i in range(len(prompts))]
    outs = [[] for _ in prompts]
    logits = session.step(StepBatch.build(prompts, [0] * len(prompts), tables))
    for _ in range(n_new):
        nxt = logits.argmax(axis=-1)
        for o, t in zip(outs, nxt, strict=True):
            o.append(int(t))
        logits = session.step(
            StepBatch.build(
                [[o[-1]] for o in outs], [len(p) + len(o) - 1 for p, o in zip(prompts, outs, strict=True)], tables
            )
        )
    for prompt, ids, out in zip(PROMPTS, prompts, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False)[0, len(ids) :].tolist()
        # transformers stops after the end-of-turn token; we generated past it, so compare up to there.
        assert out[: len(ref)] == ref, f"{prompt!r}: {tok.decode(out)!r} != {tok.decode(ref)!r}"
        assert len(ref) == n_new or ref[-1] == tok.eos_token_id
