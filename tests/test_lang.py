"""``trtbuild.lang`` programs on the tiny text engine (test_llm's character tokenizer and chat template).

References are plain ``LLM`` calls on the same engine: a greedy ``gen`` must produce what ``LLM.generate`` does
for the program's text so far, a chat program what ``LLM.chat`` does for its messages.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_llm import VOCAB, add_tokenizer

from trtbuild.errors import RequestError
from trtbuild.lang import ChoicesMethod, assistant, function, gen, select, system, user
from trtbuild.runtime.llm import LLM, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_engines, tmp_path_factory) -> Path:
    return add_tokenizer(tiny_engines["llama_gqa"][2], tmp_path_factory.mktemp("lang") / "engine")


@pytest.fixture(scope="module")
def llm(engine) -> LLM:
    return LLM(engine)


def greedy(llm: LLM, prompt, max_tokens: int) -> str:
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].text


def test_gen_in_plain_text(llm):
    @function
    def prog(s, subject):
        s += subject + " is" + gen("what", max_tokens=8)
        s += ". so" + gen("then", max_tokens=5, stop="o")

    state = prog.run(llm, subject="the cat")
    first = greedy(llm, "the cat is", 8)
    assert state["what"] == first
    second = llm.generate([f"the cat is{first}. so"], SamplingParams(temperature=0.0, max_tokens=5, stop="o"))[0]
    assert state["then"] == second.text
    assert state.text() == f"the cat is{first}. so{second.text}"


def test_chat_roles_are_rendered_by_the_chat_template(llm):
    @function
    def chat(s, question):
        s += system("be brief")
        s += user(question)
        s += assistant(gen("answer", max_tokens=10))
        s += user("and then?")
        s += assistant("Well," + gen("more", max_tokens=6))

    state = chat.run(llm, question="the cat?")
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat?"}]
    assert state["answer"] == llm.chat(turn1, SamplingParams(temperature=0.0, max_tokens=10))[0].text
    turn2 = [*turn1, {"role": "assistant", "content": state["answer"]}, {"role": "user", "content": "and then?"}]
    expected = greedy(llm, llm.chat_prompt(turn2) + llm.tokenizer.encode("Well,", add_special_tokens=False), 6)
    assert state["more"] == expected
    assert state.messages()[-1] == {"role": "assistant", "content": "Well," + expected}
    assert state.text() == llm.tokenizer.apply_chat_template(state.messages(), add_generation_prompt=False)


def test_constrained_select_picks_in_one_request_what_the_model_prefers(llm):
    """Choices with different first tokens: the pick is the one whose first token the model rates highest."""
    choices = ["dog", "cat", "bird", "fish"]

    @function
    def pick(s):
        s += "my pet is a " + select("pet", choices, choices_method=ChoicesMethod.CONSTRAINED_DECODING)

    before = llm._num_requests
    state = pick.run(llm)
    assert llm._num_requests - before == 1  # one request for the four choices
    top = llm.generate(["my pet is a "], SamplingParams(temperature=0.0, max_tokens=1, logprobs=llm.vocab_size))
    logprob = dict(top[0].logprobs[0].top)
    assert state["pet"] == max(choices, key=lambda c: logprob[VOCAB.index(c[0])])
    assert state.text() == "my pet is a " + state["pet"]


def test_fork_branches_share_the_prefix_and_run_together(llm):
    prefix = "the cat is a cat of the stop. " * 3  # 90 characters: 90 tokens

    @function
    def branches(s):
        s += prefix
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"{i}:" + gen("x", max_tokens=8, ignore_eos=True)
        forks.join()
        s += " / ".join(f["x"] for f in forks)

    llm.reset_stats()
    state = branches.run(llm)
    stats = llm.stats
    outs = [greedy(llm, f"{prefix}{i}:", 8) for i in range(3)]
    assert state.text() == prefix + " / ".join(outs)
    # The prefix is computed once (the fork's commit); each branch computes its own few tokens.
    assert stats.num_computed_tokens < len(prefix) + 3 * (4 + 2 + 8)
    assert stats.prefix_cache_hits >= 3 * (len(prefix) - 4)
    # The three branches decode in the same steps: far fewer than 3 x 8 steps one after another.
    assert stats.num_steps <= 1 + 12


def test_gen_with_regex_and_json_schema(llm):
    number = {"type": "integer", "minimum": 10, "maximum": 999}

    @function
    def structured(s):
        s += "id " + gen("id", regex=r"[a-z]{3}[0-9]{2}", max_tokens=20)
        s += " n " + gen("n", json_schema=number, max_tokens=20, temperature=1.0, seed=2)

    state = structured.run(llm)
    assert re.fullmatch(r"[a-z]{3}[0-9]{2}", state["id"])
    assert 10 <= json.loads(state["n"]) <= 999


def test_run_batch_equals_runs_one_by_one(llm):
    @function
    def prog(s, word):
        s += word + gen("x", max_tokens=6)

    words = ["a", "the", "stop", "Z"]
    together = prog.run_batch(llm, [{"word": w} for w in words])
    assert [st["x"] for st in together] == [prog.run(llm, word=w)["x"] for w in words]


def test_program_errors_are_request_errors(llm):
    @function
    def gen_in_user(s):
        s += user("hi", gen("x"))

    with pytest.raises(RequestError, match="inside a user block"):
        gen_in_user.run(llm)

    @function
    def text_outside_roles(s):
        s += user("hi")
        s += "loose"

    with pytest.raises(RequestError, match="outside a role block"):
        text_outside_roles.run(llm)
    with pytest.raises(RequestError, match="regex '\\[' is not supported"):
        gen("x", regex="[")
    with pytest.raises(RequestError, match="non-empty strings"):
        select("x", [])
    with pytest.raises(KeyError, match="no variable 'y'"):
        function(lambda s: None).run(llm)["y"]


def test_select_escapes_regex_characters(llm):
    choices = ["a.b", "ok?", "a.b.c", "x?y"]  # "." and "?" are regex operators

    @function
    def pick(s):
        s += "q " + select("c", choices, choices_method=ChoicesMethod.CONSTRAINED_DECODING, temperature=1.0)

    picks: set[str] = set()
    for _ in range(40):  # until two differ (a random tiny model may favour one choice: 6 draws were once all "ok?")
        picks.add(pick.run(llm)["c"])
        assert picks <= set(choices)  # each one literal (regex characters escaped)
        if len(picks) > 1:
            break
    assert len(picks) > 1  # sampled among the choices
