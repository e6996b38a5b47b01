"""User-facing errors: the CLI prints ``error: <message>`` on one line and exits non-zero, without a traceback."""


class TrtbuildError(Exception):
    """A problem with the user's input or environment (not a bug in trtbuild)."""


class ConfigError(TrtbuildError):
    """A config, recipe or flag value is invalid; the message starts with the key path."""


class ConvertError(TrtbuildError):
    """A checkpoint cannot be converted (unsupported architecture, missing or unconsumed tensors, bad config)."""


class BuildError(TrtbuildError):
    """An engine cannot be built (bad checkpoint, missing backend, unsupported target)."""


class EngineError(TrtbuildError):
    """An engine directory cannot be loaded (missing, corrupt, or built for another target)."""


class RequestError(TrtbuildError):
    """A generation request is invalid (empty or too long prompt, bad sampling values)."""
