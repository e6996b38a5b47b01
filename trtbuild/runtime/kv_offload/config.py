"""``KVOffloadConfig``: which offload tiers an ``LLM`` keeps and how large they are; the source of the CLI flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...errors import ConfigError


@dataclass(frozen=True)
class KVOffloadConfig:
    """The KV offload tiers, off unless a size is given. Sizes are explicit: nothing is sized for you.

    Each field's ``flag`` is its ``trtbuild run/bench/serve`` flag (``trtbuild.cli.kv_offload``).
    """

    memory: int | None = field(
        default=None,
        metadata={"flag": "--kv-offload-memory", "help": "host-memory KV offload tier size (e.g. 4GiB) [default: off]"},
    )
    disk_dir: Path | None = field(
        default=None,
        metadata={
            "flag": "--kv-offload-dir",
            "help": "directory of the disk KV offload tier, shared by processes on the same engine (needs "
            "--kv-offload-disk) [default: off]",
        },
    )
    disk: int | None = field(
        default=None,
        metadata={"flag": "--kv-offload-disk", "help": "disk KV offload tier size cap (e.g. 20GiB), LRU"},
    )

    url: str | None = field(
        default=None,
        metadata={
            "flag": "--kv-offload-url",
            "help": "Redis / Valkey server of a remote KV offload tier shared by replicas, "
            "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] (or the password in $TRTBUILD_KV_OFFLOAD_REDIS_PASSWORD; "
            "rediss://...[?ssl_ca_certs=PEM&ssl_certfile=PEM&ssl_keyfile=PEM] over TLS; "
            "bound its memory with the server's maxmemory + allkeys-lru) [default: off]",
        },
    )

    def __post_init__(self) -> None:
        for name in ("memory", "disk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"kv_offload.{name} must be a positive number of bytes, got {value!r}")
        if (self.disk_dir is None) != (self.disk is None):
            raise ConfigError(
                "the disk KV offload tier needs both a directory (--kv-offload-dir) and a size cap (--kv-offload-disk)"
            )
        if self.disk_dir is not None:
            object.__setattr__(self, "disk_dir", Path(self.disk_dir))
        if self.url is not None:
            from .redis_tier import parse_redis_url

            parse_redis_url(self.url)

    @property
    def enabled(self) -> bool:
        return self.memory is not None or self.disk_dir is not None or self.url is not None
