"""Source readers: a Hugging Face folder (safetensors, single or sharded) or a llama.cpp GGUF file.

A reader exposes the source's Hugging Face-style config dict, its tensor names and lazy tensor access
(memory-mapped), so the converter can stream one tensor at a time. Build-time only: uses torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import QFormat
from ..errors import ConvertError
from .tensor_names import SourceFormat


class HFReader:
    """A Hugging Face checkpoint folder: ``config.json`` + ``model.safetensors`` or an index with shards."""

    format = SourceFormat.HF

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.folder = folder
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise ConvertError(f"{folder}: no config.json (expected a Hugging Face model folder or a .gguf file)")
        try:
            self.hf_config: dict[str, Any] = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ConvertError(f"{cfg_path}: not valid JSON ({e})") from None
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        elif (folder / "model.safetensors").is_file():
            shards = ["model.safetensors"]
        else:
            raise ConvertError(
                f"{folder}: no model.safetensors or model.safetensors.index.json (pickle weights are not loaded)"
            )
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ConvertError(f"{folder}: missing shard {missing[0]}")
        self._stack = ExitStack()
        self._where: dict[str, Any] = {}
        for shard in shards:
            try:
                handle = self._stack.enter_context(safe_open(str(folder / shard), framework="pt"))
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ConvertError(f"{folder / shard}: not a readable safetensors file ({e})") from None
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self._where[name] = handle

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def close(self) -> None:
        self._stack.close()


# GGUF metadata key (after the "<arch>." prefix) -> Hugging Face config key.
_GGUF_LLAMA_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
_GGUF_GEMMA3_KEYS = {
    **_GGUF_LLAMA_KEYS,
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
}


@dataclass(frozen=True)
class GGUFArchitecture:
    """How a GGUF ``general.architecture`` reads as a Hugging Face config: its architecture, the metadata keys
    (after the ``<arch>.`` prefix) -> config keys, and config keys GGUF does not store (transformers' defaults)."""

    hf_architecture: str
    keys: dict[str, str]
    fixed: dict[str, Any]


_GGUF_ARCHS = {
    "llama": GGUFArchitecture("LlamaForCausalLM", _GGUF_LLAMA_KEYS, {"hidden_act": "silu"}),
    # Sliding-window pattern, query_pre_attn_scalar and the local rotary base are not in the file: the
    # family's (transformers') defaults apply, as when transformers loads the file.
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", _GGUF_GEMMA3_KEYS, {"hidden_activation": "gelu_pytorch_tanh"}),
}


GGUF_BLOCK = 32  # in-features per block of llama.cpp's Q8_0, Q4_0 and Q4_1, and per sub-block of Q4_K
Q6_K_BLOCK = 16  # in-features per sub-block of Q6_K, Q3_K and Q2_K (sixteen to a super-block of 256)
# The GGUF types whose 2-D tensors ``convert`` keeps in a block format (``GGUFReader.get_block``), and which; float
# types are kept as float, any other type is dequantized. An embedding's rows are gathered, then dequantized
# (``graph.emit``), from one of ``EMBEDDING_FORMATS``: a kept type's embedding in another format is converted to
# ``int8_min_wo`` (``embedding_blocks``: a byte a code, exact).
EMBEDDING_FORMATS = (QFormat.INT8_GROUP_WO, QFormat.INT8_MIN_WO)
KEPT_GGUF_TYPES = {
    "Q8_0": QFormat.INT8_GROUP_WO,
    "Q6_K": QFormat.INT8_GROUP_WO,
    "Q5_0": QFormat.INT8_GROUP_WO,
    "Q3_K": QFormat.INT8_GROUP_WO,
    "Q5_K": QFormat.INT8_MIN_WO,
    "Q2_K": QFormat.INT8_MIN_WO,
    "Q4_0": QFormat.INT4_WO,
    "Q4_1": QFormat.INT4_MIN_WO,
    "Q4_K": QFormat.INT4_MIN_WO,
}
FLOAT_GGUF_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class BlockTensor:
    """A GGUF tensor kept in its llama.cpp block format, ``[rows, cols]`` in GGUF's row order (``block``
    in-features per block): ``w = codes * scale (+ offset)`` per block, as ``gguf.quants.dequantize`` computes it.

    ``codes`` (int8): Q8_0's int8; Q6_K's ``q - 32`` (-32..31); Q3_K's -4..3; Q5_0's ``q - 16`` (-16..15, kept as
    int8: exact, 8 bits where the file has 5.5 or 6.5); Q4_0's ``q - 8`` (signed int4, -8..7: trtbuild's symmetric
    int4); Q4_1's and Q4_K's ``q`` (0..15). uint8 for ``int8_min_wo``: Q5_K's and Q2_K's ``q`` (0..31, 0..3), or a
    fused tensor's (``fused_blocks``). ``scale`` and ``offset`` (Q4_1's min and the K-quants' negated ``dmin * m``,
    else None) are ``[rows, cols / block]``: float16, GGUF's own values, except the K-quants' float32 products of a
    float16 and a 6- or 8-bit integer (exact, as gguf-py computes them).
    """

    qformat: QFormat
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    block: int = GGUF_BLOCK

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockTensor:
        """The same tensor with ``fn`` (a permutation of rows, say) applied to the rows of every part."""
        offset = None if self.offset is None else fn(self.offset)
        return BlockTensor(self.qformat, fn(self.codes), fn(self.scale), offset, self.block)

    @staticmethod
    def cat(parts: list[BlockTensor]) -> BlockTensor:
        """Rows of ``parts`` (all of one format and block) one after another."""
        offsets = [p.offset for p in parts]
        offset = None if offsets[0] is None else torch.cat(offsets)  # type: ignore[arg-type]
        cat = torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts])
        return BlockTensor(parts[0].qformat, *cat, offset, parts[0].block)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, cols]``: ``codes * scale + offset`` per block, in gguf-py's float32 order."""
        rows, cols = self.codes.shape
        w = self.codes.reshape(rows, -1, self.block).float() * self.scale.float()[..., None]
        if self.offset is not None:
            w = w + self.offset.float()[..., None]
        return w.reshape(rows, cols)


def fused_blocks(parts: list[BlockTensor]) -> BlockTensor | None:
    """The rows of ``parts`` (a fused tensor's: q | k | v, gate | up) one after another in one block format: theirs
    when they share format and block size, else ``int8_min_wo`` at the smallest block size where every part's
    weights convert exactly (``_as_int8_min``; a Q4_K_M file's Q4_K q / k and Q6_K v); None when one does not."""
    if len({(p.qformat, p.block) for p in parts}) == 1:
        return BlockTensor.cat(parts)
    block = min(p.block for p in parts)
    converted = [_as_int8_min(p, block) if p.block % block == 0 else None for p in parts]
    return None if any(c is None for c in converted) else BlockTensor.cat(converted)  # type: ignore[arg-type]


def embedding_blocks(t: BlockTensor) -> BlockTensor | None:
    """The embedding ``t`` in one of ``EMBEDDING_FORMATS``: itself, or as ``int8_min_wo`` at its own block size
    (Q4_0, Q4_1, Q4_K: their 4-bit codes a byte each); None when that would not give its weights bit for bit."""
    return t if t.qformat in EMBEDDING_FORMATS else _as_int8_min(t, t.block)


def _as_int8_min(t: BlockTensor, block: int) -> BlockTensor | None:
    """``t`` as ``int8_min_wo`` blocks of ``block`` (dividing ``t.block``: its factors repeated), or None unless
    that dequantizes to ``t``'s weights bit for bit. Signed codes ``c`` become ``c + shift`` with offset
    ``-shift * scale``, ``shift`` the smallest power of two >= ``-min(c)`` (so the offset is exact, and the codes
    keep as few bits as they can: Q6_K's 6, Q8_0's 8)."""
    codes = t.codes.to(torch.int16)
    scale = t.scale.float()
    if t.offset is None:
        low = int(codes.min())
        shift = 1 << (-low - 1).bit_length() if low < 0 else 0
        codes, offset = codes + shift, -(shift * scale)
    else:
        offset = t.offset.float()
    if int(codes.max()) > 255:
        return None
    repeat = t.block // block
    out = BlockTensor(
        QFormat.INT8_MIN_WO,
        codes.to(torch.uint8),
        scale.repeat_interleave(repeat, dim=1),
        offset.repeat_interleave(repeat, dim=1),
        block,
    )
    return out if torch.equal(out.dequantize(), t.dequantize()) else None


def _block_tensor(data: np.ndarray, qtype: Any) -> BlockTensor:
    """Split GGUF blocks (``data`` uint8 ``[rows, bytes per row]``) into codes, scales and offsets."""
    import gguf

    rows = data.shape[0]
    blocks = data.reshape(rows, -1, gguf.GGML_QUANT_SIZES[qtype][1])
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # super-blocks of 256 with scales of their own
        return _q4_k_tensor(blocks)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        return _q6_k_tensor(blocks)
    if qtype == gguf.GGMLQuantizationType.Q5_K:
        return _q5_k_tensor(blocks)
    if qtype == gguf.GGMLQuantizationType.Q3_K:
        return _q3_k_tensor(blocks)
    if qtype == gguf.GGMLQuantizationType.Q2_K:
        return _q2_k_tensor(blocks)
    scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        return BlockTensor(QFormat.INT8_GROUP_WO, _torch(codes.reshape(rows, -1)), _torch(scale), None)
    if qtype == gguf.GGMLQuantizationType.Q5_0:  # w = d * (q - 16), q 5 bits: the fifth bits of element j in qh
        high = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [rows, blocks, 1]
        fifth = ((high >> np.arange(GGUF_BLOCK, dtype=np.uint32)) & 1).astype(np.int8)  # [rows, blocks, 32]
        packed = blocks[..., 6:]
        low = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8)
        codes = (low | (fifth << 4)) - 16  # -16..15: int8 codes, the same weights
        return BlockTensor(QFormat.INT8_GROUP_WO, _torch(codes.reshape(rows, -1)), _torch(scale), None)
    offset = None
    if qtype == gguf.GGMLQuantizationType.Q4_1:
        offset = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    packed = blocks[..., -GGUF_BLOCK // 2 :]  # element j: the low nibble of byte j, element j + 16 its high one
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8).reshape(rows, -1)
    if offset is None:  # Q4_0: w = d * (q - 8)
        return BlockTensor(QFormat.INT4_WO, _torch(q - 8), _torch(scale), None)
    return BlockTensor(QFormat.INT4_MIN_WO, _torch(q), _torch(scale), _torch(offset))


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's per-32 factors of super-blocks (uint8 ``[rows, supers, bytes]`` led by float16 ``d`` and
    ``dmin`` and 12 bytes of eight 6-bit scales ``sc`` and mins ``m``): float32 ``d * sc`` and ``-(dmin * m)``
    ``[rows, supers * 8]``, the products gguf-py computes (exact: a float16 times a 6-bit integer)."""
    import gguf

    rows, supers = blocks.shape[:2]
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).astype(np.float32)  # [rows, supers, 1]
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(rows * supers, 12))
    scale = d * sc.reshape(rows, supers, 8).astype(np.float32)
    offset = -(dmin * m.reshape(rows, supers, 8).astype(np.float32))
    return scale.reshape(rows, -1), offset.reshape(rows, -1)


def _q4_k_tensor(blocks: np.ndarray) -> BlockTensor:
    """Q4_K super-blocks (uint8 ``[rows, supers, 144]``: ``_k_scales``' 16 bytes, 128 bytes of 4-bit codes) as
    Q4_1-like blocks of 32: ``w = q * (d * sc) - dmin * m``, which gguf-py computes in float32 from the same
    products, so ``int4_min_wo`` holds the weights exactly."""
    rows = blocks.shape[0]
    scale, offset = _k_scales(blocks)
    # 4 runs of 32 bytes a super-block: sub-block 2c is run c's low nibbles, sub-block 2c + 1 its high ones
    runs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    q = (runs & 0x0F).astype(np.int8).reshape(rows, -1)
    return BlockTensor(QFormat.INT4_MIN_WO, _torch(q), _torch(scale), _torch(offset))


def _q5_k_tensor(blocks: np.ndarray) -> BlockTensor:
    """Q5_K super-blocks (uint8 ``[rows, supers, 176]``: ``_k_scales``' 16 bytes, 32 bytes of fifth bits, 128 of
    low 4 bits) as ``int8_min_wo`` blocks of 32 (codes 0..31): ``w = q * (d * sc) - dmin * m`` exactly, as Q4_K."""
    rows = blocks.shape[0]
    scale, offset = _k_scales(blocks)
    runs = blocks[..., 48:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)  # as Q4_K's
    high = blocks[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)  # bit i: sub i
    q = ((runs & 0x0F).reshape(rows, -1, 8, 32) | ((high & 0x01) << 4)).astype(np.uint8)
    return BlockTensor(QFormat.INT8_MIN_WO, _torch(q.reshape(rows, -1)), _torch(scale), _torch(offset))


def _q6_k_tensor(blocks: np.ndarray) -> BlockTensor:
    """Q6_K super-blocks (uint8 ``[rows, supers, 210]``: 128 bytes of low 4 bits, 64 of high 2 bits, sixteen int8
    scales ``sc``, a float16 ``d``) as int8 blocks of 16: ``w = (q - 32) * (d * sc)``, which gguf-py computes in
    float32 from the same product, so ``int8_group_wo`` with blocks of 16 holds the weights exactly."""
    rows, supers = blocks.shape[:2]
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [rows, supers, 16]
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).astype(np.float32)  # [rows, supers, 1]
    # 2 halves of 128 a super-block; in each, 4 runs of 32: run j is the low (j even) or high (j odd) nibbles of
    # ql's bytes 32 * (j // 2)..., with bits 4-5 from qh's 32 bytes shifted by 2 * j
    low = blocks[..., :128].reshape(rows, supers, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    low = (low & 0x0F).reshape(rows, supers, 2, 4, 32)
    high = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = (low | ((high & 0x03) << 4)).astype(np.int8) - np.int8(32)
    return BlockTensor(
        QFormat.INT8_GROUP_WO, _torch(q.reshape(rows, -1)), _torch((d * sc).reshape(rows, -1)), None, Q6_K_BLOCK
    )


def _q3_k_tensor(blocks: np.ndarray) -> BlockTensor:
    """Q3_K super-blocks (uint8 ``[rows, supers, 110]``: 32 bytes of high bits, 64 of low 2 bits, 12 of sixteen
    6-bit scales, a float16 ``d``) as int8 blocks of 16: ``w = q * (d * (sc - 32))``, q = low 2 bits - 4 where the
    high bit is 0 (-4..3), which gguf-py computes in float32 from the same product: ``int8_group_wo``, exactly."""
    rows, supers = blocks.shape[:2]
    low_sc = blocks[..., 96:104].reshape(rows, supers, 1, 8) >> np.array([0, 4], np.uint8).reshape(2, 1)
    high_sc = blocks[..., 104:108].reshape(rows, supers, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    sc = (low_sc.reshape(rows, supers, 16) & 0x0F) | ((high_sc.reshape(rows, supers, 16) & 0x03) << 4)
    d = np.ascontiguousarray(blocks[..., 108:110]).view(np.float16).astype(np.float32)  # [rows, supers, 1]
    scale = d * (sc.astype(np.int8) - np.int8(32)).astype(np.float32)
    low = blocks[..., 32:96].reshape(rows, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    high = blocks[..., :32].reshape(rows, supers, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    q = (low & 0x03).reshape(rows, supers, 256).astype(np.int8)
    q = q - (((high & 0x01) ^ 0x01).reshape(rows, supers, 256) << 2).astype(np.int8)
    return BlockTensor(
        QFormat.INT8_GROUP_WO, _torch(q.reshape(rows, -1)), _torch(scale.reshape(rows, -1)), None, Q6_K_BLOCK
    )


def _q2_k_tensor(blocks: np.ndarray) -> BlockTensor:
    """Q2_K super-blocks (uint8 ``[rows, supers, 84]``: sixteen bytes of a 4-bit scale and min each, 64 bytes of
    2-bit codes, float16 ``d`` and ``dmin``) as ``int8_min_wo`` blocks of 16: ``w = q * (d * sc) - dmin * m``, q
    0..3, exactly as gguf-py computes it."""
    rows, supers = blocks.shape[:2]
    d = np.ascontiguousarray(blocks[..., 80:82]).view(np.float16).astype(np.float32)  # [rows, supers, 1]
    dmin = np.ascontiguousarray(blocks[..., 82:84]).view(np.float16).astype(np.float32)
    scale = d * (blocks[..., :16] & 0x0F).astype(np.float32)
    offset = -(dmin * (blocks[..., :16] >> 4).astype(np.float32))
    q = (blocks[..., 16:80].reshape(rows, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03
    return BlockTensor(
        QFormat.INT8_MIN_WO,
        _torch(q.reshape(rows, -1)),
        _torch(scale.reshape(rows, -1)),
        _torch(offset.reshape(rows, -1)),
        Q6_K_BLOCK,
    )


def _torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a))  # a writable copy, off the memory map


class GGUFReader:
    """A llama.cpp GGUF file. ``get`` dequantizes any tensor to float32 (as transformers does); ``get_block``
    keeps a Q8_0 / Q6_K / Q5_K / Q5_0 / Q4_0 / Q4_1 / Q4_K / Q3_K / Q2_K one in its block format
    (``BlockTensor``)."""

    format = SourceFormat.GGUF

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        try:
            self._reader = gguf.GGUFReader(str(path))
        except Exception as e:  # gguf raises ValueError/struct.error on foreign files
            raise ConvertError(f"{path}: not a readable GGUF file ({e})") from None
        fields = self._reader.fields
        arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
        if arch not in _GGUF_ARCHS:
            supported = ", ".join(_GGUF_ARCHS)
            raise ConvertError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {supported})")
        spec = _GGUF_ARCHS[arch]
        experts = fields.get(f"{arch}.expert_count")
        if experts is not None and int(experts.contents()) > 0:
            raise ConvertError(
                f"{path}: a mixture-of-experts GGUF ({int(experts.contents())} experts) is not supported; convert "
                "the model's Hugging Face folder instead (MixtralForCausalLM, Qwen3MoeForCausalLM)"
            )
        cfg: dict[str, Any] = {"architectures": [spec.hf_architecture], **spec.fixed}
        for gkey, hkey in spec.keys.items():
            if f"{arch}.{gkey}" in fields:
                cfg[hkey] = fields[f"{arch}.{gkey}"].contents()
        cfg["vocab_size"] = len(fields["tokenizer.ggml.tokens"].data)
        for gkey, hkey in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
            if f"tokenizer.ggml.{gkey}" in fields:
                cfg[hkey] = int(fields[f"tokenizer.ggml.{gkey}"].contents())
        self._tensors = {t.name: t for t in self._reader.tensors}
        cfg["tie_word_embeddings"] = "output.weight" not in self._tensors
        self.hf_config = cfg

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        import gguf

        t = self._tensors[name]
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        return torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))  # a writable copy

    def type_name(self, name: str) -> str:
        """The GGUF type of tensor ``name`` (``Q4_1``, ``F32``, ...)."""
        return self._tensors[name].tensor_type.name

    def get_block(self, name: str) -> BlockTensor | None:
        """Tensor ``name`` in its block format, or None when it is not a 2-D tensor of a ``KEPT_GGUF_TYPES`` type."""
        t = self._tensors[name]
        if t.tensor_type.name not in KEPT_GGUF_TYPES or len(t.shape) != 2:
            return None
        block = _block_tensor(np.asarray(t.data).reshape(int(t.shape[1]), -1), t.tensor_type)
        assert block.qformat is KEPT_GGUF_TYPES[t.tensor_type.name], (t.tensor_type.name, block.qformat)
        return block

    def close(self) -> None:
        pass


def iter_tensors(reader: HFReader | GGUFReader) -> Iterator[tuple[str, torch.Tensor]]:
    for name in reader.names():
        yield name, reader.get(name)
