"""Emit the portable graph: standard ONNX (opset >= 21) with one ``trtbuild::PagedAttention`` node per layer.

Norms are single ops (RMSNormalization / LayerNormalization), gate and up projections one matmul (SwiGLU), QKV
one matmul feeding the plugin (through per-head q/k RMSNorms where the model has them, Qwen3); a sparse layer's MLP
is its float router MatMul feeding one ``trtbuild::MoE`` node (plugins/moe/README.md). Linear weights are
stored ``[in, out]`` for MatMul; a tied LM head reuses the embedding through ``Gemm(transB=1)``. Logits are
computed only for the rows named by ``logits_indices``.
"""

from __future__ import annotations

import numpy as np
import onnx

from ..checkpoint.formats import activation_block, dynamic_activations, linear_group_size
from ..checkpoint.graph import emit_quantized_linear, emit_row_offset
from ..checkpoint.layout import GATED_MLPS
from ..config import BuildConfig, EngineIO, KVCacheDType, MlpKind, ModelConfig, NormKind, PositionKind, RopeConfig
from ..plugins import moe as moe_op
from ..plugins.paged_attention import DOMAIN, OP_TYPE, rotary_cos_sin_cache
from .builder import FLOAT, INT64, GraphBuilder

# KV cache storage -> ONNX element type of the cache tensors (the plugin's ``kv_cache_dtype`` attribute).
KV_CACHE_ELEM_TYPES = {
    KVCacheDType.FLOAT32: onnx.TensorProto.FLOAT,
    KVCacheDType.INT8: onnx.TensorProto.INT8,
    KVCacheDType.FP8: onnx.TensorProto.FLOAT8E4M3FN,
}

Weights = dict[str, np.ndarray]


def emit_portable_graph(cfg: ModelConfig, weights: Weights, build: BuildConfig, io: EngineIO) -> onnx.ModelProto:
    """The model as the compiler IR; ``weights`` are float32 canonical tensors (see ``checkpoint.layout``), plus
    the quantized tensors of a quantized checkpoint (``checkpoint.layout``): those linears become Q/DQ + MatMul and a
    quantized KV cache gets its scales and dtype on the plugin node."""
    g = GraphBuilder(build.opset, name=cfg.architecture)
    hkv, d = cfg.num_kv_heads, cfg.head_size
    ids = g.add_input(io.input_ids, INT64, ["num_tokens"])
    positions = g.add_input(io.positions, INT64, ["num_tokens"])
    block_tables = g.add_input(io.block_tables, INT64, ["num_seqs", "max_blocks_per_seq"])
    qsl = g.add_input(io.query_start_loc, INT64, ["num_seqs_plus_1"])
    logits_idx = g.add_input(io.logits_indices, INT64, ["num_logits"])
    # Two KV-cache groups (full and sliding layers, ModelConfig.has_sliding_kv_group): the sliding layers read their
    # own block tables and caches of their own number of blocks; a model of one kind gets no such input.
    sliding_tables = None
    if cfg.has_sliding_kv_group:
        sliding_tables = g.add_input(io.sliding_block_tables, INT64, ["num_seqs", "max_sliding_blocks_per_seq"])
    cache_shape = ["num_blocks", "block_size", hkv, d]
    sliding_cache_shape = ["num_sliding_blocks", "block_size", hkv, d]
    cache_type = KV_CACHE_ELEM_TYPES[cfg.kv_cache_dtype]

    if "embed.weight_scale" in weights:  # GGUF blocks (checkpoint.layout): the rows gathered, then dequantized
        assert cfg.quantization is not None
        rows = g.op("Gather", [g.initializer("embed.weight", weights["embed.weight"]), ids], name="embed")
        scale = g.initializer("embed.weight_scale", np.asarray(weights["embed.weight_scale"], np.float32))
        scales = g.op("Gather", [scale, ids], name="embed.scale")
        group = linear_group_size(cfg.quantization, "embed")
        x = g.op("DequantizeLinear", [rows, scales], name="embed.dq", axis=1, block_size=group)
        if "embed.weight_offset" in weights:  # int8_min_wo: uint8 codes, + an offset per group
            offset = np.asarray(weights["embed.weight_offset"], np.float32)[..., None]  # [V, G, 1], as the rows'
            offsets = g.op("Gather", [g.initializer("embed.weight_offset", offset), ids], name="embed.offset")
            x = emit_row_offset(g, x, offsets, group, cfg.hidden_size, "embed")
    else:
        x = g.op("Gather", [g.initializer("embed.weight", weights["embed.weight"]), ids], name="embed")
    if cfg.embed_multiplier != 1.0:  # Gemma: rows scaled by sqrt(hidden) (the tied head reads the raw table)
        x = g.op("Mul", [x, g.const(cfg.embed_multiplier, np.float32)], name="embed_scale")
    if cfg.position is PositionKind.LEARNED:
        pos = g.op("Gather", [g.initializer("pos_embed.weight", weights["pos_embed.weight"]), positions])
        x = g.op("Add", [x, pos], name="embed_add_pos")
    cos_sin: dict[RopeConfig, str] = {}  # one table per distinct rotary embedding (Gemma 3: full and sliding layers)
    for rope, name in ((cfg.rope, "rotary.cos_sin_cache"), (cfg.local_rope, "rotary_local.cos_sin_cache")):
        if rope is not None:
            table = rotary_cos_sin_cache(build.max_seq_len, rope.rotary_dim, rope.theta, rope.scaling)
            cos_sin[rope] = g.initializer(name, table)

    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        h = _norm(g, cfg, weights, x, p + "input_norm")
        qkv = _linear(g, cfg, weights, h, p + "attn.qkv")
        if cfg.qk_norm:
            qkv = _qk_norm(g, cfg, weights, qkv, p + "attn")
        window = cfg.layer_window(n)
        in_sliding_group = sliding_tables is not None and window is not None
        shape = sliding_cache_shape if in_sliding_group else cache_shape
        tables = sliding_tables if in_sliding_group else block_tables
        kc = g.add_input(io.key_cache.format(layer=n), cache_type, shape)
        vc = g.add_input(io.value_cache.format(layer=n), cache_type, shape)
        kc_out, vc_out = f"key_cache_out.{n}", f"value_cache_out.{n}"
        rope = cfg.layer_rope(n)
        inputs, kv_attrs = [qkv, kc, vc, positions, tables, qsl, cos_sin[rope] if rope else ""], {}
        if cache_type != FLOAT:  # quantized cache: per-tensor scales as inputs 7, 8 (plugin README)
            inputs += [g.initializer(p + f"attn.{kv}_scale", weights[p + f"attn.{kv}_scale"]) for kv in ("k", "v")]
            kv_attrs["kv_cache_dtype"] = cache_type
        if window is not None:
            kv_attrs["sliding_window"] = window
        if cfg.attn_softcap is not None:
            kv_attrs["softcap"] = cfg.attn_softcap
        attn = g.op_multi(
            OP_TYPE,
            inputs,
            domain=DOMAIN,
            name=p + "attn.paged",
            outputs=[f"{p}attn.paged/out0", kc_out, vc_out],
            num_heads=cfg.num_heads,
            num_kv_heads=hkv,
            head_size=d,
            scale=cfg.softmax_scale,
            rotary_interleaved=int(cfg.rope.interleaved) if cfg.rope else 0,
            **kv_attrs,
        )[0]
        g.add_output(kc_out, cache_type, shape)
        g.add_output(vc_out, cache_type, shape)
        attn = _linear(g, cfg, weights, attn, p + "attn.out")
        if cfg.sandwich_norms:
            attn = _norm(g, cfg, weights, attn, p + "attn.post_norm")
        x = g.op("Add", [x, attn], name=p + "attn.residual")
        h = _norm(g, cfg, weights, x, p + "post_attn_norm")
        mlp = _mlp(g, cfg, weights, h, p + "mlp")
        if cfg.sandwich_norms:
            mlp = _norm(g, cfg, weights, mlp, p + "mlp.post_norm")
        x = g.op("Add", [x, mlp], name=p + "mlp.residual")

    x = g.op("Gather", [x, logits_idx], name="logits_rows")
    x = _norm(g, cfg, weights, x, "final_norm")
    if cfg.tie_word_embeddings and "embed.weight_scale" in weights:  # the quantized embedding is the head
        assert cfg.quantization is not None
        group = linear_group_size(cfg.quantization, "embed")
        w = g.op(
            "DequantizeLinear",
            ["embed.weight", "embed.weight_scale"],
            name="lm_head.weight_dq",
            axis=1,
            block_size=group,
        )
        if "embed.weight_offset" in weights:
            w = emit_row_offset(g, w, "embed.weight_offset", group, cfg.hidden_size, "lm_head")
        logits = g.op("Gemm", [x, w], name="lm_head", transB=1)
    elif cfg.tie_word_embeddings and "lm_head.weight_scale" not in weights:  # a quantized tied head has its own copy
        logits = g.op("Gemm", [x, "embed.weight"], name="lm_head", transB=1)
    else:
        logits = _linear(g, cfg, weights, x, "lm_head")
    if cfg.final_softcap is not None:  # cap * tanh(logits / cap)
        cap = g.const(cfg.final_softcap, np.float32)
        capped = g.op("Tanh", [g.op("Div", [logits, cap], name="logits_softcap.div")], name="logits_softcap.tanh")
        logits = g.op("Mul", [capped, cap], name="logits_softcap")
    g.rename_output(logits, io.logits)
    g.add_output(io.logits, FLOAT, ["num_logits", cfg.vocab_size])
    return g.model()


def _linear(g: GraphBuilder, cfg: ModelConfig, weights: Weights, x: str, prefix: str) -> str:
    if prefix + ".weight_scale" in weights:  # a quantized checkpoint's linear: Q/DQ (trtbuild.checkpoint.graph)
        assert cfg.quantization is not None
        return emit_quantized_linear(g, weights, x, prefix, cfg.quantization)
    w = g.initializer(prefix + ".weight", np.ascontiguousarray(weights[prefix + ".weight"].T))
    y = g.op("MatMul", [x, w], name=prefix)
    if prefix + ".bias" in weights:
        y = g.op("Add", [y, g.initializer(prefix + ".bias", weights[prefix + ".bias"])], name=prefix + ".bias_add")
    return y


def _norm(g: GraphBuilder, cfg: ModelConfig, weights: Weights, x: str, prefix: str) -> str:
    w = g.initializer(prefix + ".weight", weights[prefix + ".weight"])
    if cfg.norm is NormKind.RMS:
        return g.op("RMSNormalization", [x, w], name=prefix, axis=-1, epsilon=cfg.norm_eps)
    b = g.initializer(prefix + ".bias", weights[prefix + ".bias"])
    return g.op("LayerNormalization", [x, w, b], name=prefix, axis=-1, epsilon=cfg.norm_eps)


def _qk_norm(g: GraphBuilder, cfg: ModelConfig, weights: Weights, qkv: str, prefix: str) -> str:
    """Qwen3's per-head RMSNorm of the query and key parts of ``qkv`` ``[T, (Hq + 2 Hkv) * D]``; the plugin then
    rotates the normed heads as it rotates any (its contract is unchanged). Each part is viewed ``[T, H, D]``, normed
    over D by one RMSNormalization and flattened back; v passes through."""
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    q, k, v = g.op_multi(
        "Split", [qkv, g.const([hq * d, hkv * d, hkv * d])], outputs=3, name=prefix + ".qk_norm.split", axis=-1
    )
    normed = []
    for part, x, heads in (("q", q, hq), ("k", k, hkv)):
        name = f"{prefix}.{part}_norm"
        w = g.initializer(name + ".weight", weights[name + ".weight"])
        per_head = g.op("Reshape", [x, g.const([-1, heads, d])], name=name + ".heads")
        y = g.op("RMSNormalization", [per_head, w], name=name, axis=-1, epsilon=cfg.norm_eps)
        normed.append(g.op("Reshape", [y, g.const([-1, heads * d])], name=name + ".flat"))
    return g.op("Concat", [*normed, v], name=prefix + ".qk_norm.concat", axis=-1)


def _mlp(g: GraphBuilder, cfg: ModelConfig, weights: Weights, x: str, prefix: str) -> str:
    if (moe := prefix.removesuffix("mlp") + "moe") + ".router.weight" in weights:  # a sparse layer
        return _moe(g, cfg, weights, x, moe)
    if cfg.mlp in GATED_MLPS:
        gate_up = _linear(g, cfg, weights, x, prefix + ".gate_up")
        i = cfg.intermediate_size
        gate, up = g.op_multi("Split", [gate_up, g.const([i, i])], outputs=2, name=prefix + ".split", axis=-1)
        if cfg.mlp is MlpKind.SWIGLU:
            act = g.op("Mul", [gate, g.op("Sigmoid", [gate], name=prefix + ".sigmoid")], name=prefix + ".silu")
        else:  # GEGLU
            act = g.op("Gelu", [gate], name=prefix + ".gelu", approximate="tanh")
        h = g.op("Mul", [act, up], name=prefix + ".gated")
    else:
        h = g.op("Gelu", [_linear(g, cfg, weights, x, prefix + ".up")], name=prefix + ".gelu", approximate="tanh")
    return _linear(g, cfg, weights, h, prefix + ".down")


def _moe(g: GraphBuilder, cfg: ModelConfig, weights: Weights, x: str, prefix: str) -> str:
    """A sparse layer's mixture of experts: the router as a float MatMul (never quantized) feeding one
    ``trtbuild::MoE`` node that holds the stacked experts, float, int8 with their row scales, or packed int4 (uint8)
    with their block scales and ``group_size``; int8_sq's experts quantize their activations per block
    (``activation_block``, plugins/moe/README.md)."""
    assert cfg.moe is not None
    router = g.initializer(prefix + ".router.weight", np.ascontiguousarray(weights[prefix + ".router.weight"].T))
    logits = g.op("MatMul", [x, router], name=prefix + ".router")
    experts = [g.initializer(prefix + f".{w}.weight", weights[prefix + f".{w}.weight"]) for w in ("gate_up", "down")]
    if prefix + ".gate_up.weight_scale" in weights:  # int8 experts (a scale per row) or int4 (a scale per block)
        experts += [
            g.initializer(prefix + f".{w}.weight_scale", weights[prefix + f".{w}.weight_scale"])
            for w in ("gate_up", "down")
        ]
    quantized = {}
    if weights[prefix + ".gate_up.weight"].dtype == np.uint8:  # packed int4 experts (checkpoint.layout)
        assert cfg.quantization is not None
        quantized["group_size"] = cfg.quantization.group_size
    if cfg.quantization is not None and dynamic_activations(cfg.quantization):  # int8_sq: int8 activations too
        block = activation_block(cfg.quantization)
        assert block is not None, "quantize.check_moe_request takes int8_sq's dynamic activations only"
        quantized["activation_block"] = block
    return g.op(
        moe_op.OP_TYPE,
        [x, logits, *experts],
        domain=moe_op.DOMAIN,
        name=prefix + ".experts",
        top_k=cfg.moe.top_k,
        renormalize=int(cfg.moe.renormalize),
        activation=moe_op.ACTIVATION_SILU,
        **quantized,
    )
