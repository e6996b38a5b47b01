"""Tiny random-init Hugging Face models of every supported architecture (built inside the tests)."""

from __future__ import annotations

from pathlib import Path

TINY_CONFIGS = {
    "llama_gqa": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.15,
    ),
    "qwen2_bias": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        initializer_range=0.15,
        use_sliding_window=False,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=89,
        max_position_embeddings=128,
        sliding_window=None,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
    ),
    "qwen3": dict(  # per-head q/k RMSNorm; head_dim 16 != hidden 48 / 4 heads; GQA; untied head
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=107,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        initializer_range=0.15,
    ),
    "phi3": dict(  # fused qkv_proj / gate_up_proj; rotary over 12 of head_size 16 (0.75, as Phi-4-mini); GQA
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        partial_rotary_factor=0.75,
        vocab_size=109,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    ),
    "gemma3": dict(  # sandwich norms, (1 + w) norms, GeGLU, scaled embeddings, q/k norms, head_dim 16 != 48 / 4;
        # layers 0, 1 slide over 6 positions with rotary base 10^4, layer 2 is full with base 10^6 scaled linearly
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=113,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        sliding_window=6,  # the shared tests' sequences reach 21 tokens: blocks of 4 leave the window
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        query_pre_attn_scalar=12,
        tie_word_embeddings=True,
        initializer_range=0.15,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    ),
    "gpt2": dict(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        n_embd=48,
        n_head=4,
        n_layer=2,
        n_positions=128,
        vocab_size=103,
        initializer_range=0.15,
        activation_function="gelu_new",
        bos_token_id=0,
        eos_token_id=0,
    ),
}


# Mixture-of-experts models (tests/test_moe.py): kept out of TINY_CONFIGS, whose every entry the shared tests build.
TINY_MOE_CONFIGS = {
    "mixtral": dict(  # 4 experts, top 2 (renormalised); GQA; head_dim 8 != hidden / heads
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=97,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=False,
        initializer_range=0.15,
    ),
    "qwen3_moe": dict(  # 6 experts, top 3, not renormalised; layer 1 dense (mlp_only_layers), layer 2 sparse;
        # every layer slides over 8 positions (the runner releases blocks outside the window)
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=48,
        intermediate_size=56,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        use_sliding_window=True,
        sliding_window=8,
        vocab_size=103,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        initializer_range=0.15,
    ),
}


# Gemma 2 (tests/test_gemma.py, the gemma2 quantization cases): the tiny Gemma 3 with one rotary base, no q/k norms
# and strong soft-capping of both kinds. Kept out of TINY_CONFIGS: the shared tests run Gemma 3's paths already.
TINY_GEMMA2_CONFIGS = {
    "gemma2": dict(
        TINY_CONFIGS["gemma3"],
        model_type="gemma2",
        architectures=["Gemma2ForCausalLM"],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        attn_logit_softcapping=1.5,
        final_logit_softcapping=3.0,
    ),
}


def tiny_config(name: str) -> dict:
    """The config keys of tiny model ``name``, from any of the tables above."""
    return (TINY_CONFIGS | TINY_MOE_CONFIGS | TINY_GEMMA2_CONFIGS)[name]


def make_hf_model(name: str, folder: Path, seed: int = 0, **overrides):
    """Save a random-init transformers model of config ``name`` (with ``overrides`` of its config keys) to
    ``folder``; returns the model (eval, fp32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    spec = {**tiny_config(name), **overrides}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # norms and biases start at 1/0: randomise them so they are checked too
        for pname, p in model.named_parameters():
            if "norm" in pname or "ln_" in pname or pname.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def hf_logits(model, ids: list[int]):
    """The transformers model's float32 logits ``[len(ids), vocab]`` (numpy) for one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()
