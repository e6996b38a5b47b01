"""The torch backend: the portable graph imported into a torch module, exported with ``torch.export`` and compiled
ahead of time by AOTInductor into ``engines/torch-<device>-<target>/model.pt2`` (see docs/gpu.md).

- ``build/``: the backend's build (``build_engine_dir``): ``writer`` (export, AOTInductor, the torch-compile
  files), ``isolate`` (the package's load check in a child process);
- ``session`` (``TorchSession``, ``open_session``) and what it runs with: ``runners`` (the step callable per
  ``TorchRuntime``), ``importer`` (ONNX -> torch module: a torch-compile engine is rebuilt from its graph when
  opened, so the build shares it), ``module_files`` (that engine's files), ``ops`` (the ``trtbuild::
  paged_attention`` custom op), ``target`` (which device and ISA), ``decode_graphs`` (CUDA graphs of decode
  steps), ``memory`` (the KV pool's default size), ``sampling`` (sampling on the device).

The session imports nothing from ``build/``. torch is imported only by these modules (``import torch`` in them is
absolute: the real package).
"""
