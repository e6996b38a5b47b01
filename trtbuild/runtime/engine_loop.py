"""The engine loop behind ``LLM``: queued requests and one synchronous step that drives the scheduler (continuous
batching, chunked prefill, prefix caching, preemption), the session and the sampler::

    out = scheduler.schedule()                       # which requests run, with how many tokens
    logits = <one or more session.step_logits calls> # step shaping, see split_step; the sampled rows only
    sampled = sampler.sample(logits, out.sample_seqs)  # the session's sampler: on the host, or on its device
    scheduler.update_from_output(out, sampled.token_ids)   # the stop hook detokenizes and finds stop strings

Requests of every open ``generate``/``generate_stream`` call share the loop (``LLM`` in ``llm.py`` is its public
face). Invariant: ``_states`` holds exactly the unfinished requests the scheduler knows, by sequence id; a request
leaves it when it finishes or is cancelled, and a batch that fails to queue leaves nothing behind.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import RequestError
from . import prompt_logprobs
from .engine_session import EngineSession
from .grammar import Grammars, StepMasks
from .kv_offload.offloader import KVOffloader
from .outputs import CompletionState, EngineStats, RequestOutput
from .profile import PhaseTimes
from .requests import PreparedRequest
from .sampling import SamplerOutput
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import Sequence as Seq
from .step_counters import StepCounters
from .step_logits import run_step
from .tokenizer import IncrementalDetokenizer, Tokenizer


class EngineLoop:
    """The scheduler, session and sampler of one engine, the unfinished requests' states, and ``step()``.

    ``config`` is the scheduler's (its limits already checked against the session's); ``offloader`` (None: off)
    stores the blocks the KV cache caches and loads prefixes back; ``seed`` seeds the session's sampler.
    Not thread-safe: drive it from one thread.
    """

    def __init__(
        self,
        session: EngineSession,
        tokenizer: Tokenizer | None,
        config: SchedulerConfig,
        offloader: KVOffloader | None,
        seed: int | None,
    ) -> None:
        self.session, self.tokenizer, self.config, self.offloader = session, tokenizer, config, offloader
        loader = offloader.load_prefix if offloader is not None else None
        self.scheduler = Scheduler(config, stop_hook=self._on_token, prefix_loader=loader)
        if offloader is not None:
            self.scheduler.kv_cache.on_block_cached = offloader.store
            if self.scheduler.sliding_kv_cache is not None:
                self.scheduler.sliding_kv_cache.on_block_cached = offloader.store_sliding
        self.sampler = session.new_sampler(seed)
        self._states: dict[str, CompletionState] = {}  # unfinished requests, by sequence id
        self._num_requests = 0
        self._now = 0.0  # time of the step being applied (read by the stop hook)
        self.grammars: Grammars | None = None  # structured output's compiler and masks, made by the first request
        self.reset_stats()

    @property
    def vocab_size(self) -> int:
        return self.session.config.model.vocab_size

    def step(self) -> None:
        """One engine step: abort cancelled requests, then schedule, run, sample and apply; no-op when idle."""
        self._step()

    @property
    def stats(self) -> EngineStats:
        return self._counters.stats(self.scheduler, self.offloader)

    @property
    def phase_times(self) -> PhaseTimes:
        """The engine loop's time by phase since the last reset (``trtbuild bench --profile``)."""
        return self._counters.phase_times

    def reset_stats(self) -> None:
        """Start ``stats`` afresh (e.g. after a warm-up)."""
        self._counters = StepCounters.start(self.scheduler)
        if self.offloader is not None:
            self.offloader.reset_stats()

    # ------------------------------------------------------------------------------------------------- requests

    def _add_all(self, requests: list[PreparedRequest]) -> list[tuple[str, list[CompletionState]]]:
        """Queue every request (``n`` sequences each, seeds ``seed + k``), all or none: on error none stays queued.

        Returns (request id, the states of its ``n`` sequences ``"<id>-<k>"``) per request.
        """
        added: list[tuple[str, list[CompletionState]]] = []
        now = time.perf_counter()
        try:
            for i, (_, ids, params) in enumerate(requests):
                rid, states = str(self._num_requests), []
                self._num_requests += 1
                added.append((rid, states))
                for k in range(params.n):
                    seed = None if params.seed is None else params.seed + k
                    p = params if params.n == 1 else replace(params, n=1, seed=seed)
                    try:
                        seq = self.scheduler.add_request(f"{rid}-{k}", ids, p)
                    except RequestError as e:
                        raise RequestError(f"prompt {i}: {str(e).split(': ', 1)[-1]}") from None
                    detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, ids)
                    state = CompletionState(seq, k, detok, self.config.eos_token_ids, now)
                    if self.grammars is not None:
                        state.grammar = self.grammars.matcher(p)
                    self._states[seq.request_id] = state
                    states.append(state)
        except BaseException:
            for _, states in added:
                self._cancel(states)
                for s in states:
                    self._states.pop(s.seq.request_id, None)
            raise
        return added

    def _cancel(self, states: list[CompletionState]) -> None:
        """Abort the unfinished ones among ``states`` (FinishReason.ABORT)."""
        for s in states:
            if not s.finished and self.scheduler.abort(s.seq.request_id):
                self._states.pop(s.seq.request_id, None)
                s.finish(time.perf_counter())

    def _request_output(self, request_id: str, prompt: str | None, states: list[CompletionState]) -> RequestOutput:
        seq = states[0].seq
        scores = None if states[0].prompt_logprobs is None else list(states[0].prompt_logprobs)
        return RequestOutput(request_id, prompt, list(seq.prompt_token_ids), [s.output() for s in states], scores)

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            if self.tokenizer is None:
                raise RequestError("structured output (regex / json_schema) needs the engine's tokenizer.json")
            self.grammars = Grammars(self.tokenizer, self.vocab_size, self.config.eos_token_ids)
        return self.grammars

    def _start_masks(self, seqs: list[Seq]) -> StepMasks | None:
        """The grammar masks of the constrained ones among the step's sampled ``seqs`` (row b: ``seqs[b]``),
        computed on a worker thread while the engine runs; None when no sequence is constrained."""
        if self.grammars is None:
            return None
        rows = [(b, g) for b, seq in enumerate(seqs) if (g := self._states[seq.request_id].grammar) is not None]
        return self.grammars.start_masks(rows) if rows else None

    def _on_token(self, seq: Seq) -> str | None:
        return self._states[seq.request_id].on_token(seq.output_token_ids[-1], self._now)

    # ---------------------------------------------------------------------------------------------- engine loop

    def _step(self) -> None:
        """One scheduler step: plan, run the engine, sample, apply (finishing requests as they stop)."""
        cancelled = [s for s in self._states.values() if s.cancelled]
        if cancelled:
            self._cancel(cancelled)
        if not self.scheduler.has_unfinished():
            return
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            raise RuntimeError("the scheduler planned an empty step with requests pending")  # a bug, not user input
        self._counters.scheduled(self.scheduler)
        t1 = time.perf_counter()
        masks = self._start_masks(out.sample_seqs)
        logits = self._run(out)
        t2 = time.perf_counter()
        if masks is not None and logits is not None:
            logits = masks.apply(logits)
        sampled = SamplerOutput([], []) if logits is None else self.sampler.sample(logits, out.sample_seqs)
        if masks is not None:
            t = time.perf_counter()
            for b in masks.rows:
                self._states[out.sample_seqs[b].request_id].grammar.advance(sampled.token_ids[b])
            masks.times.apply += time.perf_counter() - t
        for seq, lp in zip(out.sample_seqs, sampled.logprobs, strict=True):
            state = self._states[seq.request_id]
            if state.logprobs is not None and lp is not None:
                state.logprobs.append(lp)
        self._now = t3 = time.perf_counter()
        finished = self.scheduler.update_from_output(out, sampled.token_ids)
        for seq in finished:
            self._states.pop(seq.request_id).finish(self._now)
        phases = self._counters.phase_times
        phases.schedule += t1 - t0
        phases.engine += t2 - t1
        phases.sample += t3 - t2
        phases.update += time.perf_counter() - t3
        self._counters.stepped(self.scheduler, out)

    def _run(self, out: SchedulerOutput) -> Any:
        """Logits of the step's ``sample_rows`` (``step_logits.run_step``); its prompt-logprob rows are recorded."""

        def record(b: int, rows: np.ndarray) -> None:
            seq = out.scheduled[b][0]
            scores = self._states[seq.request_id].prompt_logprobs
            if scores is not None:
                prompt_logprobs.record(scores, seq, out.prompt_rows[b], rows)

        logits, calls = run_step(self.session, self.sampler, out, record)
        self._counters.calls += calls
        return logits
