"""The real SmolLM2-135M (GGUF -> checkpoint -> engine) against transformers loading the same GGUF."""

from __future__ import annotations

import subprocess
import sys

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


HUGE_PAGES_CHECK = """
import sys
import numpy as np
from trtbuild.backends.onnxruntime import huge_pages
from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.runtime.batch import StepBatch
batch = StepBatch.build([[1, 504, 3458, 28, 1790, 30]], [0], [[1, 2, 3]], all_logits=True)
session = OrtSession(sys.argv[1], kv_cache_memory=32 << 20)
if huge_pages.supported():
    assert session.huge_page_bytes > 400 << 20, session.huge_page_bytes  # the float32 weights, prepacked: 538 MB
logits = session.step(batch)
small = OrtSession(sys.argv[1], kv_cache_memory=32 << 20, huge_pages=False)
assert small.huge_page_bytes == 0
np.testing.assert_array_equal(small.step(batch), logits)
"""


def test_huge_pages_change_no_logit(smollm2):
    """The weights on huge pages (the default where Linux allows it) give bit-identical logits. In a fresh
    process: here torch's freed memory would be reused for the weights, old memory that the session's window
    does not see (huge_pages.py)."""
    _, _, engine = smollm2
    done = subprocess.run([sys.executable, "-c", HUGE_PAGES_CHECK, str(engine)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


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
