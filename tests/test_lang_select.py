"""``select`` ranking its choices by log-probability (``ChoicesMethod``), on the tiny text engine (test_llm's
character tokenizer: one token per character). References are transformers' log_softmax of the full
forward of each choice's text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_llm import add_tokenizer
from test_prompt_logprobs import reference

from trtbuild.errors import RequestError
from trtbuild.lang import ChoicesMethod, SelectScores, function, select
from trtbuild.runtime.llm import LLM

# 41 characters, 41 tokens (this tokenizer adds no BOS): the last one's row scores a choice's first token, and the
# 10 blocks of 4 before it are shared.
PREFIX = "the cat is a cat of the stop. my pet: a  "
CHOICES = ["dog", "cat", "bird", "catfish", "an owl"]


@pytest.fixture(scope="module")
def engine(tiny_engines, tmp_path_factory) -> Path:
    return add_tokenizer(tiny_engines["llama_gqa"][2], tmp_path_factory.mktemp("select") / "engine")


@pytest.fixture(scope="module")
def llm(engine) -> LLM:
    return LLM(engine)


def choice_logprobs(model, llm: LLM, choices: list[str]) -> list[np.ndarray]:
    """transformers' logprob of each choice token given the prefix and the choice's earlier tokens."""
    start = len(llm.tokenizer.encode(PREFIX))
    out = []
    for choice in choices:
        ids = llm.tokenizer.encode(PREFIX + choice)
        ref = reference(model, ids)
        out.append(np.array([ref[p - 1, ids[p]] for p in range(start, len(ids))]))
    return out


def greedy_token_selection(logprobs: list[np.ndarray]) -> int:
    """SGLang's rule written out: compare first tokens, then the second ones among the best, ... (a choice out of
    tokens stands at its mean)."""
    alive = list(range(len(logprobs)))
    for j in range(max(len(lp) for lp in logprobs)):
        at = {i: logprobs[i][j] if j < len(logprobs[i]) else logprobs[i].mean() for i in alive}
        alive = [i for i in alive if at[i] == max(at.values())]
        if len(alive) == 1:
            break
    return alive[0]


@pytest.mark.parametrize("method", [ChoicesMethod.TOKEN_LENGTH_NORMALIZED, ChoicesMethod.GREEDY_TOKEN_SELECTION])
def test_select_ranks_the_choices_in_one_batched_pass(tiny_engines, engine, method):
    llm = LLM(engine)  # an empty prefix cache

    @function
    def pick(s):
        s += PREFIX + select("pet", CHOICES, choices_method=method)

    state = pick.run(llm)
    stats = llm.stats
    ref = choice_logprobs(tiny_engines["llama_gqa"][0], llm, CHOICES)
    means = [float(lp.mean()) for lp in ref]
    expected = int(np.argmax(means)) if method is ChoicesMethod.TOKEN_LENGTH_NORMALIZED else greedy_token_selection(ref)
    assert state["pet"] == CHOICES[expected]
    assert state.text() == PREFIX + CHOICES[expected]
    meta = state.get_meta_info("pet")
    assert (meta.method, meta.choices, meta.chosen) == (method, tuple(CHOICES), expected)
    assert meta.normalized_logprobs == pytest.approx(means, abs=2e-4)
    for got, want in zip(meta.token_logprobs, ref, strict=True):
        assert got == pytest.approx(want.tolist(), abs=2e-4)
    # One submission of five requests; the prefix computed once, all but its last token shared through the cache.
    lengths = [len(PREFIX) + len(c) for c in CHOICES]
    assert llm._num_requests == len(CHOICES)
    assert stats.num_steps == 2  # the first request, then the others on its cached blocks
    assert stats.prefix_cache_hits == 40 * (len(CHOICES) - 1)
    assert stats.num_computed_tokens == lengths[0] + sum(n - 40 for n in lengths[1:])


def test_select_methods_are_typed():
    with pytest.raises(RequestError, match=r"choices_method must be a trtbuild\.lang\.ChoicesMethod"):
        select("x", ["a", "b"], choices_method="greedy")
    with pytest.raises(RequestError, match="CONSTRAINED_DECODING only"):
        select("x", ["a", "b"], temperature=0.5)


def test_get_meta_info_needs_a_ranking_select(llm):
    @function
    def pick(s):
        s += "q " + select("c", ["a", "b"], choices_method=ChoicesMethod.CONSTRAINED_DECODING)

    state = pick.run(llm)
    with pytest.raises(KeyError, match="no scores for 'c'"):
        state.get_meta_info("c")


@pytest.mark.parametrize(
    ("logprobs", "normalized", "greedy"),
    [
        ([[-0.1, -5.0], [-0.5, -0.5]], 1, 0),  # a likelier first token, a worse mean
        ([[-1.0, -0.2, -9.0], [-1.0, -0.5], [-1.0]], 1, 0),  # first tokens tie; a one-token choice stands at its mean
    ],
)
def test_the_two_rankings_differ_where_sglang_says(logprobs, normalized, greedy):
    choices = tuple(f"c{i}" for i in range(len(logprobs)))
    by_mean = SelectScores.rank(ChoicesMethod.TOKEN_LENGTH_NORMALIZED, choices, logprobs)
    assert by_mean.chosen == normalized == int(np.argmax([np.mean(lp) for lp in logprobs]))
    by_token = SelectScores.rank(ChoicesMethod.GREEDY_TOKEN_SELECTION, choices, logprobs)
    assert by_token.chosen == greedy == greedy_token_selection([np.array(lp) for lp in logprobs])
