"""Security defaults: loopback binds, private files, refused shared directories, tenant isolation in
every tier, and nothing on an input path unpickled or evaluated.

The last is proved on the inputs themselves: crafted bytes (a pickle whose
``__reduce__`` creates a marker file, msgpack bombs) are fed where the library
reads outside data (a disk slot's header, the disk index, its journal, the HTTP
endpoint's body), and each is rejected, the marker never appears, and the tier
goes on.
"""

from __future__ import annotations

import concurrent.futures
import logging
import pickle
import shutil
import socket
import stat
import struct
from pathlib import Path

import msgspec
import pytest
import requests
import torch
import xxhash

from conftest import build_stack
from harness.disk import disk_removed, event_hash, header_offset, load_exact, on_disk_only, segment_path
from sglang_kvbm.config import ConfigError
from sglang_kvbm.integration.sglang.compat import device_prefix_len
from sglang_kvbm.ops.demo.server import free_port
from sglang_kvbm.tiers.disk.setup import probe
from sglang_kvbm.tiers.format import MAGIC as HEADER_MAGIC

pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")  # what a load serves, not how long it waits

# -- private files, refused shared directories ----------------------------------------------------


def test_disk_tier_files_are_private(tmp_path):
    stack = build_stack(host_blocks=4, disk_blocks=16, disk_dir=tmp_path)
    try:
        stack.insert(list(range(16)), seed=1)
        stack.settle()
    finally:
        stack.cache.close()
    directory = next(tmp_path.glob("sglang-kvbm-*"))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = list(directory.iterdir())
    assert {f.name for f in files} >= {"lock", "journal", "index.msgpack", "seg-0000.kv"}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_shared_cache_directory_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by every user"):
        probe(shared, 1 << 20, zerofill_fallback=False, disable_o_direct=False)
    with pytest.raises(ConfigError, match="writable by every user"):
        build_stack(host_blocks=4, disk_blocks=16, disk_dir=shared)
    assert not list(shared.iterdir())  # refused before anything was created in it
    shared.chmod(0o1777)  # like /tmp: others cannot replace what this user creates
    probe(shared, 1 << 20, zerofill_fallback=False, disable_o_direct=False)
    build_stack(host_blocks=4, disk_blocks=16, disk_dir=shared).cache.close()


# -- the endpoint ------------------------------------------------------------------------------


def _outbound_address():
    """This machine's address on its default route (None without one): not loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def _while_polling(stack, fn):
    """Run ``fn`` on another thread while this one plays the scheduler (``/tiers`` is answered between steps)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(fn)
        while not future.done():
            stack.cache.poll()
            concurrent.futures.wait([future], timeout=0.01)
        return future.result()


def test_endpoint_binds_loopback_by_default(stack_factory):
    port = free_port()
    stack = stack_factory(config={"metrics": True, "metrics_port": port})
    endpoint = stack.linker.endpoint
    assert endpoint.address == ("127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    stack.cache.poll()  # the scheduler publishes the snapshot /stats serves
    assert requests.get(f"{url}/stats", timeout=10).status_code == 200
    stack.insert(list(range(16)), seed=2)
    stack.settle()
    query = {"token_ids": list(range(16))}
    answer = _while_polling(stack, lambda: requests.post(f"{url}/tiers", json=query, timeout=10))
    assert answer.status_code == 200 and answer.json() == {"device": 16, "host": 16, "disk": 16}
    outbound = _outbound_address()
    if outbound is not None:  # not reachable from other machines
        with pytest.raises(OSError):
            socket.create_connection((outbound, port), timeout=5).close()


# -- tenants --------------------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", ["cache_salt", "extra_key"])
def test_cache_salt_never_shares_blocks_in_any_tier(stack_factory, tmp_path, namespace):
    stack = stack_factory(host_blocks=4, disk_blocks=64, disk_dir=tmp_path)
    tokens = list(range(100, 132))  # 8 pages: 4 fit in the host tier, all 8 go to disk
    tenant = {namespace: "tenant-a"}
    written = stack.insert(tokens, seed=3, **tenant)
    stack.settle()
    stack.evict_all()
    disk = stack.manager.tiers["disk"].store
    ids = stack.block_ids(tokens, **tenant)
    assert all(map(disk.registered, ids))
    for other in ({namespace: "tenant-b"}, {}):
        assert not set(stack.block_ids(tokens, **other)) & set(ids)  # another tenant's keys name other blocks
        tiers = stack.linker.tier_tokens(tokens, **other)
        assert (tiers.device, tiers.host, tiers.disk) == (0, 0, 0), (other, tiers)
        req, match, loaded, _, _ = stack.admit(tokens + [1], f"r-{other}", **other)
        assert (device_prefix_len(match), match.host_hit_length, loaded) == (0, 0, 0), other
    tiers = stack.linker.tier_tokens(tokens, **tenant)
    assert tiers.disk == 32 and 0 < tiers.host <= 16, tiers  # 4 host blocks: the rest only on disk
    req, match, loaded, slots, _ = stack.admit(tokens + [1], "owner", **tenant)
    assert loaded == 32 and stack.finish(req)
    assert all(map(torch.equal, stack.read_pages(slots), written))
    assert stack.linker.connector.stats.onboard_blocks_d2d > 0  # the disk tier served part of it


# -- nothing on an input path is unpickled or evaluated --------------------------------------------


class _Marker:
    """Unpickling this creates ``path``: the proof that something unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return Path.touch, (Path(self.path),)


@pytest.fixture
def payload(tmp_path):
    """A live pickle payload (checked: unpickling it does create a file) and the marker it would create."""
    control = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(_Marker(control), protocol=2))
    assert control.exists(), "the payload must be live, or the tests below prove nothing"
    marker = tmp_path / "marker"
    return pickle.dumps(_Marker(marker), protocol=2), marker


def _framed_header(payload: bytes, size: int) -> bytes:
    """A disk slot header whose framing is intact (magic, length, checksum) around ``payload``."""
    prefix = struct.pack("<8sIQ", HEADER_MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload))
    return (prefix + payload).ljust(size, b"\0")


# Decoded into fixed types, these must fail at once, not allocate or recurse without bound.
MSGPACK_BOMBS = {
    "4G-element array": b"\xdd\xff\xff\xff\xff",
    "4G-entry map": b"\xdf\xff\xff\xff\xff",
    "nested 4000 deep": b"\x91" * 4000 + b"\xc0",  # fits a slot header; untyped, it overflows the stack
    "4 GiB string": b"\xdb\xff\xff\xff\xff",
}


@pytest.mark.parametrize("crafted", ["pickle", *MSGPACK_BOMBS])
def test_crafted_disk_header_is_a_miss(stack_factory, tmp_path, payload, crafted):
    pickled, marker = payload
    stack = stack_factory(host_blocks=4, disk_blocks=64, disk_dir=tmp_path / "cache", events=True)
    disk = stack.manager.tiers["disk"].store
    tokens = list(range(200, 216))
    written = on_disk_only(stack, tokens, seed=4)
    victim = stack.block_ids(tokens)[1]
    victim_hash = event_hash(disk, victim)
    body = pickled if crafted == "pickle" else MSGPACK_BOMBS[crafted]
    with open(segment_path(disk, victim), "r+b") as f:
        f.seek(header_offset(disk, victim))
        f.write(_framed_header(body, disk.header_bytes))
    stack.tree.take_events()
    assert stack.admit(tokens + [1])[2] == 0  # refused: the request recomputes
    assert disk_removed(stack.tree.take_events()) == [victim_hash]
    assert dict(disk.stats.invalidated) == {"bad header": 1}
    assert not marker.exists()
    stack.insert(tokens, seed=4)  # the tier goes on: the recomputed KV is stored again, and served exactly
    stack.settle()
    stack.evict_all()
    load_exact(stack, tokens, written)


def _index_file(payload: bytes) -> bytes:
    """``index.msgpack`` with an intact prefix (magic, checksum) around ``payload``."""
    return struct.pack("<8sQ", b"SGKVIDX\x01", xxhash.xxh3_64_intdigest(payload)) + payload


def _journal_record(payload: bytes) -> bytes:
    return struct.pack("<IQ", len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def _written_then_closed(root: Path, tokens) -> Path:
    stack = build_stack(host_blocks=4, disk_blocks=64, disk_dir=root)
    try:
        on_disk_only(stack, tokens, seed=5)
        return stack.manager.tiers["disk"].store.directory
    finally:
        stack.cache.close()


@pytest.mark.parametrize("crafted", ["pickle", *MSGPACK_BOMBS])
def test_crafted_disk_index_is_rebuilt_from_the_blocks(tmp_path, payload, crafted, caplog):
    pickled, marker = payload
    directory = _written_then_closed(tmp_path, list(range(16)))
    body = pickled if crafted == "pickle" else MSGPACK_BOMBS[crafted]
    (directory / "index.msgpack").write_bytes(_index_file(body))
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        stack = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path)
    try:
        assert "is damaged (the snapshot index.msgpack is unreadable" in caplog.text
        assert stack.manager.tiers["disk"].store.wait_rebuilt(timeout=60)  # never decoded: rebuilt from the blocks' headers
        assert len(stack.manager.tiers["disk"].store) == 8 and stack.manager.tiers["disk"].store.accounting()["free"] == 56
        assert not marker.exists()
        tokens = list(range(300, 316))  # the tier starts and works
        written = on_disk_only(stack, tokens, seed=6)
        load_exact(stack, tokens, written)
    finally:
        stack.cache.close()


@pytest.mark.parametrize("crafted", ["pickle", *MSGPACK_BOMBS])
def test_crafted_journal_record_is_damage_and_the_index_is_rebuilt(tmp_path, payload, crafted):
    """A crash image whose journal holds good records, then a crafted one (checksum intact), then more."""
    pickled, marker = payload
    tokens = list(range(400, 416))
    live = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path / "live")
    try:
        written = on_disk_only(live, tokens, seed=7)  # its journal holds these records now
        crashed = tmp_path / "crashed" / live.manager.tiers["disk"].store.directory.name
        shutil.copytree(live.manager.tiers["disk"].store.directory, crashed)
    finally:
        live.cache.close()
    body = pickled if crafted == "pickle" else MSGPACK_BOMBS[crafted]
    clear = msgspec.msgpack.encode(["clear", -1, None, ""])  # a valid record: replayed, it would empty the index
    with open(crashed / "journal", "ab") as f:
        f.write(_journal_record(body) + _journal_record(clear))
    stack = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path / "crashed")
    try:
        assert stack.manager.tiers["disk"].store.wait_rebuilt(timeout=60)  # a bad record with records after it: rebuilt
        assert len(stack.manager.tiers["disk"].store) == 8  # every block whose header verifies; the records after it decide nothing
        assert not marker.exists()
        load_exact(stack, tokens, written)
    finally:
        stack.cache.close()


def test_http_bodies_are_json_only(stack_factory, payload):
    pickled, marker = payload
    port = free_port()
    stack = stack_factory(config={"metrics": True, "metrics_port": port})
    url = f"http://127.0.0.1:{port}/tiers"
    for body in (pickled, *MSGPACK_BOMBS.values()):
        assert requests.post(url, data=body, timeout=10).status_code == 400
    for bad in ({"token_ids": "__import__('os').system('touch x')"}, {"token_ids": [1, "2"]}, {"token_ids": [-1]},
                ["token_ids"], {"tokens": [1]}):
        assert requests.post(url, json=bad, timeout=10).status_code == 400, bad
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # announced, never sent
        sock.sendall(b"POST /tiers HTTP/1.1\r\nHost: x\r\nContent-Length: 9437184\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.0 413")
    assert requests.post(url, data=b"[" * 100_000, timeout=10).status_code == 400  # nested past the recursion limit
    for length in (b"abc", b"-1"):  # a length that is not one: answered, not waited on
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /tiers HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n")
            assert sock.recv(64).startswith(b"HTTP/1.0 400")
    assert not marker.exists()
    stack.cache.poll()
    assert requests.get(f"http://127.0.0.1:{port}/stats", timeout=10).status_code == 200  # still serving


def test_no_deserializer_that_can_run_code_is_imported():
    """Tripwire beside the proofs above: no module of the library imports one (pickle, marshal, shelve,
    dill, cloudpickle, yaml) or calls eval/exec/torch.load."""
    import ast

    src = Path(__file__).resolve().parents[2] / "src" / "sglang_kvbm"
    banned_modules = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "yaml", "jsonpickle"}
    offenders = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            offenders += [f"{path.relative_to(src)}: import {n}" for n in names if n in banned_modules]
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
                if name in ("eval", "exec") and not owner or (owner, name) == ("torch", "load"):
                    offenders.append(f"{path.relative_to(src)}:{node.lineno}: {owner + '.' if owner else ''}{name}()")
    assert not offenders, offenders
