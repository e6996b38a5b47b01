"""How much device memory a torch engine's KV pool takes when the user names no size (vLLM's memory fraction).

On a GPU the pool is sized after the package has loaded (its weights are resident): ``KV_FREE_FRACTION`` of the
memory left free, minus what one step of the engine's largest shapes needs for activations and the sampler
(``step_reserve``). On the CPU the default is ``runtime.kv_cache.DEFAULT_KV_CACHE_MEMORY`` (torch zero-fills its
pool, so a large default would take its pages at once).
"""

from __future__ import annotations

from ...config import BuildConfig, ModelConfig
from ...errors import EngineError
from ...runtime.prompt_logprobs import HOST_COPY_ROWS

KV_FREE_FRACTION = 0.9  # of the device memory free after loading; the rest is headroom for other allocations
CUDA_GRAPH_POOLS = 512 * 2**20  # the captured decode steps' memory pool (one for every padded batch size), bounded


def step_reserve(model: ModelConfig, build: BuildConfig, elem_size: int) -> int:
    """Bytes one step of ``max_num_tokens`` tokens can hold at once.

    Activations: a token's widest live tensors are the MLP's (gate|up then the product: 3 x intermediate) next to
    the residual stream and the attention's q|k|v and output (~6 x hidden), doubled for the allocator's slack.
    Logits, the larger of: ``max_batch_size`` sampled rows in float32 plus the device sampler's sort (values and
    int64 indices) and cumulative sum (~6 copies); or a prompt-logprobs step's row for every token (in the compute
    dtype) plus the float32 copy of ``HOST_COPY_ROWS`` of them on their way to the host.
    """
    per_token = (3 * model.intermediate_size + 6 * model.hidden_size) * elem_size * 2
    sampled = build.max_batch_size * model.vocab_size * 4 * 6
    prompt = (build.max_num_tokens * elem_size + HOST_COPY_ROWS * 4) * model.vocab_size
    return build.max_num_tokens * per_token + max(sampled, prompt) + CUDA_GRAPH_POOLS


def default_kv_cache_memory(free_bytes: int, model: ModelConfig, build: BuildConfig, elem_size: int) -> int:
    """The KV pool's size on a GPU with ``free_bytes`` free after loading: ``KV_FREE_FRACTION`` of it less a step.

    ``EngineError`` (one line, with the figures) when nothing is left for the pool: the machine's state, not a value
    the caller gave (``LLM`` words a ``ValueError`` from opening a session as its ``kv_cache_memory`` too small).
    """
    reserve = step_reserve(model, build, elem_size)
    budget = int(KV_FREE_FRACTION * free_bytes) - reserve
    if budget <= 0:
        raise EngineError(
            f"the GPU has {free_bytes / 2**30:.2f} GiB free after loading the engine and one step may need "
            f"{reserve / 2**30:.2f} GiB: no room for a KV cache (lower "
            "max_num_tokens / max_batch_size at build time, or free the GPU)"
        )
    return budget
