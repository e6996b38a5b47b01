"""trtbuild: Hugging Face / GGUF checkpoint -> portable ONNX graph with paged-attention plugin ops -> engines."""

__version__ = "0.1.0"
