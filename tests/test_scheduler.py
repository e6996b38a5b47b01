"""Scheduler: continuous batching, chunked prefill, preemption, FCFS, abort, stop conditions, rejection.

The scheduler is driven by ``FakeModel``, a tiny test driver over ``StepBatch`` (the real engine is tested
elsewhere): it writes each step's token ids into a simulated cache through the block tables and predicts the next
token from every earlier token read back through the block table. So a wrong block table, a bad prefix-cache hit or
a lost token changes the output, which the tests compare with a plain reference loop. With a KV window W it reads
only the last W positions (as a sliding-window model), so a block released too early is read as never written.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtbuild.errors import RequestError
from trtbuild.runtime.batch import StepBatch
from trtbuild.runtime.kv_cache_manager import KVCacheManager
from trtbuild.runtime.sampling import Sampler, SamplingParams
from trtbuild.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from trtbuild.runtime.sequence import FinishReason, RequestStatus, Sequence

VOCAB = 32


def next_token(context: list[int]) -> int:
    """The fake model's greedy prediction: depends on every token and on the position."""
    return (sum((i + 1) * t for i, t in enumerate(context)) + 7 * len(context)) % VOCAB


def reference(prompt: list[int], max_tokens: int, window: int | None = None) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens if window is None else tokens[-window:]))
    return tokens[len(prompt) :]


class FakeModel:
    """Test driver: a step writes token ids into a slot array and reads each sequence's context back (the last
    ``window`` positions only, when given)."""

    def __init__(
        self, num_blocks: int, block_size: int, random_logits: bool = False, window: int | None = None
    ) -> None:
        self.block_size = block_size
        self.slots = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.random_logits = random_logits
        self.window = window

    def step(self, batch: StepBatch) -> np.ndarray:
        bs, qsl, tables = self.block_size, batch.query_start_loc, batch.block_tables
        seq_of = np.repeat(np.arange(batch.num_seqs), np.diff(qsl))
        slots = tables[seq_of, batch.positions // bs] * bs + batch.positions % bs
        written = [set((slots[qsl[b] : qsl[b + 1]] // bs).tolist()) for b in range(batch.num_seqs)]
        for b in range(batch.num_seqs):
            assert 0 not in written[b], "a step wrote the null block"
            for c in range(batch.num_seqs):  # no other sequence may hold a block written this step
                assert c == b or not written[c] & set(tables[b].tolist()), "a shared block was written"
        self.slots[slots] = batch.input_ids
        logits = np.zeros((len(batch.logits_indices), VOCAB), dtype=np.float32)
        for row, t in enumerate(batch.logits_indices):
            b, p = int(seq_of[t]), int(batch.positions[t])
            q = np.arange(0 if self.window is None else max(0, p - self.window + 1), p + 1)
            context = self.slots[tables[b, q // bs] * bs + q % bs].tolist()
            assert -1 not in context, "read a slot never written"
            if self.random_logits:
                logits[row] = np.random.default_rng(context).standard_normal(VOCAB)
            else:
                logits[row, next_token(context)] = 1.0
        return logits


def make(num_blocks: int = 64, block_size: int = 4, seqs: int = 8, tokens: int = 64, max_len: int = 64, **kw):
    config = SchedulerConfig(seqs, tokens, max_len, block_size, num_blocks, **kw)
    return Scheduler(config), FakeModel(num_blocks, block_size, window=config.kv_window)


def make_with(config: SchedulerConfig) -> tuple[Scheduler, FakeModel]:
    return Scheduler(config), FakeModel(config.num_blocks, config.block_size, window=config.kv_window)


def step(sched: Scheduler, model: FakeModel, sampler: Sampler | None = None) -> tuple[SchedulerOutput, list]:
    out = sched.schedule()
    assert not out.is_empty
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(out.scheduled) <= sched.config.max_num_seqs
    logits = model.step(out.to_step_batch())
    if sampler is None:
        tokens = logits[out.sample_rows].argmax(axis=1).tolist()
    else:
        tokens = sampler.sample(logits[out.sample_rows], out.sample_seqs).token_ids
    return out, sched.update_from_output(out, tokens)


def drain(
    sched: Scheduler, model: FakeModel, sampler: Sampler | None = None, limit: int = 2000
) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched, model, sampler)[0])
        assert len(outs) < limit
    assert sched.kv_cache.num_used_blocks == 0 and not sched.running and not sched.waiting
    return outs


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(seq.request_id, n) for seq, n in out.scheduled]


def test_requests_join_and_leave_the_running_batch() -> None:
    sched, model = make()
    a = sched.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    b = sched.add_request("b", [4, 5], SamplingParams(temperature=0, max_tokens=4))
    assert plan(step(sched, model)[0]) == [("a", 3), ("b", 2)]
    c = sched.add_request("c", [6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=1))
    out, finished = step(sched, model)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 4)]
    assert finished == [a, c] and a.finish_reason is FinishReason.LENGTH
    assert plan(step(sched, model)[0]) == [("b", 1)]
    drain(sched, model)
    for seq, n in ((a, 2), (b, 4), (c, 1)):
        assert seq.output_token_ids == reference(seq.prompt_token_ids, n)
    assert b.status is RequestStatus.FINISHED_LENGTH and b.block_ids == []


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched, model = make(tokens=8)
    a = sched.add_request("a", [1, 2], SamplingParams(temperature=0, max_tokens=5))
    assert plan(step(sched, model)[0]) == [("a", 2)]
    b = sched.add_request("b", list(range(20)), SamplingParams(temperature=0, max_tokens=3))
    outs = [step(sched, model)[0] for _ in range(4)]
    assert [plan(o) for o in outs] == [
        [("a", 1), ("b", 7)],
        [("a", 1), ("b", 7)],
        [("a", 1), ("b", 6)],  # b's last chunk reaches its last token: it is sampled
        [("a", 1), ("b", 1)],
    ]
    assert [o.sample_rows for o in outs] == [[0], [0], [0, 1], [0, 1]]
    assert b.num_computed_tokens == 21 and b.num_output_tokens == 2
    drain(sched, model)
    assert a.output_token_ids == reference([1, 2], 5)
    assert b.output_token_ids == reference(list(range(20)), 3)


def test_step_batch_carries_positions_and_block_tables() -> None:
    sched, _ = make(block_size=2)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    sched.add_request("b", [4], SamplingParams(max_tokens=2))
    batch = sched.schedule().to_step_batch()
    assert batch.input_ids.tolist() == [1, 2, 3, 4]
    assert batch.positions.tolist() == [0, 1, 2, 0]
    assert batch.query_start_loc.tolist() == [0, 3, 4]
    assert batch.block_tables.tolist() == [[1, 2], [3, 0]]  # padded with the null block
    assert batch.logits_indices.tolist() == [2, 3]


def test_preemption_recomputes_and_everything_completes() -> None:
    # 6 usable blocks of 4: three requests of up to 11 tokens (3 blocks each) cannot all run at once.
    sched, model = make(num_blocks=7, block_size=4, seqs=3, enable_prefix_caching=False)
    seqs = [sched.add_request(f"r{i}", [i + 1] * 3, SamplingParams(temperature=0, max_tokens=9)) for i in range(3)]
    outs = drain(sched, model)
    assert sched.num_preemptions > 0
    assert sum(s.num_preemptions for s in seqs) == sched.num_preemptions
    first_victim = next(o for o in outs if o.preempted).preempted[0]
    assert first_victim is seqs[2]  # the most recently admitted goes first
    for s in seqs:
        assert s.output_token_ids == reference(s.prompt_token_ids, 9)
        assert s.finish_reason is FinishReason.LENGTH


def test_preempted_request_goes_to_the_front_of_waiting() -> None:
    sched, model = make(num_blocks=5, block_size=2, seqs=4)
    sched.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    b = sched.add_request("b", [4, 5, 6], SamplingParams(temperature=0, max_tokens=4))
    step(sched, model)  # both run: 2 blocks each, pool full
    sched.add_request("c", [7], SamplingParams(temperature=0, max_tokens=1))
    assert plan(step(sched, model)[0]) == [("a", 1), ("b", 1)]  # c does not fit yet
    out, _ = step(sched, model)  # a needs a third block: b is preempted
    assert out.preempted == [b] and plan(out) == [("a", 1)]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
    drain(sched, model)
    assert b.output_token_ids == reference([4, 5, 6], 4)


def test_fcfs_admission_order() -> None:
    sched, model = make(num_blocks=9, block_size=4, seqs=2, tokens=16)
    seqs = [sched.add_request(f"r{i}", [i] * (i + 2), SamplingParams(temperature=0, max_tokens=3)) for i in range(6)]
    first_step: dict[str, int] = {}
    for n, out in enumerate(drain(sched, model)):
        for seq, _ in out.scheduled:
            first_step.setdefault(seq.request_id, n)
    assert [first_step[s.request_id] for s in seqs] == sorted(first_step.values())


def test_prefix_cache_hit_in_the_scheduler() -> None:
    sched, model = make(block_size=4)
    prompt = list(range(1, 11))
    a = sched.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=3))
    drain(sched, model)
    b = sched.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=3))
    assert plan(sched.schedule()) == [("b", 2)]  # 8 of 10 prompt tokens came from the cache
    assert b.num_cached_tokens == 8
    assert sched.kv_cache.prefix_cache_hits == 8 and sched.kv_cache.prefix_cache_queries == 20
    drain(sched, model)
    assert b.output_token_ids == a.output_token_ids == reference(prompt, 3)


def test_requests_arriving_together_compute_their_shared_prefix_once() -> None:
    # Three requests over a 12-token shared prefix (blocks of 4) arrive in one step. The first computes the prefix;
    # the others wait until it is cached and then compute only the rest (in-batch prefix sharing), in arrival order,
    # while "d", which shares nothing, waits behind them (FCFS). In chunks of 8 the wait follows the first's chunks.
    shared = list(range(1, 13))
    for tokens, plans in (
        (64, [[("a", 14)], [("a", 1), ("b", 3), ("c", 4), ("d", 5)]]),
        (8, [[("a", 8)], [("a", 6)], [("a", 1), ("b", 3), ("c", 4)]]),
    ):
        sched, model = make(block_size=4, tokens=tokens)
        params = SamplingParams(temperature=0, max_tokens=3)
        prompts = {"a": [*shared, 20, 21], "b": [*shared, 22, 23, 24], "c": [*shared, 25, 26, 27, 28], "d": [9] * 5}
        seqs = {name: sched.add_request(name, prompt, params) for name, prompt in prompts.items()}
        assert [plan(step(sched, model)[0]) for _ in plans] == plans
        drain(sched, model)
        assert seqs["b"].num_cached_tokens == seqs["c"].num_cached_tokens == 12
        for name, prompt in prompts.items():
            assert seqs[name].output_token_ids == reference(prompt, 3)


def test_abort_waiting_and_running() -> None:
    sched, model = make(seqs=1)
    a = sched.add_request("a", [1, 2], SamplingParams(temperature=0, max_tokens=5))
    b = sched.add_request("b", [3, 4], SamplingParams(temperature=0, max_tokens=5))
    c = sched.add_request("c", [5, 6], SamplingParams(temperature=0, max_tokens=2))
    step(sched, model)
    assert sched.abort("a") and sched.abort("b")
    assert not sched.abort("a") and not sched.abort("nope")
    assert a.finish_reason is FinishReason.ABORT and b.status is RequestStatus.FINISHED_ABORTED
    assert sched.kv_cache.num_used_blocks == 0
    drain(sched, model)
    assert c.output_token_ids == reference([5, 6], 2)


def test_abort_between_schedule_and_update() -> None:
    sched, model = make()
    a = sched.add_request("a", [1, 2], SamplingParams(temperature=0, max_tokens=5))
    b = sched.add_request("b", [3], SamplingParams(temperature=0, max_tokens=2))
    out = sched.schedule()
    logits = model.step(out.to_step_batch())
    sched.abort("a")
    assert sched.update_from_output(out, logits[out.sample_rows].argmax(1).tolist()) == []
    assert a.output_token_ids == [] and b.output_token_ids == reference([3], 1)


def test_stop_conditions() -> None:
    config = SchedulerConfig(8, 64, 12, 4, 32, eos_token_ids=(reference([1], 1)[0],))
    seen: list[int] = []

    def hook(seq: Sequence) -> str | None:
        seen.append(seq.output_token_ids[-1])
        return "STOP" if seq.request_id == "s" and seq.num_output_tokens == 2 else None

    sched, model = Scheduler(config, stop_hook=hook), FakeModel(32, 4)
    eos = sched.add_request("eos", [1], SamplingParams(temperature=0, max_tokens=5))
    ign = sched.add_request("ign", [1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    stop_id = reference([2], 2)[1]
    tok = sched.add_request("tok", [2], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop_id]))
    s = sched.add_request("s", [3], SamplingParams(temperature=0, max_tokens=5, stop=["STOP"]))
    full = sched.add_request("full", [4, 5], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    drain(sched, model)
    assert eos.finish_reason is FinishReason.STOP and eos.num_output_tokens == 1 and eos.stop_reason is None
    assert ign.finish_reason is FinishReason.LENGTH and ign.num_output_tokens == 3
    assert tok.finish_reason is FinishReason.STOP and tok.stop_reason == stop_id and tok.num_output_tokens == 2
    assert s.finish_reason is FinishReason.STOP and s.stop_reason == "STOP" and s.num_output_tokens == 2
    assert full.finish_reason is FinishReason.LENGTH and full.num_tokens == 12  # max_seq_len
    assert len(seen) == sum(q.num_output_tokens for q in (eos, ign, tok, s, full))


def test_invalid_requests_are_rejected_without_disturbing_others() -> None:
    sched, model = make(num_blocks=5, block_size=4, max_len=32)  # 4 usable blocks: 16 slots
    a = sched.add_request("a", [1, 2], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(RequestError, match="exceeds the engine's max_seq_len"):
        sched.add_request("long", [1] * 30, SamplingParams(max_tokens=3))
    with pytest.raises(RequestError, match="leaves no room"):
        sched.add_request("full", [1] * 32, SamplingParams(max_tokens=None))
    with pytest.raises(RequestError, match="need 5 KV-cache blocks"):
        sched.add_request("big", [1] * 18, SamplingParams(max_tokens=3))
    with pytest.raises(RequestError, match="prompt is empty"):
        sched.add_request("empty", [], SamplingParams())
    with pytest.raises(RequestError, match="already in use"):
        sched.add_request("a", [1], SamplingParams())
    assert list(sched.requests) == ["a"] and list(sched.waiting) == [a]
    drain(sched, model)
    assert a.output_token_ids == reference([1, 2], 3)


def test_seeded_sampling_is_independent_of_batching_and_preemption() -> None:
    def run(num_blocks: int, seqs: int, tokens: int) -> list[list[int]]:
        config = SchedulerConfig(seqs, tokens, 64, 2, num_blocks, enable_prefix_caching=False)
        sched, model = Scheduler(config), FakeModel(num_blocks, 2, random_logits=True)
        reqs = [
            sched.add_request(f"r{i}", [i, i + 1, i + 2], SamplingParams(temperature=0.8, top_p=0.9, seed=i))
            for i in range(5)
        ]
        drain(sched, model, Sampler(seed=0))
        if num_blocks < 20:
            assert sched.num_preemptions > 0
        return [r.output_token_ids for r in reqs]

    assert run(200, 8, 64) == run(12, 3, 5)


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 12), st.integers(1, 8), st.integers(0, 6)), min_size=1, max_size=8
    ),
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 12),
    seqs=st.integers(1, 5),
    tokens=st.integers(1, 24),
    caching=st.booleans(),
    window=st.sampled_from([None, None, 1, 2, 3, 5, 8]),
)
def test_random_workloads_all_complete_correctly(
    requests: list[tuple[int, int, int, int]],
    block_size: int,
    extra_blocks: int,
    seqs: int,
    tokens: int,
    caching: bool,
    window: int | None,
) -> None:
    """Requests (shared-prefix kind, prompt length, max_tokens, arrival step) under random limits, with or without a
    KV window; the pool is as small as the largest request's footprint allows, plus ``extra_blocks``."""
    bound = KVCacheManager(2, block_size, window=window).max_blocks_held
    need = max(bound(n + m - 1, tokens) for _, n, m, _ in requests)
    num_blocks = 1 + need + extra_blocks
    config = SchedulerConfig(seqs, tokens, 32, block_size, num_blocks, enable_prefix_caching=caching, kv_window=window)
    sched, model = make_with(config)
    pending = sorted(enumerate(requests), key=lambda r: r[1][3])
    added: list[tuple[Sequence, int]] = []
    n_step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][1][3] <= n_step:
            i, (kind, n, m, _) = pending.pop(0)
            prompt = [(kind * 5 + j) % VOCAB for j in range(n)]
            added.append((sched.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=m)), m))
        if sched.has_unfinished():
            step(sched, model)
        n_step += 1
        assert n_step < 1000
    assert sched.kv_cache.num_used_blocks == 0
    for seq, m in added:
        assert seq.output_token_ids == reference(seq.prompt_token_ids, m, window)
        assert seq.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("tokens", [16, 64])
def test_window_4096_token_sequence_holds_a_bounded_number_of_blocks(tokens: int) -> None:
    # W 512, blocks of 16: a 4,000-token prompt in chunks of `tokens`, then 96 decodes, in a pool of exactly the
    # bound (34 blocks for chunks of 16). Without the window it would need 256 blocks and be rejected.
    bound = {16: 34, 64: 37}[tokens]
    config = SchedulerConfig(1, tokens, 4096, 16, 1 + bound, kv_window=512)
    sched, model = make_with(config)
    assert sched.kv_cache.max_blocks_held(4095, tokens) == bound
    seq = sched.add_request(
        "long", [(7 * i) % VOCAB for i in range(4000)], SamplingParams(temperature=0, max_tokens=96)
    )
    held, decode_held = [], []
    while sched.has_unfinished():
        out = sched.schedule()
        batch = out.to_step_batch()
        [(_, n)] = out.scheduled
        held.append(sched.kv_cache.num_used_blocks)
        if n == 1:
            decode_held.append(held[-1])
        # the entries before the window of the step's first token are the null block, the others real blocks
        row, first = batch.block_tables[0], max(0, int(batch.positions[0]) - 511) // 16
        assert (row[:first] == 0).all() and (row[first:] != 0).all()
        logits = model.step(batch)
        sched.update_from_output(out, logits[out.sample_rows].argmax(1).tolist())
    assert len(held) == -(-4000 // tokens) + 95  # the last prefill chunk samples the first token
    assert max(held) <= bound and max(decode_held) == 33  # ceil((512 - 1) / 16) + 1
    assert sched.num_preemptions == 0
    assert seq.output_token_ids == reference(seq.prompt_token_ids, 96, window=512)
    with pytest.raises(RequestError, match="need 256 KV-cache blocks"):
        make_with(SchedulerConfig(1, tokens, 4096, 16, 1 + bound))[0].add_request(
            "full", [1] * 4000, SamplingParams(max_tokens=96)
        )


def test_window_released_blocks_serve_other_requests() -> None:
    # Window 8, blocks of 4, 10 usable blocks: two 40-token prompts (12 blocks each over their lives) run side by
    # side without preemption, each holding at most 5 blocks, and reuse each other's released blocks.
    sched, model = make(num_blocks=11, block_size=4, seqs=2, tokens=8, kv_window=8)
    a = sched.add_request("a", [1 + i % 5 for i in range(40)], SamplingParams(temperature=0, max_tokens=8))
    b = sched.add_request("b", [2 + i % 7 for i in range(40)], SamplingParams(temperature=0, max_tokens=8))
    last_holder: dict[int, str] = {}  # block id -> the request that held it at the latest step
    handovers = 0  # blocks one request released and the other then held (the prompts share no block)
    while sched.has_unfinished():
        out, _ = step(sched, model)
        for seq, _ in out.scheduled:
            assert sched.kv_cache.num_held_blocks(seq) <= 5
            for block in set(seq.block_ids) - {0}:
                handovers += last_holder.get(block, seq.request_id) != seq.request_id
                last_holder[block] = seq.request_id
    assert handovers > 0 and sched.num_preemptions == 0
    assert a.output_token_ids == reference(a.prompt_token_ids, 8, window=8)
    assert b.output_token_ids == reference(b.prompt_token_ids, 8, window=8)


def test_window_prefix_cache_hit_enters_null_blocks() -> None:
    sched, model = make(block_size=4, kv_window=6)
    prompt = list(range(1, 19))
    a = sched.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=3))
    drain(sched, model)
    b = sched.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=3))
    out = sched.schedule()
    assert plan(out) == [("b", 2)] and b.num_cached_tokens == 16
    # positions 16, 17 read from 11: a's first two cached blocks are not taken
    assert out.to_step_batch().block_tables.tolist() == [[0, 0, *b.block_ids[2:]]] and 0 not in b.block_ids[2:]
    assert sched.kv_cache.num_held_blocks(b) == 3
    logits = model.step(out.to_step_batch())
    sched.update_from_output(out, logits[out.sample_rows].argmax(1).tolist())
    drain(sched, model)
    assert b.output_token_ids == a.output_token_ids == reference(prompt, 3, window=6)


def test_window_preemption_and_abort() -> None:
    # 4 usable blocks of 4, window 8: three 4-token prompts start with a block each; their second blocks do not all
    # fit, so the last admitted is preempted; later each holds at most 3 blocks as the window releases the first.
    sched, model = make(num_blocks=5, block_size=4, seqs=3, tokens=12, kv_window=8)
    seqs = [
        sched.add_request(f"r{i}", [i + 1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=12)) for i in range(3)
    ]
    assert plan(step(sched, model)[0]) == [("r0", 4), ("r1", 4), ("r2", 4)]
    out, _ = step(sched, model)
    assert out.preempted == [seqs[2]] and plan(out) == [("r0", 1), ("r1", 1)]
    for _ in range(8):
        step(sched, model)
    r0 = seqs[0]
    assert r0.block_ids[0] == 0 and sched.kv_cache.num_held_blocks(r0) == len(r0.block_ids) - 1
    assert sched.abort("r0")  # a request with released entries leaves cleanly
    assert r0.block_ids == [] and r0.finish_reason is FinishReason.ABORT
    drain(sched, model)
    assert sched.num_preemptions >= 1
    for s in seqs[1:]:
        assert s.output_token_ids == reference(s.prompt_token_ids, 12, window=8)


def test_window_longer_than_every_request_changes_nothing() -> None:
    def plans(kv_window: int | None) -> tuple[list, list]:
        sched, model = make(num_blocks=9, block_size=4, seqs=3, tokens=6, kv_window=kv_window)
        seqs = [sched.add_request(f"r{i}", [i + 1] * (3 + 4 * i), SamplingParams(max_tokens=6)) for i in range(3)]
        tables = []
        while sched.has_unfinished():
            out, _ = step(sched, model)
            tables.append((plan(out), out.to_step_batch().block_tables.tolist()))
        return tables, [s.output_token_ids for s in seqs]

    assert plans(64) == plans(None)
