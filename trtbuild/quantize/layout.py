from ..checkpoint.files import load_any_checkpoint  # noqa: F401  TEMPORARY(issue 40): backends switch to trtbuild.checkpoint.files.load_any_checkpoint
