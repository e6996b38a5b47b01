"""The TensorRT backend: one serialized engine per GPU arch (``engines/tensorrt-sm{XY}/engine.plan``), and its session.

- ``build/``: the backend's build (``build_engine_dir``): ``lowering.py``, each paged-attention plugin node as one
  node of the TensorRT Python plugin (pure onnx); ``engines.py``, the lowered graph -> TensorRT engines, one per
  requested arch (the plugin's PTX ISA capped as ``artifacts/ptx.py`` says);
- ``session.py``: ``TensorRTSession``, the ``EngineSession`` that runs a step on the GPU (``open_session``); it
  picks the engine that runs here with ``artifacts/engine_select.py`` and imports nothing from ``build/``.

TensorRT itself is not importable everywhere (an optional extra): nothing here imports it, and the modules above
import it only inside the functions that need it. ``import tensorrt`` in them is absolute: the real package.
"""
