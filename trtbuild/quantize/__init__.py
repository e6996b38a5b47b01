"""Stage ``trtbuild quantize``: a checkpoint -> a quantized checkpoint (modelopt calibration, canonical names).

The quantized checkpoint's contract (formats, tensors, loading) is ``trtbuild.checkpoint``'s; this package makes one:
- ``hf_config.py``, ``hf_model.py``: rebuild the transformers model from a checkpoint (the model modelopt
  calibrates): its ``config.json``, then its state dict; ``hf_moe.py`` adds the mixture-of-experts families'
  routers and experts;
- ``calibrate.py``: modelopt ``mtq.quantize`` with the format's config, fused-group unification, KV-cache ranges;
- ``int4.py``, ``awq.py``, ``fp8.py``: trtbuild's own int4 quantization, AWQ search and fp8 rowwise scale search;
- ``export.py``: the calibrated model -> the quantized checkpoint's tensors;
- ``moe.py``, ``moe_kv.py``: a mixture-of-experts checkpoint's int8 / int4 weights by round to nearest (or its
  int8_sq experts from modelopt's calibration), and its KV-cache scales by modelopt on the model rebuilt from them;
- ``quantize.py``: the stage.
"""
