"""Weight names as data: one table of canonical tensor names with every source spelling (after llama.cpp's
``gguf-py/gguf/tensor_mapping.py``).

A *source part* is a tensor as a source stores it (``q``, ``k`` and ``v`` separately, say); the converter fuses parts
into the checkpoint's canonical tensors (``FUSIONS``). ``{i}`` stands for the layer number in every pattern.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class SourceFormat(enum.Enum):
    HF = "hf"  # Hugging Face safetensors (torch Linear layout [out, in] unless the spelling says otherwise)
    GGUF = "gguf"  # llama.cpp GGUF (dims reversed by the reader; Q/K rows permuted for rotary)


class Transform(enum.Enum):
    """How a source tensor is brought into canonical layout (``[out, in]`` for linear weights)."""

    NONE = "none"
    TRANSPOSE = "transpose"  # GPT-2's Conv1D stores [in, out]
    UNPERMUTE_Q = "unpermute_q"  # llama.cpp interleaves rotary pairs of Q rows; undo with num_heads
    UNPERMUTE_K = "unpermute_k"  # likewise for K rows, with num_kv_heads
    ADD_ONE = "add_one"  # Gemma's RMSNorm scales by (1 + w): the checkpoint stores 1 + w (llama.cpp's GGUF does too)


@dataclass(frozen=True)
class Spelling:
    format: SourceFormat
    pattern: str
    transform: Transform = Transform.NONE


HF, GGUF = SourceFormat.HF, SourceFormat.GGUF

# Source parts: name -> every known spelling, commented by origin.
SOURCE_PARTS: dict[str, tuple[Spelling, ...]] = {
    "embed.weight": (
        Spelling(HF, "model.embed_tokens.weight"),  # Llama, Mistral, Qwen2, Qwen3, Phi-3
        Spelling(HF, "transformer.wte.weight"),  # GPT-2
        Spelling(GGUF, "token_embd.weight"),
    ),
    "pos_embed.weight": (Spelling(HF, "transformer.wpe.weight"),),  # GPT-2 learned positions
    "final_norm.weight": (
        Spelling(HF, "model.norm.weight"),
        Spelling(HF, "transformer.ln_f.weight"),
        Spelling(GGUF, "output_norm.weight"),
    ),
    "final_norm.bias": (Spelling(HF, "transformer.ln_f.bias"),),
    "lm_head.weight": (Spelling(HF, "lm_head.weight"), Spelling(GGUF, "output.weight")),
    "layers.{i}.input_norm.weight": (
        Spelling(HF, "model.layers.{i}.input_layernorm.weight"),
        Spelling(HF, "transformer.h.{i}.ln_1.weight"),
        Spelling(GGUF, "blk.{i}.attn_norm.weight"),
    ),
    "layers.{i}.input_norm.bias": (Spelling(HF, "transformer.h.{i}.ln_1.bias"),),
    "layers.{i}.attn.q.weight": (
        Spelling(HF, "model.layers.{i}.self_attn.q_proj.weight"),
        Spelling(GGUF, "blk.{i}.attn_q.weight", Transform.UNPERMUTE_Q),
    ),
    "layers.{i}.attn.k.weight": (
        Spelling(HF, "model.layers.{i}.self_attn.k_proj.weight"),
        Spelling(GGUF, "blk.{i}.attn_k.weight", Transform.UNPERMUTE_K),
    ),
    "layers.{i}.attn.v.weight": (
        Spelling(HF, "model.layers.{i}.self_attn.v_proj.weight"),
        Spelling(GGUF, "blk.{i}.attn_v.weight"),
    ),
    "layers.{i}.attn.q_norm.weight": (  # Qwen3, Gemma 3: per head
        Spelling(HF, "model.layers.{i}.self_attn.q_norm.weight"),
        Spelling(GGUF, "blk.{i}.attn_q_norm.weight"),
    ),
    "layers.{i}.attn.k_norm.weight": (
        Spelling(HF, "model.layers.{i}.self_attn.k_norm.weight"),
        Spelling(GGUF, "blk.{i}.attn_k_norm.weight"),
    ),
    "layers.{i}.attn.q.bias": (Spelling(HF, "model.layers.{i}.self_attn.q_proj.bias"),),  # Qwen2
    "layers.{i}.attn.k.bias": (Spelling(HF, "model.layers.{i}.self_attn.k_proj.bias"),),
    "layers.{i}.attn.v.bias": (Spelling(HF, "model.layers.{i}.self_attn.v_proj.bias"),),
    "layers.{i}.attn.qkv.weight": (
        Spelling(HF, "model.layers.{i}.self_attn.qkv_proj.weight"),  # Phi-3: q | k | v rows, fused already
        Spelling(HF, "transformer.h.{i}.attn.c_attn.weight", Transform.TRANSPOSE),
    ),
    "layers.{i}.attn.qkv.bias": (Spelling(HF, "transformer.h.{i}.attn.c_attn.bias"),),
    "layers.{i}.attn.out.weight": (
        Spelling(HF, "model.layers.{i}.self_attn.o_proj.weight"),
        Spelling(HF, "transformer.h.{i}.attn.c_proj.weight", Transform.TRANSPOSE),
        Spelling(GGUF, "blk.{i}.attn_output.weight"),
    ),
    "layers.{i}.attn.out.bias": (
        Spelling(HF, "model.layers.{i}.self_attn.o_proj.bias"),
        Spelling(HF, "transformer.h.{i}.attn.c_proj.bias"),
    ),
    "layers.{i}.post_attn_norm.weight": (
        Spelling(HF, "model.layers.{i}.post_attention_layernorm.weight"),
        Spelling(HF, "transformer.h.{i}.ln_2.weight"),
        Spelling(GGUF, "blk.{i}.ffn_norm.weight"),
    ),
    "layers.{i}.post_attn_norm.bias": (Spelling(HF, "transformer.h.{i}.ln_2.bias"),),
    # Gemma 2/3's sandwich norms: on the attention output and on the MLP output, before each residual add
    "layers.{i}.attn.post_norm.weight": (Spelling(GGUF, "blk.{i}.post_attention_norm.weight"),),
    "layers.{i}.mlp.post_norm.weight": (Spelling(GGUF, "blk.{i}.post_ffw_norm.weight"),),
    "layers.{i}.mlp.gate_up.weight": (Spelling(HF, "model.layers.{i}.mlp.gate_up_proj.weight"),),  # Phi-3: gate | up
    "layers.{i}.mlp.gate.weight": (
        Spelling(HF, "model.layers.{i}.mlp.gate_proj.weight"),
        Spelling(GGUF, "blk.{i}.ffn_gate.weight"),
    ),
    "layers.{i}.mlp.up.weight": (
        Spelling(HF, "model.layers.{i}.mlp.up_proj.weight"),
        Spelling(HF, "transformer.h.{i}.mlp.c_fc.weight", Transform.TRANSPOSE),  # GPT-2 fc (not gated)
        Spelling(GGUF, "blk.{i}.ffn_up.weight"),
    ),
    "layers.{i}.mlp.up.bias": (Spelling(HF, "transformer.h.{i}.mlp.c_fc.bias"),),
    "layers.{i}.mlp.down.weight": (
        Spelling(HF, "model.layers.{i}.mlp.down_proj.weight"),
        Spelling(HF, "transformer.h.{i}.mlp.c_proj.weight", Transform.TRANSPOSE),
        Spelling(GGUF, "blk.{i}.ffn_down.weight"),
    ),
    "layers.{i}.mlp.down.bias": (Spelling(HF, "transformer.h.{i}.mlp.c_proj.bias"),),
}


def _gemma_hf(pattern: str) -> Spelling:
    return Spelling(HF, pattern, Transform.ADD_ONE)


# Architectures whose sources spell some tensors their own way (a name the common table gives another meaning, or
# another transform): architecture -> source part -> spellings, consulted before ``SOURCE_PARTS``.
_GEMMA_PARTS: dict[str, tuple[Spelling, ...]] = {
    # Hugging Face stores w of Gemma's (1 + w) norms; llama.cpp's GGUF already holds 1 + w (the common table).
    "final_norm.weight": (_gemma_hf("model.norm.weight"),),
    "layers.{i}.input_norm.weight": (_gemma_hf("model.layers.{i}.input_layernorm.weight"),),
    "layers.{i}.attn.q_norm.weight": (_gemma_hf("model.layers.{i}.self_attn.q_norm.weight"),),
    "layers.{i}.attn.k_norm.weight": (_gemma_hf("model.layers.{i}.self_attn.k_norm.weight"),),
    # Gemma's post_attention_layernorm norms the attention output; its pre-MLP norm is pre_feedforward_layernorm
    "layers.{i}.attn.post_norm.weight": (_gemma_hf("model.layers.{i}.post_attention_layernorm.weight"),),
    "layers.{i}.post_attn_norm.weight": (_gemma_hf("model.layers.{i}.pre_feedforward_layernorm.weight"),),
    "layers.{i}.mlp.post_norm.weight": (_gemma_hf("model.layers.{i}.post_feedforward_layernorm.weight"),),
    # llama.cpp permutes Q/K rows for its llama architecture only
    "layers.{i}.attn.q.weight": (Spelling(GGUF, "blk.{i}.attn_q.weight"),),
    "layers.{i}.attn.k.weight": (Spelling(GGUF, "blk.{i}.attn_k.weight"),),
}
ARCHITECTURE_PARTS: dict[str, dict[str, tuple[Spelling, ...]]] = {
    "Gemma2ForCausalLM": _GEMMA_PARTS,
    "Gemma3ForCausalLM": _GEMMA_PARTS,
}

# Source tensors that are known and deliberately dropped (buffers, not weights).
IGNORED: tuple[Spelling, ...] = (
    Spelling(HF, "transformer.h.{i}.attn.bias"),  # GPT-2 causal-mask buffer in old checkpoints
    Spelling(HF, "transformer.h.{i}.attn.masked_bias"),
    Spelling(HF, "model.layers.{i}.self_attn.rotary_emb.inv_freq"),  # recomputed from the config
    Spelling(GGUF, "rope_freqs.weight"),
)

# Canonical checkpoint tensors made by concatenating source parts along dim 0 (output features).
FUSIONS: dict[str, tuple[str, ...]] = {
    "layers.{i}.attn.qkv.weight": ("layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"),
    "layers.{i}.attn.qkv.bias": ("layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"),
    "layers.{i}.mlp.gate_up.weight": ("layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"),
}


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


def _matchers(parts: dict[str, tuple[Spelling, ...]]) -> list[tuple[re.Pattern[str], str, Spelling]]:
    return [(_regex(sp.pattern), part, sp) for part, spellings in parts.items() for sp in spellings]


_MATCHERS = _matchers(SOURCE_PARTS)
_ARCHITECTURE_MATCHERS = {arch: _matchers(parts) for arch, parts in ARCHITECTURE_PARTS.items()}
_IGNORED = [(_regex(sp.pattern), sp) for sp in IGNORED]


@dataclass(frozen=True)
class Match:
    """A source tensor recognised as ``part`` (layer substituted) with the transform its spelling needs."""

    part: str
    transform: Transform


def match_source_name(name: str, fmt: SourceFormat, architecture: str = "") -> Match | None:
    """The source part ``name`` spells in ``fmt`` for ``architecture`` (its own spellings first, then the common
    table), or None when no rule knows it (ignored names included)."""
    for rx, part, sp in [*_ARCHITECTURE_MATCHERS.get(architecture, []), *_MATCHERS]:
        if sp.format is fmt and (m := rx.match(name)):
            layer = m.groupdict().get("i")
            return Match(part.replace("{i}", layer) if layer is not None else part, sp.transform)
    return None


def is_ignored(name: str, fmt: SourceFormat) -> bool:
    return any(sp.format is fmt and rx.match(name) for rx, sp in _IGNORED)
