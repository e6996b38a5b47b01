"""The trtbuild checkpoint: the on-disk contract between ``convert`` / ``quantize`` and ``build``.

A checkpoint is a directory of
- ``config.json``: a ``ModelConfig`` (``config.py``; its ``format_version`` is ``CHECKPOINT_FORMAT_VERSION``, and
  loading refuses one not in ``READABLE_CHECKPOINT_VERSIONS``), with a ``quantization`` block (``QuantConfig``)
  when the checkpoint is quantized;
- ``rank0.safetensors`` (``files.WEIGHTS_FILE``): every tensor under its canonical name (``layout.py``);
- the tokenizer files its source had (``files.TOKENIZER_FILES``), passed along by every stage.

Canonical names and shapes (``layout.expected_tensors``): ``embed.weight``, ``layers.{i}.input_norm.weight``,
``layers.{i}.attn.qkv.weight`` (q | k | v rows), ``layers.{i}.attn.out.weight``, ``layers.{i}.mlp.gate_up.weight``
(gate | up rows) or ``mlp.up.weight``, ``layers.{i}.mlp.down.weight``, ``final_norm.weight``, ``lm_head.weight``
(absent when tied), with biases and optional norms as the config says; linear weights are ``[out, in]``. Float
tensors are stored in ``ModelConfig.dtype`` (``dtypes.torch_dtype``). Exactly the expected tensors: readers refuse
a missing, extra or misshapen one.

A quantized checkpoint (``layout.expected_quantized_tensors``) replaces each quantized linear's float weight with the
tensors of its format (``formats.py``: int8 / fp8 / packed int4 codes, scales, zero points or offsets, input and
pre-quant scales) and adds per-layer KV-cache scales; ``graph.py`` says how those tensors become Q/DQ nodes of the
portable graph.

Who writes: ``trtbuild convert`` (``convert/``, from Hugging Face folders and GGUF files) and ``trtbuild quantize``
(``quantize/``), both through ``files.save_checkpoint``. Who reads: ``quantize`` (``files.load_checkpoint``, float
only) and every backend's build (``files.load_any_checkpoint``), which hands the tensors to ``trtbuild.graph``.
This package imports only ``config``, ``errors`` and ``artifacts`` of trtbuild (and torch lazily, for safetensors).
"""
