"""``trtbuild run`` and ``trtbuild bench`` end to end on the tiny engines, and their bad-input errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_llm import add_tokenizer

from trtbuild.cli import main
from trtbuild.runtime.llm import LLM, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_engines) -> Path:
    return tiny_engines["llama_gqa"][2]


@pytest.fixture(scope="module")
def text_engine(tiny_engines, tmp_path_factory) -> Path:
    return add_tokenizer(tiny_engines["llama_gqa"][2], tmp_path_factory.mktemp("cli") / "engine")


def cli(monkeypatch, capsys, *args: object) -> tuple[int, str, str]:
    """Run ``trtbuild ARGS`` in this process through ``main``; (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["trtbuild", *map(str, args)])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0], lines[0]


def test_run_prompt_prints_the_generated_text(monkeypatch, capsys, text_engine):
    expected = LLM(text_engine).generate(["the cat"], SamplingParams(temperature=0.0, max_tokens=12))[0].text
    args = ["run", text_engine, "--prompt", "the cat", "--temperature", 0, "--max-tokens", 12]
    code, out, err = cli(monkeypatch, capsys, *args)
    assert code == 0, err
    assert out == expected + "\n" and "tokens" in err
    code, out, _ = cli(monkeypatch, capsys, *args, "--stream")
    assert code == 0 and out == expected + "\n"
    code, out, _ = cli(monkeypatch, capsys, *args, "--prompt-logprobs", 1)
    assert code == 0 and out.startswith(expected + "\n--- prompt logprobs ---\n")
    assert len(out.splitlines()) == 2 + len("the cat") - 1  # every prompt token but the first


def test_run_chat_and_n(monkeypatch, capsys, text_engine):
    llm = LLM(text_engine)
    prompt = llm.chat_prompt([{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}])
    expected = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0].text
    args = ["run", text_engine, "--prompt", "hi", "--chat", "--system", "be nice", "--temperature", 0]
    code, out, err = cli(monkeypatch, capsys, *args, "--max-tokens", 6)
    assert code == 0 and out == expected + "\n", err
    code, out, err = cli(monkeypatch, capsys, "run", text_engine, "--prompt", "hi", "--n", 2, "--seed", 3)
    assert code == 0 and out.count("--- completion") == 2, err


def test_run_jsonl_in_and_out(monkeypatch, capsys, text_engine, tmp_path):
    lines = [
        {"prompt": "the cat", "id": "a"},
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 3, "logprobs": 2, "prompt_logprobs": 1},
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "seed": 5, "n": 2},
        {"prompt": "stop here", "stop": ["e"], "temperature": 0.0},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out" / "results.jsonl"
    dst.parent.mkdir()  # its directory must exist (test_cli_errors.py)
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    args = ["run", text_engine, "--input", src, "--output", dst, "--max-tokens", 8, "--temperature", 0]
    code, _, err = cli(monkeypatch, capsys, *args)
    assert code == 0, err
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in results] == ["a", 1, 2, 3]
    llm = LLM(text_engine)
    assert results[0]["text"] == llm.generate(["the cat"], SamplingParams(temperature=0.0, max_tokens=8))[0].text
    assert len(results[1]["outputs"][0]["token_ids"]) == 3 and len(results[1]["outputs"][0]["logprobs"]) == 3
    scored = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
    want = [None] + [{"logprob": lp.logprob, "top": [list(t) for t in lp.top]} for lp in scored.prompt_logprobs[1:]]
    assert results[1]["prompt_logprobs"] == want and "prompt_logprobs" not in results[0]
    assert len(results[2]["outputs"]) == 2
    assert "e" not in results[3]["text"]
    assert results[0]["outputs"][0]["metrics"]["num_prompt_tokens"] == 7
    assert not [p for p in dst.parent.iterdir() if p.name != "results.jsonl"]  # no temporary file left


def test_blank_lines_are_skipped_and_dash_reads_stdin(text_engine, tmp_path):
    """JSON lines with blank lines (interior, whitespace-only, trailing) read as JSON-lines readers do; ``--input -``
    and ``--prompt -`` read standard input (a real pipe into the CLI process)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    run = [sys.executable, "-m", "trtbuild.cli", "run", str(text_engine), "--temperature", "0", "--max-tokens", "6"]
    lines = '{"prompt": "the cat"}\n\n   \n{"prompt": "a dog", "id": "d"}\n\n'
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([*run, "--input", "-", "--output", out], input=lines, capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    llm = LLM(text_engine)
    expected = [o.text for o in llm.generate(["the cat", "a dog"], SamplingParams(temperature=0.0, max_tokens=6))]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["text"]) for r in results] == [(0, expected[0]), ("d", expected[1])]
    proc = subprocess.run([*run, "--prompt", "-"], input="the cat\n", capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == expected[0] + "\n", proc.stderr
    proc = subprocess.run([*run, "--input", "-", "--output", tmp_path / "none.jsonl"], input="\n \n",
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert_one_error_line(proc.returncode, proc.stderr, "<stdin>: no prompts")


def test_progress_line_with_tokens_per_second():
    from trtbuild.progress import Progress

    bar = Progress(10, "generating", "req", enabled=False, work_unit="tok")
    bar.update(0, work=500, work_left=1000)
    assert bar.line(2.0) == "generating  0/10 [........................] 250.0 tok/s, 0:04 left"
    bar.update(5, work=600, work_left=1000)  # the sooner estimate: 5 requests left at 2.5 req/s
    assert bar.line(2.0) == "generating  5/10 [############............] 300.0 tok/s, 0:02 left"


def test_generate_iter_counts_tokens_between_finishes(engine):
    llm = LLM(engine)
    params = [SamplingParams(max_tokens=m, ignore_eos=True, seed=1) for m in (20, 30)]
    finished = llm.generate_iter([[5, 6, 7], [8, 9]], params)
    assert finished.tokens() == (0, 50)
    seen = []
    for done in finished.by_step():
        seen.append((len(done), *finished.tokens()))
    assert seen[0] == (0, 2, 48) and (0, 20, 30) in seen  # one token per step each, before anything finished
    assert [s for s in seen if s[0]] == [(1, 40, 10), (1, 50, 0)]


def test_run_input_shows_progress_on_a_terminal_from_the_start(text_engine, tmp_path):
    """On a real terminal (a pty as stderr) the bar is drawn before any request finishes, with tokens/s; not with
    --quiet, and not when stderr is a pipe."""
    import pty

    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"prompt": "the cat {i}", "max_tokens": 40, "ignore_eos": true}}\n' for i in range(3)))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    run = [sys.executable, "-m", "trtbuild.cli", "run", str(text_engine), "--input", str(src), "--overwrite"]

    def on_a_terminal(*extra: str) -> str:
        leader, follower = pty.openpty()
        proc = subprocess.Popen([*run, "--output", str(tmp_path / "o.jsonl"), *extra], stderr=follower, env=env)
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(leader)
        assert proc.wait(120) == 0
        return b"".join(chunks).decode()

    err = on_a_terminal()
    assert err.startswith("\rgenerating  0/3 [........................] 0.0 tok/s"), err
    assert "\rgenerating  3/3 [########################]" in err and "wrote 3 results (120 tokens)" in err
    assert "wrote 3 results" in on_a_terminal("--quiet") and "generating" not in on_a_terminal("--quiet")
    proc = subprocess.run([*run, "--output", tmp_path / "p.jsonl"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stderr.startswith("wrote 3 results"), proc.stderr


def test_every_sampling_field_has_a_flag(monkeypatch, capsys, engine):
    code, out, _ = cli(monkeypatch, capsys, "run", "--help")
    assert code == 0
    for f in dataclasses.fields(SamplingParams):
        assert "--" + f.name.replace("_", "-") in out


def test_top_k_minus_one_and_zero_mean_all_tokens_everywhere(monkeypatch, capsys, text_engine, tmp_path):
    """One top_k rule for the Python API, the CLI flag and JSON-lines fields (the server's test: test_serve.py):
    -1 and 0 mean all tokens (stored as None), as in vLLM; no message or help text shows Python's None."""
    assert SamplingParams(top_k=-1).top_k is None and SamplingParams(top_k=0) == SamplingParams()
    args = ["run", text_engine, "--prompt", "the cat", "--seed", 5, "--max-tokens", 8]
    code, expected, err = cli(monkeypatch, capsys, *args)
    assert code == 0, err
    for k in (-1, 0):
        code, out, err = cli(monkeypatch, capsys, *args, "--top-k", k)
        assert code == 0 and out == expected, err
    code, out, _ = cli(monkeypatch, capsys, *args, "--top-k", 1)
    assert code == 0 and out != expected  # a real k still filters
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "the cat", "top_k": -1, "seed": 5, "max_tokens": 8}\n')
    code, _, err = cli(monkeypatch, capsys, "run", text_engine, "--input", src, "--output", tmp_path / "o.jsonl")
    assert code == 0, err
    assert json.loads((tmp_path / "o.jsonl").read_text())["text"] + "\n" == expected
    code, _, err = cli(monkeypatch, capsys, *args, "--top-k", -2)
    assert_one_error_line(code, err, "top_k must be >= 1 (or -1 / 0: all tokens)")
    src.write_text('{"prompt": "x", "logprobs": "2"}\n')
    code, _, err = cli(monkeypatch, capsys, "run", text_engine, "--input", src, "--output", tmp_path / "p.jsonl")
    assert_one_error_line(code, err, "logprobs must be an integer, got '2'")
    code, help_text, _ = cli(monkeypatch, capsys, "run", "--help")
    for message in (err, help_text):
        assert "None" not in message and "null" not in message


def test_bench_json(monkeypatch, capsys, engine):
    args = ["bench", engine, "--num-requests", 6, "--input-len", 10, "--output-len", 5, "--json"]
    code, out, err = cli(monkeypatch, capsys, *args, "--shared-prefix-len", 16)
    assert code == 0, err
    r = json.loads(out)
    assert r["output_tokens"] == 30 and r["prompt_tokens"] == 6 * 26
    assert r["prefix_cache_hit_rate"] > 0 and r["output_tokens_per_s"] > 0 and r["kv_blocks_peak"] > 0
    assert {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "kv_waste_pct", "preemptions"} <= r.keys()
    assert r["open_s"] > 0  # the engine's open time (a torch-compile engine compiles then)
    code, out, _ = cli(monkeypatch, capsys, *args, "--shared-prefix-len", 16, "--no-prefix-caching")
    assert code == 0 and json.loads(out)["prefix_cache_hit_rate"] == 0
    code, out, _ = cli(monkeypatch, capsys, *args, "--concurrency", 2, "--kv-cache-memory", "64KiB")
    r = json.loads(out)
    assert code == 0 and r["kv_blocks_total"] == 31 and r["output_tokens"] == 30
    code, out, _ = cli(monkeypatch, capsys, "bench", engine, "--num-requests", 2, "--input-len", 4, "--output-len", 2)
    assert code == 0 and "output tok/s" in out and "prefix cache" in out


def test_bench_samples_when_asked(monkeypatch, capsys, engine):
    """``--temperature`` / ``--top-p`` / ``--top-k``: the requests are sampled (the sampler's time in the figures),
    the workload says so; values SamplingParams refuses are one error line."""
    args = ["bench", engine, "--num-requests", 4, "--input-len", 6, "--output-len", 5]
    code, out, err = cli(monkeypatch, capsys, *args, "--temperature", 0.8, "--top-p", 0.9, "--top-k", 20, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert (r["temperature"], r["top_p"], r["top_k"], r["output_tokens"]) == (0.8, 0.9, 20, 20)
    code, out, _ = cli(monkeypatch, capsys, *args, "--temperature", 0.8, "--top-p", 0.9)
    assert code == 0 and "out, temperature 0.8, top_p 0.9, top_k all)" in out.splitlines()[0]
    code, _, err = cli(monkeypatch, capsys, *args, "--temperature", 0.8, "--top-p", 0)
    assert_one_error_line(code, err, "top_p must be in (0, 1]")


def test_cli_subprocess_end_to_end(engine):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "trtbuild.cli", "bench", str(engine)]
    cmd += ["--num-requests", "3", "--input-len", "5", "--output-len", "3", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["output_tokens"] == 9
    proc = subprocess.run([*cmd[:4], "/nonexistent/engine"], capture_output=True, text=True, env=env, timeout=120)
    assert_one_error_line(proc.returncode, proc.stderr, "no such engine directory")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "{missing}", "--prompt", "x"], "no such engine directory"),
        (["run", "{engine}", "--prompt", "x"], "no tokenizer.json"),
        (["run", "{engine}"], "give exactly one of --prompt TEXT or --input FILE"),
        (["run", "{engine}", "--input", "{jsonl}"], "--input needs --output"),
        (["run", "{text}", "--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
        (["run", "{text}", "--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["run", "{text}", "--prompt", "x", "--max-tokens", "500"], "exceeds the engine's max_seq_len"),
        (["run", "{text}", "--prompt", "", "--max-tokens", "5"], "prompt is empty"),
        (["run", "{text}", "--prompt", "x", "--stream", "--n", "2"], "--stream needs --n 1"),
        (["run", "{text}", "--prompt", "x", "--system", "s"], "--system needs --chat"),
        (["run", "{text}", "--prompt", "x", "--kv-cache-memory", "lots"], "is not a size"),
        (
            ["run", "{text}", "--prompt", "x", "--kv-cache-memory", "1KiB"],
            "--kv-cache-memory (1024 bytes) is too small",
        ),
        (["run", "{text}", "--prompt", "x", "--max-num-seqs", "1000"], "--max-num-seqs must be an integer"),
        (["run", "{text}", "--input", "{bad_json}", "--output", "{out}"], "bad.jsonl:2: not valid JSON"),
        (["run", "{text}", "--input", "{bad_key}", "--output", "{out}"], "expected an object with exactly one of"),
        (["run", "{text}", "--input", "{bad_token}", "--output", "{out}"], "badtoken:2: token id 500 is outside"),
        (
            ["run", "{text}", "--input", "{misspelled}", "--output", "{out}"],
            "misspelled:2: unknown key 'temprature' (did you mean 'temperature'?)",
        ),
        (["run", "{text}", "--input", "{blank}", "--output", "{out}"], "blank:4: not valid JSON"),
        (
            ["run", "{text}", "--input", "{str_tokens}", "--output", "{out}"],
            "strtokens:1: max_tokens must be an integer, got '5'",
        ),
        (["run", "{text}", "--input", "{negative}", "--output", "{out}"], "negative:2: temperature must be >= 0"),
        (
            ["run", "{text}", "--input", "{surrogate}", "--output", "{out}"],
            "surrogate:1: the text is not valid UTF-8 (lone surrogate U+D800",
        ),
        (
            ["run", "{text}", "--input", "{chat_surrogate}", "--output", "{out}"],
            "chatsurrogate:1: the text is not valid UTF-8",
        ),
        (["run", "{text}", "--prompt", "\udcff\udcfe"], "the text is not valid UTF-8 (byte 0xff at character 0)"),
        (["run", "{text}", "--prompt", "x", "--output", "{existing}"], "already exists (use --overwrite"),
        (["run", "{text}", "--prompt", "x", "--stream", "--output", "{out}"], "--stream prints to the terminal"),
        (
            ["run", "{text}", "--input", "{bad_type}", "--output", "{out}"],
            "badtype:1: temperature must be a number, got 'hot'",
        ),
        (["run", "{text}", "--input", "{missing}", "--output", "{out}"], "cannot read"),
        (["bench", "{engine}", "--input-len", "0"], "--input-len must be >= 1"),
        (["bench", "{engine}", "--input-len", "100", "--output-len", "100"], "exceeds the engine's max_seq_len"),
        (["bench", "{engine}", "--concurrency", "0"], "--concurrency must be an integer in [1, 64]"),
    ],
)
def test_bad_input_one_error_line(monkeypatch, capsys, engine, text_engine, tmp_path, args, needle):
    files = {
        "jsonl": '{"prompt": "x"}\n',
        "bad_json": '{"prompt": "x"}\n{"prompt": \n',
        "bad_key": '{"text": "x"}\n',
        "bad_token": '{"prompt": "x"}\n{"prompt_token_ids": [1, 500]}\n',
        "bad_type": '{"prompt": "x", "temperature": "hot"}\n',
        "misspelled": '{"prompt": "x"}\n{"prompt": "y", "temprature": 0.5}\n',
        "blank": '{"prompt": "x"}\n\n  \n{"prompt": \n',  # blank lines skipped; errors keep the file's numbers
        "str_tokens": '{"prompt": "x", "max_tokens": "5"}\n',
        "negative": '{"prompt": "x"}\n{"prompt": "y", "temperature": -1}\n',
        "surrogate": '{"prompt": "a\\ud800"}\n',
        "chat_surrogate": '{"messages": [{"role": "user", "content": "\\ud800"}]}\n',
        "existing": "keep me\n",
    }
    paths = {"engine": engine, "text": text_engine, "missing": tmp_path / "missing", "out": tmp_path / "out.jsonl"}
    for name, text in files.items():
        paths[name] = tmp_path / (name.replace("_", "") if name != "bad_json" else "bad.jsonl")
        paths[name].write_text(text)
    code, _, err = cli(monkeypatch, capsys, *(a.format(**paths) for a in args))
    assert_one_error_line(code, err, needle)
    assert not (tmp_path / "out.jsonl").exists()
    assert (tmp_path / "existing").read_text() == "keep me\n"
