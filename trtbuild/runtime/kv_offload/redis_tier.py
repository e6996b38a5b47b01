"""The remote tier: blocks in a Redis / Valkey server, so replicas on several machines share them.

Speaks the Redis protocol (RESP2: ``AUTH``, ``SELECT``, ``GET``, ``SET``, ``PING``) over a plain socket, one
connection per thread (the writer thread stores while the engine thread looks up): no client package. A password
comes from the URL (``redis://[USER]:PASSWORD@HOST``) or, kept out of the process list, from
``$TRTBUILD_KV_OFFLOAD_REDIS_PASSWORD``; messages show the URL with the password masked. ``rediss://`` connects
over TLS (``TlsOptions``: the server's certificate checked against the system's CAs or ``ssl_ca_certs``, its name
against the host; a client certificate for servers that ask for one), with redis-py's URL parameters. Keys are
``trtkv:<engine fingerprint>:<block hash hex>``; values are a disk file's bytes (header with the block hash, length
and crc32, then the payload), so a truncated or foreign value is a miss. The server bounds the memory: run it with
``maxmemory`` and ``maxmemory-policy allkeys-lru``. A server that stops answering turns lookups into misses and drops
stores (the next call reconnects).
"""

from __future__ import annotations

import enum
import os
import socket
import ssl
import threading
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np

from ...errors import ConfigError
from ..block_pool import BlockHash
from .tiers import TierStats, decode_block, encode_block

TIMEOUT_S = 5.0
PASSWORD_ENV = "TRTBUILD_KV_OFFLOAD_REDIS_PASSWORD"  # used when the URL carries no password


class CertReqs(enum.Enum):
    """``ssl_cert_reqs``: whether the server's certificate is checked (redis-py's values)."""

    REQUIRED = "required"  # checked against the CAs, and its name against the host (the default)
    NONE = "none"  # not checked: encrypted, but open to a man in the middle (a test server's self-signed one)


@dataclass(frozen=True)
class TlsOptions:
    """TLS of a ``rediss://`` URL, from its query (redis-py's names): ``ssl_ca_certs`` (a PEM file of the CAs to
    trust instead of the system's), ``ssl_certfile`` / ``ssl_keyfile`` (a client certificate), ``ssl_cert_reqs``."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cert_reqs: CertReqs = CertReqs.REQUIRED

    def context(self) -> ssl.SSLContext:
        """The client context (``OSError`` / ``ssl.SSLError`` for files it cannot read)."""
        context = ssl.create_default_context(cafile=self.ca_certs)
        if self.cert_reqs is CertReqs.NONE:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.certfile is not None:
            context.load_cert_chain(self.certfile, self.keyfile)
        return context


TLS_QUERY = {"ssl_ca_certs": "ca_certs", "ssl_certfile": "certfile", "ssl_keyfile": "keyfile"}


@dataclass(frozen=True)
class RedisAddress:
    """Where the server is and how to log in: ``username`` is None for the default user (``AUTH password``);
    ``tls`` None for a plain connection (``redis://``)."""

    host: str
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: TlsOptions | None = None


def masked(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@" + parts.netloc.rpartition("@")[2]).geturl()


def parse_redis_url(url: str) -> RedisAddress:
    """The address of ``redis[s]://[[USER]:PASSWORD@]HOST[:PORT][/DB][?TLS options]`` (password else
    ``$TRTBUILD_KV_OFFLOAD_REDIS_PASSWORD``; TLS options for ``rediss`` only: ``TlsOptions``); ``ConfigError``
    otherwise."""
    parts = urlsplit(url)
    try:
        port = parts.port or 6379
        db = int(parts.path.strip("/") or 0)
    except ValueError:
        port = db = -1
    tls = parts.scheme == "rediss"
    if parts.scheme not in ("redis", "rediss") or not parts.hostname or port < 0 or db < 0 or (parts.query and not tls):
        raise ConfigError(
            f"--kv-offload-url {masked(url)!r}: expected redis://HOST[:PORT][/DB] "
            "(redis://[USER]:PASSWORD@HOST... with a password, rediss://...[?ssl_ca_certs=PEM] over TLS)"
        )
    password = unquote(parts.password) if parts.password is not None else os.environ.get(PASSWORD_ENV) or None
    username = unquote(parts.username) if parts.username else None
    return RedisAddress(parts.hostname, port, db, username, password, _tls_options(url, parts.query) if tls else None)


def _tls_options(url: str, query: str) -> TlsOptions:
    files: dict[str, str] = {}
    cert_reqs = CertReqs.REQUIRED
    for name, given in parse_qs(query, keep_blank_values=True).items():
        if len(given) != 1 or not given[0]:
            raise ConfigError(f"--kv-offload-url {masked(url)!r}: {name} takes one value")
        if name == "ssl_cert_reqs":
            choices = [c.value for c in CertReqs]
            if given[0] not in choices:
                raise ConfigError(f"--kv-offload-url {masked(url)!r}: ssl_cert_reqs must be one of {choices}")
            cert_reqs = CertReqs(given[0])
        elif name in TLS_QUERY:
            files[TLS_QUERY[name]] = given[0]
        else:
            known = sorted([*TLS_QUERY, "ssl_cert_reqs"])
            raise ConfigError(f"--kv-offload-url {masked(url)!r}: unknown parameter {name!r} (known: {known})")
    return TlsOptions(files.get("ca_certs"), files.get("certfile"), files.get("keyfile"), cert_reqs)


class RedisError(Exception):
    """The server answered an error, or the connection broke."""


class RespConnection:
    """One connection speaking RESP2; ``call`` sends a command and returns its reply (bytes, int, None, list)."""

    def __init__(self, address: RedisAddress) -> None:
        sock = socket.create_connection((address.host, address.port), timeout=TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if address.tls is not None:
            try:
                sock = address.tls.context().wrap_socket(sock, server_hostname=address.host)
            except (OSError, ValueError):
                sock.close()
                raise
        self.sock = sock
        self.reader = self.sock.makefile("rb")
        if address.password is not None:
            user = [address.username.encode()] if address.username else []
            self.call(b"AUTH", *user, address.password.encode())
        if address.db:
            self.call(b"SELECT", str(address.db).encode())

    def call(self, *args: bytes | memoryview) -> object:
        chunks = [b"*%d\r\n" % len(args)]
        for arg in args:
            chunks += [b"$%d\r\n" % len(arg), arg, b"\r\n"]
        self.sock.sendall(b"".join(chunks))
        return self._reply()

    def _reply(self) -> object:
        line = self.reader.readline()
        if not line.endswith(b"\r\n"):
            raise RedisError("connection closed")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise RedisError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.reader.read(n + 2)
            if len(data) != n + 2:
                raise RedisError("connection closed")
            return data[:-2]
        if kind == b"*":
            return [self._reply() for _ in range(int(rest))]
        raise RedisError(f"unexpected reply {line[:20]!r}")

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


class RedisTier:
    """Blocks under ``trtkv:<fingerprint>:`` in the server at ``url`` (see the module docstring)."""

    def __init__(self, url: str, fingerprint: str) -> None:
        self.address = parse_redis_url(url)
        self.prefix = f"trtkv:{fingerprint}:".encode()
        self.stats = TierStats("redis")
        self._local = threading.local()
        self._lock = threading.Lock()  # the counters
        try:
            self._call(b"PING")
        except (OSError, RedisError) as e:
            raise ConfigError(f"--kv-offload-url {masked(url)}: cannot reach the server ({e})") from None

    def key(self, key: BlockHash) -> bytes:
        return self.prefix + key.hex().encode()

    def _call(self, *args: bytes | memoryview) -> object:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = RespConnection(self.address)
        try:
            return conn.call(*args)
        except (OSError, RedisError, ValueError):
            conn.close()
            self._local.conn = None
            raise

    def get(self, key: BlockHash, nbytes: int) -> np.ndarray | None:
        try:
            raw = self._call(b"GET", self.key(key))
        except (OSError, RedisError, ValueError):
            raw = None
        data = decode_block(raw, key, nbytes) if isinstance(raw, bytes) else None
        with self._lock:
            if data is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_loaded += nbytes
        return data

    def put(self, key: BlockHash, data: np.ndarray) -> None:
        payload = memoryview(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
        try:
            self._call(b"SET", self.key(key), encode_block(key, payload) + payload.tobytes())
        except (OSError, RedisError, ValueError):
            return
        with self._lock:
            self.stats.blocks_stored += 1
            self.stats.bytes_stored += payload.nbytes
