"""``trtbuild inspect SOURCE``: would ``trtbuild convert`` take this Hugging Face folder or ``.gguf`` file, and if
not, why; found without converting and without reading tensor data.

- A problem is a line ``convert`` would stop at, all of them rather than the first: opening the source
  (``readers``: ``config.json``, the weights' files, a GGUF file's metadata and architecture) and reading its
  config (``models.config_problems``: each family's refusals, collected).
- A multimodal config (``*ForConditionalGeneration`` with a ``text_config``): its towers are never converted. For
  the architectures of ``multimodal.TEXT_MODELS`` ``convert`` converts the text model and drops the towers: supported,
  with a note saying so. Others are not supported; whether their text model would convert from a folder of its own,
  and as what, is reported beside (``text_model``); that model's config is the completed ``text_config``.
- Supported: the ``ModelConfig`` that ``convert`` would write (``model``).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..artifacts.manifest import MANIFEST
from ..checkpoint.files import WEIGHTS_FILE
from ..config import DType, ModelConfig
from ..errors import ConvertError, TrtbuildError
from ..models import config_problems, hf_dtype, supported_architectures
from .multimodal import TEXT_MODELS, text_config, text_model_config, towers, towers_phrase
from .tensor_names import SourceFormat


def is_source(path: Path) -> bool:
    """Whether ``path`` is what ``convert`` reads: a ``.gguf`` file, or a folder with a ``config.json`` that is
    neither a checkpoint (``rank0.safetensors``) nor an engine directory (``manifest.json`` /
    ``runtime_config.json``)."""
    if path.is_file():
        return path.suffix.lower() == ".gguf"
    trtbuild_files = (WEIGHTS_FILE, MANIFEST, "runtime_config.json")
    return (path / "config.json").is_file() and not any((path / name).exists() for name in trtbuild_files)


@dataclass(frozen=True)
class SupportReport:
    """Whether ``convert`` takes the source at ``path``: ``problems`` (none: supported) and, when supported, the
    ``model`` it would write; ``text_model`` for a multimodal config whose text model would convert."""

    path: Path
    source: SourceFormat
    architectures: list[str]
    problems: list[str]
    model: ModelConfig | None = None
    text_model: ModelConfig | None = None
    tensor_types: dict[str, int] = field(default_factory=dict)  # GGUF: tensor type -> count
    dequantized_types: list[str] = field(default_factory=list)  # GGUF: the quantized types convert dequantizes
    notes: list[str] = field(default_factory=list)  # what convert would leave out (a multimodal folder's towers)

    @property
    def supported(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "source",
            "path": str(self.path),
            "source": self.source.value,
            "architectures": self.architectures,
            "supported": self.supported,
            "problems": self.problems,
            "model": None if self.model is None else model_summary(self.model),
            "text_model": None if self.text_model is None else model_summary(self.text_model),
            "tensor_types": self.tensor_types,
            "dequantized_types": self.dequantized_types,
            "notes": self.notes,
        }

    def summary_line(self) -> str:
        """One line: supported or not, with the number of problems."""
        archs = ", ".join(self.architectures) or "no architecture"
        if self.supported:
            return f"{self.path}: {archs}: supported"
        return f"{self.path}: {archs}: not supported ({len(self.problems)} problem{'s' * (len(self.problems) > 1)})"

    def render_text(self) -> str:
        kind = {SourceFormat.HF: "Hugging Face folder", SourceFormat.GGUF: "GGUF file"}[self.source]
        lines = [f"{kind}: {self.path}", f"architecture: {', '.join(self.architectures) or 'none'}"]
        if self.tensor_types:
            lines.append("tensor types: " + ", ".join(f"{n} {t}" for t, n in self.tensor_types.items()))
            if self.dequantized_types:
                lines.append(
                    f"dequantized by convert: {', '.join(self.dequantized_types)} (no trtbuild format keeps them; "
                    "their fused partners are dequantized with them)"
                )
        lines.append("supported: yes (trtbuild convert converts it)" if self.supported else "supported: no")
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  note: {n}" for n in self.notes]
        if self.model is not None:
            lines += _model_lines("converts to", self.model)
        if self.text_model is not None:
            lines += _model_lines("its text model, from a folder of its own, would convert to", self.text_model)
        return "\n".join(lines)


def model_summary(cfg: ModelConfig) -> dict[str, Any]:
    """What a converted model is, in the terms of ``ModelConfig``."""
    rope = cfg.rope
    return {
        "architecture": cfg.architecture,
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_size": cfg.head_size,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_positions": cfg.max_position_embeddings,
        "norm": cfg.norm.value,
        "mlp": cfg.mlp.value,
        "position": cfg.position.value,
        "rotary": None
        if rope is None
        else {"theta": rope.theta, "rotary_dim": rope.rotary_dim, "scaling": rope.scaling},
        "qk_norm": cfg.qk_norm,
        "moe": None
        if cfg.moe is None
        else {
            "experts": cfg.moe.num_experts,
            "top_k": cfg.moe.top_k,
            "expert_intermediate_size": cfg.moe.intermediate_size,
            "renormalize": cfg.moe.renormalize,
            "sparse_layers": list(cfg.moe.sparse_layers),
        },
        "tied_head": cfg.tie_word_embeddings,
        "dtype": cfg.dtype.value,
    }


def _model_lines(title: str, cfg: ModelConfig) -> list[str]:
    s = model_summary(cfg)
    rotary = s["rotary"]
    position = (
        f"rotary theta {_number(rotary['theta'])} over {rotary['rotary_dim']} of {cfg.head_size} dims"
        + (f", scaling {_number(rotary['scaling'])}" if rotary["scaling"] != 1.0 else "")
        if rotary is not None
        else f"{s['position']} positions"
    )
    return [
        f"{title} {s['architecture']}:",
        f"  {s['layers']} layers, hidden {s['hidden_size']}, {s['heads']} heads / {s['kv_heads']} kv heads, head size "
        f"{s['head_size']}, intermediate {s['intermediate_size']}, vocab {s['vocab_size']}",
        f"  {position}; {s['max_positions']} positions; {s['norm']} norm, {s['mlp']} MLP"
        + ("; q/k norm" if s["qk_norm"] else ""),
        *([] if (moe := s["moe"]) is None else [_moe_line(moe, cfg.num_layers)]),
        f"  tied head: {'yes' if s['tied_head'] else 'no'}; dtype: {s['dtype']}",
    ]


def _moe_line(moe: dict[str, Any], layers: int) -> str:
    sparse = len(moe["sparse_layers"])
    where = "every layer" if sparse == layers else f"{sparse} of {layers} layers ({moe['sparse_layers']})"
    weights = "top-k weights renormalised" if moe["renormalize"] else "softmax weights, not renormalised"
    return (
        f"  mixture of experts in {where}: top {moe['top_k']} of {moe['experts']} experts of intermediate "
        f"{moe['expert_intermediate_size']}, {weights}"
    )


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def check_source(path: Path) -> SupportReport:
    """The support report of the ``.gguf`` file or Hugging Face folder at ``path`` (``is_source``)."""
    if not path.exists():
        raise TrtbuildError(f"{path}: no such file or directory")
    if path.is_file():
        return _check_gguf(path)
    return _check_hf(path)


def _check_gguf(path: Path) -> SupportReport:
    from .convert import source_dtype
    from .readers import FLOAT_GGUF_TYPES, KEPT_GGUF_TYPES, GGUFReader

    try:
        reader = GGUFReader(path)  # metadata and tensor infos; the tensor data stays memory-mapped, unread
    except ConvertError as e:
        return SupportReport(path, SourceFormat.GGUF, [], [str(e)])
    types = Counter(reader.type_name(name) for name in reader.names())
    archs = list(reader.hf_config["architectures"])
    cfg, problems = config_problems(reader.hf_config, source_dtype(reader))
    dequantized = [t for t, _ in types.most_common() if t not in (*KEPT_GGUF_TYPES, *FLOAT_GGUF_TYPES)]
    return SupportReport(
        path, SourceFormat.GGUF, archs, problems, cfg, tensor_types=dict(types.most_common()),
        dequantized_types=dequantized,
    )  # fmt: skip


def _check_hf(folder: Path) -> SupportReport:
    config_path = folder / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return SupportReport(folder, SourceFormat.HF, [], [f"{config_path}: not valid JSON ({e})"])
    if not isinstance(hf, dict):
        return SupportReport(folder, SourceFormat.HF, [], [f"{config_path}: not a JSON object"])
    if "format_version" in hf and "architectures" not in hf:
        raise TrtbuildError(f"{folder}: a trtbuild checkpoint's config.json without {WEIGHTS_FILE}")
    archs = hf.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    problems = _weights_problems(folder)
    dtype = hf_dtype(hf)
    if len(archs) == 1 and archs[0] in TEXT_MODELS and isinstance(hf.get("text_config"), dict):
        cfg, config_refusals = config_problems(text_model_config(hf), dtype)
        problems = [f"its text model: {p}" for p in config_refusals] + problems
        named = towers_phrase(towers(hf))
        note = f"{archs[0]}: {named} not converted; the text model converts"
        return SupportReport(folder, SourceFormat.HF, archs, problems, None if problems else cfg, notes=[note])
    if len(archs) == 1 and archs[0] not in supported_architectures() and isinstance(hf.get("text_config"), dict):
        multimodal, text_model = _multimodal_problems(archs[0], hf, dtype)
        return SupportReport(folder, SourceFormat.HF, archs, multimodal + problems, text_model=text_model)
    cfg, config_refusals = config_problems(hf, dtype)
    problems = config_refusals + problems
    return SupportReport(folder, SourceFormat.HF, archs, problems, None if problems else cfg)


def _weights_problems(folder: Path) -> list[str]:
    """The line ``convert`` stops at when the folder's weights cannot be opened (their headers only are read)."""
    from .readers import HFReader

    try:
        HFReader(folder).close()
    except ConvertError as e:
        return [str(e)]
    return []


def _multimodal_problems(arch: str, hf: dict[str, Any], dtype: DType) -> tuple[list[str], ModelConfig | None]:
    """The problems of a multimodal config, and its text model's ``ModelConfig`` when that would convert."""
    named = towers_phrase(towers(hf)) or "what is beside its text model"
    problems = [f"{arch}: {named} not supported"]
    text_hf = text_config(hf["text_config"])
    text_arch = (text_hf.get("architectures") or [None])[0]
    if text_arch is None:
        model_type = hf["text_config"].get("model_type")
        return [*problems, f"its text model (model_type {model_type!r}) has no causal-LM class in transformers"], None
    own = hf["text_config"].get("dtype", hf["text_config"].get("torch_dtype"))  # else the outer config's
    text_cfg, text_problems = config_problems(text_hf, hf_dtype(hf["text_config"]) if own else dtype)
    if text_cfg is None:
        return [*problems, *(f"its text model ({text_arch}) does not convert either: {p}" for p in text_problems)], None
    why = f"trtbuild convert takes {text_arch} folders, not the text model inside a {arch} folder"
    return [*problems, f"its text model ({text_arch}) would convert, but {why}"], text_cfg
