"""The portable graph: a checkpoint's model as standard ONNX plus the paged-attention plugin (imports only config,
checkpoint and plugins)."""
