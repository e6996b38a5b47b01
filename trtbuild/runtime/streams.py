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
    """What ``LLM.generate_iter`` returns: ``(prompt index, RequestOutput)`` pairs in completion order."""

    def __init__(
        self, num_requests: int, items: Iterator[tuple[int, RequestOutput]], abort: Callable[[], None]
    ) -> None:
        self.num_requests = num_requests
        self._items, self._abort = items, abort

    def __next__(self) -> tuple[int, RequestOutput]:
        return next(self._items)

    def close(self) -> None:
        """Abort the requests that have not finished."""
        close = getattr(self._items, "close", None)
        if close is not None:
            close()
        self._abort()

    def __del__(self) -> None:
        self.close()
