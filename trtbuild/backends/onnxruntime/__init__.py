"""The onnxruntime backend: the CPU engine ``engines/onnxruntime-cpu/model.onnx`` and its session.

- ``lowering.py``: each paged-attention plugin node as ~20 standard ONNX ops (``CpuAttention.LOWERED``);
- ``native.py``: or as one node of the native C++ kernel library, compiled at first use (``CpuAttention.NATIVE``);
- ``weights.py``: quantized linears restated for onnxruntime's kernels (``MatMulNBits``, ``MatMulInteger``);
- ``build.py``: the backend's build function (``trtbuild.backends.BACKENDS``);
- ``session.py``: ``OrtSession``, the ``EngineSession`` that runs a step.

Nothing is imported here, so naming the package loads no onnxruntime; ``import onnxruntime`` in its modules is
absolute, so it is the real package, not this one.
"""
