"""KVCacheManager: exact block tables, prefix sharing, eviction, and invariants under random interleavings."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trtbuild.runtime.kv_cache_manager import KVCacheManager
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.sequence import Sequence

BS = 4


def make_seq(request_id: str, prompt: list[int], salt: str | None = None) -> Sequence:
    return Sequence(request_id, list(prompt), SamplingParams(), 0, salt)


def run(kv: KVCacheManager, seq: Sequence, num_new: int | None = None) -> bool:
    """Admit (with prefix-cache lookup) or advance ``seq`` by ``num_new`` tokens, as one engine step would."""
    computed, num_hit = kv.get_computed_blocks(seq) if not seq.block_ids else (None, 0)
    num_new = seq.num_tokens - seq.num_computed_tokens - num_hit if num_new is None else num_new
    if not kv.allocate_slots(seq, num_new, computed):
        return False
    seq.num_computed_tokens += num_hit + num_new
    kv.cache_blocks(seq)
    return True


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def test_prefix_sharing_exact_block_ids() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_seq("a", list(range(10)))
    computed, hit = kv.get_computed_blocks(a)
    assert computed.blocks == () and hit == 0
    assert run(kv, a)
    assert a.block_ids == [1, 2, 3]
    assert set(kv.pool.cached) == set(a.block_hashes[:2])  # 10 tokens: two full blocks cached, block 3 partial

    # Same first 8 tokens: shares blocks 1 and 2, gets a fresh block for its 9th token.
    b = make_seq("b", [*range(8), 99])
    computed, hit = kv.get_computed_blocks(b)
    assert hit == 8 and [blk.block_id for blk in computed.blocks] == [1, 2]
    assert run(kv, b) and b.block_ids == [1, 2, 4]
    assert ref_counts(kv)[:5] == [0, 2, 2, 1, 1]

    # A prompt that is exactly two cached blocks hits only one: its last token is recomputed for logits.
    c = make_seq("c", list(range(8)))
    assert kv.get_computed_blocks(c)[1] == 4
    assert run(kv, c) and c.block_ids == [1, 5]
    assert c.num_computed_tokens == 8

    # Another namespace never hits.
    d = make_seq("d", list(range(10)), salt="lora-1")
    assert kv.get_computed_blocks(d)[1] == 0
    assert kv.prefix_cache_queries == 10 + 9 + 8 and kv.prefix_cache_hits == 8 + 4

    # a leaves: its blocks are freed last-first; only block 3 was a's alone.
    kv.free(a)
    assert a.block_ids == [] and ref_counts(kv)[:6] == [0, 2, 1, 0, 1, 1]
    assert [blk.block_id for blk in kv.pool.free_queue] == [6, 7, 8, 9, 3]
    assert kv.num_used_blocks == 4 and kv.usage == 4 / 9


def test_decode_growth_allocates_at_block_boundaries() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_prefix_caching=False)
    s = make_seq("s", [7, 7, 7])
    assert run(kv, s) and s.block_ids == [1]
    for expected in ([1], [1, 2], [1, 2], [1, 2], [1, 2], [1, 2, 3]):
        s.output_token_ids.append(7)
        assert run(kv, s, 1)
        assert s.block_ids == expected
    assert s.num_computed_tokens == 9
    assert not kv.pool.cached  # caching disabled
    assert kv.kv_waste_slots() == 3 * BS - 9


def test_allocate_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_seq("a", list(range(9)))
    assert run(kv, a) and a.block_ids == [1, 2, 3]
    before = (list(a.block_ids), ref_counts(kv), kv.pool.num_free_blocks, a.num_computed_tokens)
    a.output_token_ids += [1, 2, 3, 4]
    assert not kv.allocate_slots(a, 4)  # needs a 4th block
    assert (a.block_ids, ref_counts(kv), kv.pool.num_free_blocks, a.num_computed_tokens) == before


def test_free_cached_hits_count_against_the_free_budget() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_seq("a", list(range(9)))
    assert run(kv, a)
    kv.free(a)
    assert [blk.block_id for blk in kv.pool.free_queue] == [3, 2, 1]
    # 13 tokens: hits blocks 1, 2 (both free) and needs 2 more, but only block 3 is left once the hits are taken.
    b = make_seq("b", [*range(8), 50, 51, 52, 53, 54])
    computed, hit = kv.get_computed_blocks(b)
    assert hit == 8
    assert not kv.allocate_slots(b, 5, computed)
    assert b.block_ids == [] and kv.pool.num_free_blocks == 3 and len(kv.pool.cached) == 2
    # 9 tokens fit: blocks 1, 2 re-hit, block 3 reused.
    c = make_seq("c", [*range(8), 50])
    assert run(kv, c) and c.block_ids == [1, 2, 3]


def test_lru_eviction_then_miss() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a, b = make_seq("a", list(range(9))), make_seq("b", list(range(100, 108)))
    assert run(kv, a) and run(kv, b)
    assert a.block_ids == [1, 2, 3] and b.block_ids == [4, 5]
    kv.free(a)  # a freed first: its blocks are evicted first, tail first
    kv.free(b)
    assert [blk.block_id for blk in kv.pool.free_queue] == [3, 2, 1, 5, 4]
    c = make_seq("c", list(range(200, 209)))
    assert run(kv, c) and c.block_ids == [3, 2, 1]  # evicts a's cached blocks 2 and 1
    assert kv.get_computed_blocks(make_seq("a2", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_seq("b2", list(range(100, 109))))[1] == 8
    assert kv.kv_waste_slots() == 3 * BS - 9


def run_windowed(kv: KVCacheManager, seq: Sequence, num_new: int | None = None) -> bool:
    """``run`` as the scheduler plans a step with a KV window: release the blocks outside the window first."""
    kv.free_outside_window(seq)
    return run(kv, seq, num_new)


def test_window_releases_blocks_and_reuses_them() -> None:
    # Window 6, blocks of 4, 3 usable blocks: a 20-token prompt in chunks of 4 never holds more than 3 blocks.
    kv = KVCacheManager(num_blocks=4, block_size=BS, window=6)
    stored: list[tuple[int, bytes]] = []  # what the KV offload would store: every full block, before its release
    kv.on_block_cached = lambda block_id, block_hash: stored.append((block_id, block_hash))
    a = make_seq("a", list(range(20)))
    tables, held = [], []
    for _ in range(5):
        assert run_windowed(kv, a, 4)
        tables.append(list(a.block_ids))
        held.append(kv.num_used_blocks)
    assert tables == [
        [1],
        [1, 2],
        [1, 2, 3],
        [0, 2, 3, 1],  # next position 12 reads 7..15: block 1 (0..3) is released and reused for 12..15
        [0, 0, 3, 1, 2],  # next position 16 reads 11..19: block 2 (4..7) likewise
    ]
    assert held == [1, 2, 3, 3, 3] and max(held) <= kv.max_blocks_held(20, 4) == 3
    assert stored == list(zip([1, 2, 3, 1, 2], a.block_hashes, strict=True))
    assert kv.num_held_blocks(a) == 3 and ref_counts(kv) == [0, 1, 1, 1]
    # Each full block was registered once computed; reusing blocks 1 and 2 evicted their old prefixes.
    assert [kv.pool.cached[h].block_id for h in a.block_hashes[2:5]] == [3, 1, 2]
    assert len(kv.pool.cached) == 3 and kv.kv_waste_slots() == 0
    kv.free(a)
    assert a.block_ids == [] and kv.num_used_blocks == 0 and [b.block_id for b in kv.pool.free_queue] == [2, 1, 3]


def test_window_release_of_a_shared_block_drops_one_reference() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, window=5)
    a, b = make_seq("a", list(range(9))), make_seq("b", [*range(4), 50, 51, 52, 53, 54])
    assert run(kv, a) and run(kv, b)
    assert a.block_ids == [1, 2, 3] and b.block_ids == [1, 4, 5]  # b shares block 1 (tokens 0..3)
    assert kv.free_outside_window(a) == 1  # next position 9 reads 5..9: block 1 (0..3) is out
    assert a.block_ids == [0, 2, 3] and ref_counts(kv)[:6] == [0, 1, 1, 1, 1, 1]
    assert kv.free_outside_window(a) == 0  # nothing more until a advances
    assert kv.pool.num_free_blocks == 4  # block 1 is still b's
    assert kv.free_outside_window(b) == 1
    assert b.block_ids == [0, 4, 5] and kv.pool.blocks[1].ref_cnt == 0 and kv.pool.num_free_blocks == 5
    assert [blk.block_id for blk in kv.pool.free_queue][-1] == 1 and kv.pool.blocks[1].block_hash is not None
    kv.free(a)
    kv.free(b)
    assert kv.num_used_blocks == 0


def test_window_released_block_serves_another_request() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, window=4)
    a, b, c = make_seq("a", list(range(8))), make_seq("b", [20, 21, 22, 23]), make_seq("c", [30, 31])
    assert run(kv, a) and run(kv, b) and (a.block_ids, b.block_ids) == ([1, 2], [3])
    assert kv.pool.num_free_blocks == 0 and not kv.allocate_slots(c, 2)
    assert kv.free_outside_window(a) == 1  # a's next position 8 reads 5..8: block 1 is out
    assert run(kv, c) and c.block_ids == [1]  # ... and c computes into it, evicting a's first prefix block
    assert kv.pool.get_cached_block(a.block_hashes[0]) is None and a.block_ids == [0, 2]


def test_window_hits_before_the_window_are_not_taken() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, window=6)
    a = make_seq("a", list(range(18)))
    assert run(kv, a) and a.block_ids == [1, 2, 3, 4, 5]
    kv.free(a)
    # Same 16 leading tokens: four hits; the first new position is 16, reading 11..16, so hits 1 and 2 are null.
    b = make_seq("b", [*range(16), 60, 61])
    computed, hit = kv.get_computed_blocks(b)
    assert hit == 16 and [blk.block_id for blk in computed.blocks] == [0, 0, 3, 4]
    assert run(kv, b)
    assert b.block_ids == [0, 0, 3, 4, 6] and b.num_computed_tokens == 18
    assert ref_counts(kv)[:7] == [0, 0, 0, 1, 1, 0, 1]  # blocks 1 and 2 stay free (and cached)
    assert kv.pool.blocks[1].block_hash == b.block_hashes[0]
    assert kv.prefix_cache_hits == 16 and kv.num_held_blocks(b) == 3
    # A full pool but for the hits before the window still admits: only the hits read count.
    kv2 = KVCacheManager(num_blocks=4, block_size=BS, window=6)
    a2 = make_seq("a", list(range(12)))
    assert run(kv2, a2) and a2.block_ids == [1, 2, 3]  # 3 blocks registered
    kv2.free(a2)
    c = make_seq("c", list(range(13)))  # 3 hits and a 4th block: fits only as the first hit is not taken
    computed, hit = kv2.get_computed_blocks(c)
    assert hit == 12 and kv2.allocate_slots(c, 1, computed)
    assert c.block_ids == [0, 2, 3, 1]  # 12 - 6 + 1 = 7: block 1 (0..3) skipped, then evicted for position 12


def test_window_lookup_needs_only_the_blocks_the_first_step_reads() -> None:
    # 4 usable blocks, window 6: a 20-token prompt in chunks of 4 reuses its own released block 1, so the prefix of
    # its first block is evicted; a later request with the same prompt still hits all 20 tokens, as position 20
    # reads only 15..20 (blocks 3 and 4).
    kv = KVCacheManager(num_blocks=5, block_size=BS, window=6)
    a = make_seq("a", list(range(20)))
    for _ in range(5):
        assert run_windowed(kv, a, 4)
    assert a.block_ids == [0, 0, 3, 4, 1] and kv.pool.get_cached_block(a.block_hashes[0]) is None
    kv.free(a)
    b = make_seq("b", [*range(20), 99])
    computed, hit = kv.get_computed_blocks(b)
    assert hit == 20 and [blk.block_id for blk in computed.blocks] == [0, 0, 0, 4, 1]
    assert run(kv, b, 1) and b.block_ids == [0, 0, 0, 4, 1, 2]
    assert kv.num_held_blocks(b) == 3 and kv.prefix_cache_hits == 20
    # Without a window the same cache state is a miss: the chain's first block is gone.
    assert KVCacheManager(num_blocks=5, block_size=BS).get_computed_blocks(make_seq("c", [*range(20), 99]))[1] == 0


def test_window_lookup_stops_at_a_gap_inside_the_window() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS, window=6)
    a = make_seq("a", list(range(20)))
    assert run(kv, a) and a.block_ids == [1, 2, 3, 4, 5]
    kv.free(a)  # free queue [5, 4, 3, 2, 1]

    def evict(block_id: int) -> None:  # evict one free cached block, keeping the others
        keep = [blk for blk in kv.pool.free_queue if blk.block_id != block_id]
        kv.pool.touch(keep)
        [taken] = kv.pool.get_new_blocks(1)
        kv.pool.free_blocks([taken, *keep])

    def lookup() -> tuple[int, list[int]]:
        computed, hit = kv.get_computed_blocks(make_seq("q", [*range(20), 99]))
        return hit, [blk.block_id for blk in computed.blocks]

    evict(3)  # tokens 8..11: before the window of position 20, which reads 15..20
    assert lookup() == (20, [0, 0, 0, 4, 5])
    evict(4)  # tokens 12..15: inside it; the longest end left whose window is cached is 8 (it reads 3..8)
    assert lookup() == (8, [1, 2])


def test_max_blocks_held_bound() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=16, window=512)
    assert kv.max_blocks_held(4096, 1) == 33  # a decode: positions p - 511 .. p meet at most 33 blocks
    assert kv.max_blocks_held(4096, 16) == kv.max_blocks_held(4096, 18) == 34 == 512 // 16 + 2
    assert kv.max_blocks_held(4096, 19) == 35
    assert kv.max_blocks_held(4096, 4096) == 256  # one chunk of everything holds it all
    assert kv.max_blocks_held(100, 1) == 7  # short requests hold what they have
    assert KVCacheManager(num_blocks=2, block_size=16).max_blocks_held(4096, 1) == 256
    # The bound is tight: a step of n tokens from position c meets max(0, c - 511) .. c + n - 1.
    for n in (1, 5, 16, 17, 18, 40):
        worst = max(-(-(c + n) // 16) - max(0, c - 511) // 16 for c in range(0, 4096 - n))
        assert worst == kv.max_blocks_held(4096, n)


SHARED = [5, 6, 7, 8, 5, 6, 7, 8]  # prompts start with a piece of this, so prefixes are often shared


class CacheMachine(RuleBasedStateMachine):
    """Random interleavings of admit / step / decode / preempt / finish against a simulated cache of token ids."""

    WINDOW: int | None = None  # the manager's KV window

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=7, block_size=2, window=self.WINDOW)
        self.slots: dict[int, int] = {}  # simulated cache: slot -> token id written there
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}  # every hash seen -> the token prefix it stands for
        self.count = 0

    def _write(self, seq: Sequence, start: int, stop: int) -> None:
        bs = self.kv.block_size
        for p in range(start, stop):
            block = self.kv.pool.blocks[seq.block_ids[p // bs]]
            assert block.ref_cnt == 1 and block.block_hash is None  # never write a shared or cached block
            self.slots[block.block_id * bs + p % bs] = seq.token_ids(p, p + 1)[0]

    def _advance(self, seq: Sequence, num_new: int) -> bool:
        self.kv.free_outside_window(seq)
        start = seq.num_computed_tokens
        if not self.kv.allocate_slots(seq, num_new):
            return False
        self._write(seq, start, start + num_new)
        seq.num_computed_tokens += num_new
        self.kv.cache_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(seq.num_tokens % 3)  # a "sampled" token
        return True

    @rule(
        shared=st.integers(0, len(SHARED)),
        tail=st.lists(st.integers(0, 2), max_size=4),
        salt=st.sampled_from([None, None, "x"]),
    )
    def add(self, shared: int, tail: list[int], salt: str | None) -> None:
        self.count += 1
        self.waiting.append(make_seq(f"r{self.count}", [*SHARED[:shared], *tail] or [0], salt))

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 8))
    def admit(self, pick: int, chunk: int) -> None:
        seq = self.waiting[pick % len(self.waiting)]
        computed, hit = self.kv.get_computed_blocks(seq)
        assert hit < seq.num_tokens and hit % self.kv.block_size == 0
        num_new = min(chunk, seq.num_tokens - hit)
        if not self.kv.allocate_slots(seq, num_new, computed):
            assert not seq.block_ids
            return
        self.waiting.remove(seq)
        self.running.append(seq)
        bs = self.kv.block_size
        for p in range(hit):  # the hit blocks it took hold exactly this request's tokens
            if seq.block_ids[p // bs] != 0:
                assert self.slots[seq.block_ids[p // bs] * bs + p % bs] == seq.token_ids(p, p + 1)[0]
        seq.num_computed_tokens = hit
        self._write(seq, hit, hit + num_new)
        seq.num_computed_tokens += num_new
        self.kv.cache_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(seq.num_tokens % 3)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 8))
    def step(self, pick: int, chunk: int) -> None:
        seq = self.running[pick % len(self.running)]
        self._advance(seq, min(chunk, seq.num_tokens - seq.num_computed_tokens))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def preempt(self, pick: int) -> None:
        seq = self.running.pop(pick % len(self.running))
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        self.waiting.insert(0, seq)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def finish(self, pick: int) -> None:
        self.kv.free(self.running.pop(pick % len(self.running)))

    @invariant()
    def blocks_are_owned_exactly_once(self) -> None:
        pool = self.kv.pool
        owners = [0] * pool.num_blocks
        for seq in self.running:
            # the released entries are the leading ones, all of them wholly before the window
            num_null = len(seq.block_ids) - self.kv.num_held_blocks(seq)
            assert num_null <= self.kv.num_blocks_outside_window(seq.num_computed_tokens)
            held = seq.block_ids[num_null:]
            assert seq.block_ids[:num_null] == [0] * num_null and len(set(held)) == len(held) and 0 not in held
            assert len(seq.block_ids) == self.kv.num_blocks_for(seq.num_computed_tokens)
            for b in held:
                owners[b] += 1
        for seq in self.waiting:
            assert seq.block_ids == [] and seq.num_computed_tokens == 0
        assert [b.ref_cnt for b in pool.blocks] == owners
        free = [b.block_id for b in pool.free_queue]
        assert len(free) == len(set(free)) == pool.num_free_blocks
        assert set(free) == {b for b in range(1, pool.num_blocks) if owners[b] == 0}
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks - 1
        # kv_waste_slots (one pass per sequence) equals its definition block by block: allocated slots minus
        # each block's fill, as far as its fullest owner
        bs = self.kv.block_size
        filled: dict[int, int] = {}
        for seq in self.running:
            for i, b in enumerate(seq.block_ids):
                if b == 0:
                    continue
                filled[b] = max(filled.get(b, 0), min(bs, max(0, seq.num_computed_tokens - i * bs)))
        assert self.kv.kv_waste_slots() == pool.num_used_blocks * bs - sum(filled.values())

    @invariant()
    def cache_holds_what_it_claims(self) -> None:
        bs = self.kv.block_size
        for seq in self.running + self.waiting:
            for i, h in enumerate(seq.block_hashes):
                assert self.prefix_of.setdefault(h, tuple(seq.token_ids(0, (i + 1) * bs))) == tuple(
                    seq.token_ids(0, (i + 1) * bs)
                )
        hashed = {b.block_id for b in self.kv.pool.blocks if b.block_hash is not None}
        assert hashed == {b.block_id for b in self.kv.pool.cached.values()}
        for h, block in self.kv.pool.cached.items():
            assert block.block_hash == h
            content = tuple(self.slots[block.block_id * bs + o] for o in range(bs))
            assert content == self.prefix_of[h][-bs:]
        for seq in self.running:  # every computed position still held reads back its own token
            for p in range(seq.num_computed_tokens):
                if seq.block_ids[p // bs] != 0:
                    assert self.slots[seq.block_ids[p // bs] * bs + p % bs] == seq.token_ids(p, p + 1)[0]


CacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_cache_machine = CacheMachine.TestCase


class WindowCacheMachine(CacheMachine):
    """The same interleavings with a KV window of 3 positions (blocks of 2): blocks are released as requests run."""

    WINDOW = 3


WindowCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_window_cache_machine = WindowCacheMachine.TestCase
