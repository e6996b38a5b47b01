"""The onnxruntime backend: the CPU engine ``engines/onnxruntime-cpu/model.onnx`` and its session.

- ``build/``: the build (``build_engine_dir``) and its graph rewrites, in order in ``build/passes.py``;
- ``session.py``: ``OrtSession``, the ``EngineSession`` that runs a step (``open_session``);
- ``huge_pages.py``: the session's weights on transparent huge pages (and the arena layout the build writes).

Engines with native ops load the native C++ kernel library, compiled at first use by ``trtbuild/kernels/library.py``.

The run-time modules import nothing from ``build/`` (``tests/test_layering.py``). Nothing is imported here, so
naming the package loads no onnxruntime; ``import onnxruntime`` in its modules is absolute, so it is the real
package, not this one.
"""
