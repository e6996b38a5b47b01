"""One background thread owns the ``LLM`` and steps it; HTTP handlers submit requests and read updates.

Requests of every connection join the same continuous batch. The thread drains an inbox (new requests, aborts)
between steps, runs ``LLM.step()`` while anything is queued, and hands each request's new text, tokens and
logprobs to its asyncio queue (one ``call_soon_threadsafe`` per step). An abort marks the request's sequences
cancelled; the next step frees them and their KV blocks. Admission control: when ``max_queue`` sequences are
waiting (queued in the inbox or the scheduler), ``submit`` raises ``QueueFull``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import RequestError
from ..runtime.llm import LLM
from ..runtime.outputs import CompletionState
from ..runtime.sampling import SamplingParams, TokenLogprobs
from ..runtime.sequence import FinishReason, RequestStatus
from .metrics import EngineSnapshot, ServerMetrics


class QueueFull(Exception):
    """``max_queue`` sequences are already waiting."""


class ShuttingDown(Exception):
    """The engine no longer admits requests."""


@dataclass(frozen=True)
class Update:
    """What one completion produced in one step; ``finish_reason`` is set on its last update."""

    index: int  # the choice index: prompt index x n + completion index
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: FinishReason | None


@dataclass
class Submission:
    """One HTTP request's prompts (text, token ids, or chats: ``tools.ChatInput``) on their way through the engine."""

    prompts: Sequence[Any]
    params: SamplingParams
    is_chat: bool
    arrival: float = field(default_factory=time.perf_counter)
    queue: asyncio.Queue[list[Update]] = field(default_factory=asyncio.Queue)
    prompt_token_ids: list[list[int]] = field(default_factory=list)  # set once admitted
    states: list[CompletionState] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)  # per state: tokens already handed out
    first_token_time: list[float | None] = field(default_factory=list)
    last_token_time: list[float] = field(default_factory=list)
    finish_sent: set[int] = field(default_factory=set)  # completions whose last update was handed out
    aborted: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.prompts) * self.params.n


class EngineLoop:
    """The background loop around one ``LLM``; ``start`` it from the event loop that will read the updates."""

    def __init__(self, llm: LLM, max_queue: int, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.max_queue = max_queue
        self.metrics = metrics
        stats = llm.stats
        self.snapshot = EngineSnapshot(
            kv_total_blocks=stats.num_blocks,
            sliding_kv_used_blocks=None if stats.num_sliding_blocks is None else 0,
            sliding_kv_total_blocks=stats.num_sliding_blocks,
        )
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Submission, asyncio.Future[None] | None]] = []
        self._pending_seqs = 0  # sequences in the inbox
        self._sched_waiting = 0  # sequences in the scheduler's waiting queue after the last iteration
        self._active: list[Submission] = []  # owned by the engine thread
        self._admitting = True
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="trtbuild-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self._pending_seqs + self._sched_waiting

    async def submit(self, sub: Submission) -> None:
        """Queue ``sub``; returns once the engine accepted it. Raises QueueFull, ShuttingDown or RequestError."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._cond:
            if not self._admitting:
                raise ShuttingDown
            if self._pending_seqs + self._sched_waiting >= self.max_queue:
                raise QueueFull
            self._pending_seqs += sub.num_seqs
            self._inbox.append(("add", sub, future))
            self._cond.notify()
        await future

    def abort(self, sub: Submission) -> None:
        """Cancel ``sub`` (a client went away): its sequences and KV blocks are freed at the next step."""
        with self._cond:
            self._inbox.append(("abort", sub, None))
            self._cond.notify()

    def stop_admitting(self) -> None:
        with self._cond:
            self._admitting = False

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever still runs and end the thread (the server's shutdown, after the grace period)."""
        with self._cond:
            self._admitting = False
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # --------------------------------------------------------------------------------------------- engine side

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._active and not self._stop:
                    self._cond.wait()
                commands, self._inbox = self._inbox, []
                stop = self._stop
            for kind, sub, future in commands:
                if kind == "add":
                    self._add(sub, future)
                else:
                    self._cancel(sub)
            if stop:
                for sub in self._active:
                    self._cancel(sub)
            try:
                if self._active:
                    self.llm.step()
            except Exception as e:  # an engine failure: fail the running requests, keep serving
                self._fail_all(e)
            self._publish()
            if stop and not self._active:
                return

    def _add(self, sub: Submission, future: asyncio.Future[None] | None) -> None:
        error: BaseException | None = None
        try:
            prompts: list[Any] = [
                self.llm.chat_prompt(p.messages, tools=p.tools, reply_prefix=p.reply_prefix) if sub.is_chat else p
                for p in sub.prompts
            ]
            added = self.llm.add_requests(prompts, sub.params)
        except RequestError as e:
            error = e
        except Exception as e:  # e.g. a tokenizer failure on odd input: the request fails, the server does not
            error = RequestError(f"cannot process the prompt ({type(e).__name__}: {e})")
        with self._cond:
            self._pending_seqs -= sub.num_seqs
            self._sched_waiting = len(self.llm.scheduler.waiting)
        if error is None:
            for _, states in added:
                sub.prompt_token_ids.append(list(states[0].seq.prompt_token_ids))
                sub.states.extend(states)
            n = len(sub.states)
            sub.sent_tokens, sub.first_token_time, sub.last_token_time = [0] * n, [None] * n, [0.0] * n
            self.metrics.prompt_tokens.inc(sum(len(p) for p in sub.prompt_token_ids))
            self._active.append(sub)
        self._call(_resolve, future, error, self, sub)

    def _cancel(self, sub: Submission) -> None:
        sub.aborted = True
        for state in sub.states:
            state.cancelled = True

    def _fail_all(self, error: Exception) -> None:
        """An engine step raised: abort every running request (their streams end with finish_reason abort)."""
        self.metrics.engine_errors.inc()
        for sub in self._active:
            self._cancel(sub)
        try:
            self.llm.step()  # only aborts the cancelled requests (nothing else is queued): no engine call
        except Exception:  # the scheduler is in no state to abort: end the requests' streams here
            now = time.perf_counter()
            for sub in self._active:
                for state in sub.states:
                    if not state.finished:
                        state.finish(now)
                        state.seq.status = RequestStatus.FINISHED_ABORTED

    def _publish(self) -> None:
        """Hand every active request its new output; drop the finished ones; refresh the gauges and histograms."""
        now = time.perf_counter()
        deliveries: list[tuple[asyncio.Queue[list[Update]], list[Update]]] = []
        still_active = []
        for sub in self._active:
            updates = [u for i in range(len(sub.states)) if (u := self._update(sub, i, now)) is not None]
            if updates:
                deliveries.append((sub.queue, updates))
            if all(s.finished for s in sub.states):
                self.metrics.observe_request(sub.arrival, now, sub.states)
            else:
                still_active.append(sub)
        self._active = still_active
        scheduler, stats = self.llm.scheduler, self.llm.stats
        with self._cond:
            self._sched_waiting = len(scheduler.waiting)
        self.snapshot = EngineSnapshot(
            running=len(scheduler.running),
            waiting=self.num_waiting,
            kv_used_blocks=scheduler.kv_cache.num_used_blocks,
            kv_total_blocks=stats.num_blocks,
            sliding_kv_used_blocks=None if (sliding := scheduler.sliding_kv_cache) is None else sliding.num_used_blocks,
            sliding_kv_total_blocks=stats.num_sliding_blocks,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            preemptions=stats.num_preemptions,
            steps=stats.num_steps,
            kv_offload=stats.kv_offload,
        )
        if deliveries:
            self._call(_deliver, deliveries)

    def metrics_snapshot(self) -> EngineSnapshot:
        """The last step's snapshot with the KV offload tiers' counters read now: the tiers store behind the engine
        (a writer thread), so a request's stores land after the step that made them."""
        offloader = self.llm.offloader
        return self.snapshot if offloader is None else replace(self.snapshot, kv_offload=offloader.stats())

    def _update(self, sub: Submission, i: int, now: float) -> Update | None:
        """Completion ``i``'s new output since its last update; None when there is none (a finished completion's
        last update is handed out once, though its request stays active until all of its completions finish)."""
        if i in sub.finish_sent:
            return None
        state = sub.states[i]
        tokens = state.seq.output_token_ids[sub.sent_tokens[i] :]
        text = state.take_delta()
        finish = state.seq.finish_reason if state.finished else None
        if not tokens and not text and finish is None:
            return None
        if tokens:
            if sub.first_token_time[i] is None:
                sub.first_token_time[i] = now
                self.metrics.ttft.observe(now - sub.arrival)
            else:
                self.metrics.itl.observe((now - sub.last_token_time[i]) / len(tokens), len(tokens))
            sub.last_token_time[i] = now
            self.metrics.output_tokens.inc(len(tokens))
        logprobs = [] if state.logprobs is None else state.logprobs[sub.sent_tokens[i] :]
        sub.sent_tokens[i] += len(tokens)
        if finish is not None:
            sub.finish_sent.add(i)
        return Update(i, text, list(tokens), list(logprobs), finish)

    def _call(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closed (shutdown): nobody listens any more
            self._loop.call_soon_threadsafe(fn, *args)


def _resolve(future: asyncio.Future[None] | None, error: BaseException | None, engine: EngineLoop, sub: Any) -> None:
    if future is None:
        return
    if future.cancelled():  # the handler went away while the request was queued
        engine.abort(sub)
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)


def _deliver(deliveries: Sequence[tuple[asyncio.Queue[list[Update]], list[Update]]]) -> None:
    for queue, updates in deliveries:
        queue.put_nowait(updates)
