"""Running the app under uvicorn, with a graceful shutdown on SIGINT/SIGTERM that exits 0.

On the first signal the server stops admitting (new requests get 503, the listening socket closes), lets running
requests finish for ``shutdown_grace`` seconds, then cancels the rest (their sequences are aborted) and stops the
engine thread. A second SIGINT forces the exit.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import socket
import threading
from collections.abc import Generator
from types import FrameType

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from ..runtime.llm import LLM
from .app import ACCESS_LOGGER, build_app
from .config import ServeConfig

# uvicorn's own logging, plus trtbuild's access log through uvicorn's stderr handler ("INFO:     ..."); uvicorn's
# access log (stdout, without times or tokens) stays off.
LOG_CONFIG = copy.deepcopy(LOGGING_CONFIG)
LOG_CONFIG["loggers"][ACCESS_LOGGER] = {"handlers": ["default"], "level": "INFO", "propagate": False}


class Server(uvicorn.Server):
    """uvicorn's server, told to stop admitting on the first signal and not to re-raise it after the shutdown."""

    def __init__(self, llm: LLM, config: ServeConfig, model_name: str) -> None:
        self.app = build_app(llm, config, model_name)
        super().__init__(
            uvicorn.Config(
                self.app,
                host=config.host,
                port=config.port,
                timeout_graceful_shutdown=config.shutdown_grace,
                access_log=False,
                log_config=LOG_CONFIG,
                log_level="info",
            )
        )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.app.state.server.engine.stop_admitting()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one; read it from ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
