"""``trtbuild inspect SOURCE`` (issue 38, item 4): whether a Hugging Face folder or a GGUF file converts, every
reason it does not, and the model it would be; nothing converted, no tensor data read."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_run_cli import cli
from tiny_models import TINY_CONFIGS, make_hf_model

from trtbuild.config import DType
from trtbuild.convert.support import check_source, is_source
from trtbuild.errors import ConvertError
from trtbuild.models import config_problems, model_config_from_hf

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e6}
UNSUPPORTED_QWEN3 = dict(hidden_act="gelu_new", rope_parameters=YARN)


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    out = {name: root / name for name in ("llama_gqa", "qwen3", "phi3")}
    for name, folder in out.items():
        make_hf_model(name, folder)
    out["qwen3_gelu_yarn"] = root / "qwen3_gelu_yarn"
    make_hf_model("qwen3", out["qwen3_gelu_yarn"], **UNSUPPORTED_QWEN3)
    return out


@pytest.mark.parametrize(
    "name, summary",
    [
        ("llama_gqa", dict(layers=2, hidden_size=64, heads=4, kv_heads=2, head_size=16, vocab_size=97, qk_norm=False)),
        ("qwen3", dict(layers=2, hidden_size=48, heads=4, kv_heads=2, head_size=16, vocab_size=107, qk_norm=True)),
        ("phi3", dict(layers=2, hidden_size=64, heads=4, kv_heads=2, head_size=16, vocab_size=109, qk_norm=False)),
    ],
)
def test_a_supported_folder_reports_the_model_convert_would_write(folders, name, summary):
    report = check_source(folders[name])
    assert report.supported and report.problems == [], report.problems
    assert report.architectures == TINY_CONFIGS[name]["architectures"]
    info = report.to_dict()
    assert info["supported"] is True and info["source"] == "hf" and info["text_model"] is None
    model = info["model"]
    assert {k: model[k] for k in summary} == summary
    assert model["architecture"] == report.architectures[0] and model["dtype"] == "float32"
    assert model["tied_head"] is False
    rotary_dim = 12 if name == "phi3" else 16  # Phi-3's partial rotary: 0.75 of head size 16
    assert model["rotary"]["rotary_dim"] == rotary_dim
    text = report.render_text()
    assert "supported: yes" in text and f"{summary['layers']} layers" in text and "problem" not in text


def test_every_problem_is_listed_and_convert_still_stops_at_the_first(folders):
    """A Qwen3 with a gelu MLP and a yarn rope: inspect lists both; convert's one line is unchanged."""
    report = check_source(folders["qwen3_gelu_yarn"])
    assert not report.supported and report.model is None
    assert report.problems == [
        "hidden_act 'gelu_new' is not supported (silu)",
        "rope type 'yarn' is not supported (supported: default, linear)",
    ]
    hf = json.loads((folders["qwen3_gelu_yarn"] / "config.json").read_text())
    with pytest.raises(ConvertError) as e:
        model_config_from_hf(hf, DType.FLOAT32)
    assert str(e.value) == f"inconsistent config.json for Qwen3ForCausalLM: {report.problems[0]}"


def test_each_family_collects_its_refusals():
    llama = {**TINY_CONFIGS["llama_gqa"], "hidden_act": "gelu", "mlp_bias": True, "rope_scaling": YARN}
    phi3 = {**TINY_CONFIGS["phi3"], "attention_bias": True, "rope_scaling": {"type": "longrope"}}
    gpt2 = {**TINY_CONFIGS["gpt2"], "activation_function": "relu", "reorder_and_upcast_attn": True}
    for hf, count in ((llama, 3), (phi3, 2), (gpt2, 2)):
        cfg, problems = config_problems(hf, DType.FLOAT32)
        assert cfg is None and len(problems) == count and all("not supported" in p for p in problems), problems
    cfg, problems = config_problems({**TINY_CONFIGS["qwen3"], "layer_types": ["full_attention"]}, DType.FLOAT32)
    assert cfg is None and problems == ["inconsistent config.json for Qwen3ForCausalLM: layer_types names 1 layers, "
                                        "num_hidden_layers is 2"]  # fmt: skip
    cfg, problems = config_problems(TINY_CONFIGS["mistral"], DType.BFLOAT16)
    assert problems == [] and cfg is not None and cfg.dtype is DType.BFLOAT16


def test_an_unknown_architecture_names_the_supported_ones(tmp_path):
    folder = write_config(tmp_path / "m", {"architectures": ["FalconForCausalLM"], "hidden_size": 8})
    report = check_source(folder)
    assert not report.supported and report.architectures == ["FalconForCausalLM"]
    first = report.problems[0]
    assert first.startswith("unsupported architecture FalconForCausalLM; supported: ") and "Qwen3ForCausalLM" in first
    assert any("no model.safetensors" in p for p in report.problems)  # convert would stop there too


TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_a_multimodal_config_names_its_towers_and_what_its_text_model_would_be(tmp_path):
    llava = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": {"model_type": "llama", "vocab_size": 100, **TEXT},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32},
        "dtype": "float16",
    }
    report = check_source(write_config(tmp_path / "llava", llava))
    assert not report.supported and report.model is None
    assert report.problems[0] == "LlavaForConditionalGeneration: vision tower (vision_config) not supported"
    assert report.problems[1].startswith("its text model (LlamaForCausalLM) would convert, but trtbuild convert")
    text_model = report.to_dict()["text_model"]
    assert text_model["architecture"] == "LlamaForCausalLM" and text_model["layers"] == 2
    assert text_model["head_size"] == 16 and text_model["dtype"] == "float16"
    assert "its text model, from a folder of its own, would convert to LlamaForCausalLM" in report.render_text()


def test_gemma3_for_conditional_generation(tmp_path):
    gemma3 = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {"model_type": "gemma3_text", "head_dim": 16, "vocab_size": 100, **TEXT},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32},
    }
    report = check_source(write_config(tmp_path / "gemma3", gemma3))  # convert takes its text model, towers dropped
    assert report.notes == [
        "Gemma3ForConditionalGeneration: vision tower (vision_config) not converted; the text model converts"
    ]
    assert len(report.problems) == 1 and "no model.safetensors" in report.problems[0]  # a config without weights
    gemma3["text_config"]["hidden_activation"] = "relu"
    report = check_source(write_config(tmp_path / "relu", gemma3))
    assert (
        report.problems[0] == "its text model: hidden_activation 'relu' is not supported for Gemma (gelu_pytorch_tanh)"
    )


def test_the_smollm2_gguf_is_supported_from_its_metadata():
    from trtbuild.demo import smollm2_gguf_path

    start = time.perf_counter()
    report = check_source(smollm2_gguf_path())
    assert time.perf_counter() - start < 10
    assert report.supported, report.problems
    info = report.to_dict()
    assert info["source"] == "gguf" and info["architectures"] == ["LlamaForCausalLM"]
    model = info["model"]
    assert (model["layers"], model["hidden_size"], model["heads"], model["kv_heads"]) == (30, 576, 9, 3)
    assert model["vocab_size"] == 49152 and model["tied_head"] is True
    assert info["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1} and info["dequantized_types"] == []


def test_cli_exit_status_and_json(monkeypatch, capsys, folders, tmp_path):
    code, out, err = cli(monkeypatch, capsys, "inspect", folders["qwen3"])
    assert code == 0 and err == "" and "supported: yes" in out
    code, out, err = cli(monkeypatch, capsys, "inspect", folders["qwen3"], "--json")
    assert code == 0 and json.loads(out)["supported"] is True and json.loads(out)["problems"] == []

    bad = folders["qwen3_gelu_yarn"]
    code, out, err = cli(monkeypatch, capsys, "inspect", bad)
    assert code == 1 and out.count("problem: ") == 2
    assert err == f"inspect: {bad}: Qwen3ForCausalLM: not supported (2 problems)\n"
    code, out, err = cli(monkeypatch, capsys, "inspect", bad, "--json")
    info = json.loads(out)
    assert code == 1 and info["supported"] is False and len(info["problems"]) == 2 and info["model"] is None
    assert err.count("\n") == 1

    garbled = tmp_path / "model.gguf"
    garbled.write_bytes(b"GGUF")  # convert refuses it: a problem, not an error of inspect
    code, out, err = cli(monkeypatch, capsys, "inspect", garbled)
    assert code == 1 and "not a readable GGUF file" in out and err.startswith(f"inspect: {garbled}: ")


def test_what_is_a_source(tmp_path, folders):
    assert is_source(folders["llama_gqa"]) and not is_source(tmp_path / "nope")
    ckpt = write_config(tmp_path / "ckpt", {"architecture": "LlamaForCausalLM"})
    (ckpt / "rank0.safetensors").write_bytes(b"")
    assert not is_source(ckpt) and not is_source(tmp_path)
