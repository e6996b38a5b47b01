"""Sampling on the logits' device: one step's tokens leave the GPU as ``B`` integers, not ``B x vocab`` floats.

``DeviceSampler`` follows the host ``Sampler`` (``trtbuild/runtime/sampling.py``) row for row: greedy rows take
the argmax (lowest id on ties); random rows divide by the temperature, then min-p, top-k (ties with the k-th
kept), top-p (ties ordered by token id, the most likely token always kept), and invert the cumulative
distribution in token-id order at one uniform draw. The draw comes from the request's own numpy generator (or
the sampler's, when unseeded) exactly as on the host, so a seeded request gets the same tokens whatever the batch
and wherever it is sampled, up to the rounding of float32 against the host's float64 (float64 logits are
sampled in float64: the same tokens as the host's).

Rows that need the host's per-request work (repetition / frequency / presence penalties, logprobs) are copied
to the host and sampled there by the host sampler; only those rows cross.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...runtime.sampling import (
    TOP_P_CANDIDATES,
    Sampler,
    SamplerOutput,
    SamplingParams,
    SamplingRequest,
    TokenLogprobs,
)

# The smallest temperature sampled on the device: logits divided by a smaller one can overflow float32 (inf - inf
# is NaN: the row would draw its last token). Such rows go to the host sampler, whose float64 keeps them exact.
MIN_DEVICE_TEMPERATURE = 1e-30


def on_device(params: SamplingParams) -> bool:
    """Whether a request's rows can be sampled on the device (no penalties, no logprobs, a temperature of 0 or one
    float32 can divide by)."""
    return (
        params.logprobs is None
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and (params.greedy or params.temperature >= MIN_DEVICE_TEMPERATURE)
    )


class DeviceSampler:
    """Turns a step's device logits ``[B, V]`` into one token per request (see the module docstring)."""

    def __init__(self, seed: int | None = None) -> None:
        self.host = Sampler(seed)  # host-only rows, and the generator of unseeded requests

    def sample(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> SamplerOutput:
        """Pick a token for each row of ``logits`` (any float dtype, any device); row b belongs to ``requests[b]``."""
        if logits.ndim != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(requests)} requests")
        device_rows = [b for b, r in enumerate(requests) if on_device(r.sampling_params)]
        host_rows = [b for b, r in enumerate(requests) if not on_device(r.sampling_params)]
        token_ids = [0] * len(requests)
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        # Every random row's draw in row order, as the host sampler makes them: an unseeded request's token then
        # does not depend on which of its neighbours are sampled where.
        draws = [None if r.sampling_params.greedy else self.host.uniform(r) for r in requests]
        if device_rows:
            params = [requests[b].sampling_params for b in device_rows]
            uniforms = [draws[b] or 0.0 for b in device_rows]
            rows = logits if len(device_rows) == len(requests) else logits[device_rows]
            for b, t in zip(device_rows, sample_rows(rows, params, uniforms).tolist(), strict=True):
                token_ids[b] = int(t)
        if host_rows:
            host = logits[host_rows].float().cpu().numpy()
            out = self.host.sample(host, [requests[b] for b in host_rows], [draws[b] for b in host_rows])
            for b, t, lp in zip(host_rows, out.token_ids, out.logprobs, strict=True):
                token_ids[b], logprobs[b] = t, lp
        return SamplerOutput(token_ids, logprobs)

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Rows of several steps' logits, stacked in order."""
        return torch.cat(list(parts))


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]) -> torch.Tensor:
    """Token ids ``[B]`` (on the logits' device) for rows without penalties; ``uniforms[b]`` is row b's draw."""
    device, vocab = logits.device, logits.shape[-1]
    x = logits if logits.dtype == torch.float64 else logits.float()
    tokens = torch.argmax(x, dim=-1)  # the first maximum: the lowest id on ties, as np.argmax
    if all(p.greedy for p in params):
        return tokens
    # Per-row parameters go over as small tensors; which stages run is decided on the host (no device syncs).
    greedy = torch.tensor([p.greedy for p in params], device=device)
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device, dtype=x.dtype)
    x = x / temperature[:, None]
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=x.dtype)
        probs = torch.exp(x - x.max(dim=-1, keepdim=True).values)  # the largest is 1
        x = x.masked_fill(probs < min_p[:, None], -torch.inf)
    k = [min(p.top_k or vocab, vocab) for p in params]
    if any(n < vocab for n in k):
        x = _top_k(x, k)
    nucleus = [b for b, p in enumerate(params) if p.top_p < 1]  # rows of top_p 1 keep every token: left alone
    if nucleus:
        top_p = torch.tensor([params[b].top_p for b in nucleus], device=device, dtype=x.dtype)
        if len(nucleus) == len(params):
            x = _top_p(x, top_p)
        else:
            x[nucleus] = _top_p(x[nucleus], top_p)
    weights = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1:]
    target = torch.tensor(uniforms, device=device, dtype=cdf.dtype)[:, None] * total
    # below the total: a draw within 2**-25 of 1 rounds to it in float32, and the search would then run past the
    # last token some filter kept (to the vocabulary's last token, whatever its weight)
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=vocab - 1)
    return torch.where(greedy, tokens, drawn)


def _top_k(x: torch.Tensor, k: Sequence[int]) -> torch.Tensor:
    """Mask to -inf all but each row's ``k[b]`` largest (ties with the k-th kept; ``k[b]`` >= the vocabulary: all).

    The k-th largest comes from a partial selection (``torch.topk``) of the largest ``k``, not a sort of the row."""
    vocab = x.shape[-1]
    most = max(n for n in k if n < vocab)
    largest = torch.topk(x, most, dim=-1).values  # descending
    at = torch.tensor([min(n, most) - 1 for n in k], device=x.device)
    kth = largest.gather(1, at[:, None])
    kth = kth.masked_fill(torch.tensor([n >= vocab for n in k], device=x.device)[:, None], -torch.inf)
    return x.masked_fill(x < kth, -torch.inf)


def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf all but the smallest set of each row's most likely tokens whose mass reaches ``top_p[b]``
    (ties ordered by token id, the most likely token always kept; tokens of probability 0 never kept).

    As the host's ``apply_top_p``: only the ``TOP_P_CANDIDATES`` most likely tokens are sorted. The candidates'
    order is exact for every token above the smallest candidate value t (ties by id: sorted by id, then stably by
    value), so a row whose tokens above t hold a mass of at least ``top_p`` has its cut among them, whatever order
    tokens tied at t would take. Rows where they fall short (a flat distribution) try 8 times as many candidates,
    and so on up to a sort of the whole row (one host sync a try)."""
    vocab = x.shape[-1]
    rows = torch.arange(x.shape[0], device=x.device)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # of the whole row
    m = min(TOP_P_CANDIDATES, vocab)
    out = None  # made when some rows need another try: until then ``rows`` is every row
    while rows.numel():
        sub, p, row_lse = (x, top_p, lse) if out is None else (x[rows], top_p[rows], lse[rows])
        if m == vocab:
            if out is None:
                return _top_p_sorted(sub, p)
            out[rows] = _top_p_sorted(sub, p)
            break
        values, ids = _in_sampling_order(*torch.topk(sub, m, dim=-1))  # the m largest (topk orders ties arbitrarily)
        probs = torch.exp(values - row_lse)
        above = (probs * (values > values[:, -1:])).sum(dim=-1)  # the mass above the smallest candidate value
        settled = above >= p
        kept = torch.full_like(sub, -torch.inf).scatter_(1, ids, _nucleus(values, probs, p))
        if bool(settled.all()):  # the usual case (a language model's rows): no copy of the rows that settled
            if out is None:
                return kept
            out[rows] = kept
            break
        if out is None:
            out = torch.full_like(x, -torch.inf)
        out[rows[settled]] = kept[settled]
        rows = rows[~settled]
        m = min(8 * m, vocab)
    assert out is not None  # the loop returns when the first try settles every row
    return out


def _in_sampling_order(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``values`` and their token ``ids`` sorted by value descending, ties by token id."""
    by_id = torch.argsort(ids, dim=-1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = torch.sort(values, dim=-1, descending=True, stable=True).indices  # ties stay in token-id order
    return values.gather(1, by_value), ids.gather(1, by_value)


def _nucleus(values: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``values`` (each row sorted descending, ties by token id; ``probs`` their probabilities in the whole row)
    with those past the row's top-p cut set to -inf."""
    before = torch.cumsum(probs, dim=-1) - probs  # the mass of the strictly more likely tokens
    drop = (before >= top_p[:, None]) | (probs <= 0)  # masked (or underflowed) tokens are never kept
    drop[:, 0] = False  # the most likely token always stays
    return values.masked_fill(drop, -torch.inf)


def _top_p_sorted(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``_top_p`` by a sort of the whole row."""
    values, order = torch.sort(x, dim=-1, descending=True, stable=True)  # ties stay in token-id order
    return torch.empty_like(x).scatter_(1, order, _nucleus(values, torch.softmax(values, dim=-1), top_p))
