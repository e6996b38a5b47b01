"""Stage ``trtbuild convert``: read a Hugging Face folder or GGUF file into a checkpoint (``trtbuild.checkpoint``)."""
