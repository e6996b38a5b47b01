"""Continuous batching (nano-vllm / vLLM v1 style): which requests run in the next step, and with how many tokens.

Each ``schedule()`` fills one step under a token budget: running requests first (a decode token, or the next chunk
of a prompt: chunked prefill), then waiting requests in arrival order (after a prefix-cache lookup; one whose next
uncached block a scheduled request is computing waits a step and then finds it cached: requests queued together
share their prefix). A request asking for prompt logprobs reuses cached blocks only before its first scored row
(``prompt_logprobs.py``), and the plan names its prompt rows (``SchedulerOutput.prompt_rows``). With a KV
window (every layer sliding), each running request first releases its blocks wholly before the window of its next
token (``KVCacheManager.free_outside_window``), so a long request holds a bounded number of blocks. A model of both
sliding and full layers has two KV-cache groups (``kv_groups.py``): every request holds blocks in both, allocated
and freed together, and releases the sliding group's blocks outside its window the same way. When a running
request cannot get a block, the most recently admitted running request is preempted by recompute: its blocks are
freed and it goes back to the FRONT of the waiting queue with its tokens kept. No request is ever lost.

One step of the caller's loop::

    out = scheduler.schedule()
    logits = session.step(out.to_step_batch())
    sampled = sampler.sample(logits[out.sample_rows], out.sample_seqs)  # with prompt rows: see logits_ends
    finished = scheduler.update_from_output(out, sampled.token_ids)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import RequestError
from . import kv_groups
from .engine_session import EngineSession
from .kv_cache_manager import KVCacheGroup, KVCacheManager
from .prompt_logprobs import prompt_rows
from .sampling import SamplingParams
from .scheduler_output import SchedulerOutput
from .sequence import FinishReason, KVReuse, RequestStatus, Sequence

# Called once for every token appended to a running request; returns the stop string the request's text now
# contains (which finishes it with FinishReason.STOP), or None. The detokenizing layer plugs stop strings in here.
StopHook = Callable[[Sequence], str | None]
# Called before a waiting request's prefix-cache lookup to bring its prefix into the pools (the KV-cache groups'
# managers) from elsewhere (the KV offload tier's ``KVOffloader.load_prefix``); returns the number of blocks it loaded.
PrefixLoader = Callable[[list[KVCacheManager], Sequence], int]
# Reads the K/V of a request's reused range (``Sequence.kv_reuse``, runtime/blend.py) before the request's slots are
# allocated (which may evict where it reads from); returns what writes it into them once they are, or None when the
# source is gone (the range is then computed like the rest of the prompt).
KVInjector = Callable[[Sequence, KVReuse], Callable[[], None] | None]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of continuous batching; ``for_session`` takes them from an engine."""

    max_num_seqs: int  # requests running at once (and so in one step)
    max_num_batched_tokens: int  # tokens in one step: prefill chunks plus decode tokens
    max_seq_len: int  # positions per request, prompt plus generated tokens
    block_size: int  # token slots per KV-cache block
    num_blocks: int  # blocks in the cache, the null block 0 included
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()  # tokens that finish a request unless its params say ignore_eos
    # ModelConfig.kv_window: the positions every layer attends to, its own included; None when some layer attends
    # fully. When set, blocks wholly before a request's window are released while it runs.
    kv_window: int | None = None
    # A model of both attention kinds (ModelConfig.has_sliding_kv_group): its sliding layers' window and the blocks
    # of their KV-cache group (kv_groups.py), null block included; both None for a model of one kind.
    sliding_window: int | None = None
    num_sliding_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_seq_len", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.kv_window is not None and self.kv_window <= 0:
            raise ValueError("kv_window must be positive (or None)")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is reserved)")
        if (self.sliding_window is None) != (self.num_sliding_blocks is None):
            raise ValueError("sliding_window and num_sliding_blocks go together (a sliding KV-cache group)")
        if self.sliding_window is not None and self.kv_window is not None:
            raise ValueError("a sliding KV-cache group is for models whose layers do not all slide (kv_window None)")
        if self.sliding_window is not None and (self.sliding_window <= 0 or self.num_sliding_blocks < 2):
            raise ValueError("sliding_window must be positive and num_sliding_blocks at least 2")

    @classmethod
    def for_session(cls, session: EngineSession, *, enable_prefix_caching: bool = True) -> SchedulerConfig:
        """The engine's own limits: its batch size, step tokens, sequence length, block size, cache size and the
        KV window of its model (or its sliding layers' window and KV-cache group)."""
        build, model = session.config.build, session.config.model
        return cls(
            max_num_seqs=build.max_batch_size,
            max_num_batched_tokens=build.max_num_tokens,
            max_seq_len=build.max_seq_len,
            block_size=build.kv_block_size,
            num_blocks=session.num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            eos_token_ids=tuple(session.config.model.eos_token_ids),
            kv_window=model.kv_window,
            sliding_window=model.sliding_window if model.has_sliding_kv_group else None,
            num_sliding_blocks=session.num_sliding_blocks,
        )


class Scheduler:
    """Owns the waiting/running queues and the KV-cache manager; see the module docstring."""

    def __init__(
        self, config: SchedulerConfig, stop_hook: StopHook | None = None, prefix_loader: PrefixLoader | None = None
    ) -> None:
        self.config = config
        self.stop_hook = stop_hook
        self.prefix_loader = prefix_loader
        self.kv_injector: KVInjector | None = None  # set by runtime/blend.py for requests with reused ranges
        self.kv_groups = kv_groups.make_groups(
            config.num_blocks, config.block_size, config.enable_prefix_caching, config.kv_window,
            config.sliding_window, config.num_sliding_blocks,
        )  # fmt: skip
        self.kv_cache = self.kv_groups[0]  # every layer's, or the full layers' of a model of both kinds
        # The sliding layers' group of a model of both kinds (kv_groups.py), else None.
        self.sliding_kv_cache = self.kv_groups[1] if len(self.kv_groups) > 1 else None
        self.waiting: deque[Sequence] = deque()  # WAITING and PREEMPTED requests, in admission order
        self.running: deque[Sequence] = deque()  # RUNNING requests, oldest admission first
        self.requests: dict[str, Sequence] = {}  # every unfinished request, waiting or running
        self.num_preemptions = 0
        self._num_added = 0

    def add_request(
        self, request_id: str, prompt_token_ids: Iterable[int], params: SamplingParams, *, cache_salt: str | None = None
    ) -> Sequence:
        """Queue a request; raises ``RequestError`` (changing nothing) when it could never run to completion."""
        prompt = list(prompt_token_ids)
        cfg = self.config
        if request_id in self.requests:
            raise RequestError(f"request {request_id!r}: id already in use")
        if not prompt:
            raise RequestError(f"request {request_id!r}: prompt is empty")
        max_len = cfg.max_seq_len if params.max_tokens is None else len(prompt) + params.max_tokens
        if len(prompt) >= cfg.max_seq_len:
            raise RequestError(
                f"request {request_id!r}: prompt ({len(prompt)} tokens) leaves no room to generate within the "
                f"engine's max_seq_len ({cfg.max_seq_len})"
            )
        if max_len > cfg.max_seq_len:
            raise RequestError(
                f"request {request_id!r}: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{max_len} exceeds the engine's max_seq_len ({cfg.max_seq_len})"
            )
        # The last generated token is never fed back, so max_len - 1 positions need K/V. A request that cannot fit
        # even alone in the pool would be preempted forever: reject it now. With a KV window it holds at most the
        # window plus one step's tokens at once, however long it grows.
        for kv in self.kv_groups:
            need = kv.max_blocks_held(max_len - 1, cfg.max_num_batched_tokens)
            if need > kv.num_usable_blocks:
                raise RequestError(
                    f"request {request_id!r}: up to {max_len - 1} tokens need {need} KV-cache blocks of "
                    f"{cfg.block_size} but the engine has {kv.num_usable_blocks}"
                    f"{' (sliding layers)' if kv.group is KVCacheGroup.SLIDING else ''}; lower max_tokens or the "
                    "prompt length"
                )
        seq = Sequence(request_id, prompt, params, self._num_added, cache_salt)
        self._num_added += 1
        self.requests[request_id] = seq
        self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring). Allocates the blocks the planned tokens need."""
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        for seq in self.running:  # before any allocation, so the released blocks serve this step
            for kv in self.kv_groups:
                kv.free_outside_window(seq)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            reused, write = self._reuse_at(seq)  # a range whose K/V is written, not computed, then the tokens after
            num_new = min(self._computable(seq, seq.num_computed_tokens + reused), budget)
            while not kv_groups.allocate_slots(self.kv_groups, seq, reused + num_new):
                victim = self.running.pop()  # the most recently admitted; never one already planned (index < i)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                if write is not None:
                    write()
                    seq.num_computed_tokens += reused
                scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
        # Admit waiting requests in arrival order, unless this step already had to preempt (the pool is full). A
        # request whose next uncached block a scheduled request is computing waits for it (kv_groups.in_flight),
        # before any lookup in the KV offload tiers.
        in_flight = kv_groups.in_flight(self.kv_cache, [seq for seq, _ in scheduled]) if self.waiting else set()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            seq = self.waiting[0]
            computed, num_hit_tokens = kv_groups.get_computed_blocks(self.kv_groups, seq)
            if kv_groups.waits_for(self.kv_cache, seq, num_hit_tokens, in_flight):
                break  # FCFS: its prefix is cached after this step, and it goes first then
            if self.prefix_loader is not None and self.prefix_loader(self.kv_groups, seq):
                computed, num_hit_tokens = kv_groups.get_computed_blocks(self.kv_groups, seq)
            num_new = min(self._computable(seq, num_hit_tokens), budget)
            if not kv_groups.allocate_slots(self.kv_groups, seq, num_new, computed):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if seq.status is RequestStatus.WAITING:
                seq.num_cached_tokens = num_hit_tokens
            seq.status = RequestStatus.RUNNING
            seq.num_computed_tokens = num_hit_tokens
            self.running.append(seq)
            scheduled.append((seq, num_new))
            in_flight |= kv_groups.in_flight(self.kv_cache, [seq])
            budget -= num_new
        sample_rows = [b for b, (seq, n) in enumerate(scheduled) if seq.num_computed_tokens + n == seq.num_tokens]
        rows = {b: r for b, (seq, n) in enumerate(scheduled) if (r := prompt_rows(seq, n))}
        return SchedulerOutput(scheduled, sample_rows, preempted, self.sliding_kv_cache is not None, rows)

    def _reuse_at(self, seq: Sequence) -> tuple[int, Callable[[], None] | None]:
        """(tokens, writer) of ``seq``'s reused range starting at its next position, read now (``KVInjector``);
        (0, None) when there is none. A range whose K/V cannot be read is dropped: it is computed instead."""
        reuse = next((r for r in seq.kv_reuse if r.start == seq.num_computed_tokens), None)
        if reuse is None:
            return 0, None
        write = None if self.kv_injector is None else self.kv_injector(seq, reuse)
        if write is None:
            seq.kv_reuse = tuple(r for r in seq.kv_reuse if r is not reuse)
            return 0, None
        return reuse.end - reuse.start, write

    @staticmethod
    def _computable(seq: Sequence, start: int) -> int:
        """Tokens from position ``start`` on that a step may compute: up to the next reused range, or the end."""
        end = next((r.start for r in seq.kv_reuse if r.start >= start), seq.num_tokens)
        return end - start

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: Iterable[int]) -> list[Sequence]:
        """Advance the planned requests after the step; ``sampled_token_ids`` pairs with ``out.sample_seqs``.

        Appends each sampled token, checks stop conditions and returns the requests that finished (their blocks
        freed). Requests aborted since ``schedule()`` are skipped.
        """
        for seq, n in out.scheduled:
            if seq.status is RequestStatus.RUNNING:
                seq.num_computed_tokens += n
                for kv in self.kv_groups:
                    kv.cache_blocks(seq)
        finished = []
        for seq, token in zip(out.sample_seqs, sampled_token_ids, strict=True):
            if seq.status is not RequestStatus.RUNNING:
                continue
            seq.output_token_ids.append(int(token))
            reason = self._check_stop(seq, int(token))
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        if finished:
            self.running = deque(seq for seq in self.running if not seq.is_finished)
        return finished

    def abort(self, request_id: str) -> bool:
        """Cancel a waiting or running request (FinishReason.ABORT); False when it is unknown or already finished."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        queue = self.running if seq.status is RequestStatus.RUNNING else self.waiting
        queue.remove(seq)
        self._finish(seq, FinishReason.ABORT)
        return True

    def _check_stop(self, seq: Sequence, token: int) -> FinishReason | None:
        """Stop conditions after ``token`` was appended; sets ``seq.stop_reason`` for stop tokens and strings."""
        params = seq.sampling_params
        stop_string = self.stop_hook(seq) if self.stop_hook is not None else None  # sees every token
        if not params.ignore_eos and token in self.config.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return FinishReason.STOP
        if stop_string is not None:
            seq.stop_reason = stop_string
            return FinishReason.STOP
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.config.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _preempt(self, seq: Sequence) -> None:
        for kv in self.kv_groups:
            kv.free(seq)
        seq.status = RequestStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        for kv in self.kv_groups:
            kv.free(seq)
        seq.status = RequestStatus.finished(reason)
        del self.requests[seq.request_id]
