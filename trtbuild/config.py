"""Typed, versioned configs: the one source of truth for checkpoint files, engine directories, CLI flags and recipes.

- ``ModelConfig``: what a converted checkpoint is (``CKPT_DIR/config.json``).
- ``BuildConfig``: how an engine is built (``trtbuild build`` flags, recorded in the manifest).
- ``RuntimeConfig``: what the runner needs to drive an engine (``ENGINE_DIR/runtime_config.json``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path

from .configio import from_dict, read_json, to_dict, write_json

# 2: QuantConfig.tensor_formats and the GGUF block formats (int8_group_wo, int4_min_wo); 3: ModelConfig's per-layer
# attention kinds, sliding window, soft-capping, embedding multiplier, sandwich norms and GeGLU (Gemma 3); 4:
# ModelConfig.moe, sparse mixture-of-experts MLPs (Mixtral, Qwen3-MoE); 5: QuantConfig.tensor_group_sizes (GGUF
# Q6_K's blocks of 16) and the int8_min_wo block format (Q5_K, fused tensors of mixed block formats); 6: an
# int8_min_wo embedding (a GGUF file's 4- or 5-bit token_embd, with embed.weight_offset)
CHECKPOINT_FORMAT_VERSION = 6
READABLE_CHECKPOINT_VERSIONS = (1, 2, 3, 4, 5, 6)  # an older one: a version-6 checkpoint whose new fields hold defaults
# 2: BuildConfig.cpu_attention (native attention writes the cache in the graph); 3: a torch AOTInductor engine's
# package holds code only (a step program and a one-token decode program) and its weights.safetensors beside it
ENGINE_FORMAT_VERSION = 3
READABLE_ENGINE_VERSIONS = (2, 3)  # a version-2 AOTInductor package (one program, weights inside) still loads


class DType(enum.Enum):
    """Storage dtype of a checkpoint's floating-point weights."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class NormKind(enum.Enum):
    RMS = "rms"
    LAYER = "layer"


class MlpKind(enum.Enum):
    """``SWIGLU``: silu(gate) * up, gate/up fused into one matmul. ``GELU_TANH``: fc -> gelu(tanh approx) -> proj.
    ``GEGLU``: gelu_tanh(gate) * up, fused as SWIGLU."""

    SWIGLU = "swiglu"
    GELU_TANH = "gelu_tanh"
    GEGLU = "geglu"  # gelu(tanh approx)(gate) * up, gate/up fused like SWIGLU (Gemma)


class AttentionKind(enum.Enum):
    """What a layer attends to: ``FULL`` every earlier position of its sequence (causal), ``SLIDING`` only the
    last ``ModelConfig.sliding_window`` positions, its own included (key position > query position - window, as
    transformers' sliding-window mask)."""

    FULL = "full"
    SLIDING = "sliding"


class PositionKind(enum.Enum):
    ROPE = "rope"
    LEARNED = "learned"


class QFormat(enum.Enum):
    """Weight/activation quantization formats of ``trtbuild quantize``."""

    INT8_SQ = "int8_sq"  # INT8 SmoothQuant: per-channel int8 weights, int8 activations (``ActivationScales``), smoothed
    FP8 = "fp8"  # FLOAT8E4M3FN weights and activations: rowwise (per channel / per token) or per-tensor static
    INT8_WO = "int8_wo"  # int8 weight-only, per-channel scales
    INT4_WO = "int4_wo"  # int4 weight-only round-to-nearest, per-group scales
    INT4_AWQ = "int4_awq"  # int4 weight-only with AWQ activation-aware scaling, per-group scales
    # The block formats ``trtbuild convert`` keeps from llama.cpp GGUF files (``trtbuild quantize`` does not make them):
    INT8_GROUP_WO = "int8_group_wo"  # int8 weight-only, per-group scales: w = q * scale (Q8_0, Q5_0, Q6_K)
    INT4_MIN_WO = "int4_min_wo"  # int4 codes 0..15, per-group float scale and min: w = q * scale + min (Q4_1, Q4_K)
    # uint8 codes 0..255, per-group float scale and min (Q5_K; a fused tensor of parts in different block formats)
    INT8_MIN_WO = "int8_min_wo"


class ActivationScales(enum.Enum):
    """How ``int8_sq`` and ``fp8`` quantize a linear's input activations (weight-only formats have none)."""

    # Computed at run time from the values themselves: int8 per block of 16 in-features of each token (onnxruntime's
    # MatMulNBits quantizes its activations so, at full speed), fp8 per token. Holds on text of any domain.
    DYNAMIC = "dynamic"
    # Computed at run time, one per token (the whole row), as TensorRT-LLM's and vLLM's per-token SmoothQuant: int8
    # then runs as an integer GEMM, faster from a few dozen rows (prefill, batched decode) but coarser than DYNAMIC
    # (docs/decisions/dynamic-activation-scales.md). For fp8, which DYNAMIC already quantizes per token, the same.
    PER_TOKEN = "per_token"
    # One per-tensor scale per linear, calibrated offline (what TensorRT's int8/fp8 Q/DQ GEMMs take). Fits the
    # calibration text: on another domain the clipped outliers cost accuracy (docs/quantization.md).
    STATIC = "static"


class KVCacheDType(enum.Enum):
    """Storage dtype of the paged KV cache."""

    FLOAT32 = "float32"
    FP8 = "fp8"
    INT8 = "int8"


class Backend(enum.Enum):
    ONNXRUNTIME = "onnxruntime"
    TENSORRT = "tensorrt"
    TORCH = "torch"  # the portable graph exported with torch.export and compiled by AOTInductor (docs/gpu.md)


class CpuAttention(enum.Enum):
    """How the onnxruntime engine runs ``trtbuild::PagedAttention`` (docs/decisions/native-attention.md).

    ``NATIVE``: one native custom-op node per layer (the native CPU library, compiled with the machine's C++
    compiler at first use) that writes the KV cache in place and reads it where it lies (float32, int8 or fp8
    cache). ``LOWERED``: about 20 standard ONNX ops per layer (``backends/onnxruntime/build/lowering.py``), no
    compiler needed; the step's keys/values leave the graph and the session stores them."""

    NATIVE = "native"
    LOWERED = "lowered"


class CpuLinear(enum.Enum):
    """How the onnxruntime engine runs its quantized linears (docs/decisions/native-quantized-linear.md).

    ``NATIVE``: int8 per-channel and symmetric int4 weights as the native library's ``QLinear`` (AVX-512 VNNI or
    AVX2, AMX tiles for many rows; ``backends/onnxruntime/build/native_linear.py``), compiled like the native attention
    kernel, and quantized MoE experts on ``QLinear``'s products inside the native ``MoE`` kernel
    (``build/moe_experts.py``); a build on a CPU with neither, or of a model with no such linear or experts,
    records ``ONNXRUNTIME`` instead.
    ``ONNXRUNTIME``: onnxruntime's ``MatMulNBits`` / ``MatMulInteger``; the ``MoE`` kernel's quantized experts with
    float activations."""

    NATIVE = "native"
    ONNXRUNTIME = "onnxruntime"


class TorchDevice(enum.Enum):
    """Device type a torch engine runs on (an AOTInductor package holds code for exactly one)."""

    CUDA = "cuda"
    CPU = "cpu"


class TorchRuntime(enum.Enum):
    """How a torch engine runs (docs/gpu.md).

    ``TORCH_COMPILE``: the engine holds the portable graph's structure and the imported module's weights
    (safetensors, in the engine's dtypes); opening it builds the torch module on the device and ``torch.compile``s
    it (Inductor, dynamic sizes; compiled code cached under ``~/.cache/trtbuild/inductor`` so a second load is
    warm), decode steps replayed as CUDA graphs. Needs no GPU to build and runs wherever torch runs the device
    (TensorRT-LLM's PyTorch flow). ``AOT_INDUCTOR``: the graph compiled ahead of time into one ``model.pt2``
    package for the build machine's GPU architecture (or CPU ISA): nothing compiles at load, but building for CUDA
    needs that GPU, and a package that does not load and run in a child process at build time is replaced by the
    ``TORCH_COMPILE`` form (one warning line)."""

    TORCH_COMPILE = "torch-compile"
    AOT_INDUCTOR = "aot-inductor"


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: ``theta`` base, rotated width ``rotary_dim`` (<= head_size), linear position ``scaling``."""

    theta: float
    rotary_dim: int
    interleaved: bool = False
    scaling: float = 1.0


# Calibration windows x tokens when a QuantConfig does not give them (docs/decisions/calibration-defaults.md).
DEFAULT_CALIBRATION = (64, 512)
CALIBRATION_DEFAULTS = {QFormat.INT4_AWQ: (4, 512), QFormat.INT8_SQ: (16, 256), QFormat.FP8: (16, 256)}


# SmoothQuant's migration strength when a QuantConfig does not give one (docs/decisions/smoothquant-alpha.md).
SMOOTHQUANT_ALPHA = {ActivationScales.DYNAMIC: 0.3, ActivationScales.STATIC: 0.8, ActivationScales.PER_TOKEN: 0.5}


@dataclass(frozen=True)
class QuantConfig:
    """Options of ``trtbuild quantize`` (each field is a CLI flag of the same name)."""

    qformat: QFormat = field(metadata={"help": "quantization format"})
    kv_cache_dtype: KVCacheDType = field(default=KVCacheDType.FLOAT32, metadata={"help": "KV cache storage dtype"})
    activation_scales: ActivationScales = field(
        default=ActivationScales.DYNAMIC,
        metadata={
            "help": "int8_sq / fp8 activation scales: dynamic (per block of 16 in-features for int8, per token for "
            "fp8, computed at run time), per_token (computed at run time per token: int8 on the CPU's integer GEMM, "
            "2-3x faster prefill and batched decode, about 1% more perplexity than dynamic) or static (per "
            "tensor, calibrated: what TensorRT needs; fits the calibration text's domain only)"
        },
    )
    group_size: int = field(
        default=128, metadata={"help": "int4 block size along in-features: a power of two >= 16 (last may be partial)"}
    )
    calib_dataset: str = field(default="lee_news", metadata={"help": "calibration dataset name or text/JSONL path"})
    calib_size: int | None = field(
        default=None,
        metadata={
            "help": "calibration samples [default: 4 for int4_awq, 16 for int8_sq and fp8, 64 for KV-cache ranges; "
            "int8_wo and int4_wo read no calibration data]; more samples give steadier ranges, and the forward "
            "passes grow with calib_size x calib_seq_len (int4_awq's searches do not)"
        },
    )
    calib_seq_len: int | None = field(
        default=None,
        metadata={"help": "tokens per calibration sample [default: 256 for int8_sq and fp8, 512 for the others]"},
    )
    # Nothing is kept in float by default: the LM head is quantized too, int8 weight-only in every format
    # (``checkpoint.formats.HEAD_FORMAT``; docs/decisions/lm-head-quantized.md); ``--exclude lm_head`` keeps it float.
    exclude: list[str] = field(default_factory=list, metadata={"help": "module name patterns kept in float"})
    smoothquant_alpha: float | None = field(
        default=None,
        metadata={
            "help": "int8_sq migration strength (0: none, 1: all of the activation range to weights) [default: 0.3 "
            "with dynamic activation scales, 0.8 with static ones: docs/quantization.md has the measurements]"
        },
    )
    zero_points: bool = field(
        default=False,
        metadata={
            "help": "int4 formats: unsigned codes 0..15 and a zero point per group (asymmetric ranges, as "
            "llama.cpp's Q4_1 and the AWQ paper); onnxruntime and torch engines, not TensorRT"
        },
    )

    # Set by ``trtbuild convert`` of a GGUF file whose tensors keep mixed block formats (llama.cpp mixes them, e.g.
    # a Q8_0 embedding beside Q4_1 linears): canonical prefix (``embed``, ``lm_head``, ``layers.3.mlp.down``) -> the
    # format of that tensor where it is not ``qformat``. The embedding is float unless listed; a tied LM head reads
    # a listed embedding's tensors. Not a CLI flag.
    tensor_formats: dict[str, QFormat] = field(default_factory=dict)
    # Likewise: canonical prefix -> in-features per block of that tensor where it is not ``group_size`` (GGUF Q6_K's
    # blocks of 16 beside the blocks of 32 of the file's other block formats). Not a CLI flag.
    tensor_group_sizes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        size, seq_len = CALIBRATION_DEFAULTS.get(self.qformat, DEFAULT_CALIBRATION)
        if self.calib_size is None:  # unset: the format's default (the stored config always holds the number)
            object.__setattr__(self, "calib_size", size)
        if self.calib_seq_len is None:
            object.__setattr__(self, "calib_seq_len", seq_len)
        if self.smoothquant_alpha is None:
            object.__setattr__(self, "smoothquant_alpha", SMOOTHQUANT_ALPHA[self.activation_scales])
        for name in ("group_size", "calib_size", "calib_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if any(size <= 0 for size in self.tensor_group_sizes.values()):
            raise ValueError("tensor_group_sizes must be positive")
        if not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise ValueError("smoothquant_alpha must be in [0, 1]")
        if self.zero_points and self.qformat not in (QFormat.INT4_WO, QFormat.INT4_AWQ):
            raise ValueError(f"zero_points applies to the int4 formats only, not {self.qformat.value}")


@dataclass(frozen=True)
class MoeConfig:
    """The sparse mixture-of-experts MLP of a model's sparse layers (Mixtral, Qwen3-MoE), as ``trtbuild::MoE`` runs
    it (plugins/moe/README.md): a float router ``[E, H]`` scores each token, softmax over all ``num_experts``, the
    ``top_k`` most probable experts are kept (their probabilities divided by their sum when ``renormalize``), and
    the token's output is the weighted sum of those experts' SwiGLU MLPs (each ``intermediate_size`` wide).

    Invariants (``__post_init__``): 1 <= top_k <= num_experts; ``sparse_layers`` ascending, without repeats."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert (transformers' moe_intermediate_size; Mixtral's intermediate_size)
    renormalize: bool  # Mixtral: always; Qwen3-MoE: norm_topk_prob
    sparse_layers: list[int]  # layers whose MLP is this block; the others keep the dense MLP (intermediate_size)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be between 1 and num_experts {self.num_experts}")
        if self.intermediate_size <= 0:
            raise ValueError("moe intermediate_size must be positive")
        if self.sparse_layers != sorted(set(self.sparse_layers)) or any(n < 0 for n in self.sparse_layers):
            raise ValueError(f"sparse_layers {self.sparse_layers} must be ascending layer numbers without repeats")


@dataclass(frozen=True)
class ModelConfig:
    """A converted checkpoint's architecture, written as ``config.json`` next to ``rank0.safetensors``.

    Invariants (checked in ``__post_init__``): num_heads % num_kv_heads == 0; RoPE models carry ``rope`` and
    learned-position models do not; rotary_dim is even and <= head_size; q/k norms are RMS norms;
    ``layer_types`` names every layer; ``sliding_window`` is set exactly when a layer slides; ``local_rope`` only
    on RoPE models with sliding layers; ``moe`` layers exist and are SwiGLU.
    """

    architecture: str  # the registry key of the source architecture, e.g. "LlamaForCausalLM"
    dtype: DType
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    max_position_embeddings: int
    norm: NormKind
    norm_eps: float
    mlp: MlpKind
    position: PositionKind
    rope: RopeConfig | None
    qkv_bias: bool
    attn_out_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    # Qwen3: an RMSNorm (``norm_eps``, weight of ``head_size``) on each query and key head after the qkv projection,
    # before rotary (``attn.q_norm`` / ``attn.k_norm``). Absent from checkpoints written before it (False).
    qk_norm: bool = False
    # Per layer: full or sliding-window attention (Mistral, Qwen2/3 and Phi-3 with a window; Gemma 3 interleaves
    # five sliding layers with one full one). Written by every converter; a checkpoint written before version 3
    # has none, which reads as every layer full.
    layer_types: list[AttentionKind] = field(default_factory=list)
    sliding_window: int | None = None  # positions a SLIDING layer attends to (its own included)
    # The rotary embedding of SLIDING layers where it differs from ``rope`` (Gemma 3: base 10,000 locally, 1e6 for
    # the full layers); None: every layer rotates by ``rope``.
    local_rope: RopeConfig | None = None
    # Softmax scale of attention; None: 1 / sqrt(head_size) (Gemma 3: query_pre_attn_scalar ** -0.5).
    attention_scale: float | None = None
    # Soft-capping ``cap * tanh(x / cap)`` of the attention scores (after scaling) and of the final logits (Gemma 2).
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Embedding rows are multiplied by this after the lookup (Gemma: sqrt(hidden_size), rounded to the model's
    # dtype); a tied LM head reads the unscaled table.
    embed_multiplier: float = 1.0
    # Gemma 2/3: a norm on the attention output and one on the MLP output before each residual add
    # (``attn.post_norm``, ``mlp.post_norm``), besides the usual pre-norms. RMS norms (Gemma's (1 + w) weights are
    # stored with the 1 added).
    sandwich_norms: bool = False
    # Sparse mixture-of-experts MLPs in ``moe.sparse_layers`` (Mixtral, Qwen3-MoE); None: every layer's MLP is dense
    # (every checkpoint written before version 4).
    moe: MoeConfig | None = None
    # Set by ``trtbuild quantize``: how the linear weights (and KV cache) of this checkpoint are quantized; the
    # tensors it implies are listed by ``trtbuild.checkpoint.layout``. None for a float checkpoint.
    quantization: QuantConfig | None = None
    format_version: int = CHECKPOINT_FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format_version not in READABLE_CHECKPOINT_VERSIONS:
            raise ValueError(f"checkpoint format {self.format_version} is not one of {READABLE_CHECKPOINT_VERSIONS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if (self.position is PositionKind.ROPE) != (self.rope is not None):
            raise ValueError("rope settings must be given exactly when position is 'rope'")
        if self.rope is not None and (self.rope.rotary_dim % 2 or self.rope.rotary_dim > self.head_size):
            raise ValueError(f"rotary_dim {self.rope.rotary_dim} must be even and <= head_size {self.head_size}")
        if self.qk_norm and self.norm is not NormKind.RMS:
            raise ValueError("qk_norm is an RMS norm: norm must be 'rms'")
        if not self.layer_types:  # a checkpoint written before layer kinds existed: every layer attends fully
            object.__setattr__(self, "layer_types", [AttentionKind.FULL] * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}")
        if (AttentionKind.SLIDING in self.layer_types) != (self.sliding_window is not None):
            raise ValueError("sliding_window must be given exactly when a layer is 'sliding'")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError("sliding_window must be positive")
        if self.local_rope is not None and (self.rope is None or self.sliding_window is None):
            raise ValueError("local_rope applies to RoPE models with sliding layers only")
        for name in ("attention_scale", "attn_softcap", "final_softcap"):
            if (value := getattr(self, name)) is not None and value <= 0:
                raise ValueError(f"{name} must be positive")
        if self.sandwich_norms and self.norm is not NormKind.RMS:
            raise ValueError("sandwich_norms are RMS norms: norm must be 'rms'")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_size", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.moe is not None and self.mlp is not MlpKind.SWIGLU:
            raise ValueError("mixture-of-experts layers are SwiGLU experts: mlp must be 'swiglu'")
        if self.moe is not None and any(n >= self.num_layers for n in self.moe.sparse_layers):
            raise ValueError(f"moe.sparse_layers {self.moe.sparse_layers} name layers past {self.num_layers}")

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the mixture of experts (``moe``) rather than the dense MLP."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def softmax_scale(self) -> float:
        """The attention softmax scale: ``attention_scale`` or 1 / sqrt(head_size)."""
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_size)

    def layer_rope(self, layer: int) -> RopeConfig | None:
        """The rotary embedding of ``layer``: ``local_rope`` for a sliding layer that has one, else ``rope``."""
        if self.local_rope is not None and self.layer_types[layer] is AttentionKind.SLIDING:
            return self.local_rope
        return self.rope

    def layer_window(self, layer: int) -> int | None:
        """Positions ``layer`` attends to, or None for the whole context."""
        return self.sliding_window if self.layer_types[layer] is AttentionKind.SLIDING else None

    @property
    def kv_window(self) -> int | None:
        """The window every layer slides over, or None when some layer attends fully: only then may the runner free
        a sequence's KV blocks that fall wholly before the window (a full layer still reads them)."""
        return self.sliding_window if AttentionKind.FULL not in self.layer_types else None

    @property
    def has_sliding_kv_group(self) -> bool:
        """Whether the model mixes sliding and full layers: its sliding layers then form a second KV-cache group,
        with their own block tables (``EngineIO.sliding_block_tables``) and their own number of cache blocks, from
        which the runner frees the blocks that fall wholly before a sequence's window (docs/runner.md, "KV-cache
        groups"); the full layers' group keeps every block of a sequence."""
        return self.sliding_window is not None and self.kv_window is None

    @property
    def kv_cache_dtype(self) -> KVCacheDType:
        return self.quantization.kv_cache_dtype if self.quantization else KVCacheDType.FLOAT32

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_size

    def save(self, directory: Path) -> None:
        write_json(directory / "config.json", to_dict(self))

    @classmethod
    def load(cls, directory: Path) -> ModelConfig:
        return from_dict(cls, read_json(directory / "config.json"), "config")


@dataclass(frozen=True)
class BuildConfig:
    """Options of ``trtbuild build`` (each field is a CLI flag of the same name)."""

    backend: Backend = field(default=Backend.ONNXRUNTIME, metadata={"help": "engine backend"})
    max_batch_size: int = field(default=64, metadata={"help": "most sequences in one step"})
    max_seq_len: int = field(
        default=2048, metadata={"help": "most positions per sequence (prompt + output); capped by the model's maximum"}
    )
    max_num_tokens: int = field(default=2048, metadata={"help": "most tokens in one step (prefill chunks + decodes)"})
    kv_block_size: int = field(default=16, metadata={"help": "token slots per KV-cache block"})
    opset: int = field(default=23, metadata={"help": "ONNX opset of the portable graph (>= 21)"})
    cpu_attention: CpuAttention = field(
        default=CpuAttention.NATIVE,
        metadata={
            "help": "onnxruntime engines: attention as one native kernel per layer (needs a C++ compiler, g++ or "
            "$CXX, at first use) or as standard ONNX ops"
        },
    )
    cpu_linear: CpuLinear = field(
        default=CpuLinear.NATIVE,
        metadata={
            "help": "onnxruntime engines: quantized linears on trtbuild's native AVX-512 VNNI / AVX2 kernel, AMX tiles "
            "for many rows (needs the same compiler; CPUs with neither fall back) or on onnxruntime's MatMulNBits / "
            "MatMulInteger"
        },
    )

    @property
    def uses_native_cpu_library(self) -> bool:
        """Whether an onnxruntime engine built so has nodes of trtbuild's native library (attention or linears)."""
        return self.cpu_attention is CpuAttention.NATIVE or self.cpu_linear is CpuLinear.NATIVE

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_seq_len", "max_num_tokens", "kv_block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.opset < 21:
            raise ValueError("opset must be >= 21")


class HardwareCompatibility(enum.Enum):
    """TensorRT hardware compatibility: ``NONE``: the build GPU only; ``AMPERE_PLUS``: every GPU from sm80."""

    NONE = "none"
    AMPERE_PLUS = "ampere+"


class PluginImpl(enum.Enum):
    """How the TensorRT engine runs the paged-attention plugin: embedded PTX (AOT), a Python callback (JIT), or AOT
    when the installed TensorRT supports it (AUTO)."""

    AUTO = "auto"
    AOT = "aot"
    JIT = "jit"


@dataclass(frozen=True)
class TensorRTConfig:
    """TensorRT-only options of ``trtbuild build --backend tensorrt`` (each field is a CLI flag)."""

    arch: list[str] = field(
        default_factory=lambda: ["native"],
        metadata={"help": "GPU architecture(s) to build for: native, sm80, sm86, sm89, sm90 (repeatable)"},
    )
    hardware_compatibility: HardwareCompatibility = field(
        default=HardwareCompatibility.NONE, metadata={"help": "ampere+: one engine for every GPU from sm80"}
    )
    version_compatible: bool = field(default=False, metadata={"help": "engine loadable by later TensorRT versions"})
    timing_cache: Path | None = field(default=None, metadata={"help": "timing cache file, read and updated"})
    builder_optimization_level: int | None = field(
        default=None, metadata={"help": "TensorRT builder optimization level 0-5 (TensorRT's default when unset)"}
    )
    plugin_impl: PluginImpl = field(default=PluginImpl.AUTO, metadata={"help": "paged-attention plugin implementation"})
    ptx_version: int | None = field(
        default=None,
        metadata={"help": "cap the AOT plugin's PTX ISA, e.g. 85 for 8.5 (default: what this machine's driver loads)"},
    )

    def __post_init__(self) -> None:
        if not self.arch:
            raise ValueError("arch: give at least one GPU architecture")
        if self.ptx_version is not None and not 60 <= self.ptx_version <= 99:
            raise ValueError("ptx_version must be a PTX ISA version as major * 10 + minor, e.g. 85 for 8.5")
        if self.builder_optimization_level is not None and not 0 <= self.builder_optimization_level <= 5:
            raise ValueError("builder_optimization_level must be between 0 and 5")


@dataclass(frozen=True)
class TorchConfig:
    """Options of ``trtbuild build --backend torch`` (each field is a CLI flag)."""

    device: TorchDevice = field(default=TorchDevice.CUDA, metadata={"help": "torch engine device (--backend torch)"})
    dtype: DType = field(default=DType.FLOAT32, metadata={"help": "torch engine compute dtype (--backend torch)"})
    torch_runtime: TorchRuntime = field(
        default=TorchRuntime.TORCH_COMPILE,
        metadata={
            "help": "torch-compile: weights + graph, torch.compile at load (any GPU, no GPU needed to build; "
            "SmolLM2 on 2 CPU cores: the first load compiles for ~50 s, later ones take ~14 s from the cache); "
            "aot-inductor: an AOTInductor package for this machine's GPU / CPU ISA, loaded in under a second (on "
            "the CPU the fastest torch form) (--backend torch)"
        },
    )
    max_autotune: bool = field(
        default=False,
        metadata={
            "help": "let Inductor time its GEMM templates against cuBLAS / MKL (Triton on a GPU, with weight-only "
            "formats' dequantization fused in; C++ micro-kernels on prepacked weights on the CPU): at build for "
            "aot-inductor, at every open for torch-compile; ~4 minutes more for SmolLM2 on 2 CPU cores, where the "
            "weights are frozen into one program, without aot-inductor's one-token decode program (--backend torch)"
        },
    )


@dataclass(frozen=True)
class EvalConfig:
    """Options of ``trtbuild eval``: perplexity over non-overlapping windows of a dataset's evaluation split.

    The default text (``flask_docs``: technical prose with code) is of another domain than the default calibration
    text (``lee_news``: news), because static activation ranges that fit the calibration text can fail on others.
    """

    dataset: str = field(
        default="flask_docs",
        metadata={
            "help": "dataset name (its evaluation split) or text/JSONL path; the default, technical prose with "
            "code, is of another domain than quantize's default calibration text (news)"
        },
    )
    windows: int = field(default=8, metadata={"help": "number of windows"})
    seq_len: int = field(default=512, metadata={"help": "tokens per window"})

    def __post_init__(self) -> None:
        if self.windows <= 0:
            raise ValueError("windows must be positive")
        if self.seq_len < 2:
            raise ValueError("seq_len must be at least 2")


@dataclass(frozen=True)
class PerplexityGate:
    """``trtbuild build --accuracy-gate REF_ENGINE_DIR --max-ppl-increase PCT``: the build fails, leaving no engine,
    when the new engine's perplexity is more than ``max_ppl_increase`` percent above the reference engine's."""

    ref_engine: Path
    max_ppl_increase: float  # percent: 1.0 allows perplexity up to 1.01 x the reference's
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.max_ppl_increase < 0:
            raise ValueError("max_ppl_increase must be >= 0")


@dataclass(frozen=True)
class EngineIO:
    """Tensor names of an engine's graph inputs/outputs (one KV cache pair per layer)."""

    input_ids: str = "input_ids"
    positions: str = "positions"
    block_tables: str = "block_tables"
    # The sliding layers' block tables, a graph input only when the model has both attention kinds
    # (``ModelConfig.has_sliding_kv_group``): int64 [num_seqs, max_sliding_blocks_per_seq], read by the sliding
    # layers' paged-attention nodes (input 4) in place of ``block_tables``; those layers' caches have
    # ``num_sliding_blocks`` blocks.
    sliding_block_tables: str = "sliding_block_tables"
    query_start_loc: str = "query_start_loc"
    logits_indices: str = "logits_indices"
    logits: str = "logits"
    key_cache: str = "key_cache.{layer}"
    value_cache: str = "value_cache.{layer}"
    # Outputs of the ONNX Runtime engine: this step's (rotated) keys/values, written into the cache by the runtime.
    new_keys: str = "new_keys.{layer}"
    new_values: str = "new_values.{layer}"


# Name prefix of every node the onnxruntime lowering of ``trtbuild::PagedAttention`` adds (its per-step metadata
# included); ``trtbuild bench --profile`` counts kernels under it as attention.
ORT_LOWERED_NODE_PREFIX = "ort/"


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything the runner needs to drive an engine, written as ``ENGINE_DIR/runtime_config.json``."""

    model: ModelConfig
    build: BuildConfig
    engine_file: str  # relative to ENGINE_DIR
    io: EngineIO = field(default_factory=EngineIO)
    format_version: int = ENGINE_FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format_version not in READABLE_ENGINE_VERSIONS:
            raise ValueError(f"engine format {self.format_version} is not one of {READABLE_ENGINE_VERSIONS}")

    def save(self, directory: Path) -> None:
        write_json(directory / "runtime_config.json", to_dict(self))

    @classmethod
    def load(cls, directory: Path) -> RuntimeConfig:
        return from_dict(cls, read_json(directory / "runtime_config.json"), "runtime_config")
