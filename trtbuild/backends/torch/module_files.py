"""The torch-compile runtime's engine files: the portable graph's structure and the imported module's weights.

``engines/torch-compile-<device>/graph.onnx`` is the portable graph without its weights (nodes, inputs, outputs,
the int64 constants: a few hundred KB) and ``weights.safetensors`` holds every other initializer exactly as the
importer makes it (``importer.import_weights``: float weights in the engine's dtype, quantized ones in their integer
or float8 storage). Opening the engine reads both straight onto the device and builds the ``PortableModule``;
nothing here depends on the GPU architecture or the torch version that wrote it.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from safetensors.torch import load_file, save_file

from ...config import EngineIO
from ...errors import EngineError
from .importer import PortableModule, graph_structure, import_weights
from .row_products import RowProducts

GRAPH_FILE = "graph.onnx"
WEIGHTS_FILE = "weights.safetensors"


def write_module_files(portable: onnx.ModelProto, dtype: torch.dtype, directory: Path) -> Path:
    """Write ``graph.onnx`` and ``weights.safetensors`` of ``portable`` into ``directory``; returns the graph's path.

    The import runs here once (``PortableModule`` checks every op), so an engine that builds also opens."""
    weights = import_weights(portable, dtype)
    structure = graph_structure(portable)
    directory.mkdir(parents=True)
    onnx.save(structure, str(directory / GRAPH_FILE))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / WEIGHTS_FILE))
    return directory / GRAPH_FILE


def load_module(
    graph_path: Path,
    io: EngineIO,
    dtype: torch.dtype,
    device: torch.device,
    *,
    row_products: RowProducts = RowProducts.NONE,
) -> PortableModule:
    """The engine's ``PortableModule`` with its weights on ``device`` (read there directly, no host copy kept);
    ``row_products`` as ``PortableModule``'s."""
    try:
        structure = onnx.load(str(graph_path), load_external_data=False)
        weights = load_file(str(graph_path.parent / WEIGHTS_FILE), device=str(device))
    except Exception as e:
        raise EngineError(f"{graph_path.parent}: cannot read the torch engine's graph and weights ({e})") from None
    return PortableModule(structure, io, dtype, weights, row_products=row_products).eval()
