"""Stage 1, ``trtbuild convert``: a Hugging Face folder or GGUF file -> a trtbuild checkpoint.

The checkpoint is ``config.json`` (``ModelConfig``), ``rank0.safetensors`` (canonical names, fused QKV and
gate/up, ``[out, in]`` layout) and the tokenizer files. Tensors stream one at a time from the memory-mapped
source, and fusion pieces are released as soon as their fused tensor is complete, so peak memory stays near one
copy of the model. Every source tensor must be consumed by a rule and every expected tensor must be present.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..artifacts.atomic import atomic_output_dir
from ..checkpoint.dtypes import torch_dtype
from ..checkpoint.files import copy_tokenizer_files, save_checkpoint
from ..checkpoint.formats import FORMATS, Numeric, pack_int4
from ..checkpoint.layout import canonical_linears, expected_quantized_tensors, expected_tensors
from ..config import DType, ModelConfig, QuantConfig
from ..errors import ConvertError
from ..models import hf_dtype, model_config_from_hf
from .multimodal import TextModelReader, open_source
from .readers import (
    FLOAT_GGUF_TYPES,
    GGUF_BLOCK,
    BlockTensor,
    GGUFReader,
    HFReader,
    embedding_blocks,
    fused_blocks,
)
from .tensor_names import Transform, fusion_of, is_ignored, match_source_name


@dataclass(frozen=True)
class ConvertResult:
    config: ModelConfig
    num_tensors: int
    seconds: float
    # GGUF tensors of a quantized type that no trtbuild format holds, dequantized to float: GGUF type -> names
    dequantized: dict[str, list[str]] = field(default_factory=dict)
    # What convert left out of the source, one line each (a multimodal folder's towers)
    notes: list[str] = field(default_factory=list)

    def dequantized_line(self) -> str | None:
        """One line naming the dequantized tensors by type (None when there are none)."""
        if not self.dequantized:
            return None
        parts = [f"{len(names)} {kind} ({_names(names)})" for kind, names in sorted(self.dequantized.items())]
        kept = "types no trtbuild format keeps, and their fused partners"
        return f"dequantized to {self.config.dtype.value} ({kept}): " + "; ".join(parts)


def _names(names: list[str], shown: int = 3) -> str:
    more = f", ... {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a Q or K projection ``[n_head * D, in]``."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def source_dtype(reader: HFReader | GGUFReader) -> DType:
    """The dtype a checkpoint of ``reader`` keeps by default: a Hugging Face config's ``dtype`` (``torch_dtype``
    before transformers 5) when it is one of ``DType``, else float32 (GGUF files: their float tensors are mostly
    F32, and dequantized ones are float32)."""
    return DType.FLOAT32 if isinstance(reader, GGUFReader) else hf_dtype(reader.hf_config)


def convert(
    src: Path, out: Path, dtype: DType | None = None, *, dequantize: bool = False, overwrite: bool = False
) -> ConvertResult:
    """Convert ``src`` into a checkpoint at ``out`` (written atomically), float tensors in ``dtype`` (default: the
    source's, ``source_dtype``). A GGUF file's Q8_0 / Q5_0 / Q4_0 / Q4_1 tensors and K-quants (Q6_K ... Q2_K) stay
    quantized (a quantized checkpoint, ``checkpoint.layout``) unless ``dequantize``; other quantized types are
    dequantized (``ConvertResult.dequantized``)."""
    start = time.perf_counter()
    reader = open_source(src)
    try:
        cfg = model_config_from_hf(reader.hf_config, dtype or source_dtype(reader))
        dequantized: dict[str, list[str]] = {}
        tensors = _convert_tensors(reader, cfg, keep_blocks=not dequantize, dequantized=dequantized)
        cfg, tensors = _blocks_as_checkpoint(cfg, tensors, dequantized)
        with atomic_output_dir(out, overwrite=overwrite) as tmp:
            cfg = _with_generation_eos(cfg, reader)
            save_checkpoint(tmp, cfg, tensors)
            _write_tokenizer(reader, tmp)
    finally:
        reader.close()
    notes = [reader.dropped_line()] if isinstance(reader, TextModelReader) else []
    return ConvertResult(cfg, len(tensors), time.perf_counter() - start, dequantized, notes)


Tensor = torch.Tensor | BlockTensor


def _convert_tensors(
    reader: HFReader | GGUFReader, cfg: ModelConfig, *, keep_blocks: bool, dequantized: dict[str, list[str]]
) -> dict[str, Tensor]:
    """Canonical name -> tensor (float in ``cfg.dtype``, or a GGUF ``BlockTensor`` where ``keep_blocks``); GGUF
    tensors of a quantized type not kept are recorded in ``dequantized`` (type -> source names)."""
    expected = expected_tensors(cfg)
    target_dtype = torch_dtype(cfg.dtype)
    out: dict[str, Tensor] = {}
    pending: dict[str, Tensor] = {}
    source_of: dict[str, str] = {}  # canonical part -> source name (for the dequantized line)

    def to_float(part: str, t: Tensor) -> torch.Tensor:
        if isinstance(t, BlockTensor):  # kept from the file, but its partners were not: dequantized after all
            assert isinstance(reader, GGUFReader)
            dequantized.setdefault(reader.type_name(source_of[part]), []).append(source_of[part])
            t = t.dequantize()
        return t.to(target_dtype).contiguous()

    for name in reader.names():
        match = match_source_name(name, reader.format, cfg.architecture)
        if match is None:
            if is_ignored(name, reader.format):
                continue
            raise ConvertError(f"source tensor {name} is not consumed by any rule for {cfg.architecture}")
        if match.part == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied head stored anyway: the embedding is the head
        source_of[match.part] = name
        t = _read(reader, name, match.part, keep_blocks, dequantized)
        if match.transform is Transform.TRANSPOSE:
            assert isinstance(t, torch.Tensor)  # GPT-2's Conv1D: Hugging Face only
            t = t.t()
        elif match.transform is Transform.UNPERMUTE_Q:
            t = _rows(t, lambda r: _unpermute(r, cfg.num_heads))
        elif match.transform is Transform.UNPERMUTE_K:
            t = _rows(t, lambda r: _unpermute(r, cfg.num_kv_heads))
        elif match.transform is Transform.ADD_ONE:
            assert isinstance(t, torch.Tensor)  # a norm weight: float in every source
            t = t.float() + 1.0
        if isinstance(t, torch.Tensor):
            t = t.to(target_dtype).contiguous()
        fusion = fusion_of(match.part, cfg.moe.num_experts if cfg.moe is not None else 0)
        if fusion is None or fusion[0] not in expected:  # e.g. GPT-2's un-gated "up" is not fused
            if match.part in out:
                raise ConvertError(f"source tensor {name} duplicates {match.part}")
            out[match.part] = t
            continue
        target, pieces = fusion
        pending[match.part] = t
        if all(p in pending for p in pieces):
            parts = {p: pending.pop(p) for p in pieces}
            blocks = [t for t in parts.values() if isinstance(t, BlockTensor)]
            fused = fused_blocks(blocks) if len(blocks) == len(pieces) else None
            if fused is not None:
                out[target] = fused
            else:  # a fused tensor has one format: parts of a float one, or of inexact promotion, become float
                fused = torch.cat([to_float(p, t) for p, t in parts.items()], dim=0)
                experts = expected[target][0]
                if len(expected[target]) == 3 and fused.shape[0] % experts == 0:  # [E * rows, in] -> [E, rows, in]
                    fused = fused.reshape(experts, -1, fused.shape[-1])
                out[target] = fused
    if pending:
        raise ConvertError(f"incomplete fused tensor: {sorted(pending)[0]} has no partner parts in the source")
    unknown = sorted(set(out) - set(expected))
    if unknown:
        raise ConvertError(f"tensor {unknown[0]} is not used by {cfg.architecture} with this config (unconsumed)")
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ConvertError(f"missing tensor {missing[0]} for {cfg.architecture}")
    for name, shape in expected.items():
        got = out[name].codes.shape if isinstance(out[name], BlockTensor) else out[name].shape
        if tuple(got) != shape:
            raise ConvertError(f"tensor {name} has shape {tuple(got)}, config implies {shape}")
    if isinstance(embed := out.get("embed.weight"), BlockTensor):  # its rows are gathered: a byte a code
        out["embed.weight"] = embedding_blocks(embed) or to_float("embed.weight", embed)
    return out


def _read(
    reader: HFReader | GGUFReader, name: str, part: str, keep_blocks: bool, dequantized: dict[str, list[str]]
) -> Tensor:
    if not isinstance(reader, GGUFReader):
        return reader.get(name)
    block = reader.get_block(name) if keep_blocks and part.endswith(".weight") else None
    if block is not None:
        return block
    kind = reader.type_name(name)
    if keep_blocks and kind not in FLOAT_GGUF_TYPES:
        dequantized.setdefault(kind, []).append(name)
    return reader.get(name)


def _rows(t: Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> Tensor:  # fn: a permutation of rows
    return t.map_rows(fn) if isinstance(t, BlockTensor) else fn(t)


def _blocks_as_checkpoint(
    cfg: ModelConfig, tensors: dict[str, Tensor], dequantized: dict[str, list[str]]
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The checkpoint config and tensors of ``tensors``: a float checkpoint when no ``BlockTensor`` is among them,
    else a quantized one whose ``QuantConfig`` says which linear has which block format (``checkpoint.layout``)."""
    formats = {n.removesuffix(".weight"): t.qformat for n, t in tensors.items() if isinstance(t, BlockTensor)}
    if not formats:
        return cfg, tensors  # type: ignore[return-value]  (all float)
    linears = [n for n in canonical_linears(cfg) if n != "lm_head"]
    counts = Counter(formats[n] for n in linears if n in formats)
    qformat = counts.most_common(1)[0][0] if counts else next(iter(formats.values()))
    tied_to_embed = cfg.tie_word_embeddings and "embed" in formats
    kept_in_float = [n for n in canonical_linears(cfg) if n not in formats and not (n == "lm_head" and tied_to_embed)]
    blocks = {n.removesuffix(".weight"): t.block for n, t in tensors.items() if isinstance(t, BlockTensor)}
    qcfg = QuantConfig(
        qformat,
        group_size=GGUF_BLOCK,
        exclude=kept_in_float,
        tensor_formats={n: f for n, f in formats.items() if n in ("embed", "lm_head") or f is not qformat},
        tensor_group_sizes={n: b for n, b in blocks.items() if b != GGUF_BLOCK},
    )
    cfg = replace(cfg, quantization=qcfg)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, BlockTensor):
            out[name] = t
            continue
        prefix = name.removesuffix(".weight")
        int4 = FORMATS[t.qformat].weights is Numeric.INT4
        out[name] = pack_int4(t.codes).contiguous() if int4 else t.codes.contiguous()
        out[prefix + ".weight_scale"] = t.scale.contiguous()
        if t.offset is not None:
            out[prefix + ".weight_offset"] = t.offset.contiguous()
    expected = expected_quantized_tensors(cfg)
    if set(expected) != set(out):  # the layout module and this function disagree: a bug, not a user error
        raise AssertionError(sorted(set(expected) ^ set(out)))
    return cfg, out


def _with_generation_eos(cfg: ModelConfig, reader: HFReader | GGUFReader) -> ModelConfig:
    """Merge the eos ids of ``generation_config.json`` (chat models list their turn-end token there)."""
    if not isinstance(reader, HFReader) or not (reader.folder / "generation_config.json").is_file():
        return cfg
    eos = json.loads((reader.folder / "generation_config.json").read_text()).get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    merged = list(dict.fromkeys([*cfg.eos_token_ids, *(int(e) for e in extra)]))
    return replace(cfg, eos_token_ids=merged)


def _write_tokenizer(reader: HFReader | GGUFReader, out: Path) -> None:
    if isinstance(reader, HFReader):
        copy_tokenizer_files(reader.folder, out)
        return
    from transformers import AutoTokenizer  # GGUF: transformers rebuilds tokenizer.json from the metadata

    try:
        tok = AutoTokenizer.from_pretrained(str(reader.path.parent), gguf_file=reader.path.name)
    except Exception as e:  # transformers raises KeyError / ValueError / its own errors on metadata it cannot read
        raise ConvertError(
            f"{reader.path}: transformers cannot rebuild its tokenizer ({type(e).__name__}: {e})"
        ) from None
    tok.save_pretrained(str(out))
