"""The public runner API (vLLM-like): ``LLM(engine_dir).generate(prompts, SamplingParams(...))``.

One synchronous engine loop drives the scheduler (continuous batching, chunked prefill, prefix caching,
preemption), the session and the sampler::

    out = scheduler.schedule()                       # which requests run, with how many tokens
    logits = <one or more session.step_logits calls> # step shaping, see split_step; the sampled rows only
    sampled = sampler.sample(logits, out.sample_seqs)  # the session's sampler: on the host, or on its device
    scheduler.update_from_output(out, sampled.token_ids)   # the stop hook detokenizes and finds stop strings

Requests of every open ``generate``/``generate_stream`` call share the loop; each call returns once its own
requests finish. Invalid requests: ``generate`` checks every prompt before any runs and raises ``RequestError``
(``prompt i: ...``) without queueing any of them, so nothing else is disturbed and the LLM keeps serving.

Imports only numpy, onnxruntime, tokenizers (and jinja2 for chat templates, llguidance for structured output, both
when first needed): never torch or transformers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, EngineError, RequestError
from . import prompt_logprobs
from .grammar import Grammars, StepMasks
from .kv_offload import KVOffloadConfig
from .kv_offload.offloader import open_offloader
from .outputs import CompletionOutput, CompletionState, EngineStats, RequestMetrics, RequestOutput
from .profile import PhaseTimes
from .requests import Messages, PreparedRequest, Prompt, pair_prompts, prepare
from .sampling import SamplerOutput, SamplingParams, TokenLogprobs
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import FinishReason
from .sequence import Sequence as Seq
from .session import open_session
from .step_counters import StepCounters
from .step_logits import run_step
from .streams import FinishedRequests, TextStream
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineStats",
    "FinishReason",
    "FinishedRequests",
    "KVOffloadConfig",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TextStream",
    "TokenLogprobs",
]


class LLM:
    """An engine directory served with continuous batching and paged attention (see the module docstring).

    ``max_num_seqs`` / ``max_num_batched_tokens`` default to the engine's ``max_batch_size`` / ``max_num_tokens``
    and may only lower them. ``kv_cache_memory``: the KV cache's bytes; None lets the engine's session choose
    (onnxruntime: room for the engine's ``max_batch_size`` sequences of ``max_seq_len`` tokens, at most a quarter of
    the available memory; on a GPU the memory free after loading, less one step's working memory). ``seed`` seeds
    the sampler for requests without their own seed. The sampler is the session's (``new_sampler``): a GPU
    engine's samples on the device. Loading checks the size of every file the engine's manifest lists;
    ``verify=True`` checks their sha256 too. ``kv_offload``: KV offload tiers (host memory, a disk
    directory) that keep full blocks past the pool's eviction and load them back (docs/kv_offload.md); off by default.
    An engine whose every layer slides (``ModelConfig.kv_window``) has each request's blocks outside the window
    released as it runs, so a long request holds a bounded number of blocks (docs/runner.md, "Sliding-window models").
    An engine of both sliding and full layers (Gemma 2 / 3) has two KV-cache groups (``kv_groups.py``): the sliding
    layers' blocks outside the window are released the same way while the full layers keep every block; a
    prefix-cache hit is then a prefix found in both groups, and ``kv_offload`` is refused (docs/runner.md, "KV-cache
    groups").
    Not thread-safe: drive one LLM from one thread.
    """

    def __init__(
        self,
        engine_dir: str | Path,
        *,
        kv_cache_memory: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        num_threads: int | None = None,
        seed: int | None = None,
        profile_kernels: bool = False,
        verify: bool = False,
        kv_offload: KVOffloadConfig | None = None,
    ) -> None:
        engine_dir = Path(engine_dir)
        if not engine_dir.is_dir():
            from ..artifacts.inspect import not_a_directory

            raise EngineError(not_a_directory(engine_dir, "engine directory"))
        if kv_cache_memory is not None and (not isinstance(kv_cache_memory, int) or kv_cache_memory <= 0):
            raise ConfigError(f"kv_cache_memory must be a positive number of bytes, got {kv_cache_memory!r}")
        try:
            self.session = open_session(
                engine_dir,
                kv_cache_memory=kv_cache_memory,
                num_threads=num_threads,
                verify=verify,
                profile_kernels=profile_kernels,
            )
        except ValueError as e:  # too few blocks for the memory given
            raise ConfigError(f"kv_cache_memory ({kv_cache_memory} bytes) is too small: {e}") from None
        self.profile_kernels = profile_kernels
        self.tokenizer = Tokenizer.from_engine_dir(engine_dir)
        base = SchedulerConfig.for_session(self.session, enable_prefix_caching=enable_prefix_caching)
        limits = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
        for name, value in limits.items():
            cap = getattr(base, name)
            if value is not None and not (isinstance(value, int) and 1 <= value <= cap):
                raise ConfigError(f"{name} must be an integer in [1, {cap}] (the engine's limit), got {value!r}")
        self.config = replace(base, **{k: v for k, v in limits.items() if v is not None})
        self.offloader = open_offloader(self.session, engine_dir, kv_offload, enable_prefix_caching)
        loader = self.offloader.load_prefix if self.offloader is not None else None
        self.scheduler = Scheduler(self.config, stop_hook=self._on_token, prefix_loader=loader)
        if self.offloader is not None:
            self.scheduler.kv_cache.on_block_cached = self.offloader.store
            if self.scheduler.sliding_kv_cache is not None:
                self.scheduler.sliding_kv_cache.on_block_cached = self.offloader.store_sliding
        self.sampler = self.session.new_sampler(seed)
        self._states: dict[str, CompletionState] = {}  # unfinished requests
        self._num_requests = 0
        self._now = 0.0  # time of the step being applied (read by the stop hook)
        self.grammars: Grammars | None = None  # structured output's compiler and masks, made by the first request
        self.reset_stats()

    @property
    def num_kv_blocks(self) -> int:
        """KV-cache blocks usable by requests."""
        return self.scheduler.kv_cache.num_usable_blocks

    @property
    def vocab_size(self) -> int:
        return self.session.config.model.vocab_size

    # ----------------------------------------------------------------------------------------------- public API

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids); one ``RequestOutput`` per prompt, in order.

        ``params`` is one ``SamplingParams`` for all prompts or one per prompt (default: ``SamplingParams()``).
        Raises ``RequestError`` before running anything when any prompt or params is invalid.
        """
        finished = self.generate_iter(prompts, params)
        results: list[RequestOutput | None] = [None] * finished.num_requests
        for i, out in finished:
            results[i] = out
        return [r for r in results if r is not None]

    def generate_iter(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> FinishedRequests:
        """Like ``generate``, but yields ``(index, RequestOutput)`` for each prompt as soon as it finishes.

        The prompts are checked and queued now (``RequestError`` before any runs); iterating steps the engine.
        Closing the iterator early (or an exception while iterating) aborts the requests not finished yet. Its
        ``by_step()`` and ``tokens()`` show progress between finishes (``trtbuild run --input``'s bar).
        """
        requests = [self._prepare(i, p, sp) for i, (p, sp) in enumerate(pair_prompts(prompts, params))]
        added = self._add_all(requests)

        def abort() -> None:
            for _, states in added:
                self._cancel(states)

        def tokens() -> tuple[int, int]:
            """(tokens generated so far, at most how many are still to come) over every completion."""
            generated = left = 0
            for (_, prompt_ids, sp), (_, states) in zip(requests, added, strict=True):
                room = self.config.max_seq_len - len(prompt_ids)
                limit = room if sp.max_tokens is None else min(sp.max_tokens, room)
                for state in states:
                    n = state.seq.num_output_tokens
                    generated += n
                    left += 0 if state.finished else max(0, limit - n)
            return generated, left

        return FinishedRequests(len(added), self._finished_by_step(requests, added), abort, tokens)

    def _finished_by_step(
        self, requests: list[PreparedRequest], added: list[tuple[str, list[CompletionState]]]
    ) -> Iterator[list[tuple[int, RequestOutput]]]:
        """The requests that finished, as lists: one whenever some have, and an empty one after each engine step in
        which none did (so a caller can show progress between finishes)."""
        pending = dict(enumerate(added))
        try:
            while pending:
                done = [i for i, (_, states) in pending.items() if all(s.finished for s in states)]
                if done:
                    finished = [(i, pending.pop(i)) for i in done]
                    yield [(i, self._request_output(rid, requests[i].text, states)) for i, (rid, states) in finished]
                else:
                    self._step()
                    yield []
        finally:
            for _, states in pending.values():
                self._cancel(states)

    def generate_stream(self, prompt: Prompt, params: SamplingParams | None = None) -> TextStream:
        """Stream one completion's text as it is generated; iterate the result for deltas (``n`` must be 1).

        Text that could be the start of a stop string is held back until it is not, so no delta is ever taken back.
        The request is queued (and checked) now; it runs while the stream, or any other call, steps the engine.
        """
        params = params or SamplingParams()
        if params.n != 1:
            raise RequestError("generate_stream produces one completion: n must be 1")
        request = self._prepare(0, prompt, params)
        [(rid, [state])] = self._add_all([request])
        return TextStream(self, rid, state, request.text)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation or a list of them, rendered with the engine's chat template (``tools``:
        OpenAI function tools for templates that render them, as vLLM's ``LLM.chat`` takes them)."""
        chats = [messages] if not messages or isinstance(messages[0], Mapping) else list(messages)
        return self.generate([self.chat_prompt(m, tools=tools) for m in chats], params)

    def chat_prompt(
        self, messages: Messages, *, tools: Sequence[Mapping[str, Any]] | None = None, reply_prefix: str = ""
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template with ``add_generation_prompt=True`` (``tools``:
        OpenAI function tools handed to the template), followed by ``reply_prefix``, the reply's forced start."""
        tokenizer = self._require_tokenizer("chat")
        text = tokenizer.apply_chat_template(messages, tools=tools) + reply_prefix
        return tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ step-wise API (a server owns the loop)

    def add_requests(
        self, prompts: Sequence[Prompt], params: SamplingParams
    ) -> list[tuple[str, list[CompletionState]]]:
        """Queue ``prompts`` without running them, for a caller that drives the loop with ``step()``; all or none.

        Returns (request id, the live ``CompletionState`` of each of its ``n`` completions) per prompt. After each
        ``step()`` read a state's ``take_delta()``, ``seq.output_token_ids``, ``logprobs``, ``finished`` and
        ``output()``; set its ``cancelled`` to abort it at the next step (its KV blocks are freed then).
        Raises ``RequestError`` (``prompt i: ...``) like ``generate``, queueing nothing.
        """
        return self._add_all([self._prepare(i, p, params) for i, p in enumerate(prompts)])

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

    def _require_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError(f"the engine has no tokenizer.json, needed for {what}; pass token ids")
        return self.tokenizer

    def _prepare(self, index: int, prompt: Prompt, params: Any) -> PreparedRequest:
        """Prompt ``index`` checked against this engine (``requests.prepare``)."""
        return prepare(
            index,
            prompt,
            params,
            tokenizer=self._require_tokenizer,
            grammars=self._grammars,
            vocab_size=self.vocab_size,
        )

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
