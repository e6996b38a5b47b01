"""The KV offload tier (``trtbuild/runtime/kv_offload/``): round trips, reload after eviction, bad files, sharing."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_run_cli import assert_one_error_line, cli
from test_serve import start_serve

from trtbuild.config import KVCacheDType, QFormat, QuantConfig, RuntimeConfig
from trtbuild.errors import ConfigError
from trtbuild.runtime.kv_cache import PagedKVCache, bytes_per_block
from trtbuild.runtime.kv_offload import KVOffloadConfig, KVOffloader
from trtbuild.runtime.kv_offload.offloader import engine_fingerprint
from trtbuild.runtime.kv_offload.redis_tier import (
    PASSWORD_ENV,
    CertReqs,
    RedisAddress,
    RespConnection,
    TlsOptions,
    parse_redis_url,
)
from trtbuild.runtime.kv_offload.tiers import HEADER, DiskTier, MemoryTier
from trtbuild.runtime.llm import LLM, SamplingParams
from trtbuild.serve.metrics import kv_offload_lines

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
POOL_BLOCKS = 20  # usable blocks: one 60-token prompt (15 full blocks) fits, three do not stay


@pytest.fixture(scope="module")
def engine(tiny_engines):
    return tiny_engines["llama_gqa"][2]


@pytest.fixture(scope="module")
def block_bytes(engine):
    config = RuntimeConfig.load(engine)
    return bytes_per_block(config.model, config.build.kv_block_size)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 97, 60).tolist() for _ in range(3)]


def chat_rounds(llm: LLM, rounds: int = 2) -> list[list[int]]:
    """Each prompt in turn, ``rounds`` times (the pool forgets the first before it comes back)."""
    out = []
    for _ in range(rounds):
        for p in prompts():
            out.append(llm.generate([p], GREEDY)[0].outputs[0].token_ids)
            if llm.offloader is not None:
                llm.offloader.flush()
    return out


def small_llm(engine, block_bytes, kv_offload=None) -> LLM:
    return LLM(engine, kv_cache_memory=(POOL_BLOCKS + 1) * block_bytes, kv_offload=kv_offload)


@pytest.mark.parametrize("tier", ["memory", "disk", "both"])
def test_eviction_then_reload_gives_the_same_tokens_and_computes_less(engine, block_bytes, tmp_path, tier):
    base = small_llm(engine, block_bytes)
    expected = chat_rounds(base)
    assert base.stats.prefix_cache_hits == 0  # the pool alone keeps nothing across the rounds
    config = KVOffloadConfig(
        memory=1 << 20 if tier != "disk" else None,
        disk_dir=tmp_path if tier != "memory" else None,
        disk=1 << 20 if tier != "memory" else None,
    )
    llm = small_llm(engine, block_bytes, config)
    assert chat_rounds(llm) == expected
    stats = llm.stats
    assert stats.kv_offload_loaded_blocks == 3 * 14  # round 2: every full block but the one the last token is in
    assert stats.prefix_cache_hits == 3 * 14 * 4
    assert stats.num_computed_tokens == base.stats.num_computed_tokens - 3 * 14 * 4
    by_name = {t.name: t for t in stats.kv_offload}
    top = by_name["memory" if tier != "disk" else "disk"]
    assert top.hits == 3 * 14 and top.bytes_loaded == 3 * 14 * block_bytes
    assert all(t.blocks_stored == 3 * 16 for t in stats.kv_offload)  # 67 computed tokens: 16 full blocks a prompt


@pytest.mark.parametrize("kv", [KVCacheDType.FLOAT32, KVCacheDType.INT8, KVCacheDType.FP8])
def test_store_and_load_round_trip_is_bit_exact(engine, tmp_path, kv):
    """A block's bytes stored by one offloader come back identical through a fresh memory-less one (disk only)."""
    model = RuntimeConfig.load(engine).model
    if kv is not KVCacheDType.FLOAT32:
        model = replace(model, quantization=QuantConfig(qformat=QFormat.INT8_WO, kv_cache_dtype=kv))
    rng = np.random.default_rng(1)
    caches = [PagedKVCache(model, 8, 4) for _ in range(2)]
    for arr in (caches[0].keys, caches[0].values):
        arr.view(np.uint8)[...] = rng.integers(0, 256, arr.nbytes, dtype=np.uint8).reshape(arr.view(np.uint8).shape)
    config = KVOffloadConfig(disk_dir=tmp_path, disk=1 << 20)
    keys = [bytes([i]) * 32 for i in range(1, 8)]
    writer = KVOffloader(config, caches[0], "fp")
    for b, key in enumerate(keys, start=1):
        writer.store(b, key)
    writer.close()
    reader = KVOffloader(config, caches[1], "fp")
    for b, key in enumerate(keys, start=1):
        data = reader.lookup(key, caches[1].block_nbytes)
        assert data is not None
        caches[1].write_block(b, data)
    assert caches[1].keys.dtype == caches[0].keys.dtype
    for name in ("keys", "values"):  # blocks 1..7 (block 0 is the null block, never stored)
        assert getattr(caches[1], name)[:, 1:].tobytes() == getattr(caches[0], name)[:, 1:].tobytes()
    assert not caches[1].keys[:, 0].any()
    assert reader.disk.stats.hits == 7 and reader.disk.stats.bytes_loaded == 7 * caches[0].block_nbytes


def test_pool_blocks_and_disk_files_hold_the_same_bytes(engine, block_bytes, tmp_path):
    llm = small_llm(engine, block_bytes, KVOffloadConfig(disk_dir=tmp_path, disk=1 << 20))
    llm.generate([prompts()[0]], GREEDY)
    llm.offloader.flush()
    disk, cache = llm.offloader.disk, llm.offloader.cache
    cached = llm.scheduler.kv_cache.pool.cached
    assert len(cached) == 16
    for key, block in cached.items():
        assert disk.get(key, cache.block_nbytes).tobytes() == cache.read_block(block.block_id).tobytes()


def test_corrupt_or_truncated_files_are_misses(engine, block_bytes, tmp_path):
    expected = chat_rounds(small_llm(engine, block_bytes))
    config = KVOffloadConfig(disk_dir=tmp_path, disk=1 << 20)
    writer = small_llm(engine, block_bytes, config)
    chat_rounds(writer, rounds=1)
    writer.offloader.close()
    files = sorted(writer.offloader.disk.dir.glob("*.kv"))
    assert len(files) == 3 * 16
    damaged = files[::2]
    for i, path in enumerate(damaged):
        raw = bytearray(path.read_bytes())
        if i % 3 == 0:
            raw[HEADER.size + 5] ^= 0x40  # one payload bit
        elif i % 3 == 1:
            del raw[-7:]  # truncated
        else:
            raw[8] ^= 1  # the header's block hash
        path.write_bytes(bytes(raw))
    tier = DiskTier(tmp_path, writer.offloader.fingerprint, 1 << 20)
    for path in damaged:
        assert tier.get(bytes.fromhex(path.stem), block_bytes) is None
        assert not path.exists()  # removed, to be written afresh
    assert tier.stats.misses == len(damaged) and tier.stats.hits == 0
    # The damaged prefixes are recomputed, the others loaded: the tokens are those of a run without the tier.
    reader = small_llm(engine, block_bytes, config)
    assert chat_rounds(reader) == expected


CHILD = """
import sys
from trtbuild.runtime.kv_offload import KVOffloadConfig
from trtbuild.runtime.llm import LLM, SamplingParams
engine, directory, memory, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), eval(sys.argv[4])
llm = LLM(engine, kv_cache_memory=memory, kv_offload=KVOffloadConfig(disk_dir=directory, disk=1 << 20))
print(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids)
"""


def test_two_processes_share_the_disk_tier(engine, block_bytes, tmp_path):
    """A process writes the blocks and exits (its writer drains at exit); this one loads them instead of computing."""
    prompt = prompts()[1]
    memory = (POOL_BLOCKS + 1) * block_bytes
    args = [sys.executable, "-c", CHILD, str(engine), str(tmp_path), str(memory), repr(prompt)]
    child = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
    llm = small_llm(engine, block_bytes, KVOffloadConfig(disk_dir=tmp_path, disk=1 << 20))
    tokens = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert child.stdout.strip() == str(tokens)
    assert llm.stats.kv_offload_loaded_blocks == 14
    assert llm.stats.num_computed_tokens == 60 - 14 * 4 + 7


def test_two_llms_on_one_disk_tier_and_another_engine_never_mixes(engine, tiny_engines, block_bytes, tmp_path):
    config = KVOffloadConfig(disk_dir=tmp_path, disk=1 << 20)
    first = small_llm(engine, block_bytes, config)
    expected = first.generate([prompts()[2]], GREEDY)[0].outputs[0].token_ids
    first.offloader.flush()
    second = small_llm(engine, block_bytes, config)
    assert second.generate([prompts()[2]], GREEDY)[0].outputs[0].token_ids == expected
    assert second.stats.kv_offload_loaded_blocks == 14
    other = next(e for name, (_, _, e) in tiny_engines.items() if name != "llama_gqa")
    assert engine_fingerprint(other) != engine_fingerprint(engine)
    third = LLM(other, kv_offload=config)
    assert third.offloader.disk.dir != second.offloader.disk.dir
    third.generate([[t % third.vocab_size for t in prompts()[2]]], GREEDY)
    assert third.stats.kv_offload_loaded_blocks == 0


KILLED_WRITER = """
import sys
import numpy as np
from trtbuild.runtime.kv_offload.tiers import DiskTier
tier = DiskTier(sys.argv[1], "fp", 1 << 40)
data = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8)
for i in range(1, 10**6):
    tier.put(i.to_bytes(32, "big"), data)
    print(i, flush=True)
"""


def test_a_killed_writer_leaves_no_partial_file_visible(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "1"  # one file written; the next ones are being written
        time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    tier = DiskTier(tmp_path, "fp", 1 << 40)
    visible = sorted(tier.dir.glob("*.kv"))
    assert visible
    for path in visible:  # every visible file is whole
        assert tier.get(bytes.fromhex(path.stem), 32 << 20) is not None
    assert tier.stats.misses == 0
    # A temporary file left by the killed writer is not a block, and is removed once stale.
    leftover = tier.dir / ".dead.kv.1.2.tmp"
    leftover.write_bytes(b"partial")
    os.utime(leftover, (time.time() - 3600, time.time() - 3600))
    DiskTier(tmp_path, "fp", 1 << 40)
    assert not leftover.exists()


def test_tiers_stay_under_their_caps_dropping_the_least_recently_used(tmp_path):
    block = np.zeros(1000, np.uint8)
    memory = MemoryTier(3500)
    for i in range(3):
        memory.put(bytes([i]) * 32, block)
    assert memory.get(bytes([0]) * 32) is not None  # 0 is now the most recent: 1 goes first
    memory.put(bytes([3]) * 32, block)
    assert memory.nbytes == 3000 and bytes([1]) * 32 not in memory and bytes([0]) * 32 in memory
    disk = DiskTier(tmp_path, "fp", 3 * (HEADER.size + 1000))
    for i in range(3):
        disk.put(bytes([i]) * 32, block)
        time.sleep(0.01)  # distinct mtimes
    assert disk.get(bytes([0]) * 32, 1000) is not None
    disk.put(bytes([3]) * 32, block)
    names = {p.stem for p in disk.dir.glob("*.kv")}
    assert names == {(bytes([i]) * 32).hex() for i in (0, 2, 3)}
    assert disk.stats.evictions == 1


def test_config_errors(engine, tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match="needs both a directory"):
        KVOffloadConfig(disk_dir=tmp_path)
    with pytest.raises(ConfigError, match="positive"):
        KVOffloadConfig(memory=0)
    with pytest.raises(ConfigError, match="prefix caching"):
        LLM(engine, enable_prefix_caching=False, kv_offload=KVOffloadConfig(memory=1 << 20))
    assert not KVOffloadConfig().enabled and LLM(engine, kv_offload=KVOffloadConfig()).offloader is None
    code, _, err = cli(monkeypatch, capsys, "run", engine, "--prompt", "hi", "--kv-offload-dir", tmp_path)
    assert_one_error_line(code, err, "--kv-offload-disk")
    code, _, err = cli(monkeypatch, capsys, "run", engine, "--prompt", "hi", "--kv-offload-memory", "lots")
    assert_one_error_line(code, err, "--kv-offload-memory: 'lots' is not a size")


def test_bench_and_metrics_report_each_tier(engine, tmp_path, monkeypatch, capsys):
    args = ["bench", engine, "--num-requests", "4", "--input-len", "8", "--output-len", "4", "--shared-prefix-len"]
    args += ["32", "--kv-offload-memory", "1MiB", "--kv-offload-dir", tmp_path, "--kv-offload-disk", "1MiB"]
    code, out, err = cli(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "KV offload memory" in out and "KV offload disk" in out
    llm = LLM(engine, kv_offload=KVOffloadConfig(memory=1 << 20))
    llm.generate([prompts()[0]], GREEDY)
    llm.offloader.flush()
    text = "\n".join(kv_offload_lines(llm.stats.kv_offload))
    assert 'trtbuild_kv_offload_stored_bytes_total{tier="memory"} ' in text
    assert text.count('tier="memory"') == 6
    assert kv_offload_lines(()) == []


def start_redis(workdir, *extra: str, tls: tuple[Path, Path] | None = None):
    """A redis-server of our own on a free port (skipped where none is installed): (process, port). ``tls``: (its
    certificate, key): the port speaks TLS only, and clients need no certificate."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir]
    if tls is not None:
        cert, key = tls
        args[1:3] = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", cert, "--tls-key-file", key]
        args += ["--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]
    proc = subprocess.Popen([str(a) for a in [*args, *extra]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.05)
    return proc, port


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    proc, port = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        RespConnection(RedisAddress("127.0.0.1", port)).call(b"PING")
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_replicas_share_blocks_through_redis(engine, block_bytes, redis_url):
    expected = chat_rounds(small_llm(engine, block_bytes))
    config = KVOffloadConfig(url=redis_url)
    first = small_llm(engine, block_bytes, config)
    assert chat_rounds(first, rounds=1) == expected[:3]
    first.offloader.close()
    assert first.stats.kv_offload[0].blocks_stored == 3 * 16
    # A second replica (no memory, no disk) loads every prefix from the server and gives the same tokens.
    second = small_llm(engine, block_bytes, config)
    assert chat_rounds(second, rounds=1) == expected[:3]
    [remote] = second.stats.kv_offload
    assert remote.name == "redis" and remote.hits == 3 * 14 and second.stats.kv_offload_loaded_blocks == 3 * 14
    # A value that is not a whole block of that key is a miss.
    tier = second.offloader.remote
    key = next(iter(second.scheduler.kv_cache.pool.cached))
    conn = RespConnection(parse_redis_url(redis_url))
    raw = conn.call(b"GET", tier.key(key))
    assert tier.get(key, block_bytes) is not None
    for bad in (raw[:-1], raw[:-1] + bytes([raw[-1] ^ 1]), b""):
        conn.call(b"SET", tier.key(key), bad)
        assert tier.get(key, block_bytes) is None


def test_redis_url_errors(engine):
    with pytest.raises(ConfigError, match="expected redis://HOST"):
        KVOffloadConfig(url="http://localhost:6379")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(ConfigError, match="cannot reach the server"):
        LLM(engine, kv_offload=KVOffloadConfig(url=f"redis://127.0.0.1:{port}"))


def test_redis_url_with_a_password():
    address = parse_redis_url("redis://app:s%40cret@cache.internal:6380/2")
    assert address == RedisAddress("cache.internal", 6380, 2, "app", "s@cret")
    assert "s@cret" not in repr(address)
    assert parse_redis_url("redis://:pw@h").username is None


def test_redis_server_with_a_password(engine, block_bytes, tmp_path, monkeypatch):
    proc, port = start_redis(tmp_path, "--requirepass", "s3cret")
    try:
        config = KVOffloadConfig(url=f"redis://:s3cret@127.0.0.1:{port}/1")
        llm = small_llm(engine, block_bytes, config)
        chat_rounds(llm, rounds=1)
        llm.offloader.close()
        assert llm.stats.kv_offload[0].blocks_stored > 0
        with pytest.raises(ConfigError, match="cannot reach the server") as e:
            LLM(engine, kv_offload=KVOffloadConfig(url=f"redis://:wrong@127.0.0.1:{port}"))
        assert "wrong" not in str(e.value) and ":***@" in str(e.value)
        monkeypatch.setenv(PASSWORD_ENV, "s3cret")  # kept out of the process list
        conn = RespConnection(parse_redis_url(f"redis://127.0.0.1:{port}/1"))
        assert conn.call(b"DBSIZE") == llm.stats.kv_offload[0].blocks_stored
    finally:
        proc.terminate()
        proc.wait(10)


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made by the openssl CLI (skipped where there is none)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_replicas_share_blocks_through_redis_over_tls(engine, block_bytes, tmp_path):
    """rediss:// with the server's certificate trusted through ssl_ca_certs: two replicas share blocks as over
    redis://; without trusting it (the system's CAs) the certificate check fails in one line; ssl_cert_reqs=none
    skips the check."""
    cert, key = self_signed(tmp_path)
    proc, port = start_redis(tmp_path, tls=(cert, key))
    try:
        url = f"rediss://127.0.0.1:{port}?ssl_ca_certs={cert}"
        assert parse_redis_url(url).tls == TlsOptions(ca_certs=str(cert))
        expected = chat_rounds(small_llm(engine, block_bytes), rounds=1)
        first = small_llm(engine, block_bytes, KVOffloadConfig(url=url))
        assert chat_rounds(first, rounds=1) == expected
        first.offloader.close()
        second = small_llm(engine, block_bytes, KVOffloadConfig(url=url))
        assert chat_rounds(second, rounds=1) == expected and second.stats.kv_offload[0].hits == 3 * 14
        with pytest.raises(ConfigError, match=r"cannot reach the server .*CERTIFICATE_VERIFY_FAILED"):
            LLM(engine, kv_offload=KVOffloadConfig(url=f"rediss://127.0.0.1:{port}"))
        with pytest.raises(ConfigError, match="cannot reach the server"):  # plain text to a TLS port
            LLM(engine, kv_offload=KVOffloadConfig(url=f"redis://127.0.0.1:{port}"))
        unchecked = RespConnection(parse_redis_url(f"rediss://127.0.0.1:{port}?ssl_cert_reqs=none"))
        assert unchecked.call(b"DBSIZE") == 3 * 16
    finally:
        proc.terminate()
        proc.wait(10)


def test_rediss_url_options():
    tls = parse_redis_url("rediss://h:6380/1?ssl_certfile=c.pem&ssl_keyfile=k.pem&ssl_cert_reqs=none").tls
    assert tls == TlsOptions(None, "c.pem", "k.pem", CertReqs.NONE)
    assert parse_redis_url("redis://h").tls is None
    for url, needle in (
        ("redis://h?ssl_ca_certs=x", "expected redis://HOST"),  # TLS options need rediss://
        ("rediss://h?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of"),
        ("rediss://h?sslmode=on", "unknown parameter 'sslmode'"),
        ("rediss://h?ssl_ca_certs=", "ssl_ca_certs takes one value"),
    ):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            KVOffloadConfig(url=url)


def test_an_unused_llm_and_its_writer_go_away(engine, tmp_path):
    import gc
    import threading
    import weakref

    def writers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "kv-offload-writer" and t.is_alive()}

    before = writers()
    llm = LLM(engine, kv_offload=KVOffloadConfig(memory=1 << 20, disk_dir=tmp_path, disk=1 << 20))
    assert len(writers() - before) == 1
    llm.generate([prompts()[0]], GREEDY)
    ref = weakref.ref(llm.offloader)
    del llm
    gc.collect()
    assert ref() is None
    assert len(list(tmp_path.glob("*/*.kv"))) == 16  # queued blocks were written before the writer stopped
    assert writers() <= before


def test_a_failing_disk_drops_stores_and_the_engine_goes_on(engine, block_bytes, tmp_path):
    expected = chat_rounds(small_llm(engine, block_bytes))
    llm = small_llm(engine, block_bytes, KVOffloadConfig(memory=1 << 20, disk_dir=tmp_path, disk=1 << 20))
    shutil.rmtree(llm.offloader.disk.dir)  # the directory goes away under the running engine
    assert chat_rounds(llm) == expected  # flush() returns: the writer survived
    memory, disk = llm.stats.kv_offload
    # round 1: 16 blocks a prompt; round 2: the 2 recomputed past the loaded ones (never stored, so tried again)
    assert disk.blocks_stored == 0 and disk.store_errors == 3 * 16 + 3 * 2
    assert memory.hits == 3 * 14


def serve_once(engine: Path, disk_dir: Path, prompt: list[int], *, stores: bool) -> tuple[str, str]:
    """Start ``trtbuild serve`` on the disk tier, complete ``prompt`` greedily, read /metrics, SIGTERM it:
    (the completion's text, the KV offload lines of /metrics)."""
    flags = ["--no-access-log", "--kv-offload-dir", str(disk_dir), "--kv-offload-disk", "1MiB"]
    proc, v1, _ = start_serve(engine, *flags)
    base = v1.removesuffix("/v1")
    try:
        body = {"model": engine.name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(
            base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        text = json.loads(urllib.request.urlopen(request, timeout=60).read())["choices"][0]["text"]
        # the disk tier writes behind the engine (a writer thread): when the request ``stores``, wait for its blocks
        deadline = time.monotonic() + 10
        while True:
            metrics = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
            stored = 'stored_bytes_total{tier="disk"} 0\n' not in metrics
            if not stores or stored or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        return text, "\n".join(ln for ln in metrics.splitlines() if "kv_offload" in ln and not ln.startswith("#"))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_serve_restarted_on_the_disk_tier_loads_what_it_stored(engine, tmp_path):
    prompt = prompts()[0]
    text, metrics = serve_once(engine, tmp_path, prompt, stores=True)
    assert 'trtbuild_kv_offload_stored_bytes_total{tier="disk"} 0' not in metrics
    again, metrics = serve_once(engine, tmp_path, prompt, stores=False)
    assert again == text
    assert 'trtbuild_kv_offload_hits_total{tier="disk"} 14' in metrics.splitlines()


@pytest.fixture(scope="module", params=[KVCacheDType.INT8, KVCacheDType.FP8], ids=["kv_int8", "kv_fp8"])
def quantized_kv_engine(request, tmp_path_factory):
    """A tiny engine whose KV cache is int8 / fp8 (int8 weight-only linears), quantized and built once."""
    from quantize_helpers import calib_file, tiny_checkpoint

    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig
    from trtbuild.quantize.quantize import quantize

    root = tmp_path_factory.mktemp(f"kv-{request.param.value}")
    _, ckpt = tiny_checkpoint(root)
    qcfg = QuantConfig(
        qformat=QFormat.INT8_WO,
        kv_cache_dtype=request.param,
        calib_dataset=str(calib_file(root)),
        calib_size=2,
        calib_seq_len=24,
    )
    quantize(ckpt, root / "qckpt", qcfg, progress=False)
    build_engine(root / "qckpt", root / "engine", BuildConfig(max_seq_len=128, kv_block_size=4))
    return root / "engine"


def test_quantized_kv_cache_engine_reloads_its_blocks_bit_exact(quantized_kv_engine, tmp_path):
    """With an int8 / fp8 KV cache the tier keeps the codes as they are: the pool's blocks and the disk files hold the
    same bytes, and eviction -> reload gives the tokens of a run without the tier."""
    engine = quantized_kv_engine
    config = RuntimeConfig.load(engine)
    per_block = bytes_per_block(config.model, config.build.kv_block_size)
    expected = chat_rounds(small_llm(engine, per_block))
    llm = small_llm(engine, per_block, KVOffloadConfig(disk_dir=tmp_path, disk=1 << 20))
    assert llm.offloader.cache.keys.dtype == (np.int8 if config.model.kv_cache_dtype is KVCacheDType.INT8 else np.uint8)
    assert chat_rounds(llm) == expected
    assert llm.stats.kv_offload_loaded_blocks == 3 * 14
    disk, cache = llm.offloader.disk, llm.offloader.cache
    cached = llm.scheduler.kv_cache.pool.cached
    assert cached
    for key, block in cached.items():
        assert disk.get(key, per_block).tobytes() == cache.read_block(block.block_id).tobytes()
