"""trtbuild's native kernels: their C++ sources and ``library.py``, which compiles them.

``cpu/`` is the C++ of the onnxruntime custom-op library (domain ``trtbuild.cpu``), one file per op with its
instruction-set variants in headers and the onnxruntime glue apart: ``paged_attention.cc``, ``linear.cc``
(``QLinear``), ``row_ops.cc`` (``QuantizeRows``, ``RescaleRows``), ``swiglu.cc``, ``moe.cc``, ``ort_ops.cc``, and
``c_api.cc`` (the attention kernel as a plain C function, for the torch engine's CPU op). ``library.py``
compiles it for the machine at first use and finds it for both runtimes (imports only the standard library and
``trtbuild.errors``). The ops' contracts and
reference implementations live with their plugins (``plugins/paged_attention/``) and graph rewrites
(``backends/onnxruntime/build/``).
"""
