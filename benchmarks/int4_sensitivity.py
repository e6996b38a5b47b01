"""How much int4 costs per linear kind of SmolLM2-135M: why int4 at group 128 cannot stay within a few percent.

    python benchmarks/int4_sensitivity.py [--group-size 128] [--windows 8] [--seq-len 512]

For each linear kind (q, k, v, o, gate, up, down) and for all of them together, modelopt's int4 round-to-nearest
(``INT4_BLOCKWISE_WEIGHT_ONLY_CFG`` at ``--group-size``, every other linear left in float) fake-quantizes the
transformers model rebuilt from the float32 checkpoint of the GGUF; the perplexity on the lee_news evaluation split
is compared with the float model's. Runs in torch (no engine build): about 15 s per row on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

KINDS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq

    from trtbuild.calibration_data import Split, load_documents, token_windows, tokenize_documents
    from trtbuild.checkpoint.files import load_checkpoint
    from trtbuild.config import DType
    from trtbuild.convert.convert import convert
    from trtbuild.demo import smollm2_gguf_path
    from trtbuild.quantize.hf_model import build_hf_model

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        convert(smollm2_gguf_path(), Path(tmp) / "ckpt", DType.FLOAT32, dequantize=True)
        cfg, weights = load_checkpoint(Path(tmp) / "ckpt")
        docs = load_documents("lee_news", Split.EVALUATION)
        ids = tokenize_documents(Path(tmp) / "ckpt" / "tokenizer.json", docs, args.windows * args.seq_len)
    windows = token_windows(ids, args.windows, args.seq_len)

    def perplexity(model: torch.nn.Module) -> float:
        nll = 0.0
        with torch.no_grad():
            for row in windows:
                logits = model(torch.from_numpy(np.ascontiguousarray(row))[None]).logits[0].double()
                nll += torch.nn.functional.cross_entropy(logits[:-1], torch.from_numpy(row[1:]), reduction="sum")
        return math.exp(float(nll) / (windows.shape[0] * (windows.shape[1] - 1)))

    base = perplexity(build_hf_model(cfg, weights))
    print(f"float32 perplexity {base:.3f}; int4 round to nearest, group {args.group_size}, one kind at a time:")
    for kinds in [[k] for k in KINDS] + [KINDS]:
        config = copy.deepcopy(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
        for entry in config["quant_cfg"]:
            block = (entry.get("cfg") or {}).get("block_sizes")
            if block is not None:
                block[-1] = args.group_size
        config["quant_cfg"].append({"quantizer_name": "*weight_quantizer", "enable": False})
        for kind in kinds:
            config["quant_cfg"].append({"quantizer_name": f"*{kind}.weight_quantizer", "enable": True})
        model = build_hf_model(cfg, weights)
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):  # modelopt prints its progress
            warnings.simplefilter("ignore")
            mtq.quantize(model, config, None)
        ppl = perplexity(model)
        label = "all seven" if len(kinds) > 1 else kinds[0]
        print(f"  {label:10s} perplexity {ppl:8.3f}  {100 * (ppl / base - 1):+6.2f}%", flush=True)


if __name__ == "__main__":
    main()
