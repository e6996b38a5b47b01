"""``trtbuild chat``: multi-turn with history, ``/reset``, a turn that outgrows the engine refused without ending the
chat, Ctrl-D, and one error line for an engine without a chat template. Replies are checked against ``LLM.chat``."""

from __future__ import annotations

import io
import sys

import pytest
from test_llm import add_tokenizer
from test_run_cli import assert_one_error_line, cli

from trtbuild.runtime.llm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def text_engine(tiny_engines, tmp_path_factory):
    return add_tokenizer(tiny_engines["llama_gqa"][2], tmp_path_factory.mktemp("chat") / "engine")


def chat(monkeypatch, capsys, engine, typed: str, *flags: object) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(typed))
    return cli(monkeypatch, capsys, "chat", engine, "--temperature", 0, "--max-tokens", 6, *flags)


def test_chat_keeps_history_resets_and_survives_an_overlong_turn(monkeypatch, capsys, text_engine):
    llm = LLM(text_engine)
    system = {"role": "system", "content": "be brief"}
    first = [system, {"role": "user", "content": "hi"}]
    a1 = llm.chat(first, GREEDY)[0].text
    second = [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": "and?"}]
    a2 = llm.chat(second, GREEDY)[0].text
    fresh = llm.chat([system, {"role": "user", "content": "cat"}], GREEDY)[0].text
    too_long = "x" * 200  # the engine's max_seq_len is 128 tokens, one a character
    typed = f"hi\n\nand?\n{too_long}\n/reset\ncat\n"
    code, out, err = chat(monkeypatch, capsys, text_engine, typed, "--system", "be brief")
    assert code == 0, err
    assert out.splitlines() == [a1, a2, fresh]  # turn 2 saw turn 1; after /reset only the system message
    assert err.count("error: ") == 1 and "max_seq_len" in err and "/reset starts a new conversation" in err
    assert "(new conversation)" in err and "(reply cut at the token limit)" in err  # 6 tokens: cut


def test_chat_exit_command_and_help(monkeypatch, capsys, text_engine):
    code, out, err = chat(monkeypatch, capsys, text_engine, "/help\n/exit\nhi\n")
    assert code == 0 and out == "" and "/reset" in err and "/exit" in err  # nothing after /exit runs


def test_chat_needs_a_chat_template(monkeypatch, capsys, tiny_engines, tmp_path):
    engine = add_tokenizer(tiny_engines["llama_gqa"][2], tmp_path / "e", chat_template=False)
    code, _, err = chat(monkeypatch, capsys, engine, "hi\n")
    assert_one_error_line(code, err, "has no chat template")
