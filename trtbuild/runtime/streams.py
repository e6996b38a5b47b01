"""The iterators ``LLM`` hands out: a streamed completion's text deltas, and requests in the order they finish.

Both step the LLM's engine loop as they are iterated, and abort what has not finished when closed or dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from .outputs import CompletionState, RequestOutput


class _Engine(Protocol):
    """What a stream needs of its ``LLM``: one more engine step, and a finished request's output."""

    def _step(self) -> None: ...

    def _request_output(self, request_id: str, prompt: str | None, states: list[CompletionState]) -> RequestOutput: ...


class TextStream(Iterator[str]):
    """Text deltas of one streamed request (``LLM.generate_stream``); ``output`` holds the result once exhausted.

    The deltas concatenate to ``output.text``. Dropping or ``close()``-ing an unfinished stream aborts its request.
    """

    def __init__(self, llm: _Engine, request_id: str, state: CompletionState, prompt: str | None) -> None:
        self._llm, self._id, self._state, self._prompt = llm, request_id, state, prompt
        self.output: RequestOutput | None = None

    def __next__(self) -> str:
        state = self._state
        while True:
            delta = state.take_delta()
            if delta:
                return delta
            if state.finished:
                if self.output is None:
                    self.output = self._llm._request_output(self._id, self._prompt, [state])
                raise StopIteration
            self._llm._step()

    def close(self) -> None:
        if not self._state.finished:
            self._state.cancelled = True  # aborted before the next step (safe even from a finalizer)

    def __del__(self) -> None:
        self.close()


class FinishedRequests(Iterator[tuple[int, RequestOutput]]):
    """What ``LLM.generate_iter`` returns: ``(prompt index, RequestOutput)`` pairs in completion order.

    ``by_step()`` iterates the same requests a step at a time, and ``tokens()`` counts their tokens, for a caller
    that shows progress while no request has finished yet (``trtbuild run --input``).
    """

    def __init__(
        self,
        num_requests: int,
        steps: Iterator[list[tuple[int, RequestOutput]]],
        abort: Callable[[], None],
        tokens: Callable[[], tuple[int, int]],
    ) -> None:
        self.num_requests = num_requests
        self._steps, self._abort, self._tokens = steps, abort, tokens
        self._ready: list[tuple[int, RequestOutput]] = []

    def __next__(self) -> tuple[int, RequestOutput]:
        while not self._ready:
            self._ready = next(self._steps)
        return self._ready.pop(0)

    def by_step(self) -> Iterator[list[tuple[int, RequestOutput]]]:
        """The requests that finished, as lists: an empty one after each engine step in which none did."""
        if self._ready:
            yield self._ready
            self._ready = []
        yield from self._steps

    def tokens(self) -> tuple[int, int]:
        """(tokens generated so far, at most how many are still to come: each unfinished completion's max_tokens,
        or room to the engine's max_seq_len, less what it has generated)."""
        return self._tokens()

    def close(self) -> None:
        """Abort the requests that have not finished."""
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()
        self._abort()

    def __del__(self) -> None:
        self.close()
