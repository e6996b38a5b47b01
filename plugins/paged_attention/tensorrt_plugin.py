"""TensorRT plugin for ``trtbuild::PagedAttention``, defined with TensorRT's Python plugin API (``tensorrt.plugin``).

Nothing here imports TensorRT until :func:`register` is called, so the package imports without it.

What :func:`register` declares (TensorRT >= 10.6; AOT needs a release whose ``tensorrt.plugin`` has ``aot_impl``):

- ``@trtp.register("trtbuild::PagedAttention")``: seven inputs in the README's order, ``cos_sin_cache`` always
  present (the TensorRT lowering feeds a dummy table and ``has_rope=0`` when the model has no RoPE, because a
  Python plugin has a fixed number of inputs); attributes ``num_heads``, ``num_kv_heads``, ``head_size``
  (int), ``scale`` (float), ``rotary_interleaved``, ``has_rope`` (int 0/1), ``sliding_window`` (int) and
  ``softcap`` (float). A plugin field cannot be absent, so for the op's two optional attributes the field holds 0
  where the attribute is absent (the TensorRT lowering writes it); :func:`op_attrs` turns 0 back into ``None``
  before anything else sees it. Outputs: ``output [T, Hq * D]`` with
  qkv's dtype, and the two caches as ``TensorDesc.aliased()`` of inputs 1 and 2: TensorRT hands the plugin the
  *same* buffer for the cache input and output, and the kernel writes the new K/V into it in place. Aliased plugin
  I/O is a TensorRT preview feature (``PreviewFeature.ALIASED_PLUGIN_IO_10_03``), enabled by the backend's builder.
- ``@trtp.autotune``: fp32 or fp16 activations and caches, int32 metadata (the lowering casts int64 to int32),
  fp32 cos/sin table, linear layout. bf16 is not declared.
- ``@trtp.impl`` (JIT: the engine calls back into Python): runs the two-kernel Triton form on TensorRT's stream
  through torch tensors that view TensorRT's buffers (as the torch backend does; the fused form spills registers
  and, at head size 256, needs more shared memory than a block may have: ``benchmarks/triton_registers.py``).
- ``@trtp.aot_impl`` (no Python at run time): compiles the fused single-launch Triton kernel (query tiles on tensor
  cores, no split-KV: TensorRT's AOT launch is one kernel) to PTX for the target arch and returns it with the launch
  grid ``(T // block_q + B, num_kv_heads)`` and the seven int32 scalars as symbolic shape expressions.
  The PTX keeps Triton's two trailing scratch-pointer parameters, which TensorRT's launcher leaves null; the kernel
  uses no scratch (``compile_ptx`` refuses otherwise).

Verified here (CPU only): the kernel's numerics in Triton's interpreter, and that ``compile_ptx`` produces PTX for
sm_80/sm_90 with the parameter order TensorRT's AOT launcher uses. NOT verified: anything that needs TensorRT or a
GPU — registration itself, the aliasing preview feature, the JIT and AOT launches, and whether TensorRT inserts a
copy for an aliased network input.
"""

from typing import Any

from .reference import PagedAttentionAttrs

PLUGIN_NAMESPACE = "trtbuild"
PLUGIN_NAME = "PagedAttention"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
# Version of this plugin's kernels and I/O contract, recorded in engine manifests: an engine only runs with the
# plugin version it was built with. Bump it when the kernel semantics or the plugin's inputs/attributes change.
PLUGIN_VERSION = "1.2.0"  # 1.2.0: sliding_window, softcap; 1.1.0: tensor-core query tiles, clamped metadata
# TensorRT's own creator version: tensorrt.plugin registers every creator as "1" (the ONNX node's plugin_version).
TENSORRT_CREATOR_VERSION = "1"
# Supported dtypes per I/O position: qkv, key_cache, value_cache, positions, block_tables, query_start_loc,
# cos_sin_cache, output, key_cache_out, value_cache_out ("A|B" pairs index-wise across positions: all-fp32 or fp16).
TYPE_COMBINATION = ", ".join(["FP32|FP16"] * 3 + ["INT32"] * 3 + ["FP32"] + ["FP32|FP16"] * 3)
ATTRIBUTES = (
    "num_heads", "num_kv_heads", "head_size", "scale", "rotary_interleaved", "has_rope", "sliding_window", "softcap"
)  # fmt: skip

_state: dict[str, Any] = {"registered": False, "aot": False, "aot_arch": None, "ptx_version": None, "ptx_isa": None}

_TRITON_TYPES = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16", "INT32": "i32", "INT64": "i64"}


def aot_available() -> bool:
    """Whether the installed TensorRT's ``tensorrt.plugin`` supports ahead-of-time (PTX) implementations."""
    import tensorrt.plugin as trtp

    return hasattr(trtp, "aot_impl")


def configure_aot(arch: int | None, ptx_version: int | None = None) -> None:
    """Set the arch (e.g. 80 for an ampere+ portable engine, 90 for H100) the AOT implementation compiles for.

    ``None`` means the build GPU's own arch. ``ptx_version`` (e.g. 85) caps the PTX ISA for older drivers.
    """
    _state["aot_arch"] = arch
    _state["ptx_version"] = ptx_version


def compiled_ptx_isa() -> str | None:
    """PTX ISA version (e.g. ``"8.5"``) of the last kernel the AOT implementation compiled; None before any."""
    return _state["ptx_isa"]


def register() -> bool:
    """Register the plugin with TensorRT (idempotent); returns whether the AOT implementation was registered too."""
    if _state["registered"]:
        return bool(_state["aot"])
    import tensorrt.plugin as trtp

    _register_definitions(trtp)
    _state["registered"] = True
    if aot_available():
        _register_aot(trtp)
        _state["aot"] = True
    return bool(_state["aot"])


def op_attrs(
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    rotary_interleaved: int,
    sliding_window: int,
    softcap: float,
) -> PagedAttentionAttrs:
    """The op's attributes from the plugin's fields (``sliding_window`` / ``softcap`` 0: the attribute is absent)."""
    return PagedAttentionAttrs(
        int(num_heads),
        int(num_kv_heads),
        int(head_size),
        float(scale),
        bool(rotary_interleaved),
        sliding_window=int(sliding_window) if sliding_window else None,
        softcap=float(softcap) if softcap else None,
    )


def _register_definitions(trtp: Any) -> None:
    desc, tensor = trtp.TensorDesc, trtp.Tensor

    @trtp.register(PLUGIN_ID)
    def _describe(
        qkv: desc,
        key_cache: desc,
        value_cache: desc,
        positions: desc,
        block_tables: desc,
        query_start_loc: desc,
        cos_sin_cache: desc,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        rotary_interleaved: int,
        has_rope: int,
        sliding_window: int,
        softcap: float,
    ) -> tuple[desc, desc, desc]:
        output = trtp.from_shape_expr((qkv.shape_expr[0], num_heads * head_size), dtype=qkv.dtype)
        return output, key_cache.aliased(), value_cache.aliased()

    @trtp.autotune(PLUGIN_ID)
    def _autotune(
        qkv: desc,
        key_cache: desc,
        value_cache: desc,
        positions: desc,
        block_tables: desc,
        query_start_loc: desc,
        cos_sin_cache: desc,
        outputs: tuple[desc, desc, desc],
    ) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(TYPE_COMBINATION)]

    @trtp.impl(PLUGIN_ID)
    def _run(
        qkv: tensor,
        key_cache: tensor,
        value_cache: tensor,
        positions: tensor,
        block_tables: tensor,
        query_start_loc: tensor,
        cos_sin_cache: tensor,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        rotary_interleaved: int,
        has_rope: int,
        sliding_window: int,
        softcap: float,
        outputs: tuple[tensor, tensor, tensor],
        stream: int,
    ) -> None:
        import torch

        from .triton_kernel import paged_attention_triton

        def view(x: Any) -> Any:
            return torch.as_tensor(x, device="cuda")

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            paged_attention_triton(
                view(qkv),
                view(outputs[1]),  # aliased: the same buffer as key_cache, written in place
                view(outputs[2]),
                view(positions),
                view(block_tables),
                view(query_start_loc),
                view(cos_sin_cache) if has_rope else None,
                op_attrs(num_heads, num_kv_heads, head_size, scale, rotary_interleaved, sliding_window, softcap),
                fused=False,  # the cache-write kernel, then attention (split for decode): no spills, fits head 256
                out=view(outputs[0]),
            )


def _register_aot(trtp: Any) -> None:
    desc = trtp.TensorDesc

    @trtp.aot_impl(PLUGIN_ID)
    def _compile(
        qkv: desc,
        key_cache: desc,
        value_cache: desc,
        positions: desc,
        block_tables: desc,
        query_start_loc: desc,
        cos_sin_cache: desc,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        rotary_interleaved: int,
        has_rope: int,
        sliding_window: int,
        softcap: float,
        outputs: tuple[desc, desc, desc],
        tactic: int,
    ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
        from .triton_kernel import compile_ptx

        kernel = compile_ptx(
            op_attrs(num_heads, num_kv_heads, head_size, scale, rotary_interleaved, sliding_window, softcap),
            has_rope=bool(has_rope),
            arch=_state["aot_arch"] or _local_arch(),
            float_type=_triton_type(qkv.dtype),
            index_type=_triton_type(positions.dtype),
            cos_sin_type=_triton_type(cos_sin_cache.dtype),
            ptx_version=_state["ptx_version"],
        )
        _state["ptx_isa"] = kernel.ptx_isa
        num_seqs = query_start_loc.shape_expr[0] - 1
        launch = trtp.KernelLaunchParams()
        launch.grid_x = qkv.shape_expr[0] // kernel.block_q + num_seqs  # query tiles (see triton_kernel)
        launch.grid_y = int(num_kv_heads)
        launch.block_x = kernel.num_threads
        launch.shared_mem = kernel.shared_mem
        # The kernel's int32 scalars, in order: num_tokens, num_seqs, max_blocks, num_blocks, block_size, rotary
        # dim, rotary table rows (the kernel clamps every metadata-derived index with them).
        scalars = (
            qkv.shape_expr[0],
            num_seqs,
            block_tables.shape_expr[1],
            key_cache.shape_expr[0],
            key_cache.shape_expr[1],
            cos_sin_cache.shape_expr[1] if has_rope else 0,
            cos_sin_cache.shape_expr[0] if has_rope else 1,
        )
        extra_args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in scalars])
        return kernel.name.encode(), kernel.ptx.encode(), launch, extra_args


def _triton_type(dtype: Any) -> str:
    name = str(dtype).rsplit(".", 1)[-1].upper()
    if name not in _TRITON_TYPES:
        raise ValueError(f"trtbuild::PagedAttention: unsupported tensor dtype {dtype}")
    return _TRITON_TYPES[name]


def _local_arch() -> int:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor
