"""``ServeConfig``: the server's settings, the single source of the ``trtbuild serve`` flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass(frozen=True)
class ServeConfig:
    """How ``trtbuild serve`` listens and admits requests (the engine's own flags are ``LLM``'s)."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (0.0.0.0 exposes the server)"})
    port: int = field(default=8000, metadata={"help": "TCP port (0 = any free port)"})
    api_key: str | None = field(
        default=None, metadata={"help": "require 'Authorization: Bearer KEY' on /v1/* [env: TRTBUILD_API_KEY]"}
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model id in /v1/models and requests [default: the engine dir's name]"}
    )
    max_queue: int = field(
        default=256, metadata={"help": "waiting sequences beyond which new requests get HTTP 429 (Retry-After)"}
    )
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "larger request bodies get HTTP 413"})
    shutdown_grace: float = field(
        default=30.0, metadata={"help": "seconds running requests may finish after SIGINT/SIGTERM before abort"}
    )
    access_log: bool = field(
        default=True,
        metadata={"help": "one stderr line per request: client, method, path, status, seconds, prompt/output tokens"},
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        for name in ("max_queue", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.shutdown_grace < 0:
            raise ConfigError("--shutdown-grace must be >= 0")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key must not be empty")
