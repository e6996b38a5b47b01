"""One peer measurement, run by ``vs_peers.py`` or ``quant_vs_llamacpp.py`` in the peers' virtualenv (never ours).

Reads one JSON request on stdin and prints one JSON line on stdout. Requests:

- ``{"task": "quantize_gguf", "src": PATH, "dst": PATH, "ftype": INT}``: llama.cpp's ``llama_model_quantize``
  (requantizing allowed, so a Q4_1 GGUF becomes F32 and an F32 one Q8_0 / Q4_0).
- ``{"task": "greedy" | "decode" | "batch", "system": "ort" | "llama", "model": PATH, "prompts": [[ids]],
  "new_tokens": N, "threads": T}``: load the model with T intra-op threads, warm up, then
  ``greedy`` returns the new token ids of prompt 0; ``decode`` times one prompt (TTFT = prompt evaluation and the
  first token; decode tok/s = the tokens after the first per second); ``batch`` times all prompts as one static
  batch (onnxruntime-genai only; equal-length prompts, so no padding) and returns output tok/s.
- ``{"task": "nll", "model": GGUF, "windows": [[ids]], "threads": T}``: llama.cpp's logits for every position of
  each window (one ``eval`` of the given token ids, no re-tokenization, no BOS added); returns ``nll_sums``, per
  window the summed negative log-likelihood (nats) of tokens 1.. scored from the logits one position earlier.

EOS is ignored: llama.cpp's loop never looks at it; onnxruntime-genai gets ``min_length = max_length`` (EOS masked).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


class OrtGenai:
    """onnxruntime-genai: a model folder from its model builder, its session limited to ``threads`` intra-op threads."""

    def __init__(self, model: str, threads: int) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(model)
        options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
        self.model = og.Model(config)

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, float, float]:
        """(new tokens per prompt, seconds to the first token, seconds after it, total seconds)."""
        og = self.og
        params = og.GeneratorParams(self.model)
        length = len(prompts[0]) + new_tokens
        params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=len(prompts))
        generator = og.Generator(self.model, params)
        start = time.perf_counter()
        generator.append_tokens(np.asarray(prompts, dtype=np.int32))
        generator.generate_next_token()
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            generator.generate_next_token()
        end = time.perf_counter()
        out = [list(map(int, generator.get_sequence(i)[len(prompts[0]) :])) for i in range(len(prompts))]
        return out, first - start, end - first, end - start


class LlamaCpp:
    """llama.cpp through llama-cpp-python's low-level eval (greedy argmax of the last logits, no sampler)."""

    def __init__(self, model: str, threads: int, context: int) -> None:
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=context, n_batch=context, verbose=False
        )

    def _argmax(self) -> int:
        ptr = self.llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).argmax())

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, float, float]:
        if len(prompts) != 1:
            raise ValueError("llama.cpp is measured at batch 1 only")
        llm = self.llm
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompts[0])
        out = [self._argmax()]
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([out[-1]])
            out.append(self._argmax())
        end = time.perf_counter()
        return [out], first - start, end - first, end - start


def quantize_gguf(src: str, dst: str, ftype: int) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return {"ok": True}


def window_nll(model: str, windows: list[list[int]], threads: int) -> dict:
    import llama_cpp

    n = max(map(len, windows))
    llm = llama_cpp.Llama(
        model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=n, n_batch=n, logits_all=True, verbose=False
    )
    sums = []
    for ids in windows:
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
        log_z = np.logaddexp.reduce(logits, axis=-1)
        sums.append(float(np.sum(log_z - logits[np.arange(len(ids) - 1), ids[1:]])))
    return {"nll_sums": sums}


def measure(req: dict) -> dict:
    prompts, new_tokens = req["prompts"], req["new_tokens"]
    if req["system"] == "ort":
        runner = OrtGenai(req["model"], req["threads"])
    else:
        runner = LlamaCpp(req["model"], req["threads"], len(prompts[0]) + new_tokens + 16)
    runner.run([prompts[0][:16]], 4)  # warm-up
    tokens, ttft, decode_s, total_s = runner.run(prompts, new_tokens)
    if req["task"] == "greedy":
        return {"tokens": tokens[0]}
    if req["task"] == "decode":
        return {"ttft_s": ttft, "decode_tok_s": (new_tokens - 1) / decode_s}
    return {"output_tok_s": len(prompts) * new_tokens / total_s}


def main() -> None:
    req = json.loads(sys.stdin.read())
    try:
        if req["task"] == "quantize_gguf":
            result = quantize_gguf(req["src"], req["dst"], req["ftype"])
        elif req["task"] == "nll":
            result = window_nll(req["model"], req["windows"], req["threads"])
        else:
            result = measure(req)
    except Exception as exc:  # reported to vs_peers.py as one error line
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
