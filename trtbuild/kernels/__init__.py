"""trtbuild's native kernels, as sources: no Python here.

``cpu/`` is the C++ of the onnxruntime custom-op library (domain ``trtbuild.cpu``), one file per op with its
instruction-set variants in headers and the onnxruntime glue apart: ``paged_attention.cc``, ``linear.cc``
(``QLinear``), ``row_ops.cc`` (``QuantizeRows``, ``RescaleRows``), ``swiglu.cc`` and ``ort_ops.cc``. The runtime
compiles it for the machine at first use (``backends/onnxruntime/kernel_library.py``). The ops' contracts and
reference implementations live with their plugins (``plugins/paged_attention/``) and graph rewrites
(``backends/onnxruntime/build/``).
"""
