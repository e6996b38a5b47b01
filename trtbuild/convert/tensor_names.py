"""Weight names as data: one table of canonical tensor names with every source spelling (after llama.cpp's
``gguf-py/gguf/tensor_mapping.py``).

A *source part* is a tensor as a source stores it (``q``, ``k`` and ``v`` separately, say); the converter fuses parts
into the checkpoint's canonical tensors (``FUSIONS``). ``{i}`` stands for the layer number in every pattern, ``{e}``
for the expert number in a mixture-of-experts layer's per-expert tensors.
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
    # Mixture of experts (Mixtral, Qwen3-MoE): the float router [E, H] and the experts, stacked along a leading E
    "layers.{i}.moe.router.weight": (
        Spelling(HF, "model.layers.{i}.block_sparse_moe.gate.weight"),  # Mixtral on disk
        Spelling(HF, "model.layers.{i}.mlp.gate.weight"),  # Qwen3-MoE; transformers 5's Mixtral module
    ),
    "layers.{i}.moe.gate_up.weight": (Spelling(HF, "model.layers.{i}.mlp.experts.gate_up_proj"),),  # [E, 2I, H] fused
    "layers.{i}.moe.down.weight": (Spelling(HF, "model.layers.{i}.mlp.experts.down_proj"),),  # [E, H, I] fused
    "layers.{i}.moe.experts.{e}.gate.weight": (
        Spelling(HF, "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"),  # Mixtral
        Spelling(HF, "model.layers.{i}.mlp.experts.{e}.gate_proj.weight"),  # Qwen3-MoE
    ),
    "layers.{i}.moe.experts.{e}.up.weight": (
        Spelling(HF, "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"),
        Spelling(HF, "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
    ),
    "layers.{i}.moe.experts.{e}.down.weight": (
        Spelling(HF, "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight"),
        Spelling(HF, "model.layers.{i}.mlp.experts.{e}.down_proj.weight"),
    ),
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

# Canonical checkpoint tensors made by concatenating source parts along dim 0 (output features). Parts with ``{e}``
# repeat for every expert, expert by expert (gate_0, up_0, gate_1, ...), and the concatenation is viewed
# ``[E, rows of one expert, in]``.
FUSIONS: dict[str, tuple[str, ...]] = {
    "layers.{i}.attn.qkv.weight": ("layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"),
    "layers.{i}.attn.qkv.bias": ("layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"),
    "layers.{i}.mlp.gate_up.weight": ("layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"),
    "layers.{i}.moe.gate_up.weight": ("layers.{i}.moe.experts.{e}.gate.weight", "layers.{i}.moe.experts.{e}.up.weight"),
    "layers.{i}.moe.down.weight": ("layers.{i}.moe.experts.{e}.down.weight",),
}


def _regex(pattern: str) -> re.Pattern[str]:
    escaped = re.escape(pattern).replace(re.escape("{i}"), r"(?P<i>\d+)").replace(re.escape("{e}"), r"(?P<e>\d+)")
    return re.compile(escaped + "$")


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
            for key, value in m.groupdict().items():
                part = part.replace("{" + key + "}", value)
            return Match(part, sp.transform)
    return None


_NUMBERED = re.compile(r"^layers\.(?P<i>\d+)\.(?:(?P<pre>.*?\.experts\.)(?P<e>\d+)\.)?")
_PIECE_OF = {piece: target for target, pieces in FUSIONS.items() for piece in pieces}


def fusion_of(part: str, num_experts: int) -> tuple[str, tuple[str, ...]] | None:
    """The canonical tensor ``part`` (a source part, numbers substituted) is fused into, with every part of it in
    concatenation order (``num_experts`` experts for a per-expert part), or None when ``part`` is not fused."""
    m = _NUMBERED.match(part)
    pattern = part
    if m is not None:
        expert = f"{m['pre']}{{e}}." if m["e"] is not None else ""
        pattern = f"layers.{{i}}.{expert}" + part[m.end() :]
    target = _PIECE_OF.get(pattern)
    if target is None:
        return None
    layer = m["i"] if m is not None else ""
    pieces = FUSIONS[target]
    experts = range(num_experts) if any("{e}" in p for p in pieces) else range(1)
    concrete = tuple(p.replace("{i}", layer).replace("{e}", str(e)) for e in experts for p in pieces)
    return target.replace("{i}", layer), concrete


def is_ignored(name: str, fmt: SourceFormat) -> bool:
    return any(sp.format is fmt and rx.match(name) for rx, sp in _IGNORED)
