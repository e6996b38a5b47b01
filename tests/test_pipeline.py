"""``trtbuild pipeline``: stage caching by content, minimal rebuilds, failures, SIGKILL mid-stage, index.json, the
lock on the artifacts folder, the terminal status line. A recipe's targets, formats and accuracy gate:
test_pipeline_targets.py."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from tiny_models import make_hf_model

from trtbuild.artifacts.verify import verify_artifacts, verify_engine_dir
from trtbuild.errors import ConfigError
from trtbuild.pipeline import heartbeat
from trtbuild.pipeline.heartbeat import Heartbeat
from trtbuild.pipeline.plan import Stage, StageKind, make_plan
from trtbuild.pipeline.runner import PipelineError, PipelineRun, run_pipeline
from trtbuild.progress import Elapsed
from trtbuild.recipe import load_recipe

TRTBUILD = [sys.executable, "-m", "trtbuild.cli"]
BUILD = {"max_seq_len": 64, "kv_block_size": 4, "max_num_tokens": 64, "max_batch_size": 4}


def write_recipe(path: Path, model_name: str, model: Path, **extra) -> Path:
    data = {
        "name": model_name,
        "model": {"name": model_name, "path": str(model)},
        "formats": [{"name": "fp32"}],
        "targets": [{"backend": "onnxruntime", "arch": "cpu"}],
        "build": dict(BUILD),
        **extra,
    }
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(autouse=True)
def fixed_code_digest(monkeypatch):
    """Runs in one test compare keys: a colleague saving a trtbuild file meanwhile must not change them."""
    monkeypatch.setattr("trtbuild.pipeline.runner.code_digest", lambda hashes: "test-code")


def run(recipes: list[Path], out: Path, **kwargs) -> PipelineRun:
    lines: list[str] = []
    result = run_pipeline(make_plan([load_recipe(r) for r in recipes]), out, report=lines.append, **kwargs)
    result.lines = lines  # type: ignore[attr-defined]
    return result


def statuses(result: PipelineRun) -> dict[str, str]:
    return {sid: o.status.value for sid, o in result.outcomes.items()}


def tiny_sources(root: Path) -> dict[str, Path]:
    """name -> Hugging Face folder of the tiny llama_gqa and gpt2 models, made under ``root``."""
    out = {}
    for name in ("llama_gqa", "gpt2"):
        make_hf_model(name, root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return tiny_sources(tmp_path_factory.mktemp("src"))


def test_second_run_is_all_cached_and_fast(sources, tmp_path, monkeypatch):
    monkeypatch.undo()  # the second run is a separate process: both runs use the real code digest
    recipe = write_recipe(tmp_path / "a.yaml", "tiny", sources["llama_gqa"])
    art = tmp_path / "art"
    first = run([recipe], art)
    assert statuses(first) == {"tiny/checkpoint": "built", "tiny/fp32/onnxruntime/cpu": "built"}
    engine = art / "tiny/fp32/onnxruntime/cpu"
    assert (engine / "manifest.json").is_file() and verify_engine_dir(engine).ok

    index = json.loads((art / "index.json").read_text())
    entries = {a["id"]: a for a in index["artifacts"]}
    build = entries["tiny/fp32/onnxruntime/cpu"]
    assert (build["stage"], build["model"], build["format"], build["backend"], build["target"]) == (
        "build",
        "tiny",
        "fp32",
        "onnxruntime",
        "cpu",
    )
    assert build["size"] == sum(f["size"] for f in build["files"].values()) > 0
    assert {"manifest.json", "runtime_config.json"} <= set(build["files"]) and build["build_seconds"] >= 0
    assert len(build["digest"]) == 64 and index["recipes"][0]["name"] == "tiny"

    start = time.perf_counter()
    proc = subprocess.run([*TRTBUILD, "pipeline", str(recipe), "-o", str(art)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert time.perf_counter() - start < 10  # interpreter start-up included; the stages themselves cost ~0
    assert proc.stdout.count(": cached") == 2 and "running" not in proc.stdout, proc.stdout
    assert "2 cached" in proc.stdout.splitlines()[-1]
    again = json.loads((art / "index.json").read_text())
    assert {a["id"]: a["status"] for a in again["artifacts"]} == {
        "tiny/checkpoint": "cached",
        "tiny/fp32/onnxruntime/cpu": "cached",
    }
    assert {a["id"]: a["digest"] for a in again["artifacts"]} == {a["id"]: a["digest"] for a in index["artifacts"]}


def test_changes_rebuild_only_dependent_stages(sources, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for f in sources["llama_gqa"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    recipe = write_recipe(tmp_path / "a.yaml", "tiny", src, formats=[{"name": "fp32"}, {"name": "fp32-long"}])
    art = tmp_path / "art"
    assert set(statuses(run([recipe], art)).values()) == {"built"}

    # A build option: both engines are rebuilt, the checkpoint they share is not.
    data = yaml.safe_load(recipe.read_text())
    data["build"]["max_seq_len"] = 32
    recipe.write_text(yaml.safe_dump(data))
    dry = run([recipe], art, dry_run=True)
    assert statuses(dry) == {
        "tiny/checkpoint": "cached",
        "tiny/fp32/onnxruntime/cpu": "would run",
        "tiny/fp32-long/onnxruntime/cpu": "would run",
    }
    assert "options changed: build.max_seq_len" in dry.outcomes["tiny/fp32/onnxruntime/cpu"].reason
    result = run([recipe], art)
    assert statuses(result) == {
        "tiny/checkpoint": "cached",
        "tiny/fp32/onnxruntime/cpu": "built",
        "tiny/fp32-long/onnxruntime/cpu": "built",
    }
    assert json.loads((art / "tiny/fp32/onnxruntime/cpu/runtime_config.json").read_text())["build"]["max_seq_len"] == 32

    # The checkpoint dtype: convert and everything after it.
    data["model"]["dtype"] = "float16"
    recipe.write_text(yaml.safe_dump(data))
    assert set(statuses(run([recipe], art)).values()) == {"built"}

    # A source file that does not change the converted checkpoint: convert reruns, its output is byte-identical,
    # so the engines stay cached (keys use input content, not input timestamps).
    (src / "README.md").write_text("notes\n")
    assert statuses(run([recipe], art)) == {
        "tiny/checkpoint": "built",
        "tiny/fp32/onnxruntime/cpu": "cached",
        "tiny/fp32-long/onnxruntime/cpu": "cached",
    }

    # An edited artifact is noticed and rebuilt; touching a file without changing it is not a change.
    engine = art / "tiny/fp32/onnxruntime/cpu"
    os.utime(engine / "runtime_config.json")
    assert set(statuses(run([recipe], art)).values()) == {"cached"}
    (engine / "runtime_config.json").write_text("{}")
    result = run([recipe], art)
    assert result.outcomes["tiny/fp32/onnxruntime/cpu"].reason == "artifact modified since it was built"
    assert statuses(result)["tiny/fp32/onnxruntime/cpu"] == "built" and verify_artifacts(art).ok


def test_parallel_recipes_share_stages_and_conflicts_are_errors(sources, tmp_path):
    a = write_recipe(tmp_path / "a.yaml", "llama", sources["llama_gqa"])
    b = write_recipe(tmp_path / "b.yaml", "gpt2", sources["gpt2"], name="gpt2-b")
    a2 = write_recipe(tmp_path / "a2.yaml", "llama", sources["llama_gqa"], name="llama-again")
    art = tmp_path / "art"
    result = run([a, b, a2], art, jobs=3)
    assert len(result.outcomes) == 4 and set(statuses(result).values()) == {"built"}
    assert verify_artifacts(art).ok
    bad = write_recipe(
        tmp_path / "c.yaml", "llama", sources["llama_gqa"], name="llama-long", build=dict(BUILD, max_seq_len=16)
    )
    with pytest.raises(ConfigError, match="recipes llama and llama-long both make llama/fp32/onnxruntime/cpu"):
        make_plan([load_recipe(a), load_recipe(bad)])
    with pytest.raises(ConfigError, match="--target sm90: no recipe has such a target"):
        make_plan([load_recipe(a)], ("sm90",))


def test_failed_stage_fails_clearly_and_keeps_finished_artifacts(sources, tmp_path, monkeypatch):
    monkeypatch.undo()  # runs in a subprocess too: the real code digest in both
    good = write_recipe(tmp_path / "good.yaml", "good", sources["llama_gqa"])
    art = tmp_path / "art"
    run([good], art)
    broken_src = tmp_path / "broken"
    broken_src.mkdir()
    (broken_src / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    (broken_src / "model.safetensors").write_bytes(b"\0" * 16)
    broken = write_recipe(tmp_path / "broken.yaml", "broken", broken_src)
    proc = subprocess.run(
        [*TRTBUILD, "pipeline", str(good), str(broken), "-o", str(art)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: convert broken/checkpoint failed:"), proc.stderr
    assert "Traceback" not in proc.stderr and "convert  broken/checkpoint: FAILED" in proc.stdout
    index = {a["id"]: a["status"] for a in json.loads((art / "index.json").read_text())["artifacts"]}
    assert index == {
        "good/checkpoint": "cached",
        "good/fp32/onnxruntime/cpu": "cached",
        "broken/checkpoint": "failed",
        "broken/fp32/onnxruntime/cpu": "skipped",
    }
    assert verify_engine_dir(art / "good/fp32/onnxruntime/cpu").ok
    assert not (art / "broken").exists()


def _medium_model(folder: Path) -> None:
    """A random Llama big enough (~40 MB) that writing its artifacts takes a while: room to kill mid-write."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=16000,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(folder))


@pytest.mark.parametrize("stage", ["convert", "build"])
def test_sigkill_mid_stage_leaves_nothing_complete_and_next_run_finishes(tmp_path, stage, monkeypatch):
    monkeypatch.undo()  # runs in a subprocess too: the real code digest in both
    _medium_model(tmp_path / "src")
    recipe = write_recipe(tmp_path / "r.yaml", "med", tmp_path / "src")
    art = tmp_path / "art"
    final = art / ("med/checkpoint" if stage == "convert" else "med/fp32/onnxruntime/cpu")
    proc = subprocess.Popen(
        [*TRTBUILD, "pipeline", str(recipe), "-o", str(art)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if final.parent.is_dir() and any(p.name.startswith(f".{final.name}.tmp-") for p in final.parent.iterdir()):
                os.kill(proc.pid, signal.SIGKILL)  # the stage is writing its artifact right now
                break
            time.sleep(0.001)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the pipeline finished before it could be killed mid-stage"
    assert not final.exists()  # the artifact is renamed into place only when complete
    assert not verify_artifacts(art).ok  # no index of a finished run either
    if stage == "build":
        assert (art / "med/checkpoint").is_dir()  # the finished stage before it is kept...
    result = run([recipe], art)
    assert statuses(result)["med/checkpoint"] == ("built" if stage == "convert" else "cached")  # ...and reused
    assert verify_artifacts(art).ok and verify_engine_dir(art / "med/fp32/onnxruntime/cpu").ok
    leftovers = [p for p in art.rglob(".*") if ".tmp-" in p.name]
    assert not leftovers


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_heartbeat_line_names_running_stages_their_time_and_last_run():
    stage = Stage(StageKind.QUANTIZE, "m/int4/checkpoint", (), {})
    term, lock = Terminal(), threading.Lock()
    beat = Heartbeat(lambda s: 185.0 if s.id == stage.id else None, lock, term)
    beat.started(stage)
    assert beat.line(time.perf_counter() + 83) == "running: quantize m/int4/checkpoint 1:23 (last run 3:05)"
    beat.draw()
    assert term.getvalue().startswith("\rrunning: quantize m/int4/checkpoint 0:00 (last run 3:05)")
    beat.finished(stage)
    assert beat.line() == ""
    beat.close()
    assert term.getvalue().endswith("\r")  # the line is cleared
    quiet = Heartbeat(lambda s: None, lock, io.StringIO())  # not a terminal: nothing, ever
    quiet.started(stage)
    quiet.draw()
    quiet.close()
    assert quiet.stream.getvalue() == ""


def test_elapsed_line_for_build_and_convert_on_a_terminal_only(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with Elapsed("building onnxruntime engine", interval=0.01):
        time.sleep(0.1)
    assert term.getvalue().startswith("\rbuilding onnxruntime engine  0:00") and term.getvalue().endswith("\r")
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stderr", plain)
    with Elapsed("converting", interval=0.01):
        time.sleep(0.05)
    assert plain.getvalue() == ""


def test_pipeline_shows_a_status_line_on_a_terminal(sources, tmp_path, monkeypatch):
    monkeypatch.setattr(heartbeat, "INTERVAL_S", 0.01)
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    recipe = write_recipe(tmp_path / "t.yaml", "tiny", sources["llama_gqa"])
    run([recipe], tmp_path / "art")
    assert "\rrunning: build tiny/fp32/onnxruntime/cpu 0:0" in term.getvalue()  # a second or so: redrawn each 10 ms
    assert term.getvalue().endswith("\r")  # cleared at the end


def test_code_digest_covers_stage_code_only(tmp_path):
    from trtbuild.pipeline.cache import FileHashCache, code_digest

    class Edited(FileHashCache):
        def __init__(self, edited: str) -> None:
            super().__init__(tmp_path / "hashes.json")
            self.edited = edited

        def sha256(self, path: Path) -> str:
            return "edited" if path.as_posix().endswith(self.edited) else super().sha256(path)

    base = code_digest(FileHashCache(tmp_path / "hashes.json"))
    assert code_digest(Edited("nothing")) == base
    assert code_digest(Edited("trtbuild/quantize/quantize.py")) != base
    assert code_digest(Edited("paged_attention/reference.py")) != base  # plugins are stage code too
    assert code_digest(Edited("trtbuild/cli/pipeline.py")) == base  # orchestration is not


def test_pipeline_refuses_a_busy_artifacts_dir(sources, tmp_path):
    import fcntl

    recipe = write_recipe(tmp_path / "a.yaml", "tiny", sources["llama_gqa"])
    (tmp_path / "art/.pipeline").mkdir(parents=True)
    with open(tmp_path / "art/.pipeline/lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(PipelineError, match="in use by another trtbuild pipeline"):
            run([recipe], tmp_path / "art")
