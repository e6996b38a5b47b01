"""``trtbuild serve`` through the official ``openai`` client, on the tiny text engine (see test_llm.add_tokenizer).

Each server runs in-process (uvicorn in a thread, on a free loopback port); an offline ``LLM`` on the same engine
is the reference every response is compared with.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from test_llm import add_tokenizer

from trtbuild.runtime.llm import LLM, SamplingParams
from trtbuild.serve.config import ServeConfig
from trtbuild.serve.server import Server, bind

API_KEY = "test-key"
MODEL = "tiny"
PROMPTS = ["the cat is", "a stop of", "st", "hello world", "Z"]


@contextlib.contextmanager
def running_server(engine: Path, config: ServeConfig, **llm_args) -> Iterator[str]:
    """A server on a free loopback port for the duration of the block; yields its base URL (``.../v1``)."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = Server(LLM(engine, **llm_args), config, MODEL)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def engine(tiny_engines, tmp_path_factory) -> Path:
    return add_tokenizer(tiny_engines["llama_gqa"][2], tmp_path_factory.mktemp("serve") / "engine")


@pytest.fixture(scope="module")
def offline(engine) -> LLM:
    return LLM(engine)


@pytest.fixture(scope="module")
def url(engine) -> Iterator[str]:
    with running_server(engine, ServeConfig(api_key=API_KEY, max_body_bytes=1 << 16)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0)


def request(url: str, method: str, path: str, body: bytes | None = None, headers=None) -> tuple[int, dict, dict]:
    """(status, headers, JSON or {"text": ...}) of one raw HTTP request (for what the client cannot send)."""
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {API_KEY}", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = {"text": data.decode()}
        return resp.status, dict(resp.getheaders()), parsed
    finally:
        conn.close()


def metric(url: str, name: str) -> float:
    _, _, body = request(url, "GET", "/metrics")
    return float(re.search(rf"^{name} (\S+)$", body["text"], re.MULTILINE).group(1))


# ------------------------------------------------------------------------------------------ results and usage


def test_completions_equal_llm_generate(client, offline):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = offline.generate(PROMPTS, params)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [o.text for o in expected]
    assert [c.finish_reason for c in resp.choices] == [o.finish_reason.value for o in expected]
    assert resp.usage.prompt_tokens == sum(len(offline.tokenizer.encode(p)) for p in PROMPTS)
    assert resp.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    # token-id prompts too
    ids = offline.tokenizer.encode(PROMPTS[0])
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert resp.choices[0].text == expected[0].text


def test_completion_stream_concatenates_to_the_whole_text(client, offline):
    expected = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)


def test_chat_whole_and_streamed(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=16))[0]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(offline.chat_prompt(messages))
    assert resp.usage.completion_tokens == len(expected.token_ids)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_top_k_minus_one_and_zero_mean_all_tokens_as_in_the_cli(client, offline):
    expected = offline.generate(PROMPTS[0], SamplingParams(seed=3, max_tokens=8, ignore_eos=True))[0].text
    for k in (-1, 0):
        resp = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=8, seed=3, extra_body={"top_k": k, "ignore_eos": True}
        )
        assert resp.choices[0].text == expected
    with pytest.raises(openai.BadRequestError, match=r"top_k must be >= 1 \(or -1 / 0: all tokens\)") as e:
        client.completions.create(model=MODEL, prompt="x", extra_body={"top_k": -5})
    assert e.value.body["param"] == "top_k" and "None" not in e.value.message


def test_n_and_logprobs(client, offline):
    params = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=7, logprobs=2, ignore_eos=True)
    expected = offline.generate(PROMPTS[1], params)[0]
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=8, n=2, seed=7, logprobs=2, extra_body={"ignore_eos": True}
    )
    assert len(resp.choices) == 2
    for choice, out in zip(resp.choices, expected.outputs, strict=True):
        assert choice.text == out.text
        assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in out.logprobs], abs=1e-5)
        assert [len(top) for top in choice.logprobs.top_logprobs] == [2] * 8
    assert resp.usage.completion_tokens == 16
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_echo_and_logprobs_score_the_prompt_as_lm_eval_reads_them(client, offline, tiny_engines):
    """lm-evaluation-harness's ``local-completions`` loglikelihood: token ids, ``echo``, ``logprobs: 1``,
    ``max_tokens: 1``; it sums ``token_logprobs[ctxlen:-1]`` and checks them against ``top_logprobs``."""
    from test_prompt_logprobs import reference

    text = "the cat is a stop"
    ids = offline.tokenizer.encode(text)
    ref = reference(tiny_engines["llama_gqa"][0], ids)
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    choice = resp.choices[0]
    generated = offline.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert choice.text == text + generated.text
    lp = choice.logprobs
    assert lp.tokens == [*text, generated.text]  # one character per token
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx([ref[p - 1, ids[p]] for p in range(1, len(ids))], abs=2e-4)
    for p in range(1, len(ids)):
        [(token, value)] = lp.top_logprobs[p].items()
        best = offline.tokenizer.decode([int(ref[p - 1].argmax())], skip_special_tokens=False)
        assert (token, value) == (best, pytest.approx(ref[p - 1].max(), abs=2e-4))
    assert lp.text_offset == list(range(len(text) + 1))
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[-1] <= 0  # the generated token's, last
    # max_tokens 0: the prompt alone; a string prompt; several prompts
    resp = client.completions.create(model=MODEL, prompt=[text, "a cat"], max_tokens=0, logprobs=0, echo=True)
    assert [c.text for c in resp.choices] == [text, "a cat"]
    assert resp.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=1e-5)
    assert resp.choices[1].logprobs.tokens == list("a cat")
    assert [c.finish_reason for c in resp.choices] == ["length", "length"]
    assert resp.usage.completion_tokens == 0
    # echo without logprobs prepends the prompt to the completion
    resp = client.completions.create(model=MODEL, prompt=text, max_tokens=4, echo=True, temperature=0)
    assert resp.choices[0].text == text + offline.generate(text, SamplingParams(temperature=0.0, max_tokens=4))[0].text
    assert resp.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="'echo' with 'stream' is not supported"):
        client.completions.create(model=MODEL, prompt=text, echo=True, stream=True)


def test_models_health_metrics(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert request(url, "GET", "/health")[0] == 200
    status, _, body = request(url, "GET", "/metrics")
    assert status == 200
    for name in ("num_requests_running", "kv_cache_usage_ratio", "prefix_cache_hit_rate", "num_preemptions_total"):
        assert f"trtbuild_{name} " in body["text"]
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f'trtbuild_{name}_bucket{{le="+Inf"}}' in body["text"]
    assert metric(url, "trtbuild_generation_tokens_total") > 0


# ------------------------------------------------------------------------------------------------ concurrency


def test_32_concurrent_streams_each_equal_offline(url, offline):
    prompts = [f"{w} {i}" for i, w in enumerate(["the cat", "a stop", "hello", "of is"] * 8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.text for o in offline.generate(prompts, params)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(main()) == expected


def test_disconnect_mid_stream_frees_blocks(client, url):
    assert metric(url, "trtbuild_kv_cache_used_blocks") == 0  # idle: every block free (cached or not)
    aborted = metric(url, "trtbuild_requests_abort_total")
    stream = client.completions.create(
        model=MODEL, prompt="the cat", max_tokens=110, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 20
    while metric(url, "trtbuild_requests_abort_total") == aborted:
        assert time.monotonic() < deadline, "the disconnected request was never aborted"
        time.sleep(0.05)
    assert metric(url, "trtbuild_kv_cache_used_blocks") == 0
    assert metric(url, "trtbuild_num_requests_running") == 0


def test_overload_gets_429_and_accepted_requests_complete(engine, offline):
    prompts = [f"the cat {i}" for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = [o.text for o in offline.generate(prompts, params)]
    with running_server(engine, ServeConfig(max_queue=2), max_num_seqs=1) as base:

        async def one(client: openai.AsyncOpenAI, prompt: str) -> str | int:
            try:
                resp = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
                )
            except openai.RateLimitError as e:
                assert e.response.headers["retry-after"] == "1"
                assert e.body["code"] == "queue_full"
                return 429
            return resp.choices[0].text

        async def main() -> list[str | int]:
            async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
                return await asyncio.gather(*(one(client, p) for p in prompts))

        results = asyncio.run(main())
    assert 429 in results
    accepted = [(r, e) for r, e in zip(results, expected, strict=True) if r != 429]
    assert len(accepted) >= 2 and all(r == e for r, e in accepted)


# ------------------------------------------------------------------------------------------------- bad input

GOOD = {"model": MODEL, "prompt": "the cat", "max_tokens": 3, "ignore_eos": True}  # 3 tokens, whatever is sampled
BAD_INPUT = [
    ("malformed JSON", b'{"model": "tiny", "prompt": ', {}, 400, None),
    ("not an object", b"[1, 2]", {}, 400, None),
    ("wrong type", json.dumps({**GOOD, "max_tokens": "ten"}).encode(), {}, 400, "max_tokens"),
    ("wrong prompt type", json.dumps({**GOOD, "prompt": {"a": 1}}).encode(), {}, 400, "prompt"),
    ("temperature < 0", json.dumps({**GOOD, "temperature": -0.5}).encode(), {}, 400, "temperature"),
    ("max_tokens 0", json.dumps({**GOOD, "max_tokens": 0}).encode(), {}, 400, "max_tokens"),
    ("overlong prompt", json.dumps({**GOOD, "prompt": "a" * 200}).encode(), {}, 400, "prompt"),
    ("token out of vocab", json.dumps({**GOOD, "prompt": [5, 100000]}).encode(), {}, 400, "prompt"),
    ("unknown model", json.dumps({**GOOD, "model": "gpt-9"}).encode(), {}, 400, "model"),
    ("unknown field", json.dumps({**GOOD, "temprature": 0}).encode(), {}, 400, "temprature"),
    ("missing API key", json.dumps(GOOD).encode(), {"Authorization": ""}, 401, None),
    ("wrong API key", json.dumps(GOOD).encode(), {"Authorization": "Bearer nope"}, 401, None),
    ("oversized body", json.dumps({**GOOD, "prompt": "a" * 70000}).encode(), {}, 413, None),
]


@pytest.mark.parametrize(("case", "body", "headers", "status", "param"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_gets_openai_error_and_server_keeps_serving(url, case, body, headers, status, param):
    got, _, err = request(url, "POST", "/v1/completions", body, {"Content-Type": "application/json", **headers})
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["param"] == param
    ok, _, resp = request(url, "POST", "/v1/completions", json.dumps(GOOD).encode())
    assert ok == 200 and resp["usage"]["completion_tokens"] == 3


def test_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match=r"Invalid value: 'robot'\. Supported values are: 'system'"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])


def test_unknown_chat_role_gets_openai_400(url, client):
    """OpenAI's roles only (whatever the chat template would render), refused in OpenAI's shape; then served on."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]}
    status, _, err = request(url, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and err["error"] == {
        "message": "Invalid value: 'wizard'. Supported values are: 'system', 'assistant', 'user', 'function', 'tool', "
        "and 'developer'.",
        "type": "invalid_request_error",
        "param": "messages[1].role",
        "code": "invalid_value",
    }
    for role in ("system", "assistant", "user"):  # the roles the test engine's template renders are accepted
        messages = [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert resp.choices[0].message.role == "assistant"


# ------------------------------------------------------------------------------------------- the CLI process


def start_serve(engine: Path, *flags: str) -> tuple[subprocess.Popen, str, list[str]]:
    """``trtbuild serve ENGINE --port 0 FLAGS``, started and answering GET /v1/models: (the process, its base URL ending
    in ``/v1``, the stderr lines read up to the "serving" one). The caller stops it; a start that fails kills it."""
    command = [sys.executable, "-m", "trtbuild.cli", "serve", str(engine), "--port", "0", *flags]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = [proc.stderr.readline()]
        while "serving" not in lines[-1]:
            lines.append(proc.stderr.readline())
            assert lines[-1], "the server exited before serving"
        base = re.search(r"(http://\S+/v1)", lines[-1]).group(1)
        deadline = time.monotonic() + 30
        while True:  # the socket listens before the app's startup completes
            try:
                urllib.request.urlopen(base + "/models", timeout=5)
                return proc, base, lines
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    except BaseException:
        proc.kill()
        proc.wait()
        proc.stderr.close()
        raise


@pytest.mark.parametrize("grace", [120.0, 0.0])
def test_cli_sigterm_stops_admitting_finishes_or_aborts_then_exits_0(engine, grace):
    """SIGTERM: new connections are refused; the open stream finishes within the grace period (or is cut when the
    grace is 0); the process exits 0."""
    flags = ["--served-model-name", MODEL, "--shutdown-grace", str(grace), "--max-num-seqs", "1"]
    proc, base, _ = start_serve(engine, *flags)
    try:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        # With --max-num-seqs 1 the n completions run one after another (n x 120 steps): time to signal. Without a
        # grace period, 100 of them (12,000 steps) cannot all finish before the shutdown cuts them.
        n = 10 if grace else 100
        stream = client.completions.create(
            model=MODEL, prompt="the", max_tokens=120, n=n, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        it = iter(stream)
        chunks = [next(it)]
        proc.send_signal(signal.SIGTERM)
        if grace:  # while the stream drains, nothing new is admitted (with no grace it is cut before we could ask)
            time.sleep(0.3)
            with pytest.raises((openai.APIConnectionError, openai.InternalServerError)):
                openai.OpenAI(base_url=base, api_key="none", max_retries=0).models.list()
        try:
            chunks += list(it)
        except (openai.APIError, openai.APIConnectionError):
            assert grace == 0
        finished = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        if grace:
            assert finished == ["length"] * n
        else:
            assert finished != ["length"] * n  # cut: the requests were aborted
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def _serve_and_log(engine: Path, *flags: str) -> list[str]:
    """Run ``trtbuild serve``, send a completion, a streamed chat, a bad request and a 404, stop it with SIGTERM;
    its stderr lines."""
    proc, base, lines = start_serve(engine, "--served-model-name", MODEL, *flags)
    try:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        client.completions.create(model=MODEL, prompt="the cat", max_tokens=5, extra_body={"ignore_eos": True})
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        assert len([c for c in stream if c.choices and c.choices[0].delta.content is not None]) >= 1
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", temperature=-1)
        assert request(base, "GET", "/v1/nothing")[0] == 404
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        return lines + proc.stderr.read().splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_cli_access_log_one_line_per_request(engine):
    lines = [ln for ln in _serve_and_log(engine) if ' - "' in ln]
    pattern = r'INFO: +127\.0\.0\.1:\d+ - "(\w+) (\S+) HTTP/1\.1" (\d+) (\d+\.\d{3})s(.*)$'
    parsed = [re.match(pattern, ln).groups() for ln in lines]
    requests = [(method, path, int(status), tokens.strip()) for method, path, status, _, tokens in parsed]
    assert requests[-4:] == [
        ("POST", "/v1/completions", 200, "prompt_tokens=7 completion_tokens=5"),
        ("POST", "/v1/chat/completions", 200, requests[-3][3]),
        ("POST", "/v1/completions", 400, ""),
        ("GET", "/v1/nothing", 404, ""),
    ]
    assert re.fullmatch(r"prompt_tokens=\d+ completion_tokens=4", requests[-3][3])  # a stream, logged at its end
    assert all(method == "GET" and path == "/v1/models" for method, path, _, _ in requests[:-4])
    assert not [ln for ln in _serve_and_log(engine, "--no-access-log") if ' - "' in ln]


def test_cli_bad_engine_dir_is_one_error_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trtbuild.cli", "serve", str(tmp_path / "missing")], capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr


def test_load_generator_reports_every_request(url, engine):
    script = Path(__file__).parents[1] / "benchmarks" / "serve.py"
    args = ["--base-url", url, "--api-key", API_KEY, "--tokenizer", str(engine), "--num-requests", "6"]
    args += ["--input-len", "8", "--output-len", "8", "--concurrency", "3", "--request-rate", "50", "--json"]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["completed"] == 6 and summary["output_tokens"] == 48 and summary["prompt_tokens"] >= 48
    assert summary["output_throughput"] > 0 and summary["ttft_ms"]["p99"] >= summary["ttft_ms"]["p50"] > 0
