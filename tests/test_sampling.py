"""SamplingParams validation and the Sampler, checked against brute-force numpy and hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trtbuild.errors import RequestError
from trtbuild.runtime import sampling
from trtbuild.runtime.sampling import Sampler, SamplingParams, apply_penalties, log_softmax
from trtbuild.runtime.sequence import Sequence


def req(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None) -> Sequence:
    seq = Sequence("r", prompt or [0], params, 0)
    seq.output_token_ids.extend(output or [])
    return seq


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def kept(processed: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(processed)).tolist())


def brute_top_k(logits: np.ndarray, k: int) -> set[int]:
    return set(sorted(range(len(logits)), key=lambda i: -logits[i])[:k])


def brute_top_p(logits: np.ndarray, p: float) -> set[int]:
    probs = softmax(logits)
    out, mass = set(), 0.0
    for i in sorted(range(len(logits)), key=lambda i: -probs[i]):
        out.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return out


def brute_min_p(logits: np.ndarray, min_p: float) -> set[int]:
    probs = softmax(logits)
    return {i for i in range(len(logits)) if probs[i] >= min_p * probs.max()}


logit_rows = st.lists(st.floats(-8, 8, allow_nan=False), min_size=2, max_size=40).map(
    lambda xs: np.array(xs, dtype=np.float32)
)


def test_greedy_is_exact_argmax() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 1000)).astype(np.float32)
    logits[2, [5, 9]] = 100.0  # a tie: the lowest id wins, as np.argmax
    reqs = [req(SamplingParams(temperature=0)) for _ in range(6)]
    assert Sampler().sample(logits, reqs).token_ids == logits.argmax(axis=1).tolist()
    assert Sampler().sample(logits, reqs).token_ids[2] == 5


def test_seeded_requests_reproduce_whatever_the_batch() -> None:
    rng = np.random.default_rng(1)
    steps = [rng.standard_normal((4, 50)).astype(np.float32) for _ in range(10)]
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)

    alone, batched = req(params), req(params)
    others = [req(SamplingParams(temperature=1.0)), req(SamplingParams(temperature=0.7, seed=5)), req(params)]
    sampler = Sampler(seed=99)
    for logits in steps:
        a = sampler.sample(logits[:1], [alone]).token_ids[0]
        # the same request's row placed among others, at another index
        b = sampler.sample(logits[[1, 0, 2, 3]], [others[0], batched, *others[1:]])
        assert b.token_ids[1] == a
    assert alone.generator is not None
    different = req(SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=4321))
    tokens = [Sampler().sample(x[:1], [different]).token_ids[0] for x in steps]
    fresh = req(params)
    assert tokens != [Sampler().sample(x[:1], [fresh]).token_ids[0] for x in steps]


@settings(max_examples=60, deadline=None)
@given(logits=logit_rows, k=st.integers(1, 45))
def test_top_k_keeps_the_k_most_likely(logits: np.ndarray, k: int) -> None:
    assume(len(set(logits.tolist())) == len(logits))  # ties at the k-th value are all kept: test distinct values
    processed = Sampler().process(logits, req(SamplingParams(top_k=k)))
    assert kept(processed) == brute_top_k(logits, k)
    mask = np.isfinite(processed)
    expected = softmax(logits.astype(np.float64))[mask]
    np.testing.assert_allclose(softmax(processed)[mask], expected / expected.sum(), rtol=1e-9)


@settings(max_examples=60, deadline=None)
@given(logits=logit_rows, p=st.floats(0.05, 1.0))
def test_top_p_keeps_the_smallest_set_reaching_p(logits: np.ndarray, p: float) -> None:
    probs = np.sort(softmax(logits.astype(np.float64)))[::-1]
    assume(np.min(np.abs(np.cumsum(probs) - p)) > 1e-9)  # not on a float boundary
    gaps = -np.diff(probs)  # and no near-tie (e.g. logits 0 and 2e-16), which rounding may order either way
    assume(np.all((gaps == 0) | (gaps > 1e-12)))
    processed = Sampler().process(logits, req(SamplingParams(top_p=p)))
    assert kept(processed) == brute_top_p(logits.astype(np.float64), p)
    assert softmax(logits.astype(np.float64))[list(kept(processed))].sum() >= p - 1e-12


@settings(max_examples=60, deadline=None)
@given(logits=logit_rows, min_p=st.floats(0.0, 1.0))
def test_min_p_drops_tokens_below_the_scaled_maximum(logits: np.ndarray, min_p: float) -> None:
    probs = softmax(logits.astype(np.float64))
    assume(np.min(np.abs(probs - min_p * probs.max())) > 1e-9)
    processed = Sampler().process(logits, req(SamplingParams(min_p=min_p)))
    assert kept(processed) == brute_min_p(logits.astype(np.float64), min_p)


def test_top_p_candidate_shortcut_equals_the_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    def full_sort_top_p(logits: np.ndarray, p: float) -> np.ndarray:
        probs = softmax(logits)
        order = np.argsort(-probs, kind="stable")
        drop = np.cumsum(probs[order]) - probs[order] >= p
        drop[0] = False
        out = logits.copy()
        out[order[drop]] = -np.inf
        return out

    rng = np.random.default_rng(3)
    for candidates in (1, 3, 8, 1024):
        monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
        for _ in range(100):
            scale = rng.choice([0.5, 3.0, 10.0])  # flat to peaked
            row = np.round(rng.standard_normal(rng.integers(2, 60)) * scale)  # rounding makes ties
            p = float(rng.uniform(0.05, 1.0))
            got = row.copy()
            sampling.apply_top_p(got, p)
            np.testing.assert_array_equal(got, full_sort_top_p(row, p))


def test_filters_compose_in_order_temperature_min_p_top_k_top_p() -> None:
    logits = np.array([3.0, 2.5, 2.0, 1.0, 0.5, -1.0, -4.0], dtype=np.float32)
    # After temperature, x = [6, 5, 4, 2, 1, -2, -8]: min-p keeps 5 tokens, top-k 4, top-p 3 (mass 0.899 < 0.9 at 2).
    params = SamplingParams(temperature=0.5, min_p=0.005, top_k=4, top_p=0.9)
    processed = Sampler().process(logits, req(params))
    x = logits.astype(np.float64) / 0.5
    stage = x.copy()
    stage[[i for i in range(7) if i not in brute_min_p(x, 0.005)]] = -np.inf
    stage[[i for i in range(7) if i not in brute_top_k(stage, 4)]] = -np.inf
    stage[[i for i in range(7) if i not in brute_top_p(stage, 0.9)]] = -np.inf
    np.testing.assert_array_equal(processed, stage)
    assert kept(processed) == {0, 1, 2}


def test_penalties_match_hand_computed_values() -> None:
    logits = np.array([2.0, -1.0, 0.5, 3.0, 0.0], dtype=np.float64)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, params, prompt_ids=[0, 1], output_ids=[3, 3, 2])
    # repetition on {0, 1, 2, 3}: 2/2, -1*2, 0.5/2, 3/2; then output counts {3: 2, 2: 1}: -0.5*count - 0.25
    np.testing.assert_allclose(logits, [1.0, -2.0, 0.25 - 0.75, 1.5 - 1.25, 0.0])
    row = np.array([[2.0, -1.0, 0.5, 3.0, 0.0]], dtype=np.float32)
    greedy = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert Sampler().sample(row, [req(greedy, [0, 1], [3, 3, 2])]).token_ids == [0]  # 3 would win unpenalised


def test_negative_penalties_and_temperature() -> None:
    logits = np.array([1.0, 1.0, 1.0], dtype=np.float64)
    apply_penalties(logits, SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5), [0], [2, 2])
    np.testing.assert_allclose(logits, [1.0, 1.0, 3.5])
    processed = Sampler().process(np.array([2.0, 4.0], dtype=np.float32), req(SamplingParams(temperature=2.0)))
    np.testing.assert_allclose(processed, [1.0, 2.0])


@pytest.mark.parametrize("order", ["random", "ascending", "descending", "ties"])
def test_kth_largest_is_the_partitions(order: str) -> None:
    """``kth_largest`` (a strided sample's threshold, then a partition of what lies above it) gives exactly
    ``np.partition``'s m-th largest, whether the sample's threshold holds (random rows) or not (ordered rows)."""
    rng = np.random.default_rng(5)
    for n in (2, 17, 1000, 49152):
        row = rng.standard_normal(n) * 3
        row = {"random": row, "ascending": np.sort(row), "descending": np.sort(row)[::-1].copy(),
               "ties": np.round(row)}[order]  # fmt: skip
        for m in {1, 2, 7, 50, 1024, n}:
            if m <= n:
                assert sampling.kth_largest(row, m) == np.partition(row, n - m)[n - m], (n, m)


def test_a_draw_over_the_kept_tokens_is_the_whole_rows() -> None:
    """``draw`` sums only the tokens the filters kept: the same token as inverting the whole row's cumulative
    weights (its filtered tokens adding 0), at every draw, the extremes included."""
    rng = np.random.default_rng(6)
    for kept_share in (0.001, 0.05, 0.5, 1.0):
        for _ in range(20):
            row = rng.standard_normal(5000) * 2
            row[rng.random(5000) >= kept_share] = -np.inf
            row[rng.integers(5000)] = 1.0  # at least one token kept
            cdf = np.cumsum(np.exp(row - row.max()))
            for u in (0.0, 1e-12, *rng.random(5), 1 - 2**-40, np.nextafter(1.0, 0.0)):
                target = min(u * cdf[-1], np.nextafter(cdf[-1], 0.0))
                whole = min(int(np.searchsorted(cdf, target, side="right")), len(row) - 1)
                assert sampling.draw(row, u) == sampling.draw(row, u, filtered=False) == whole


def test_draws_follow_the_processed_distribution() -> None:
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], dtype=np.float32))
    seq = req(SamplingParams(temperature=1.0, seed=7))
    sampler = Sampler()
    counts = np.bincount([sampler.sample(logits, [seq]).token_ids[0] for _ in range(20000)], minlength=4)
    np.testing.assert_allclose(counts / 20000, [0.5, 0.3, 0.15, 0.05], atol=0.015)


@settings(max_examples=60, deadline=None)
@given(
    logits=logit_rows,
    k=st.one_of(st.none(), st.integers(1, 5)),
    p=st.floats(0.1, 1.0),
    min_p=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**32),
)
def test_never_draws_a_filtered_token(logits: np.ndarray, k: int | None, p: float, min_p: float, seed: int) -> None:
    seq = req(SamplingParams(temperature=0.7, top_k=k, top_p=p, min_p=min_p, seed=seed, logprobs=3))
    sampler = Sampler()
    processed = sampler.process(logits, seq)
    out = sampler.sample(logits[None], [seq])
    assert out.token_ids[0] in kept(processed)
    lp = out.logprobs[0]
    assert lp is not None and math.isfinite(lp.logprob)
    np.testing.assert_allclose(lp.logprob, log_softmax(processed)[out.token_ids[0]])


def test_logprobs_of_the_processed_logits() -> None:
    logits = np.array([[1.0, 3.0, 2.0, 0.0]], dtype=np.float32)
    out = Sampler().sample(logits, [req(SamplingParams(temperature=0, logprobs=2))])
    lp = out.logprobs[0]
    expected = log_softmax(logits[0].astype(np.float64))
    assert out.token_ids == [1] and lp is not None
    assert lp.logprob == pytest.approx(expected[1])
    assert [t for t, _ in lp.top] == [1, 2] and lp.top[1][1] == pytest.approx(expected[2])
    filtered = Sampler().sample(logits, [req(SamplingParams(top_k=1, logprobs=0, seed=0))])
    assert filtered.token_ids == [1] and filtered.logprobs[0].logprob == 0.0 and filtered.logprobs[0].top == []
    assert Sampler().sample(logits, [req(SamplingParams(temperature=0))]).logprobs == [None]
    ties = np.array([[0.0, 1.0, 1.0, 0.5, 1.0]], dtype=np.float32)
    top = Sampler().sample(ties, [req(SamplingParams(temperature=0, logprobs=2))]).logprobs[0]
    assert top is not None and [t for t, _ in top.top] == [1, 2]  # ties in id order


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": math.nan}, "temperature must be >= 0"),
        ({"top_k": -2}, "top_k must be >= 1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"n": 0}, "n must be >= 1"),
        ({"logprobs": -1}, "logprobs must be >= 0"),
        ({"stop": ["ok", ""]}, "stop must be a list of non-empty strings"),
        ({"stop_token_ids": [-5]}, "stop_token_ids must be token ids"),
    ],
)
def test_invalid_params_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kwargs)


def test_params_normalise_lists() -> None:
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[3])
    assert params.stop == ("a", "b") and params.stop_token_ids == (3,)
    assert SamplingParams(stop="end").stop == ("end",)
    assert hash(params) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(3,)))
