"""Issue 13, one test (or more) per observed item: calibration defaults, progress, interrupted work, strict input,
one-line errors, no U+FFFD tail, docs that match the recipes, umask modes, engine files checked on load."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_llm import BYTES, VOCAB, add_tokenizer
from test_run_cli import assert_one_error_line, cli

from trtbuild.config import QFormat, QuantConfig
from trtbuild.errors import EngineError
from trtbuild.runtime.llm import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONWARNINGS="ignore")


@pytest.fixture(scope="module")
def engine(tiny_engines) -> Path:
    return tiny_engines["llama_gqa"][2]


@pytest.fixture(scope="module")
def text_engine(tiny_engines, tmp_path_factory) -> Path:
    return add_tokenizer(tiny_engines["llama_gqa"][2], tmp_path_factory.mktemp("usability") / "engine")


# ------------------------------------------------------------------------------- 1. defaults that take hours


def test_calibration_defaults_are_per_format_and_small_for_awq(monkeypatch, capsys):
    awq = QuantConfig(QFormat.INT4_AWQ)
    assert (awq.calib_size, awq.calib_seq_len) == (4, 512)  # what the shipped recipe measured: minutes, not hours
    for fmt in QFormat:
        cfg = QuantConfig(fmt)
        assert cfg.calib_size * cfg.calib_seq_len <= 64 * 512
    assert QuantConfig(QFormat.INT8_WO).calib_size == 64 and QuantConfig(QFormat.FP8).calib_size == 16
    assert QuantConfig(QFormat.INT4_AWQ, calib_size=8).calib_size == 8
    code, out, _ = cli(monkeypatch, capsys, "quantize", "--help")
    text = " ".join(out.split())
    assert code == 0 and "4 for int4_awq" in text and "forward passes grow with" in text and "searches do not" in text


# -------------------------------------------------------------------------------------- 2. silent long jobs


def test_progress_line_has_count_rate_and_estimate():
    from trtbuild.progress import Progress

    bar = Progress(10, "generating", "req", enabled=False)
    bar.update(5)
    assert bar.line(2.0) == "generating  5/10 [############............] 2.50 req/s, 0:02 left"


def test_progress_on_a_terminal_only_and_never_with_json(monkeypatch, capsys, text_engine, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"prompt": "the cat {i}", "max_tokens": 3}}\n' for i in range(4)))
    args = ["run", text_engine, "--input", src, "--output", tmp_path / "a.jsonl"]
    code, _, err = cli(monkeypatch, capsys, *args)
    assert code == 0 and err.count("\n") == 1 and err.startswith("wrote 4 results")  # not a terminal: no bar
    monkeypatch.setattr("trtbuild.progress.interactive", lambda stream=None: True)
    code, _, err = cli(monkeypatch, capsys, *args[:-1], tmp_path / "b.jsonl")
    assert code == 0 and "\rgenerating  4/4 [" in err and "tok/s" in err
    code, out, err = cli(monkeypatch, capsys, "bench", text_engine, "--num-requests", 3, "--input-len", 4,
                         "--output-len", 2)  # fmt: skip
    assert code == 0 and "\rbenchmarking  3/3 [" in err and "output tok/s" in out
    assert err.startswith("\rbenchmarking  0/3 [") and "tok/s" in err  # drawn before any request finishes
    text = tmp_path / "eval.txt"
    text.write_text("the cat is on the mat. " * 20)
    evaluate = ["eval", text_engine, "--dataset", text, "--windows", 2, "--seq-len", 16]
    code, out, err = cli(monkeypatch, capsys, *evaluate)
    assert code == 0 and "\revaluating  2/2 [" in err and out.startswith("perplexity")
    code, out, err = cli(monkeypatch, capsys, *evaluate, "--json")
    assert code == 0 and err == "" and json.loads(out)["windows"] == 2
    code, _, err = cli(monkeypatch, capsys, "bench", text_engine, "--num-requests", 3, "--input-len", 4,
                       "--output-len", 2, "--json")  # fmt: skip
    assert code == 0 and err == ""


# ------------------------------------------------------------------------------ 3. interrupted work is kept


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_interrupted_run_input_writes_the_finished_results(monkeypatch, capsys, engine, tmp_path, how):
    lengths = [1, 2, 3, 20, 4, 30]
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(f'{{"prompt_token_ids": [5, 6, {i + 7}], "max_tokens": {n}}}\n' for i, n in enumerate(lengths))
    )
    args = ["run", engine, "--input", src, "--temperature", 0, "--ignore-eos"]
    code, _, err = cli(monkeypatch, capsys, *args, "--output", tmp_path / "full.jsonl")
    assert code == 0, err
    full = [json.loads(line) for line in (tmp_path / "full.jsonl").read_text().splitlines()]

    real_step, steps = LLM._step, []

    def step(self):  # the user interrupts after the tenth engine step
        steps.append(1)
        if len(steps) == 10:
            if how == "sigterm":
                signal.raise_signal(signal.SIGTERM)  # handled by the CLI like Ctrl-C
            raise KeyboardInterrupt
        real_step(self)

    monkeypatch.setattr(LLM, "_step", step)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code, _, err = cli(monkeypatch, capsys, *args, "--output", tmp_path / "part.jsonl")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 130
    finished = [i for i, n in enumerate(lengths) if n < 10]
    part = [json.loads(line) for line in (tmp_path / "part.jsonl").read_text().splitlines()]
    assert [(r["id"], r["outputs"][0]["token_ids"]) for r in part] == [
        (full[i]["id"], full[i]["outputs"][0]["token_ids"]) for i in finished
    ]
    assert f"interrupted: wrote the {len(finished)} of {len(lengths)} results that had finished" in err


def _scratch(parent: Path, name: str) -> list[Path]:
    return list(parent.glob(f".{name}.scratch-*"))


def test_killed_quantize_leaves_nothing_behind(tmp_path):
    pytest.importorskip("modelopt")
    from tiny_models import make_hf_model

    make_hf_model("llama_gqa", tmp_path / "hf")
    cmd = [sys.executable, "-m", "trtbuild.cli", "quantize", str(tmp_path / "hf"), "--qformat", "int8_wo", "-o"]
    for sig in (signal.SIGKILL, signal.SIGTERM):
        out = tmp_path / f"q-{sig.name}"
        for _ in range(5):  # the tiny model can finish between its scratch appearing and the signal: run it again
            proc = subprocess.Popen([*cmd, str(out)], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            deadline = time.monotonic() + 120
            while not _scratch(tmp_path, out.name) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _scratch(tmp_path, out.name), "the conversion's scratch directory never appeared"
            proc.send_signal(sig)
            proc.wait(timeout=120)
            if proc.returncode != 0:
                break
            shutil.rmtree(out)  # finished before the signal: nothing was interrupted
        if sig is signal.SIGKILL:  # no code runs: the scratch stays until the next run to that output
            assert _scratch(tmp_path, out.name) and not out.exists()
            done = subprocess.run([*cmd, str(out)], env=ENV, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            assert (out / "config.json").is_file()
        else:  # cleanup runs on SIGTERM
            assert proc.returncode == 130, proc.stderr.read().decode()
            assert not out.exists()
        assert not _scratch(tmp_path, out.name)


# ----------------------------------------------------------------------------------- 4. input taken silently


def test_prompt_with_output_writes_a_file_and_logprobs_print(monkeypatch, capsys, text_engine, tmp_path):
    out = tmp_path / "r.jsonl"
    args = ["run", text_engine, "--prompt", "hi", "--max-tokens", 4, "--temperature", 0]
    code, _, err = cli(monkeypatch, capsys, *args, "--output", out)
    assert code == 0 and "wrote 1 results" in err
    first = out.read_text()
    assert first.count("\n") == 1 and '"id": 0' in first
    code, _, err = cli(monkeypatch, capsys, *args, "--output", out)
    assert_one_error_line(code, err, "already exists (use --overwrite")
    code, _, err = cli(monkeypatch, capsys, *args, "--output", out, "--overwrite")
    assert code == 0 and out.read_text().count("\n") == 1
    code, stdout, _ = cli(monkeypatch, capsys, *args, "--logprobs", 3)
    lines = stdout.splitlines()
    assert lines[1] == "--- logprobs ---" and len(lines) == 2 + 4
    assert all(ln.count("top:") == 1 and ln.count(" -") >= 3 for ln in lines[2:])


def test_build_says_when_max_seq_len_is_capped(monkeypatch, capsys, tiny_engines, tmp_path):
    ckpt = tiny_engines["llama_gqa"][1]
    code, _, err = cli(monkeypatch, capsys, "build", ckpt, "-o", tmp_path / "e", "--max-seq-len", 100000)
    assert code == 0 and "note: max_seq_len 100000 is more than the model's" in err


# ---------------------------------------------------------------------------------- 5. tracebacks, vagueness


def test_non_utf8_prompt_bytes_are_one_error_line(text_engine):
    cmd = [sys.executable, "-m", "trtbuild.cli", "run", str(text_engine), "--prompt", b"\xff\xfe"]
    proc = subprocess.run(cmd, capture_output=True, env=ENV, timeout=120)
    assert_one_error_line(proc.returncode, proc.stderr.decode(), "not valid UTF-8 (byte 0xff at character 0)")


# ------------------------------------------------------------------------------------ 6. no U+FFFD at the end


def test_output_cut_mid_character_has_no_replacement_char(text_engine):
    llm = LLM(text_engine)
    lead = {VOCAB.index(b) for b in BYTES if int(b[3:5], 16) >= 0xC0}  # first bytes of multi-byte characters
    params = [SamplingParams(temperature=3.0, seed=s, max_tokens=5, ignore_eos=True) for s in range(300)]
    outs = llm.generate(["a b"] * len(params), params)
    cut = [o for o in outs if o.outputs[0].token_ids[-1] in lead]
    assert len(cut) >= 3  # outputs that stopped right after the first byte of a character
    for o in outs:
        assert not o.text.endswith("\ufffd")
        assert o.text == llm.tokenizer.decode(o.outputs[0].token_ids).rstrip("\ufffd")


# --------------------------------------------------------------------------- 7. docs, recipes, modes, verify


def test_docs_quote_the_recipes_figures():
    from trtbuild.recipe import load_recipe

    docs = " ".join((ROOT / "docs/pipeline.md").read_text().split())
    quantization = " ".join((ROOT / "docs/quantization.md").read_text().split())
    for path in sorted((ROOT / "recipes").glob("smollm2-*.yaml")):
        recipe = load_recipe(path)
        targets = ", ".join(t.label for t in recipe.targets)
        gate = recipe.accuracy_gate
        quant = [f.quantization for f in recipe.formats if f.quantization is not None]
        calib = f"{quant[0].calib_size} x {quant[0].calib_seq_len}" if quant else "—"
        row = f"| `{path.name}` | {targets} | {calib} | {f'{gate.max_ppl_increase:g}%' if gate else '—'} |"
        assert row in docs, f"docs/pipeline.md: the shipped-recipes table disagrees with {path.name}: {row}"
        if quant:  # the measured row of docs/quantization.md that names the recipe
            assert f"(`recipes/{path.name}`)" in quantization or quant[0].qformat is QFormat.FP8, path.name
    for stale in ("sm90 only", "+6.7%", "gate 10%", "+1.9%", "~3 CPU-minutes"):
        assert stale not in docs, stale
    # Every perplexity increase quoted in docs/pipeline.md or in a recipe's comments is a measured figure of
    # docs/quantization.md (the one place measurements live), and every time quoted for AWQ is its measured one.
    recipes_text = " ".join(p.read_text() for p in (ROOT / "recipes").glob("smollm2-*.yaml"))
    for figure in re.findall(r"\+\d+(?:\.\d+)?%", docs + " " + recipes_text):
        assert figure in quantization, f"{figure} is quoted but not among the measured figures of quantization.md"
    for seconds in re.findall(r"(\d+) s measured", recipes_text):
        assert f"| {seconds} s |" in quantization, seconds


def test_outputs_follow_the_umask(monkeypatch, capsys, text_engine, tiny_engines, tmp_path):
    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig, DType
    from trtbuild.convert.convert import convert

    old = os.umask(0o022)
    try:
        ckpt = tiny_engines["llama_gqa"][1]
        convert(ckpt.parent / "llama_gqa-hf", tmp_path / "ckpt", DType.FLOAT32)  # safetensors writes 0600
        build_engine(ckpt, tmp_path / "engine", BuildConfig(max_seq_len=64))
        code, _, err = cli(monkeypatch, capsys, "run", text_engine, "--prompt", "hi", "--output", tmp_path / "r.jsonl")
        assert code == 0, err
        outputs = [tmp_path / "ckpt", tmp_path / "engine", tmp_path / "r.jsonl"]
        for p in [*outputs, *(tmp_path / "ckpt").rglob("*"), *(tmp_path / "engine").rglob("*")]:
            want = 0o755 if p.is_dir() else 0o644
            assert stat.S_IMODE(p.stat().st_mode) == want, p
    finally:
        os.umask(old)


def test_verify_on_a_checkpoint_says_so(monkeypatch, capsys, tiny_engines):
    code, out, err = cli(monkeypatch, capsys, "verify", tiny_engines["llama_gqa"][1])
    assert code != 0 and "a checkpoint, not an engine directory" in out + err and " build" not in (out + err)


# ----------------------------------------------------------------------------- 8. engine files changed on disk


def test_engine_files_are_checked_on_load(monkeypatch, capsys, engine, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    files = json.loads((copy / "manifest.json").read_text())["files"]
    data = copy / max(files, key=lambda f: files[f]["size"])  # the external weights
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(blob)  # one byte flipped: same size
    LLM(copy)  # sizes match: loads (a flipped byte is found by --verify and `trtbuild verify`, see docs/runner.md)
    with pytest.raises(EngineError, match="sha256 differs"):
        LLM(copy, verify=True)
    bench = ["bench", copy, "--num-requests", 1, "--input-len", 2, "--output-len", 1]
    code, _, err = cli(monkeypatch, capsys, *bench, "--verify")
    assert_one_error_line(code, err, "sha256 differs from the recorded one")
    code, _, err = cli(monkeypatch, capsys, "serve", copy, "--port", 0, "--verify")  # refused before it listens
    assert_one_error_line(code, err, "sha256 differs from the recorded one")
    data.write_bytes(bytes(blob) + b"\0")  # one byte more: caught on every load
    with pytest.raises(EngineError, match=r"size \d+ != recorded \d+.*the engine changed after it was built"):
        LLM(copy)
    code, _, err = cli(monkeypatch, capsys, *bench)
    assert_one_error_line(code, err, "the engine changed after it was built")


# ------------------------------------------------------------------- issue 39, item 8: an engine without a manifest


def test_engine_without_manifest_is_refused_everywhere(monkeypatch, capsys, text_engine, tmp_path):
    """LLM, run, bench, serve and eval refuse an engine directory without manifest.json (a build writes it last:
    without it the files cannot be trusted) with one line; a build's accuracy gate still evaluates its own engine
    before the manifest exists (tests/test_eval.py)."""
    copy = tmp_path / "engine"
    shutil.copytree(text_engine, copy)
    (copy / "manifest.json").unlink()
    needle = f"{copy}: no manifest.json, so not a finished engine (an interrupted build, or a copy without it)"
    with pytest.raises(EngineError) as e:
        LLM(copy)
    assert str(e.value).startswith(needle)
    commands = [
        ["run", copy, "--prompt", "x"],
        ["bench", copy, "--num-requests", 1, "--input-len", 2, "--output-len", 1],
        ["eval", copy, "--windows", 1, "--seq-len", 8],
    ]
    for args in commands:
        code, _, err = cli(monkeypatch, capsys, *args)
        assert_one_error_line(code, err, needle)
    code, _, err = cli(monkeypatch, capsys, "inspect", copy)
    assert_one_error_line(code, err, f"{copy}: an engine directory without manifest.json, so not a finished engine")
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "serve", str(copy), "--port", "0"],
                          capture_output=True, text=True, env=ENV, timeout=120)  # fmt: skip
    assert_one_error_line(proc.returncode, proc.stderr, needle)


# ------------------------------------------------------------ issue 39, item 11: third-party noise during quantize


@pytest.mark.parametrize("qformat", ["int8_sq", pytest.param("fp8", marks=pytest.mark.slow)])  # ~20 s each
def test_quantize_prints_nothing_of_modelopt_or_torch(tmp_path, qformat):
    """With Python's default warning filters (and even with PYTHONWARNINGS=default, which shows deprecations) a
    quantization prints its summary line and nothing else: no modelopt "Registered ..." / "Inserted N quantizers" /
    "Smoothed N modules", no modelopt version or smoothing UserWarning, no torch deprecation."""
    pytest.importorskip("modelopt")
    from quantize_helpers import calib_file, tiny_checkpoint

    _, ckpt = tiny_checkpoint(tmp_path)
    cmd = [sys.executable, "-m", "trtbuild.cli", "quantize", str(ckpt), "--qformat", qformat, "--calib-size", "2",
           "--calib-seq-len", "16", "--calib-dataset", calib_file(tmp_path), "--kv-cache-dtype", "int8"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    for warnings_env in ({}, {"PYTHONWARNINGS": "default"}):
        out = tmp_path / f"q-{len(warnings_env)}"
        proc = subprocess.run([*cmd, "-o", str(out)], env={**env, **warnings_env}, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == "" and proc.stdout.startswith(f"quantized LlamaForCausalLM to {qformat}"), proc.stderr
        assert len(proc.stdout.splitlines()) == 1, proc.stdout


def test_quiet_calibration_keeps_other_warnings_and_real_errors(capsys):
    import warnings

    from trtbuild.errors import TrtbuildError
    from trtbuild.quantize.calibrate import third_party_quiet

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with third_party_quiet():
            print("Inserted 756 quantizers")
            warnings.warn("transformers 9.0 is not tested with current version of modelopt", UserWarning, stacklevel=1)
            warnings.warn("overflow in the scales", RuntimeWarning, stacklevel=1)  # not third-party noise: shown
    assert [str(w.message) for w in seen] == ["overflow in the scales"]
    assert capsys.readouterr() == ("", "")
    with pytest.raises(ValueError, match="broken"), third_party_quiet():
        print("Inserted 3 quantizers")
        raise ValueError("broken")  # a bug: what modelopt printed before it goes to stderr, with the traceback
    assert capsys.readouterr().err == "Inserted 3 quantizers\n"
    with pytest.raises(TrtbuildError), third_party_quiet():
        print("Inserted 3 quantizers")
        raise TrtbuildError("a user error: one line")
    assert capsys.readouterr() == ("", "")
