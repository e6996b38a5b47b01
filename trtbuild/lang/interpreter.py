"""Programs and their states: ``@function`` programs run against one ``LLM``; ``ProgramState`` is the ``s`` they
append to.

Each state runs its appends in order on a worker thread of its own (SGLang's stream executor), so ``s += gen(...)``
returns at once and a program that appends to several forks keeps all of them generating in one batch; reading a
variable (``s["name"]``), the text, or forking waits for the appends before it. Text and roles: a program without
role blocks is plain text (encoded with the tokenizer's special tokens, as ``LLM.generate`` does); with role blocks
the state is a chat, rendered by the engine's chat template (the messages so far, plus the open assistant block
after the generation prompt), and text goes inside role blocks.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import RequestError
from ..runtime.llm import LLM
from ..runtime.sampling import SamplingParams
from .choices import SelectScores
from .ir import Concat, Expr, Gen, Role, RoleBlock, Select
from .runtime import Runtime
from .tools import CallTool


class ProgramState:
    """The text (or chat) a program builds, and the variables its ``gen`` / ``select`` stored."""

    def __init__(self, runtime: Runtime, run: _Run) -> None:
        self._runtime = runtime
        self._run = run
        self._plain = ""  # the text of a program without roles (or before its first role block)
        self._messages: list[dict[str, str]] = []  # closed role blocks
        self._open: tuple[Role, str] | None = None  # the role block being appended to, and its content so far
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, SelectScores] = {}  # a ranking select's scores, by variable name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trtbuild-lang-state")
        self._last: Future[None] | None = None
        self._pending = 0  # appends queued or running; the worker counts as busy while there are any
        self._lock = threading.Lock()
        run.states.append(self)

    # ------------------------------------------------------------------------------------------ program side

    def __iadd__(self, expr: Expr | str) -> ProgramState:
        if not isinstance(expr, str | Expr):
            raise TypeError(f"a program appends strings and trtbuild.lang expressions, not {type(expr).__name__}")
        previous = self._last

        def apply() -> None:
            try:
                if previous is not None:
                    previous.result()  # an earlier append failed: this one does not run (the error shows on sync)
                self._apply(expr)
            finally:
                with self._lock:
                    self._pending -= 1
                    idle = self._pending == 0
                if idle:
                    self._runtime.add_busy(-1)

        with self._lock:
            self._pending += 1
            started = self._pending == 1
        if started:
            self._runtime.add_busy(1)
        self._last = self._executor.submit(apply)
        return self

    def __getitem__(self, name: str) -> Any:
        """Variable ``name`` (waits for the appends so far)."""
        self.sync()
        if name not in self._vars:
            raise KeyError(f"no variable {name!r} (set by gen / select); have {sorted(self._vars)}")
        return self._vars[name]

    def get_var(self, name: str) -> Any:
        return self[name]

    def get_meta_info(self, name: str) -> SelectScores:
        """The scores of the ranking ``select`` that set variable ``name`` (SGLang's ``get_meta_info``; waits for
        the appends so far). Its ``normalized_logprobs`` are SGLang's ``normalized_prompt_logprobs``."""
        self.sync()
        if name not in self._meta:
            raise KeyError(f"no scores for {name!r}: set by a select ranking its choices; have {sorted(self._meta)}")
        return self._meta[name]

    @property
    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._vars)

    def text(self) -> str:
        """The whole text so far: the plain text, or the chat rendered by the chat template."""
        self.sync()
        return self._prompt_text()

    def messages(self) -> list[dict[str, str]]:
        """The chat's messages so far (the open role block last)."""
        self.sync()
        opened = [] if self._open is None else [{"role": self._open[0].value, "content": self._open[1]}]
        return [*self._messages, *opened]

    def sync(self) -> None:
        """Wait for every append so far; raises the first one's error."""
        if self._last is None:
            return
        if self._run.running and not self._last.done():  # the program's thread waits: it queues nothing meanwhile
            with self._runtime.waiting():
                self._last.exception()
        self._last.result()

    def fork(self, n: int) -> ForkGroup:
        """``n`` copies of this state that continue independently (their appends run together in one batch).

        The text so far is computed once first (one request of one token), so that every branch finds it in the
        prefix cache instead of each computing it."""
        if not isinstance(n, int) or n < 1:
            raise RequestError(f"fork needs a number of branches >= 1, got {n!r}")
        self.sync()
        text = self._prompt_text()
        if n > 1 and text:
            commit = SamplingParams(temperature=0.0, max_tokens=1)
            self._runtime.generate(self._encode(text), commit, busy=self._run.running)
        branches = []
        for _ in range(n):
            branch = ProgramState(self._runtime, self._run)
            branch._plain, branch._messages, branch._open = self._plain, list(self._messages), self._open
            branch._vars, branch._meta = dict(self._vars), dict(self._meta)
            branches.append(branch)
        return ForkGroup(branches)

    # ---------------------------------------------------------------------------------- worker-thread side

    def _apply(self, expr: Expr | str) -> None:
        if isinstance(expr, str):
            self._append_text(expr)
        elif isinstance(expr, Concat):
            for part in expr.parts:
                self._apply(part)
        elif isinstance(expr, RoleBlock):
            if self._open is not None:
                raise RequestError(f"a {expr.role.value} block inside an open {self._open[0].value} block")
            self._open = (expr.role, "")
            for part in expr.parts:
                self._apply(part)
            role, content = self._open
            self._messages.append({"role": role.value, "content": content})
            self._open = None
        elif isinstance(expr, CallTool):
            self._check_generation()
            tools = [f.openai() for f in expr.functions] if self._runtime.tokenizer.template_takes_tools else None
            out = self._runtime.generate(self._encode(self._prompt_text(tools)), expr.params, busy=True)
            self._vars[expr.name] = expr.run(out.text)
            self._append_text(out.text)
        elif isinstance(expr, Gen | Select):
            self._check_generation()
            if isinstance(expr, Select) and expr.method.ranks:
                text = self._rank(expr)
            else:
                prompt = self._encode(self._prompt_text())
                params = expr.params if isinstance(expr, Gen) else expr.decoding_params()
                text = self._runtime.generate(prompt, params, busy=True).text
                if isinstance(expr, Select) and text not in expr.choices:
                    raise RequestError(
                        f"select {expr.name!r}: the output {text!r} is none of the choices (cut short at the engine's "
                        "max_seq_len, or a choice the tokenizer cannot spell)"
                    )
            self._vars[expr.name] = text
            self._append_text(text)
        else:
            raise TypeError(f"cannot append {type(expr).__name__}")

    def _check_generation(self) -> None:
        """Generation (gen, select, call_tool) happens in assistant blocks, or in a program without roles."""
        if self._open is not None and self._open[0] is not Role.ASSISTANT:
            raise RequestError(f"gen / select inside a {self._open[0].value} block: generate in assistant blocks")
        if self._messages and self._open is None:
            raise RequestError("gen / select outside a role block in a chat program: use assistant(gen(...))")

    def _rank(self, expr: Select) -> str:
        """Score every choice in one submission (``choices.py``); keep the scores as the variable's meta info."""
        text = self._prompt_text()
        state_ids = self._encode(text)
        requests, starts = [], []
        for choice in expr.choices:
            ids = self._encode(text + choice)
            start = next((i for i, (a, b) in enumerate(zip(ids, state_ids, strict=False)) if a != b), len(state_ids))
            if start >= len(ids):
                raise RequestError(f"select {expr.name!r}: choice {choice!r} adds no token to the state's text")
            starts.append(max(start, 1))  # position 0 has no logprob: a state with no text scores from the second
            score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, prompt_logprobs_from=starts[-1])
            requests.append((ids, score))
        states = self._runtime.generate_all(requests, busy=True)
        logprobs = [[lp.logprob for lp in st.prompt_logprobs[p:]] for st, p in zip(states, starts, strict=True)]
        scores = SelectScores.rank(expr.method, expr.choices, logprobs)
        self._meta[expr.name] = scores
        return expr.choices[scores.chosen]

    def _append_text(self, text: str) -> None:
        if self._open is not None:
            self._open = (self._open[0], self._open[1] + text)
        elif self._messages:
            raise RequestError("text outside a role block in a chat program: put it in system / user / assistant")
        else:
            self._plain += text

    def _prompt_text(self, tools: list[dict[str, Any]] | None = None) -> str:
        """The text the model sees: the plain text, or the chat template's rendering of the closed blocks (with the
        generation prompt and the content so far when an assistant block is open; ``tools``: the functions handed
        to the template, for a ``call_tool``)."""
        if not self._messages and self._open is None:
            return self._plain
        tokenizer = self._runtime.tokenizer
        if self._open is None:
            return self._plain + tokenizer.apply_chat_template(self._messages, add_generation_prompt=False)
        role, content = self._open
        if role is not Role.ASSISTANT:  # a system / user block being written: shown as the message it will be
            shown = [*self._messages, {"role": role.value, "content": content}]
            return self._plain + tokenizer.apply_chat_template(shown, add_generation_prompt=False)
        if not self._messages:
            raise RequestError("a chat program starts with a system or user block, not an assistant block")
        rendered = tokenizer.apply_chat_template(self._messages, add_generation_prompt=True, tools=tools)
        return self._plain + rendered + content

    def _encode(self, text: str) -> list[int]:
        chat = bool(self._messages) or self._open is not None
        return self._runtime.tokenizer.encode(text, add_special_tokens=not chat)

    def _close(self) -> None:
        self._executor.shutdown(wait=True)


class ForkGroup(list[ProgramState]):
    """The branches of ``ProgramState.fork``; ``join()`` waits for all of them."""

    def join(self) -> ForkGroup:
        for branch in self:
            branch.sync()
        return self


class _Run:
    """The states of one program run (closed together at its end)."""

    def __init__(self) -> None:
        self.states: list[ProgramState] = []  # appended from the program's thread only (fork happens there)
        self.running = False  # the program's thread is running the program (and counts as busy)

    def close(self) -> None:
        for state in list(self.states):
            state._close()


class Program:
    """A ``@function`` program: ``run(llm, **args)`` one, ``run_batch(llm, [args, ...])`` several in one batch."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, llm: LLM, /, **arguments: Any) -> ProgramState:
        """Run the program on ``llm``; returns its state once every append (of every fork) has finished."""
        with Runtime(llm) as runtime:
            return self._run_on(runtime, arguments)

    def run_batch(self, llm: LLM, arguments: Sequence[Mapping[str, Any]]) -> list[ProgramState]:
        """Run the program once per mapping of arguments, all at once (their requests share the engine's batch)."""
        with Runtime(llm) as runtime, ThreadPoolExecutor(max_workers=max(1, len(arguments))) as pool:
            futures = [pool.submit(self._run_on, runtime, dict(a)) for a in arguments]
            return [f.result() for f in futures]

    def _run_on(self, runtime: Runtime, arguments: dict[str, Any]) -> ProgramState:
        run = _Run()
        state = ProgramState(runtime, run)
        run.running = True
        runtime.add_busy(1)
        try:
            self.fn(state, **arguments)
        finally:
            run.running = False
            runtime.add_busy(-1)
            try:
                for s in list(run.states):
                    s.sync()
            finally:
                run.close()
        return state


def function(fn: Callable[..., None]) -> Program:
    """Make ``fn(s, **arguments)`` a program: ``s`` is its ``ProgramState``; run it with ``.run(llm, ...)``."""
    return Program(fn)


__all__ = ["ForkGroup", "Program", "ProgramState", "function"]
