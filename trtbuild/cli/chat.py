"""``trtbuild chat ENGINE_DIR``: an interactive multi-turn chat with an engine, in the terminal.

Each turn renders the whole conversation with the engine's chat template and streams the reply. Prefix caching
keeps the earlier turns' KV blocks, so a turn computes only its new tokens. Commands: ``/reset`` starts a new
conversation (the ``--system`` message kept), ``/exit`` (or Ctrl-D) quits, ``/help`` lists them. Ctrl-C stops the
reply being generated (what was generated stays in the conversation) and, at the prompt, clears the line. A turn
that no longer fits the engine's ``max_seq_len`` is refused with one line and leaves the conversation as it was.
Lines typed at the prompt are kept in the input history (arrow keys) where Python has ``readline``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Any

import click

from ..errors import EngineError, RequestError
from .jsonl import make_params
from .run import EngineFlags, engine_options, open_llm, sampling_options

COMMANDS = {"/reset": "start a new conversation", "/exit": "quit (or Ctrl-D)", "/help": "this list"}
PROMPT = ">>> "


class Conversation:
    """The messages so far: an optional system message, then user / assistant turns."""

    def __init__(self, system: str | None) -> None:
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    def with_user(self, text: str) -> list[dict[str, str]]:
        return [*self.messages, {"role": "user", "content": text}]


def reply(llm: Any, messages: list[dict[str, str]], params: Any) -> tuple[str, Any]:
    """Stream the assistant's reply to ``messages`` to stdout; (its text, finish reason). Ctrl-C aborts it."""
    stream = llm.generate_stream(llm.chat_prompt(messages), params)
    parts: list[str] = []
    try:
        for delta in stream:
            parts.append(delta)
            click.echo(delta, nl=False)
    except KeyboardInterrupt:
        stream.close()
        click.echo(" [stopped]")
        return "".join(parts), None
    click.echo()
    assert stream.output is not None
    return "".join(parts), stream.output.outputs[0].finish_reason


def read_line() -> str | None:
    """One line typed at the prompt (None at end of input); Ctrl-C clears it and asks again."""
    while True:
        try:
            return input(PROMPT if sys.stdin.isatty() else "")
        except EOFError:
            return None
        except KeyboardInterrupt:
            click.echo()


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--system", default=None, help="system message at the start of every conversation")
@engine_options
@sampling_options
def chat(engine_dir: Path, system: str | None, engine: EngineFlags, **options: Any) -> None:
    """Chat with an engine in the terminal: multi-turn, streamed, with its chat template.

    Replies run until the model ends its turn (or --max-tokens, or the engine's max_seq_len). /reset starts over,
    /exit or Ctrl-D quits; Ctrl-C stops a reply.
    """
    sampling = options  # the rest: one SamplingParams field each
    params = make_params(sampling)
    if sampling.get("max_tokens") is None:  # a reply is as long as the model makes it, not run's 16 tokens
        params = dataclasses.replace(params, max_tokens=None)
    if params.n != 1:
        raise RequestError("chat streams one reply: --n must be 1")
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (input() gains line editing and history)
    llm = open_llm(engine_dir, engine)
    if llm.tokenizer is None or llm.tokenizer.chat_template is None:
        raise EngineError(f"{engine_dir}: the engine has no chat template (use trtbuild run --prompt)")
    conversation = Conversation(system)
    if sys.stdin.isatty():
        click.echo(f"chatting with {engine_dir} (/help for commands, Ctrl-D to quit)", err=True)
    while (line := read_line()) is not None:
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                conversation.reset()
                click.echo("(new conversation)", err=True)
            else:
                click.echo("\n".join(f"{c:<8} {h}" for c, h in COMMANDS.items()), err=True)
            continue
        messages = conversation.with_user(line)
        try:
            answer, finish = reply(llm, messages, params)
        except RequestError as e:  # e.g. the conversation outgrew max_seq_len: this turn is dropped, not the chat
            click.echo(f"error: {e} (/reset starts a new conversation)", err=True)
            continue
        conversation.messages = [*messages, {"role": "assistant", "content": answer}]
        if finish is not None and finish.value == "length":
            click.echo("(reply cut at the token limit)", err=True)
