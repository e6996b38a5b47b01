"""trtbuild: Hugging Face / GGUF checkpoint -> portable ONNX graph with paged-attention plugin ops -> engines."""

__version__ = "0.1.0"

# The runner API, imported on first use so that `import trtbuild` stays light.
_LAZY = {"LLM", "SamplingParams", "RequestOutput", "KVOffloadConfig"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from .runtime import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'trtbuild' has no attribute {name!r}")
