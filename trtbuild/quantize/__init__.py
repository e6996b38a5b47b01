"""Stage ``trtbuild quantize``: a checkpoint -> a quantized checkpoint (modelopt calibration, canonical names).

- ``hf_model.py``: rebuild the transformers model from a checkpoint (the model modelopt calibrates);
- ``calibrate.py``: modelopt ``mtq.quantize`` with the format's config, fused-group unification, KV-cache ranges;
- ``formats.py``: one handler per ``QFormat``: the quantized tensors offline, and the graph that uses them;
- ``layout.py``: which tensors a quantized checkpoint holds; loading one for ``build``;
- ``quantize.py``: the stage.
"""
