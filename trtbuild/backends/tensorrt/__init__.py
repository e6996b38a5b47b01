"""The TensorRT backend: one serialized engine per GPU arch (``engines/tensorrt-sm{XY}/engine.plan``), and its session.

- ``lowering.py``: each paged-attention plugin node as one node of the TensorRT Python plugin (pure onnx);
- ``engines.py``: the lowered graph -> TensorRT engines, one per requested arch;
- ``ptx.py``: the PTX ISA the local driver loads and the plugin's AOT kernel is capped at;
- ``build.py``: the backend's build function (``trtbuild.backends.BACKENDS``);
- ``session.py``: ``TensorRTSession``, the ``EngineSession`` that runs a step on the GPU.

TensorRT itself is not importable everywhere (an optional extra): nothing here imports it, and the modules above
import it only inside the functions that need it. ``import tensorrt`` in them is absolute: the real package.
"""
