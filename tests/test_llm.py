"""The runner API (``trtbuild.LLM``) on the tiny engines: batching, preemption, prefix caching, sampling, text.

The tiny engines have no tokenizer, so most tests use token-id prompts; ``text_engine`` adds a small character
tokenizer (with byte-fallback tokens for multi-byte characters) and a chat template to a copy of one.
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trtbuild.errors import ConfigError, EngineError, RequestError
from trtbuild.runtime.llm import LLM, SamplingParams
from trtbuild.runtime.outputs import CompletionState
from trtbuild.runtime.sequence import FinishReason, Sequence
from trtbuild.runtime.step_shaping import split_step
from trtbuild.runtime.tokenizer import IncrementalDetokenizer

CHARS = [" ", *map(chr, range(97, 123)), *".,!?\n", *map(str, range(10)), *map(chr, range(65, 91))]
WORDS = [" the", " cat", "ing", "st", "op", "STOP", " a", " is", " of"]
BYTES = ["<0xC3>", "<0xA9>", "<0xE6>", "<0x97>", "<0xA5>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
VOCAB = ["<unk>", "<s>", "</s>", *CHARS, *WORDS, *BYTES]  # 89 tokens: fits every tiny model's vocabulary
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def add_tokenizer(engine: Path, dst: Path, *, chat_template: bool = True) -> Path:
    """A copy of ``engine`` with a character-level tokenizer (ids as in VOCAB; </s> = 2 = the llama EOS)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    shutil.copytree(engine, dst)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    if chat_template:
        (dst / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return dst


@pytest.fixture(scope="module")
def engine(tiny_engines) -> Path:
    return tiny_engines["llama_gqa"][2]


@pytest.fixture(scope="module")
def text_engine(tiny_engines, tmp_path_factory) -> Path:
    return add_tokenizer(tiny_engines["llama_gqa"][2], tmp_path_factory.mktemp("text") / "engine")


@pytest.fixture(scope="module")
def llm(engine) -> LLM:
    return LLM(engine)


@pytest.fixture(scope="module")
def text_llm(text_engine) -> LLM:
    return LLM(text_engine)


def mixed_requests(vocab: int, n: int = 16, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, int(rng.integers(1, 48))).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 24)), ignore_eos=True) for _ in prompts]
    return prompts, params


def ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


# ------------------------------------------------------------------------------------------------ batching


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2", "qwen2_bias"])
def test_concurrent_greedy_equals_each_alone(tiny_engines, name):
    llm = LLM(tiny_engines[name][2])
    prompts, params = mixed_requests(llm.vocab_size)
    together = llm.generate(prompts, params)
    alone = LLM(tiny_engines[name][2], enable_prefix_caching=False)
    assert ids(together) == [alone.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    chunked = LLM(tiny_engines[name][2], max_num_batched_tokens=16, max_num_seqs=5)  # chunked prefill, queueing
    assert ids(chunked.generate(prompts, params)) == ids(together)
    assert [len(o.token_ids) for o in together] == [sp.max_tokens for sp in params]
    assert all(o.finish_reason is FinishReason.LENGTH for o in together)
    assert llm.stats.num_engine_calls > llm.stats.num_steps  # steps mixing prefills with decodes were split
    assert not llm.scheduler.has_unfinished()


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3", "phi3", "gemma3"])
def test_greedy_matches_transformers(tiny_engines, name):
    import torch

    model, _, engine_dir = tiny_engines[name]
    llm = LLM(engine_dir)
    prompts, _ = mixed_requests(llm.vocab_size, n=4, seed=3)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert out.token_ids == ref[0, len(prompt) :].tolist()


def test_small_pool_preempts_and_completes_unchanged(engine, llm):
    prompts, params = mixed_requests(llm.vocab_size, seed=1)
    small = LLM(engine, kv_cache_memory=40 * 2048)  # 39 usable blocks of 4 tokens for 16 requests of ~45 tokens
    assert small.num_kv_blocks == 39
    outs = small.generate(prompts, params)
    assert small.stats.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == small.stats.num_preemptions
    assert ids(outs) == ids(LLM(engine).generate(prompts, params))
    assert small.scheduler.kv_cache.num_used_blocks == 0


def test_repeated_prefix_served_from_cache(engine):
    rng = np.random.default_rng(4)
    prefix = rng.integers(3, 97, 64).tolist()
    a, b = [*prefix, 5, 6, 7, 8, 9], [*prefix, 9, 8, 7]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(engine)
    first = llm.generate([a], params)[0]
    computed_first = llm.stats.num_computed_tokens
    llm.reset_stats()
    second = llm.generate([b], params)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == 64
    assert llm.stats.prefix_cache_hits == 64 and llm.stats.prefix_cache_hit_rate > 0.9
    assert llm.stats.num_computed_tokens <= computed_first - 64
    assert second.token_ids == LLM(engine, enable_prefix_caching=False).generate([b], params)[0].token_ids


def test_split_step_groups_decodes_and_separates_long_chunks():
    assert split_step([1, 1, 1]) == [[0, 1, 2]]
    assert split_step([1, 300, 1, 1]) == [[1], [0, 2, 3]]
    assert split_step([128, 120, 1]) == [[0, 1], [2]]
    assert split_step([600, 1, 3, 1, 256]) == [[0], [4], [2, 1, 3]]


# ------------------------------------------------------------------------------------------------ sampling


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    prompt = [5, 17, 33, 2, 8]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].token_ids
    others, other_params = mixed_requests(llm.vocab_size, n=6, seed=9)
    batch = llm.generate([*others[:3], prompt, *others[3:]], [*other_params[:3], params, *other_params[3:]])
    assert batch[3].token_ids == alone
    assert llm.generate([prompt], params)[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].token_ids != alone


def test_n_completions_use_seed_plus_index(llm):
    prompt = [7, 8, 9]
    base = dict(temperature=1.0, max_tokens=10, ignore_eos=True)
    out = llm.generate([prompt], SamplingParams(n=3, seed=40, **base))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for k, c in enumerate(out.outputs):
        assert c.token_ids == llm.generate([prompt], SamplingParams(seed=40 + k, **base))[0].token_ids


def test_logprobs_align_with_tokens(llm):
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert len(lp.top) == 3 and lp.top[0][0] == token and lp.logprob == pytest.approx(lp.top[0][1])
    assert llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2))[0].logprobs is None


def test_stop_token_ids_finish_and_stay_in_output(llm):
    prompt = [11, 12, 13, 14]
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0].token_ids
    stop = full[6]
    i = full.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]))[0]
    assert out.token_ids == full[: i + 1]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop


def test_metrics(llm):
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    m = out.metrics
    assert m.num_prompt_tokens == 4 and m.num_output_tokens == 8
    assert 0 < m.ttft <= m.e2e_latency and m.tpot > 0 and m.decode_tokens_per_s == pytest.approx(1 / m.tpot)
    one = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=1))[0].metrics
    assert np.isnan(one.tpot) and np.isnan(one.decode_tokens_per_s)


# ---------------------------------------------------------------------------------------- text and streams


def test_text_is_the_decoded_output_and_stream_deltas_concatenate(text_llm):
    tok = text_llm.tokenizer
    prompts = ["the cat is", "Hello, world!", "a"]
    for seed in range(4):
        params = SamplingParams(temperature=1.5, seed=seed, max_tokens=30)
        out = text_llm.generate(prompts, params)
        for prompt, o in zip(prompts, out, strict=True):
            visible = [t for t in o.token_ids if t != 2]
            assert o.text == tok.decode(visible).rstrip("\ufffd")  # a character cut off at max_tokens is dropped
            stream = text_llm.generate_stream(prompt, params)
            deltas = list(stream)
            assert "".join(deltas) == o.text == stream.output.text
            assert stream.output.token_ids == o.token_ids


def test_incremental_detokenizer_assembles_multibyte_characters(text_llm):
    tok, v = text_llm.tokenizer, {t: i for i, t in enumerate(VOCAB)}
    pieces = ["a", "<0xE6>", "<0x97>", "<0xA5>", " the", "<0xC3>", "<0xA9>", " a", "<0xF0>", "<0x9F>", "</s>"]
    detok = IncrementalDetokenizer(tok, tok.encode("x y"))
    assert [detok.append(v[p]) for p in pieces] == ["a", "", "", "日", " the", "", "é", " a", "", "", ""]
    assert detok.flush() == ""  # an incomplete UTF-8 tail (the output stopped mid-character) is dropped
    assert detok.flush() == ""


def test_stop_strings_cut_exactly(text_llm):
    prompt = "the cat"
    greedy = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = text_llm.generate([prompt], SamplingParams(**greedy))[0].text
    assert len(full) > 20
    for start, length in [(12, 3), (5, 1), (17, 2)]:
        stop = full[start : start + length]
        out = text_llm.generate([prompt], SamplingParams(stop=[stop], **greedy))[0]
        assert out.text == full[: full.index(stop)]
        assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
        two = text_llm.generate([prompt], SamplingParams(stop=[full[18:20], stop], **greedy))[0]
        assert two.text == full[: min(full.index(stop), full.index(full[18:20]))]


def test_stream_never_emits_text_a_stop_string_cuts(text_llm):
    for seed in range(6):
        params = SamplingParams(temperature=1.2, seed=seed, max_tokens=40, stop=["at", "e ", "xyz"])
        stream = text_llm.generate_stream("the cat", params)
        emitted = ""
        for delta in stream:
            emitted += delta
        final = stream.output
        assert emitted == final.text
        assert not any(s in final.text for s in params.stop)


class FakeDetokenizer:
    def __init__(self, pieces: list[str]) -> None:
        self.pieces = iter(pieces)

    def append(self, token_id: int) -> str:
        return next(self.pieces)

    def flush(self) -> str:
        return ""


def test_stream_holds_back_a_possible_stop_string_start():
    seq = Sequence("r", [1], SamplingParams(stop=("abc", "zz")), 0)
    state = CompletionState(seq, 0, FakeDetokenizer(["xa", "b", "d", "z", "q", "ab", "c!"]), (), 0.0)
    got = []
    for t in range(7):
        seq.output_token_ids.append(t)
        stop = state.on_token(t, 1.0)
        got.append(state.take_delta())
        if stop is not None:
            break
    assert got == ["x", "", "abd", "", "zq", "", ""] and stop == "abc" and state.text == "xabdzq"


def test_chat_template(text_llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = text_llm.tokenizer.apply_chat_template(messages)
    assert rendered == "<s>system\nbe brief</s>\n<s>user\nhi</s>\n<s>assistant\n"
    prompt_ids = text_llm.chat_prompt(messages)
    assert prompt_ids[0] == 1 and prompt_ids == text_llm.tokenizer.encode(rendered, add_special_tokens=False)
    out = text_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert out.prompt_token_ids == prompt_ids
    assert out.token_ids == text_llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=5))[0].token_ids
    assert len(text_llm.chat([messages, messages[1:]], SamplingParams(max_tokens=2))) == 2
    with pytest.raises(RequestError, match="bad role tool"):
        text_llm.chat([{"role": "tool", "content": "x"}])
    with pytest.raises(RequestError, match="messages"):
        text_llm.chat_prompt([{"content": "no role"}])
    with pytest.raises(RequestError, match="non-empty"):
        text_llm.chat([])


def test_chat_without_template_or_tokenizer(text_engine, engine, tmp_path):
    no_template = LLM(add_tokenizer(engine, tmp_path / "e", chat_template=False))
    with pytest.raises(RequestError, match="no chat template"):
        no_template.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(RequestError, match=r"no tokenizer\.json"):
        LLM(engine).chat([{"role": "user", "content": "hi"}])


def test_abandoned_stream_is_aborted(text_llm):
    stream = text_llm.generate_stream("the cat", SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    next(iter(stream))
    del stream
    gc.collect()
    text_llm.generate(["a"], SamplingParams(max_tokens=2))
    assert not text_llm.scheduler.has_unfinished() and text_llm.scheduler.kv_cache.num_used_blocks == 0


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([1] * 128, SamplingParams(), "max_seq_len"),
        ([1] * 120, SamplingParams(max_tokens=9), "exceeds the engine's max_seq_len"),
        ([], SamplingParams(), "prompt is empty"),
        ([5, 97], SamplingParams(), "token id 97 is outside the vocabulary"),
        ([-1], SamplingParams(), "token id -1"),
        ("text", SamplingParams(), "no tokenizer.json"),
        ([1, 2], SamplingParams(stop=["x"]), "no tokenizer.json, needed for stop strings"),
        ([1, "a"], SamplingParams(), "a prompt is a string or a list of token ids"),
        ([1, 2], "greedy", "expected SamplingParams"),
    ],
)
def test_bad_request_raises_and_disturbs_nothing(llm, prompt, params, match):
    good, good_params = mixed_requests(llm.vocab_size, n=3, seed=5)
    expected = ids(llm.generate(good, good_params))
    with pytest.raises(RequestError, match=match) as e:
        llm.generate([good[0], prompt, good[1]], [good_params[0], params, good_params[1]])
    assert str(e.value).startswith("prompt 1: ") and "\n" not in str(e.value)
    assert ids(llm.generate(good, good_params)) == expected
    assert not llm.scheduler.has_unfinished() and llm.scheduler.kv_cache.num_used_blocks == 0


def test_failed_generate_leaves_an_open_stream_running(text_llm):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = text_llm.generate(["the cat"], params)[0]
    stream = text_llm.generate_stream("the cat", params)
    first = next(stream)
    with pytest.raises(RequestError, match="prompt 0: prompt is empty"):
        text_llm.generate([""])
    assert first + "".join(stream) == expected.text and stream.output.token_ids == expected.token_ids


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n must be"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kwargs)


def test_request_level_errors(llm):
    with pytest.raises(RequestError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(RequestError, match="params must be a SamplingParams or a list of them, not str"):
        llm.generate([[1]], "greedy")
    with pytest.raises(RequestError, match="n must be 1"):
        llm.generate_stream([1], SamplingParams(n=2))
    assert llm.generate([], SamplingParams()) == []
    as_array = llm.generate(np.array([[3, 4, 5]]), SamplingParams(temperature=0.0, max_tokens=3))
    assert (
        as_array[0].token_ids == llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=3))[0].token_ids
    )


def test_engine_dir_errors(engine, text_engine, tmp_path):
    with pytest.raises(EngineError, match="no such engine directory"):
        LLM(tmp_path / "missing")
    with pytest.raises(EngineError, match="not an engine directory"):
        LLM(tmp_path)
    bad_config = shutil.copytree(engine, tmp_path / "bad_config")
    (bad_config / "runtime_config.json").write_text("{not json")
    with pytest.raises(EngineError, match=r"corrupt runtime_config\.json"):
        LLM(bad_config)
    bad_onnx = shutil.copytree(engine, tmp_path / "bad_onnx")
    onnx_file = next(bad_onnx.rglob("*.onnx"))
    onnx_file.write_bytes(onnx_file.read_bytes()[:100])
    with pytest.raises(EngineError, match=r"size 100 != recorded .*the engine changed after it was built"):
        LLM(bad_onnx)  # the size check on load
    (bad_onnx / "manifest.json").unlink()  # an interrupted build's leftover, or a copy that lost it
    for verify in (False, True):
        with pytest.raises(EngineError, match=r"no manifest\.json, so not a finished engine"):
            LLM(bad_onnx, verify=verify)
    bad_tok = shutil.copytree(text_engine, tmp_path / "bad_tok")
    (bad_tok / "tokenizer.json").write_text('{"version": ')
    with pytest.raises(EngineError, match="cannot load the tokenizer"):
        LLM(bad_tok)
    with pytest.raises(ConfigError, match="too small"):
        LLM(engine, kv_cache_memory=3000)
    with pytest.raises(ConfigError, match=r"max_num_seqs must be an integer in \[1, 64\]"):
        LLM(engine, max_num_seqs=65)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        LLM(engine, max_num_batched_tokens=0)


def test_runtime_imports_no_build_tool(engine):
    """The thin runtime: numpy, onnxruntime, tokenizers; not torch, transformers or onnx (a build extra)."""
    code = (
        "import sys, trtbuild\n"
        "assert 'numpy' not in sys.modules and 'onnxruntime' not in sys.modules, 'import trtbuild is not light'\n"
        f"llm = trtbuild.LLM({str(engine)!r})\n"
        "out = llm.generate([[1, 2, 3]], trtbuild.SamplingParams(max_tokens=3, ignore_eos=True))\n"
        "assert len(out[0].token_ids) == 3\n"
        "heavy = [m for m in ('torch', 'transformers', 'onnx') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_default_kv_cache_holds_a_full_batch_of_full_sequences(tiny_engines):
    from trtbuild.runtime.kv_cache import available_memory, default_cpu_kv_cache_memory

    llm = LLM(tiny_engines["llama_gqa"][2])
    model, build = llm.session.config.model, llm.session.config.build
    assert llm.session.kv_cache_memory == default_cpu_kv_cache_memory(model, build, available_memory())
    assert llm.num_kv_blocks >= build.max_batch_size * -(-build.max_seq_len // build.kv_block_size)


def test_finish_reason_prints_as_its_value(text_engine, capsys):
    """The README's example prints ``length``, not ``FinishReason.LENGTH``; it compares and serializes as a string."""
    out = LLM(text_engine).generate(["the cat"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    print(out.text, out.finish_reason, out.metrics.ttft)  # as README.md and docs/runner.md do
    printed = capsys.readouterr().out
    assert f" length {out.metrics.ttft}" in printed and "FinishReason" not in printed
    assert out.finish_reason is FinishReason.LENGTH and out.finish_reason == "length"
    assert f"{out.outputs[0].finish_reason}" == "length" and json.dumps(out.finish_reason) == '"length"'
