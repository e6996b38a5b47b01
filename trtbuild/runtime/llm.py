"""The public runner API (vLLM-like): ``LLM(engine_dir).generate(prompts, SamplingParams(...))``.

``LLM`` opens an engine directory (session, tokenizer, scheduler limits, KV offload) and is the public face of its
engine loop (``engine_loop.EngineLoop``: continuous batching, chunked prefill, prefix caching, preemption).
Requests of every open ``generate``/``generate_stream`` call share the loop; each call returns once its own
requests finish. Invalid requests: ``generate`` checks every prompt before any runs and raises ``RequestError``
(``prompt i: ...``) without queueing any of them, so nothing else is disturbed and the LLM keeps serving.

Imports only numpy, onnxruntime, tokenizers (and jinja2 for chat templates, llguidance for structured output, both
when first needed): never torch or transformers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError, EngineError, RequestError
from .engine_loop import EngineLoop
from .kv_offload import KVOffloadConfig
from .kv_offload.offloader import open_offloader
from .outputs import CompletionOutput, CompletionState, EngineStats, RequestMetrics, RequestOutput
from .requests import Messages, PreparedRequest, Prompt, pair_prompts, prepare
from .sampling import SamplingParams, TokenLogprobs
from .scheduler import SchedulerConfig
from .sequence import FinishReason
from .session import open_session
from .streams import FinishedRequests, TextStream
from .tokenizer import Tokenizer

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


class LLM(EngineLoop):
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
            session = open_session(
                engine_dir,
                kv_cache_memory=kv_cache_memory,
                num_threads=num_threads,
                verify=verify,
                profile_kernels=profile_kernels,
            )
        except ValueError as e:  # too few blocks for the memory given (a size the caller did not give is not)
            if kv_cache_memory is None:
                raise
            raise ConfigError(f"kv_cache_memory ({kv_cache_memory} bytes) is too small: {e}") from None
        self.profile_kernels = profile_kernels
        tokenizer = Tokenizer.from_engine_dir(engine_dir)
        base = SchedulerConfig.for_session(session, enable_prefix_caching=enable_prefix_caching)
        limits = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
        for name, value in limits.items():
            cap = getattr(base, name)
            if value is not None and not (isinstance(value, int) and 1 <= value <= cap):
                raise ConfigError(f"{name} must be an integer in [1, {cap}] (the engine's limit), got {value!r}")
        config = replace(base, **{k: v for k, v in limits.items() if v is not None})
        offloader = open_offloader(session, engine_dir, kv_offload, enable_prefix_caching)
        super().__init__(session, tokenizer, config, offloader, seed)

    @property
    def num_kv_blocks(self) -> int:
        """KV-cache blocks usable by requests."""
        return self.scheduler.kv_cache.num_usable_blocks

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
