"""Multimodal checkpoints (``*ForConditionalGeneration`` with a ``text_config``) whose text model converts alone.

trtbuild converts language models. For the architectures of ``TEXT_MODELS`` ``convert`` reads the folder as its
text model: the ``text_config`` (transformers' defaults filled in) is the config, the text model's tensors are
renamed to the names its own causal-LM checkpoint would have, and the towers' tensors are dropped and counted, so
the command says what it left out. Other multimodal folders are refused (``inspect`` says whether their text model
would convert from a folder of its own). ``open_source`` opens what ``convert`` reads, such a folder as its text
model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConvertError
from .readers import GGUFReader, HFReader


@dataclass(frozen=True)
class TextModelLayout:
    """Where a multimodal checkpoint keeps its text model: ``(source prefix, the text model's own prefix)`` pairs,
    and the prefixes of the tensors of everything else (vision tower, projector), which are dropped."""

    text_prefixes: tuple[tuple[str, str], ...]
    tower_prefixes: tuple[str, ...]


TEXT_MODELS: dict[str, TextModelLayout] = {
    "Gemma3ForConditionalGeneration": TextModelLayout(
        text_prefixes=(
            ("language_model.model.", "model."),  # as transformers 4.x and 5 save it (Hub checkpoints)
            ("model.language_model.", "model."),  # transformers 5's module names
            ("language_model.lm_head.", "lm_head."),
        ),
        tower_prefixes=(
            "vision_tower.",
            "multi_modal_projector.",
            "model.vision_tower.",
            "model.multi_modal_projector.",
        ),
    ),
}


def towers(hf: dict[str, Any]) -> list[str]:
    """The config keys of a multimodal config's towers (``vision_config``, ...): every sub-config but the text one."""
    return [k for k, v in hf.items() if k.endswith("_config") and k != "text_config" and isinstance(v, dict)]


def towers_phrase(keys: list[str]) -> str:
    """``vision tower (vision_config), ...``: the towers of a multimodal config by their config keys."""
    return ", ".join(f"{k.removesuffix('_config')} tower ({k})" for k in keys)


def text_config(text: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's ``text_config`` as a complete config of its own: transformers' defaults filled in
    (``config.json`` stores a sub-config's differences from them) and ``architectures`` named by transformers'
    causal-LM class of its ``model_type`` (``gemma3_text`` -> ``Gemma3ForCausalLM``) when it names none."""
    model_type = text.get("model_type")
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return dict(text)
    full = dict(text)
    if isinstance(model_type, str):
        try:
            full = {**AutoConfig.for_model(model_type, **text).to_dict(), **text}
        except (ValueError, TypeError, KeyError):  # a model_type this transformers does not know
            full = dict(text)
    if not full.get("architectures") and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        full["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    return full


def text_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of the multimodal ``hf``: its ``text_config`` completed, in the outer config's dtype
    when it names none of its own."""
    text = hf["text_config"]
    full = text_config(text)
    if "dtype" not in text and "torch_dtype" not in text:
        full["dtype"] = hf.get("dtype", hf.get("torch_dtype"))
    return full


class TextModelReader(HFReader):
    """A multimodal Hugging Face folder read as its text model (``TEXT_MODELS``): ``hf_config`` is the text
    model's, ``names`` the text model's own tensor names, and ``dropped`` counts the towers' tensors left out.
    Tensors under no known prefix keep their names, so the converter stops at them as unconsumed."""

    def __init__(self, folder: Path, layout: TextModelLayout) -> None:
        super().__init__(folder)
        self.multimodal_architecture = self.hf_config["architectures"][0]
        self.towers = towers(self.hf_config)
        self.hf_config = text_model_config(self.hf_config)
        self.dropped = 0
        self._source_of: dict[str, str] = {}
        for name in super().names():
            if name.startswith(layout.tower_prefixes):
                self.dropped += 1
                continue
            own = next((new + name[len(old) :] for old, new in layout.text_prefixes if name.startswith(old)), name)
            self._source_of[own] = name

    def names(self) -> list[str]:
        return sorted(self._source_of)

    def get(self, name: str) -> torch.Tensor:
        return super().get(self._source_of[name])

    def dropped_line(self) -> str:
        """One line saying what was left out."""
        named = towers_phrase(self.towers) or "its towers"
        return f"{self.multimodal_architecture}: dropped the {named}, {self.dropped} tensors; the text model converts"


def open_source(src: Path) -> HFReader | GGUFReader:
    """Open ``src``: a ``.gguf`` file or a Hugging Face folder (a multimodal one of ``multimodal.TEXT_MODELS`` as
    its text model)."""
    if not src.exists():
        raise ConvertError(f"{src}: no such file or directory")
    if src.is_file():
        if src.suffix != ".gguf":
            raise ConvertError(f"{src}: expected a .gguf file or a Hugging Face model folder")
        return GGUFReader(src)
    reader = HFReader(src)
    archs = reader.hf_config.get("architectures") or [None]
    if archs[0] in TEXT_MODELS and isinstance(reader.hf_config.get("text_config"), dict):
        reader.close()
        return TextModelReader(src, TEXT_MODELS[archs[0]])
    return reader
