"""``Runtime``: one ``LLM`` driven by a background thread for the programs' states (one program run or batch).

A state's worker thread calls ``generate`` and blocks; the driver thread queues every request it finds (all states'
requests join the same continuous batch, so a ``fork``'s branches run together and share their prefix's KV blocks
through the prefix cache), steps the engine while any runs, and resolves each request as it finishes. The ``LLM``
is touched by the driver thread only (it is not thread-safe).

Batching is made deterministic by counting busy threads: a program's own thread while it runs program code, and a
state's worker while it has appends to run and is not waiting for a request. Before each engine step the driver
waits (at most ``GATHER_S``) until no thread is busy, i.e. until every request the programs are about to make is
queued, so a fork's branches start in the same step however the threads were scheduled.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from ..runtime.llm import LLM
from ..runtime.outputs import CompletionOutput, CompletionState
from ..runtime.sampling import SamplingParams

Request = tuple[list[int], SamplingParams]  # prompt token ids, and how to sample them

GATHER_S = 0.05  # the longest an engine step waits for busy program threads to queue their requests


class Runtime:
    """The driver thread around one ``LLM``; use as a context manager (``close`` ends the thread)."""

    def __init__(self, llm: LLM) -> None:
        if llm.tokenizer is None:
            from ..errors import RequestError

            raise RequestError("trtbuild.lang programs need an engine with a tokenizer (tokenizer.json)")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self._cond = threading.Condition()
        # Submissions: (their requests, the future of their finished states, whether the caller counts as busy).
        self._inbox: list[tuple[list[Request], Future[list[CompletionState]], bool]] = []
        self._active: list[tuple[list[CompletionState], Future[list[CompletionState]], bool]] = []
        self._busy = 0  # program threads and state workers that may still queue a request before the next step
        self._closed = False
        # Submissions made (a program's gens, selects and fork commits; a ranking select's choices are one).
        self.num_requests = 0
        self._thread = threading.Thread(target=self._run, name="trtbuild-lang", daemon=True)
        self._thread.start()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def generate(self, prompt_ids: list[int], params: SamplingParams, *, busy: bool) -> CompletionOutput:
        """Run one request in the shared batch; blocks the calling thread until it finishes. ``busy``: the caller
        is counted busy (it is not while it waits here)."""
        [state] = self.generate_all([(prompt_ids, params)], busy=busy)
        return state.output()

    def generate_all(self, requests: list[Request], *, busy: bool) -> list[CompletionState]:
        """Run ``requests`` (prompt ids, params) together, queued in the same step, and block until all have
        finished; returns their finished states (``output()``, ``prompt_logprobs``). One fails: all fail."""
        future: Future[list[CompletionState]] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the program's runtime is closed")
            self.num_requests += 1
            self._inbox.append((requests, future, busy))
            self._busy -= busy
            self._cond.notify_all()
        return future.result()

    def add_busy(self, n: int) -> None:
        """A thread starts (+1) or stops (-1) running work that may queue requests."""
        with self._cond:
            self._busy += n
            self._cond.notify_all()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """A busy thread blocks (on another state's results): it queues nothing meanwhile."""
        self.add_busy(-1)
        try:
            yield
        finally:
            self.add_busy(1)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._active and not self._closed:
                    self._cond.wait()
                deadline = time.monotonic() + GATHER_S
                while self._busy > 0 and not self._closed and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
                inbox, self._inbox = self._inbox, []
                if self._closed and not inbox and not self._active:
                    return
            for requests, future, busy in inbox:
                states: list[CompletionState] = []
                try:
                    for prompt_ids, params in requests:
                        [(_, [state])] = self.llm.add_requests([prompt_ids], params)
                        states.append(state)
                except Exception as e:  # RequestError (too long a prompt, ...): that submission fails, not the rest
                    for state in states:
                        state.cancelled = True
                    self._resolve(future, busy, error=e)
                    continue
                self._active.append((states, future, busy))
            try:
                if self._active:
                    self.llm.step()
            except BaseException as e:  # an engine failure: every running request fails with it
                for states, future, busy in self._active:
                    for state in states:
                        state.cancelled = True
                    self._resolve(future, busy, error=e)
                self._active = []
                continue
            running = []
            for states, future, busy in self._active:
                if all(state.finished for state in states):
                    self._resolve(future, busy, result=states)
                else:
                    running.append((states, future, busy))
            self._active = running

    def _resolve(
        self,
        future: Future[list[CompletionState]],
        busy: bool,
        *,
        result: list[CompletionState] | None = None,
        error: BaseException | None = None,
    ) -> None:
        """Hand a request's result to its caller, which is busy again from now (before it even wakes up)."""
        if busy:
            self.add_busy(1)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]
