"""``trtbuild serve ENGINE_DIR``: the engine as an OpenAI-compatible HTTP server (see docs/serve.md)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ..errors import ConfigError
from ..runtime.kv_offload.config import KVOffloadConfig
from ..serve.config import ServeConfig
from .kv_offload import kv_offload_options
from .options import config_from_options, dataclass_options
from .run import EngineFlags, engine_options, open_llm


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@dataclass_options(ServeConfig)
@engine_options
@kv_offload_options
def serve(
    engine_dir: Path,
    engine: EngineFlags,
    kv_offload: KVOffloadConfig | None,
    **options: object,
) -> None:
    """Serve ENGINE_DIR over HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    try:
        from ..serve.server import Server, bind
    except ImportError as e:
        raise ConfigError(f"trtbuild serve needs the 'serve' extra: pip install 'trtbuild[serve]' ({e})") from None

    if options.get("api_key") is None and os.environ.get("TRTBUILD_API_KEY"):
        options["api_key"] = os.environ["TRTBUILD_API_KEY"]
    config = config_from_options(ServeConfig, dict(options))
    llm = open_llm(engine_dir, engine, kv_offload=kv_offload)
    model_name = config.served_model_name or engine_dir.resolve().name
    try:
        sock = bind(config.host, config.port)
    except OSError as e:
        raise ConfigError(f"cannot listen on {config.host}:{config.port} ({e.strerror})") from None
    host, port = sock.getsockname()[:2]
    click.echo(f"serving '{model_name}' on http://{host}:{port}/v1 (Ctrl+C to stop)", err=True)
    Server(llm, config, model_name).run(sockets=[sock])
