"""The torch backend: the portable graph imported into a torch module, exported with ``torch.export`` and compiled
ahead of time by AOTInductor into ``engines/torch-<device>-<target>/model.pt2`` (see docs/gpu.md).

``importer`` (ONNX -> torch module), ``ops`` (the ``trtbuild::paged_attention`` custom op), ``writer`` (export,
AOTInductor, manifest), ``target`` (which device and ISA), ``decode_graphs`` (CUDA graphs of decode steps),
``build`` (the backend's build function) and ``session`` (``TorchSession``). torch is imported only by these
modules (``import torch`` in them is absolute: the real package).
"""
