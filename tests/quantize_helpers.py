"""Helpers of the quantization tests: a tiny checkpoint with a character-level tokenizer and calibration text."""

from __future__ import annotations

from pathlib import Path

from tiny_models import make_hf_model

TEXT = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "Rain in the hills sent the river over its banks, and the town woke to water in the streets. "
    "Markets rose on Monday as traders bet that rates would fall before the end of the year. "
) * 6


def write_char_tokenizer(folder: Path, vocab_size: int) -> None:
    """A BPE tokenizer trained on ``TEXT`` with at most ``vocab_size`` tokens, saved as ``tokenizer.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["?"], show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(folder / "tokenizer.json"))


def tiny_checkpoint(root: Path, name: str = "llama_gqa") -> tuple[object, Path]:
    """(hf model, float checkpoint dir with tokenizer.json) for tiny config ``name``."""
    from trtbuild.config import DType
    from trtbuild.convert.convert import convert

    model = make_hf_model(name, root / f"{name}-hf")
    ckpt = root / f"{name}-ckpt"
    convert(root / f"{name}-hf", ckpt, DType.FLOAT32)
    write_char_tokenizer(ckpt, model.config.vocab_size)
    return model, ckpt


def calib_file(root: Path) -> Path:
    path = root / "calib.txt"
    path.write_text("\n\n".join([TEXT] * 4))
    return path
