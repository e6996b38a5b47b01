"""``trtbuild eval``: perplexity of engines and checkpoints, the JSON output, and the build's accuracy gate."""

from __future__ import annotations

import json
import math

import pytest
import torch
from quantize_helpers import calib_file, tiny_checkpoint
from test_cli_errors import assert_clean_failure, run_cli

from trtbuild.build import build_engine
from trtbuild.cli.eval import evaluate
from trtbuild.config import BuildConfig, EvalConfig, PerplexityGate, QFormat, QuantConfig
from trtbuild.errors import BuildError, TrtbuildError
from trtbuild.eval import eval_windows
from trtbuild.quantize.quantize import quantize


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model, ckpt = tiny_checkpoint(root)
    text = calib_file(root)
    build_engine(ckpt, root / "engine", BuildConfig(max_seq_len=128, kv_block_size=4))
    return model, ckpt, root / "engine", text, root


def test_perplexity_matches_transformers(setup):
    model, _, engine, text, _ = setup
    cfg = EvalConfig(dataset=str(text), windows=3, seq_len=40)
    result = evaluate(engine, cfg)
    windows = eval_windows(engine, cfg)
    assert windows.shape == (3, 40) and result.tokens == 3 * 39 and result.windows == 3
    with torch.no_grad():
        logits = model(torch.from_numpy(windows)).logits.double()
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), torch.from_numpy(windows[:, 1:]).reshape(-1)
    ).item()
    assert result.perplexity == pytest.approx(math.exp(nll), rel=1e-5)


def test_checkpoint_is_built_and_evaluated(setup):
    _, ckpt, engine, text, _ = setup
    cfg = EvalConfig(dataset=str(text), windows=2, seq_len=32)
    assert evaluate(ckpt, cfg).perplexity == pytest.approx(evaluate(engine, cfg).perplexity, rel=1e-6)


def test_cli_json_and_errors(setup, tmp_path):
    _, _, engine, text, _ = setup
    proc = run_cli("eval", engine, "--dataset", text, "--windows", "2", "--seq-len", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["tokens"] == 30 and data["perplexity"] > 1 and data["windows"] == 2
    assert_clean_failure(run_cli("eval", engine, "--dataset", text, "--seq-len", "4096"), "exceeds the engine's")
    assert_clean_failure(run_cli("eval", tmp_path, "--dataset", text), "neither an engine directory")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert_clean_failure(run_cli("eval", engine, "--dataset", short, "--seq-len", "64"), "0 windows of 64")


def test_more_windows_than_the_text_has_are_refused(setup):
    _, _, engine, text, _ = setup
    with pytest.raises(TrtbuildError, match=r"windows of 64, not --windows 1000 \(ask for at most \d+\)") as e:
        eval_windows(engine, EvalConfig(dataset=str(text), windows=1000, seq_len=64))
    available = int(str(e.value).rsplit("at most ", 1)[1].rstrip(")"))
    assert 1 <= available < 1000
    assert eval_windows(engine, EvalConfig(dataset=str(text), windows=available, seq_len=64)).shape == (available, 64)
    with pytest.raises(TrtbuildError, match=r"0 windows of 1000000.*or lower --seq-len"):
        eval_windows(engine, EvalConfig(dataset=str(text), windows=1, seq_len=10**6))


def test_accuracy_gate(setup):
    """A build passes a loose gate and fails a tight one, leaving no engine; the reference is the better engine."""
    _, ckpt, engine, text, root = setup
    qckpt = root / "int4"
    quantize(ckpt, qckpt, QuantConfig(qformat=QFormat.INT4_WO, group_size=32, calib_dataset=str(text)), progress=False)
    eval_cfg = EvalConfig(dataset=str(text), windows=2, seq_len=48)
    build = BuildConfig(max_seq_len=128, kv_block_size=4)
    build_engine(qckpt, root / "int4-engine", build)
    ppl = {path: evaluate(path, eval_cfg).perplexity for path in (engine, root / "int4-engine")}
    assert ppl[engine] != pytest.approx(ppl[root / "int4-engine"], rel=1e-3)  # int4 changes the random model
    ref, worse = (engine, qckpt) if ppl[engine] < ppl[root / "int4-engine"] else (root / "int4-engine", ckpt)
    loose = build_engine(worse, root / "gated-ok", build, gate=PerplexityGate(ref, 1e6, eval_cfg))
    assert loose.accuracy_gate["reference_perplexity"] == pytest.approx(ppl[ref])
    increase = loose.accuracy_gate["increase_pct"]
    assert increase > 0
    manifest = json.loads((root / "gated-ok" / "manifest.json").read_text())
    assert manifest["accuracy_gate"]["increase_pct"] == pytest.approx(increase)
    with pytest.raises(BuildError, match="accuracy gate failed"):
        build_engine(worse, root / "gated-fail", build, gate=PerplexityGate(ref, increase / 2, eval_cfg))
    assert not (root / "gated-fail").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".gated-fail")]


def test_build_cli_gate_flags(setup):
    _, ckpt, _, _, root = setup
    out = root / "cli-gated"
    proc = run_cli("build", ckpt, "-o", out, "--max-seq-len", "600", "--accuracy-gate", root / "nope")
    assert_clean_failure(proc, "not an engine directory")
    assert not out.exists()
