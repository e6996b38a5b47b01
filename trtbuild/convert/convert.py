"""Stage 1, ``trtbuild convert``: a Hugging Face folder or GGUF file -> a trtbuild checkpoint.

The checkpoint is ``config.json`` (``ModelConfig``), ``rank0.safetensors`` (canonical names, fused QKV and
gate/up, ``[out, in]`` layout) and the tokenizer files. Tensors stream one at a time from the memory-mapped
source, and fusion pieces are released as soon as their fused tensor is complete, so peak memory stays near one
copy of the model. Every source tensor must be consumed by a rule and every expected tensor must be present.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..artifacts.atomic import atomic_output_dir
from ..config import DType, ModelConfig
from ..errors import ConvertError
from ..models import model_config_from_hf
from .layout import expected_tensors
from .readers import GGUFReader, HFReader, open_source
from .tensor_names import FUSIONS, Transform, is_ignored, match_source_name

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def copy_tokenizer_files(src: Path, dest: Path) -> None:
    """Copy the ``TOKENIZER_FILES`` that ``src`` has into ``dest`` (each stage passes them along)."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)


@dataclass(frozen=True)
class ConvertResult:
    config: ModelConfig
    num_tensors: int
    seconds: float


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a Q or K projection ``[n_head * D, in]``."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _fusion_of(part: str) -> tuple[str, tuple[str, ...]] | None:
    layer = part.split(".")[1] if part.startswith("layers.") else None
    for target, pieces in FUSIONS.items():
        concrete = tuple(p.replace("{i}", layer or "") for p in pieces)
        if part in concrete:
            return target.replace("{i}", layer or ""), concrete
    return None


def convert(src: Path, out: Path, dtype: DType = DType.FLOAT32, *, overwrite: bool = False) -> ConvertResult:
    """Convert ``src`` into a checkpoint at ``out`` (written atomically)."""
    start = time.perf_counter()
    reader = open_source(src)
    try:
        cfg = model_config_from_hf(reader.hf_config, dtype)
        tensors = _convert_tensors(reader, cfg)
        with atomic_output_dir(out, overwrite=overwrite) as tmp:
            from safetensors.torch import save_file

            save_file(tensors, str(tmp / "rank0.safetensors"), metadata={"format": "pt"})
            cfg = _with_generation_eos(cfg, reader)
            cfg.save(tmp)
            _write_tokenizer(reader, tmp)
    finally:
        reader.close()
    return ConvertResult(cfg, len(tensors), time.perf_counter() - start)


def _convert_tensors(reader: HFReader | GGUFReader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    expected = expected_tensors(cfg)
    target_dtype = TORCH_DTYPES[cfg.dtype]
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}
    for name in reader.names():
        match = match_source_name(name, reader.format)
        if match is None:
            if is_ignored(name, reader.format):
                continue
            raise ConvertError(f"source tensor {name} is not consumed by any rule for {cfg.architecture}")
        if match.part == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied head stored anyway: the embedding is the head
        t = reader.get(name)
        if match.transform is Transform.TRANSPOSE:
            t = t.t()
        elif match.transform is Transform.UNPERMUTE_Q:
            t = _unpermute(t, cfg.num_heads)
        elif match.transform is Transform.UNPERMUTE_K:
            t = _unpermute(t, cfg.num_kv_heads)
        t = t.to(target_dtype).contiguous()
        fusion = _fusion_of(match.part)
        if fusion is None or fusion[0] not in expected:  # e.g. GPT-2's un-gated "up" is not fused
            if match.part in out:
                raise ConvertError(f"source tensor {name} duplicates {match.part}")
            out[match.part] = t
            continue
        target, pieces = fusion
        pending[match.part] = t
        if all(p in pending for p in pieces):
            out[target] = torch.cat([pending.pop(p) for p in pieces], dim=0)
    if pending:
        raise ConvertError(f"incomplete fused tensor: {sorted(pending)[0]} has no partner parts in the source")
    unknown = sorted(set(out) - set(expected))
    if unknown:
        raise ConvertError(f"tensor {unknown[0]} is not used by {cfg.architecture} with this config (unconsumed)")
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ConvertError(f"missing tensor {missing[0]} for {cfg.architecture}")
    for name, shape in expected.items():
        if tuple(out[name].shape) != shape:
            raise ConvertError(f"tensor {name} has shape {tuple(out[name].shape)}, config implies {shape}")
    return out


def _with_generation_eos(cfg: ModelConfig, reader: HFReader | GGUFReader) -> ModelConfig:
    """Merge the eos ids of ``generation_config.json`` (chat models list their turn-end token there)."""
    if not isinstance(reader, HFReader) or not (reader.folder / "generation_config.json").is_file():
        return cfg
    eos = json.loads((reader.folder / "generation_config.json").read_text()).get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    merged = list(dict.fromkeys([*cfg.eos_token_ids, *(int(e) for e in extra)]))
    from dataclasses import replace

    return replace(cfg, eos_token_ids=merged)


def _write_tokenizer(reader: HFReader | GGUFReader, out: Path) -> None:
    if isinstance(reader, HFReader):
        copy_tokenizer_files(reader.folder, out)
        return
    from transformers import AutoTokenizer  # GGUF: transformers rebuilds tokenizer.json from the metadata

    tok = AutoTokenizer.from_pretrained(str(reader.path.parent), gguf_file=reader.path.name)
    tok.save_pretrained(str(out))
