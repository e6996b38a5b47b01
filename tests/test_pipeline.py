"""``trtbuild pipeline``: stage caching by content, minimal rebuilds, failures, SIGKILL mid-stage, index.json."""

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
from test_run_cli import cli
from tiny_models import make_hf_model

from trtbuild.artifacts.verify import verify_artifacts, verify_engine_dir
from trtbuild.errors import ConfigError
from trtbuild.pipeline import heartbeat
from trtbuild.pipeline.heartbeat import Heartbeat
from trtbuild.pipeline.index import GateResult, check_gates
from trtbuild.pipeline.plan import Stage, StageKind, make_plan
from trtbuild.pipeline.runner import Outcome, PipelineError, PipelineRun, Status, run_pipeline
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


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    out = {}
    for name in ("llama_gqa", "gpt2"):
        make_hf_model(name, root / name)
        out[name] = root / name
    return out


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


def test_tensorrt_targets_get_their_arch_and_are_reported_not_buildable_without_tensorrt(
    sources, tmp_path, monkeypatch, capsys
):
    trt = {"backend": "tensorrt", "arch": "sm90"}
    recipe = write_recipe(
        tmp_path / "t.yaml",
        "tiny",
        sources["llama_gqa"],
        tensorrt={"version_compatible": True},
        targets=[{"backend": "onnxruntime"}, trt],
        accuracy_gate={"baseline": "fp32", "max_ppl_increase": 50.0, "eval": {"dataset": "lee_news", "windows": 1,
                                                                             "seq_len": 16}},
    )  # fmt: skip
    plan = make_plan([load_recipe(recipe)])
    (stage,) = [s for s in plan.stages if s.id == "tiny/fp32/tensorrt/sm90"]
    assert stage.options["build"]["backend"] == "tensorrt"
    assert stage.options["tensorrt"]["arch"] == ["sm90"] and stage.options["tensorrt"]["version_compatible"]
    assert [s.id for s in make_plan([load_recipe(recipe)], ("cpu",)).stages] == [
        "tiny/checkpoint",
        "tiny/fp32/onnxruntime/cpu",
        "tiny/fp32/onnxruntime/cpu.eval.json",
    ]
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError, installed or not
    art = tmp_path / "art"
    dry = run([recipe], art, dry_run=True)
    assert statuses(dry) == {
        "tiny/checkpoint": "would run",
        "tiny/fp32/onnxruntime/cpu": "would run",
        "tiny/fp32/onnxruntime/cpu.eval.json": "would run",
        "tiny/fp32/tensorrt/sm90": "not buildable here",
        "tiny/fp32/tensorrt/sm90.eval.json": "not buildable here",  # downstream of a target not buildable here
    }
    assert not art.exists()  # --dry-run writes nothing, not even .pipeline/
    data = yaml.safe_load(recipe.read_text())
    del data["accuracy_gate"]  # the eval stages need a tokenizer; the tiny model has none
    recipe.write_text(yaml.safe_dump(data))

    # The CPU target completes; the TensorRT build and its eval are reported, with the command to run elsewhere.
    code, out, err = cli(monkeypatch, capsys, "pipeline", recipe, "-o", art)
    assert code == 0, err
    assert statuses_from_index(art) == {
        "tiny/checkpoint": "built",
        "tiny/fp32/onnxruntime/cpu": "built",
        "tiny/fp32/tensorrt/sm90": "not buildable here",
    }
    assert "1 not buildable here" in out
    assert f"not buildable on this machine: tensorrt/sm90 (TensorRT is not installed on this machine); where it " \
        f"is: trtbuild pipeline {recipe} -o {art} --target tensorrt/sm90" in err  # fmt: skip
    assert verify_artifacts(art).ok and verify_engine_dir(art / "tiny/fp32/onnxruntime/cpu").ok
    code, out, err = cli(monkeypatch, capsys, "pipeline", recipe, "-o", art, "--strict")
    assert code == 2 and err.strip().splitlines()[-1] == "error: --strict: 1 target(s) not buildable on this machine"
    assert "3 stages (2 cached, 1 not buildable here)" in out


def statuses_from_index(art: Path) -> dict[str, str]:
    return {a["id"]: a["status"] for a in json.loads((art / "index.json").read_text())["artifacts"]}


def test_formats_with_targets_are_built_for_those_targets_only(sources, tmp_path):
    """A recipe's CPU format (dynamic scales) and its TensorRT format (static scales) are planned apart; a
    format's target that the recipe lacks, or that the gate's baseline is not built for, is one line."""
    gate = {"baseline": "fp32", "max_ppl_increase": 5.0, "eval": {"dataset": "flask_docs", "windows": 1}}
    formats = [
        {"name": "fp32"},
        {"name": "int8", "targets": ["onnxruntime/cpu"], "quantization": {"qformat": "int8_sq"}},
        {
            "name": "int8_static",
            "targets": ["tensorrt/sm90"],
            "quantization": {"qformat": "int8_sq", "activation_scales": "static"},
        },
    ]
    targets = [{"backend": "onnxruntime"}, {"backend": "tensorrt", "arch": "sm90"}]
    recipe = write_recipe(tmp_path / "t.yaml", "tiny", sources["llama_gqa"], formats=formats, targets=targets,
                          accuracy_gate=gate)  # fmt: skip
    ids = [s.id for s in make_plan([load_recipe(recipe)]).stages if s.kind is not StageKind.EVAL]
    assert ids == [
        "tiny/checkpoint",
        "tiny/fp32/onnxruntime/cpu",
        "tiny/fp32/tensorrt/sm90",
        "tiny/int8/checkpoint",
        "tiny/int8/onnxruntime/cpu",
        "tiny/int8_static/checkpoint",
        "tiny/int8_static/tensorrt/sm90",
    ]
    cpu_only = [s.id for s in make_plan([load_recipe(recipe)], ("cpu",)).stages]
    assert not any("int8_static" in i for i in cpu_only)  # not even its quantize stage
    formats[2]["targets"] = ["tensorrt/sm80"]
    write_recipe(tmp_path / "t.yaml", "tiny", sources["llama_gqa"], formats=formats, targets=targets)
    with pytest.raises(ConfigError, match="format int8_static: target 'tensorrt/sm80' is not one of"):
        load_recipe(recipe)
    formats[0]["targets"], formats[2]["targets"] = ["onnxruntime/cpu"], ["tensorrt/sm90"]
    write_recipe(tmp_path / "t.yaml", "tiny", sources["llama_gqa"], formats=formats, targets=targets,
                 accuracy_gate=gate)  # fmt: skip
    with pytest.raises(ConfigError, match="int8_static is built for tensorrt/sm90, which the gate's baseline is not"):
        load_recipe(recipe)


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


def test_accuracy_gate_compares_with_the_baseline(sources, tmp_path):
    recipe = write_recipe(
        tmp_path / "g.yaml",
        "tiny",
        sources["llama_gqa"],
        formats=[{"name": "fp32"}, {"name": "q"}],
        accuracy_gate={"baseline": "fp32", "max_ppl_increase": 10.0},
    )
    plan = make_plan([load_recipe(recipe)])
    assert [s.kind for s in plan.stages].count(StageKind.EVAL) == 2
    evals = [s for s in plan.stages if s.kind is StageKind.EVAL]
    ppl = {"fp32": 10.0, "q": 10.5}
    outcomes = {
        s.id: Outcome(s, Status.CACHED, record={"metrics": {"perplexity": ppl[s.labels["format"]]}}) for s in evals
    }
    (gate,) = check_gates(outcomes, plan)
    assert isinstance(gate, GateResult) and gate.passed and gate.format == "q" and "+5.0%" in gate.message
    ppl["q"] = 11.5
    outcomes = {
        s.id: Outcome(s, Status.CACHED, record={"metrics": {"perplexity": ppl[s.labels["format"]]}}) for s in evals
    }
    (gate,) = check_gates(outcomes, plan)
    assert (
        not gate.passed and "accuracy gate failed: tiny/q/onnxruntime/cpu perplexity 11.500 is +15.0%" in gate.message
    )


def test_quantize_and_eval_stages(tmp_path):
    pytest.importorskip("modelopt")
    from quantize_helpers import calib_file, write_char_tokenizer

    model = make_hf_model("llama_gqa", tmp_path / "hf")
    write_char_tokenizer(tmp_path / "hf", model.config.vocab_size)  # convert copies it into the checkpoint
    text = str(calib_file(tmp_path))
    quant = {"qformat": "int8_sq", "calib_dataset": text, "calib_size": 4, "calib_seq_len": 16}
    gate = {"baseline": "fp32", "max_ppl_increase": 50.0, "eval": {"dataset": text, "windows": 2, "seq_len": 32}}
    formats = [{"name": "fp32"}, {"name": "int8_sq", "quantization": quant}]
    recipe = write_recipe(tmp_path / "q.yaml", "tiny", tmp_path / "hf", accuracy_gate=gate, formats=formats)
    art = tmp_path / "art"
    result = run([recipe], art, jobs=2)
    assert [o.stage.kind.value for o in result.outcomes.values()].count("quantize") == 1
    assert set(statuses(result).values()) == {"built"}
    (gate_result,) = result.gates
    assert gate_result.format == "int8_sq" and gate_result.perplexity > 1 and gate_result.baseline_perplexity > 1
    index = json.loads((art / "index.json").read_text())
    evals = [a for a in index["artifacts"] if a["stage"] == "eval"]
    assert len(evals) == 2 and all(a["metrics"]["perplexity"] > 1 for a in evals)
    assert index["accuracy_gate"][0]["passed"] and verify_artifacts(art).ok
    assert json.loads((art / "tiny/int8_sq/checkpoint/config.json").read_text())["quantization"]["qformat"] == "int8_sq"

    # A stricter gate reruns nothing (the threshold is not a stage input) but fails the pipeline. Random weights:
    # int8 may even score better than fp32, so the baseline is whichever format scored better.
    data = yaml.safe_load(recipe.read_text())
    worse_is_int8 = gate_result.perplexity > gate_result.baseline_perplexity
    data["accuracy_gate"].update(max_ppl_increase=0.0, baseline="fp32" if worse_is_int8 else "int8_sq")
    recipe.write_text(yaml.safe_dump(data))
    worse = "int8_sq" if worse_is_int8 else "fp32"
    with pytest.raises(PipelineError, match=f"accuracy gate failed: tiny/{worse}/onnxruntime/cpu perplexity"):
        run([recipe], art)
    index = json.loads((art / "index.json").read_text())
    assert {a["status"] for a in index["artifacts"]} == {"cached"} and not index["accuracy_gate"][0]["passed"]

    # The calibration text is a file: its content is an input of quantize (and of the evals that read it too).
    Path(text).write_text(Path(text).read_text() + "\n\nMore text.\n")
    dry = statuses(run([recipe], art, dry_run=True))
    assert dry["tiny/int8_sq/checkpoint"] == "would run" and dry["tiny/checkpoint"] == "cached"
    assert dry["tiny/fp32/onnxruntime/cpu"] == "cached" and dry["tiny/fp32/onnxruntime/cpu.eval.json"] == "would run"


def test_torch_targets_carry_their_device_and_cuda_is_not_buildable_without_a_gpu(
    sources, tmp_path, monkeypatch, capsys
):
    """A recipe's torch targets: the device from the target, the dtype and runtime from ``torch:``; the CPU engine is
    built and runs; an AOTInductor CUDA one is reported not buildable on a machine without a GPU, a torch-compile
    CUDA one (compiled where it is opened) is built."""
    import torch

    from trtbuild.runtime.llm import LLM, SamplingParams

    recipe = write_recipe(
        tmp_path / "t.yaml",
        "tiny",
        sources["llama_gqa"],
        torch={"dtype": "float32", "torch_runtime": "aot-inductor"},
        targets=[{"backend": "torch", "arch": "cpu"}, {"backend": "torch", "arch": "cuda"}],
    )
    plan = make_plan([load_recipe(recipe)])
    options = {s.id: s.options.get("torch") for s in plan.stages if s.kind is StageKind.BUILD}
    common = {"dtype": "float32", "max_autotune": False, "torch_runtime": "aot-inductor"}
    assert options == {
        "tiny/fp32/torch/cpu": {"device": "cpu", **common},
        "tiny/fp32/torch/cuda": {"device": "cuda", **common},
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the machine has no GPU, whatever it has
    art = tmp_path / "art"
    code, _, err = cli(monkeypatch, capsys, "pipeline", recipe, "-o", art)
    assert code == 0, err
    assert statuses_from_index(art) == {
        "tiny/checkpoint": "built",
        "tiny/fp32/torch/cpu": "built",
        "tiny/fp32/torch/cuda": "not buildable here",
    }
    assert "torch/cuda (this machine has no CUDA GPU for torch to compile for)" in err
    engine = art / "tiny/fp32/torch/cpu"
    assert verify_engine_dir(engine).ok
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(LLM(engine).generate([[5, 6, 7]], greedy)[0].token_ids) == 4

    compile_recipe = write_recipe(
        tmp_path / "c.yaml", "tiny", sources["llama_gqa"], targets=[{"backend": "torch", "arch": "cuda"}]
    )
    code, _, err = cli(monkeypatch, capsys, "pipeline", compile_recipe, "-o", tmp_path / "art2")
    assert code == 0, err
    assert statuses_from_index(tmp_path / "art2")["tiny/fp32/torch/cuda"] == "built"
    assert verify_engine_dir(tmp_path / "art2/tiny/fp32/torch/cuda").ok


def test_recipe_torch_targets_are_checked(tmp_path, sources):
    sm90 = [{"backend": "torch", "arch": "sm90"}]
    bad = write_recipe(tmp_path / "b.yaml", "tiny", sources["llama_gqa"], targets=sm90)
    with pytest.raises(ConfigError, match="torch targets have arch 'cuda' or 'cpu'"):
        load_recipe(bad)
    dev = write_recipe(tmp_path / "d.yaml", "tiny", sources["llama_gqa"], torch={"device": "cpu"})
    with pytest.raises(ConfigError, match=r"recipe\.torch\.device: set torch devices per target"):
        load_recipe(dev)
