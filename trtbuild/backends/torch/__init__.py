"""The torch backend: the portable graph imported into a torch module, exported with ``torch.export`` and compiled
ahead of time by AOTInductor into ``engines/torch-<device>-<target>/model.pt2`` (see docs/gpu.md).

``importer`` (ONNX -> torch module), ``ops`` (the ``trtbuild::paged_attention`` custom op), ``writer`` (export,
AOTInductor, manifest) and ``session`` (``TorchSession``). torch is imported only by these modules.
"""
