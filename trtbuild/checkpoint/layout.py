"""The canonical checkpoint layout: which tensors a ``ModelConfig`` implies, with their shapes (and dtypes, when
the checkpoint is quantized).

Linear weights are ``[out_features, in_features]``; fused tensors concatenate their parts along dim 0
(``attn.qkv`` = q | k | v rows, ``mlp.gate_up`` = gate | up rows). A sparse (mixture-of-experts) layer has no
``mlp.*`` tensors but ``moe.router.weight [E, H]`` (float), ``moe.gate_up.weight [E, 2 I, H]`` (each expert's gate |
up rows) and ``moe.down.weight [E, H, I]``, I the experts' ``MoeConfig.intermediate_size``. A quantized one
(``trtbuild quantize`` of an MoE model) holds both int8 with a float32 ``weight_scale`` per expert row
(int8_wo and int8_sq: ``[E, 2I]``, ``[E, H]``: ``w = q * scale``), or packed int4 as the dense int4 format per
expert (int4_wo: uint8 ``[E, 2I, H/2]`` and ``[E, H, I/2]``, float32 ``weight_scale [E, 2I, ceil(H/group)]`` and
``[E, H, ceil(I/group)]``); the router stays float.

A quantized checkpoint is a float checkpoint whose quantized linears carry the tensors of ``formats.py`` instead of
a float weight, plus ``layers.{i}.attn.k_scale`` / ``v_scale`` (float32 ``[]``) when the KV cache is quantized.
SmoothQuant/AWQ pre-quant scales are folded where a preceding op can absorb them exactly: into ``input_norm`` for
``attn.qkv``, into ``post_attn_norm`` for ``mlp.gate_up`` and into the up rows' weight scales of ``mlp.gate_up`` for
``mlp.down``; ``attn.out`` keeps an explicit ``pre_quant_scale`` (its input, the attention output, is only linear per
KV head, which GQA shares across query heads). A quantized ``lm_head`` (not excluded) is int8 weight-only in every
format (``formats.HEAD_FORMAT``); a tied one gets its own int8 ``lm_head.weight`` while ``embed.weight`` stays float.

A checkpoint converted from a GGUF file keeps llama.cpp's block formats (``QuantConfig.tensor_formats`` says which
tensor has which, ``tensor_group_sizes`` which blocks are not 32 in-features): Q8_0 as ``int8_group_wo`` (int8
``weight``, ``weight_scale [out, in/32]``), Q6_K as ``int8_group_wo`` in blocks of 16 (codes ``q - 32``,
``weight_scale [out, in/16]``), Q4_0 as ``int4_wo`` at group 32, Q4_1 and Q4_K as ``int4_min_wo`` (unsigned codes,
``weight_scale`` and ``weight_offset [out, in/32]``: ``w = q * scale + offset``), Q5_K as ``int8_min_wo`` (uint8
codes, ``weight_scale`` and ``weight_offset``), Q3_K and Q2_K as Q6_K and Q5_K in blocks of 16; a fused tensor whose
parts differ in format or block size is ``int8_min_wo`` at the smallest block (``convert.readers.fused_blocks``).
Scales and offsets are stored float16 (GGUF's own d and m, exactly), the K-quants' float32 (exact products such as
``d * sc`` and ``-(dmin * m)``). A Q8_0, Q6_K, Q5_0 or Q3_K embedding is ``embed.weight`` int8 +
``embed.weight_scale``; a Q4_0, Q4_1, Q4_K, Q5_K or Q2_K one is ``int8_min_wo`` (uint8 ``embed.weight`` a byte a
code, ``embed.weight_scale`` and ``embed.weight_offset``); a tied head then reads those tensors.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from ..config import ActivationScales, KVCacheDType, MlpKind, ModelConfig, NormKind, PositionKind, QFormat, QuantConfig
from .formats import FORMATS, FormatSpec, Numeric, linear_format, linear_group_size

# The linears of each decoder layer that a quantized checkpoint can quantize (below ``layers.{i}.``), in layer order:
# the Llama family's (quantize's ``hf_model.LINEARS`` maps each to its Hugging Face modules).
LAYER_LINEARS = ("attn.qkv", "attn.out", "mlp.gate_up", "mlp.down")
UNFOLDED_PRE_QUANT_SCALE = ("attn.out",)
GATED_MLPS = (
    MlpKind.SWIGLU,
    MlpKind.GEGLU,
)  # gate and up fused as ``mlp.gate_up`` (gate rows first)  # canonical linears whose smoothing stays an explicit Mul


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor a checkpoint of ``cfg`` holds (no more, no fewer)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    layer_norm = cfg.norm is NormKind.LAYER
    out: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, h), "final_norm.weight": (h,)}
    if cfg.position is PositionKind.LEARNED:
        out["pos_embed.weight"] = (cfg.max_position_embeddings, h)
    if layer_norm:
        out["final_norm.bias"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        out[p + "input_norm.weight"] = (h,)
        out[p + "post_attn_norm.weight"] = (h,)
        if layer_norm:
            out[p + "input_norm.bias"] = (h,)
            out[p + "post_attn_norm.bias"] = (h,)
        out[p + "attn.qkv.weight"] = (cfg.qkv_size, h)
        if cfg.qkv_bias:
            out[p + "attn.qkv.bias"] = (cfg.qkv_size,)
        if cfg.qk_norm:  # one RMSNorm weight shared by every query head, one by every key head
            out[p + "attn.q_norm.weight"] = (cfg.head_size,)
            out[p + "attn.k_norm.weight"] = (cfg.head_size,)
        out[p + "attn.out.weight"] = (h, cfg.num_heads * cfg.head_size)
        if cfg.attn_out_bias:
            out[p + "attn.out.bias"] = (h,)
        if cfg.sandwich_norms:  # Gemma: norms on the attention and MLP outputs, before the residual adds
            out[p + "attn.post_norm.weight"] = (h,)
            out[p + "mlp.post_norm.weight"] = (h,)
        if cfg.moe is not None and cfg.is_sparse(n):
            e, i_e = cfg.moe.num_experts, cfg.moe.intermediate_size
            out[p + "moe.router.weight"] = (e, h)
            out[p + "moe.gate_up.weight"] = (e, 2 * i_e, h)
            out[p + "moe.down.weight"] = (e, h, i_e)
            continue
        if cfg.mlp in GATED_MLPS:
            out[p + "mlp.gate_up.weight"] = (2 * i, h)
        else:
            out[p + "mlp.up.weight"] = (i, h)
            if cfg.mlp_bias:
                out[p + "mlp.up.bias"] = (i,)
        out[p + "mlp.down.weight"] = (h, i)
        if cfg.mlp_bias:
            out[p + "mlp.down.bias"] = (h,)
    return out


def canonical_linears(cfg: ModelConfig) -> list[str]:
    """Every linear of ``cfg``, as canonical prefixes (``layers.0.attn.qkv``, ..., ``lm_head``). A tied
    ``lm_head`` is the embedding's weight; quantizing it gives the head its own quantized copy. A sparse layer's
    experts and router are not linears here (they stay float)."""
    layers = [
        f"layers.{n}.{lin}"
        for n in range(cfg.num_layers)
        for lin in LAYER_LINEARS
        if not (cfg.is_sparse(n) and lin.startswith("mlp."))
    ]
    return [*layers, "lm_head"]


def excluded_linears(cfg: ModelConfig, patterns: Sequence[str]) -> list[str]:
    """Canonical linears matching any of ``patterns`` (fnmatch), which stay in float."""
    return [name for name in canonical_linears(cfg) if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def quantized_linears(cfg: ModelConfig) -> list[str]:
    """The canonical linears the quantized checkpoint ``cfg`` holds quantized tensors for."""
    q = cfg.quantization
    assert q is not None
    excluded = set(excluded_linears(cfg, q.exclude))
    if cfg.tie_word_embeddings and "embed" in q.tensor_formats:
        excluded.add("lm_head")  # the tied head reads the quantized embedding's tensors
    return [name for name in canonical_linears(cfg) if name not in excluded]


def unsigned_codes(q: QuantConfig, spec: FormatSpec) -> bool:
    """Whether ``spec``'s int4 codes are stored unsigned (0..15: zero points, or a GGUF Q4_1 offset)."""
    return spec.weights is Numeric.INT4 and (q.zero_points or spec.offset)


def expert_weight_names(cfg: ModelConfig) -> list[str]:
    """The stacked experts' weights of ``cfg``'s sparse layers: ``layers.{n}.moe.gate_up.weight`` and
    ``.down.weight``."""
    sparse = cfg.moe.sparse_layers if cfg.moe is not None else []
    return [f"layers.{n}.moe.{w}.weight" for n in sparse for w in ("gate_up", "down")]


def expected_quantized_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Canonical name -> (shape, safetensors dtype) of every tensor of the quantized checkpoint ``cfg``."""
    q = cfg.quantization
    assert q is not None
    out = {name: (shape, "F32") for name, shape in expected_tensors(cfg).items()}
    for prefix in quantized_linears(cfg):
        spec = linear_format(q, prefix)
        rows, cols = (cfg.vocab_size, cfg.hidden_size) if prefix == "lm_head" else out[prefix + ".weight"][0]
        groups = -(-cols // linear_group_size(q, prefix))  # the last group may be partial
        if spec.weights is Numeric.INT4:
            out[prefix + ".weight"] = ((rows, cols // 2), "U8")
            out[prefix + ".weight_scale"] = ((rows, groups), "F32")
            if q.zero_points and not spec.offset:
                out[prefix + ".weight_zero_point"] = ((rows, groups), "U8")
            if spec.offset:
                out[prefix + ".weight_offset"] = ((rows, groups), "F32")
        elif spec.blocked:  # int8 per group (GGUF Q8_0); with offsets, uint8 codes (GGUF Q5_K)
            out[prefix + ".weight"] = ((rows, cols), "U8" if spec.offset else "I8")
            out[prefix + ".weight_scale"] = ((rows, groups), "F32")
            if spec.offset:
                out[prefix + ".weight_offset"] = ((rows, groups), "F32")
        else:
            out[prefix + ".weight"] = ((rows, cols), "F8_E4M3" if spec.weights is Numeric.FP8 else "I8")
            out[prefix + ".weight_scale"] = ((rows,), "F32")
        if spec.activations is not None and q.activation_scales is ActivationScales.STATIC:
            out[prefix + ".input_scale"] = ((), "F32")
        if spec.smoothing and prefix.endswith(UNFOLDED_PRE_QUANT_SCALE):
            out[prefix + ".pre_quant_scale"] = ((cols,), "F32")
    for name in expert_weight_names(cfg):  # quantized experts (quantize/moe.py)
        shape = out[name][0]
        if q.qformat is QFormat.INT4_WO:  # packed int4, a scale per block of each expert row
            out[name] = ((*shape[:2], shape[2] // 2), "U8")
            out[name + "_scale"] = ((*shape[:2], -(-shape[2] // q.group_size)), "F32")
        else:  # int8, a scale per expert row
            out[name] = (shape, "I8")
            out[name + "_scale"] = (shape[:2], "F32")
    if "embed" in q.tensor_formats:  # GGUF blocks (convert.readers.EMBEDDING_FORMATS), gathered row by row
        spec = FORMATS[q.tensor_formats["embed"]]
        assert spec.qformat in (QFormat.INT8_GROUP_WO, QFormat.INT8_MIN_WO), spec.qformat
        out["embed.weight"] = ((cfg.vocab_size, cfg.hidden_size), "U8" if spec.offset else "I8")
        groups = -(-cfg.hidden_size // linear_group_size(q, "embed"))
        out["embed.weight_scale"] = ((cfg.vocab_size, groups), "F32")
        if spec.offset:
            out["embed.weight_offset"] = ((cfg.vocab_size, groups), "F32")
    if q.kv_cache_dtype is not KVCacheDType.FLOAT32:
        for n in range(cfg.num_layers):
            out[f"layers.{n}.attn.k_scale"] = ((), "F32")
            out[f"layers.{n}.attn.v_scale"] = ((), "F32")
    return out
