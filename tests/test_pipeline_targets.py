"""``trtbuild pipeline`` on what a recipe asks for: TensorRT and torch targets (built here, or reported not buildable
with the command to run where they are), formats built for some targets only, the quantize and eval stages and the
accuracy gate over their perplexities."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from test_pipeline import run, statuses, tiny_sources, write_recipe
from test_run_cli import cli
from tiny_models import make_hf_model

from trtbuild.artifacts.verify import verify_artifacts, verify_engine_dir
from trtbuild.errors import ConfigError
from trtbuild.pipeline.index import GateResult, check_gates
from trtbuild.pipeline.plan import StageKind, make_plan
from trtbuild.pipeline.runner import Outcome, PipelineError, Status
from trtbuild.recipe import load_recipe


@pytest.fixture(autouse=True)
def fixed_code_digest(monkeypatch):
    """Runs in one test compare keys: a colleague saving a trtbuild file meanwhile must not change them."""
    monkeypatch.setattr("trtbuild.pipeline.runner.code_digest", lambda hashes: "test-code")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return tiny_sources(tmp_path_factory.mktemp("src"))


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
