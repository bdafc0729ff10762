"""``sglang-kvbm doctor`` on a good set-up and on broken ones, as a person runs it."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness.permissions import make_unwritable, make_writable
from sglang_kvbm.base.versions import SUPPORTED_SGLANG, check_sglang_version
from sglang_kvbm.config import ConfigError
from sglang_kvbm.ops import doctor as doctor_module
from sglang_kvbm.ops.doctor import diagnose


def doctor(env_extra, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_KVBM_", "SGLANG_KVBM_"))}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "sglang_kvbm.ops.cli", "doctor", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def rows(env, **kwargs):
    """``check -> (status, detail)`` of an in-process diagnosis."""
    return {row.check: (row.status, row.detail) for row in diagnose(env, **kwargs)}


def test_good_setup_is_ready(tmp_path):
    run = doctor({"DYN_KVBM_CPU_CACHE_GB": "1", "DYN_KVBM_DISK_CACHE_GB": "0.5", "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stdout
    from importlib.metadata import version

    assert "sglang" in run.stdout and version("sglang") in run.stdout
    assert "disk O_DIRECT       ok    on" in run.stdout
    assert run.stdout.rstrip().endswith("ready")


def test_bad_variable_is_a_problem_naming_it(tmp_path):
    run = doctor({"DYN_KVBM_CPU_CACHE_GB": "lots"})
    assert run.returncode == 1
    assert "DYN_KVBM_CPU_CACHE_GB='lots' is not a number" in run.stdout


def test_no_tier_is_a_problem():
    run = doctor({})
    assert run.returncode == 1 and "no tier configured" in run.stdout


def test_unwritable_disk_directory_is_a_problem(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    make_unwritable(locked)
    try:
        run = doctor({"DYN_KVBM_DISK_CACHE_GB": "0.1", "DYN_KVBM_DISK_CACHE_DIR": str(locked)})
    finally:
        make_writable(locked)
    assert run.returncode == 1
    assert "DYN_KVBM_DISK_CACHE_DIR" in run.stdout and "not writable" in run.stdout


# --- tiers sized in blocks: the bytes they need are checked too ----------------------------------------------

HUGE = str(10**9)  # blocks: petabytes at any real block size


def test_block_sized_host_tier_is_checked_against_memory_with_block_bytes():
    status, detail = rows({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": HUGE}, block_bytes=1 << 20)["host tier"]
    assert status == "FAIL"
    assert "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS" in detail and "lower" in detail


def test_block_sized_host_tier_that_fits_reports_its_bytes():
    status, detail = rows({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "64"}, block_bytes=1 << 20)["host tier"]
    assert status == "ok" and "64 blocks of 1 MiB = 0.06 GiB" in detail


def test_block_sized_host_tier_without_block_bytes_states_its_assumption():
    status, detail = rows({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": HUGE})["host tier"]
    assert status == "warn"
    assert "2 MiB" in detail and "assumed" in detail and "--block-bytes" in detail


def test_block_sized_disk_tier_is_checked_against_free_space(tmp_path):
    env = {"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": HUGE, "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)}
    status, detail = rows(env, block_bytes=1 << 20)["disk tier"]
    assert status == "FAIL" and "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS" in detail and "free" in detail


def test_block_sized_disk_tier_without_block_bytes_warns_on_the_assumption(tmp_path):
    env = {"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": HUGE, "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)}
    found = rows(env)
    status, detail = found["disk space"]
    assert status == "warn" and "assumed 2 MiB per block" in detail and "--block-bytes" in detail
    assert found["disk tier"][0] == "ok"  # the directory itself is fine


@pytest.mark.parametrize("page_size, header", [(16, "4 KiB"), (1024, "12 KiB")])
def test_disk_blocks_take_the_header_of_their_page_size(tmp_path, page_size, header):
    env = {"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "64", "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)}
    status, detail = rows(env, block_bytes=1 << 20, page_size=page_size)["disk tier"]
    assert status == "ok" and f"64 blocks of 1 MiB + {header} header" in detail
    routed = dict(env, SGLANG_KVBM_ROUTER_BLOCK_SIZE=str(page_size))  # the router's block size is the page size
    assert f"+ {header} header" in rows(routed, block_bytes=1 << 20)["disk tier"][1]


def test_page_size_on_the_command_line(tmp_path):
    env = {"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "64", "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)}
    run = doctor(env, "--block-bytes", "1048576", "--page-size", "1024")
    assert run.returncode == 0 and "+ 12 KiB header" in run.stdout, run.stdout
    assert doctor({}, "--page-size", "0").returncode == 2


def test_block_bytes_on_the_command_line(tmp_path):
    run = doctor({"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": HUGE, "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)},
                 "--block-bytes", "1048576")
    assert run.returncode == 1 and "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS" in run.stdout
    bad = doctor({}, "--block-bytes", "0")
    assert bad.returncode == 2 and "--block-bytes" in bad.stderr


# --- no backend that does not exist; one supported SGLang range ----------------------------------------------

def test_no_auto_backend_is_mentioned():
    assert "auto" not in doctor_module.__doc__
    assert all("auto" not in detail for _, detail in rows({"DYN_KVBM_CPU_CACHE_GB": "1"}).values())


@pytest.mark.parametrize("installed", ["0.5.21", "0.5.22", "0.5.23", "0.5.23.post1", "0.5.30", "0.5.24rc1", "0.5.23+cu130"])
def test_supported_sglang_versions(installed):
    check_sglang_version(installed)


@pytest.mark.parametrize("installed", ["0.5.20", "0.5.20.post1", "0.6.0", "0.6.0rc1", "1.0", "0.4.9"])
def test_unsupported_sglang_version_names_both_and_the_fix(installed):
    with pytest.raises(ConfigError) as err:
        check_sglang_version(installed)
    message = str(err.value)
    assert installed in message and SUPPORTED_SGLANG in message and "pip install 'sglang" in message


def test_unparseable_sglang_version():
    with pytest.raises(ConfigError, match="'not-a-version'.*pip install 'sglang"):
        check_sglang_version("not-a-version")


def test_doctor_uses_the_one_supported_range():
    assert doctor_module.SUPPORTED_SGLANG is SUPPORTED_SGLANG


def test_pip_is_told_the_same_range():
    """pyproject.toml's ``sglang`` extra (what pip resolves) and the run-time check name one range."""
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'sglang = ["sglang{SUPPORTED_SGLANG}"]' in pyproject


def test_license_is_an_spdx_expression_with_its_file():
    """PEP 639: a TOML-table license is deprecated (setuptools stops building it after 2027-02-18)."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[2]
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert pyproject["project"]["license-files"] == ["LICENSE"]
    assert "scikit-build-core>=0.11" in pyproject["build-system"]["requires"]  # PEP 639 metadata from 0.11
    text = (root / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_version_module_imports_neither_sglang_nor_torch():
    code = "import sys, sglang_kvbm.base.versions; print([m for m in ('sglang', 'torch') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_g4_master_that_answers_and_one_that_does_not(tmp_path):
    from harness.mooncake import MooncakeCluster
    from sglang_kvbm.ops.demo.server import free_port

    base = {"DYN_KVBM_CPU_CACHE_GB": "1"}
    with MooncakeCluster(tmp_path, lend="") as cluster:
        env = {**base, "SGLANG_KVBM_MOONCAKE_MASTER": cluster.master_address,
               "SGLANG_KVBM_MOONCAKE_METADATA": cluster.metadata_url}
        assert rows(env)["G4 (Mooncake)"] == ("ok", f"master {cluster.master_address} answers (P2PHANDSHAKE: no "
                                              "metadata server)")
    nobody = f"127.0.0.1:{free_port()}"
    status, detail = rows({**env, "SGLANG_KVBM_MOONCAKE_MASTER": nobody})["G4 (Mooncake)"]
    assert status == "warn" and nobody in detail and "starts without G4" in detail


# --- what listens where (G4): bound addresses read from /proc, against a live master and real sockets -----------

G4 = {"DYN_KVBM_CPU_CACHE_GB": "1"}


def listening_socket(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock


def test_g4_listeners_of_a_master_bound_to_loopback(tmp_path):
    from harness.mooncake import MooncakeCluster

    with MooncakeCluster(tmp_path, lend="") as cluster:
        found = rows({**G4, "SGLANG_KVBM_MOONCAKE_MASTER": cluster.master_address,
                      "SGLANG_KVBM_MOONCAKE_METADATA": cluster.metadata_url})
    assert found["G4 advertised address"] == ("ok", "peers reach this worker's G4 memory at 127.0.0.1 (the master is "
                                              "on loopback: one host; MOONCAKE_LOCAL_HOSTNAME sets it)")
    assert found["G4 master RPC"] == ("ok", f"listens on 127.0.0.1:{cluster.rpc_port} only")
    assert found["G4 master metrics"] == ("ok", f"listens on 127.0.0.1:{cluster.admin_port} only")  # its --metrics_port
    assert found["G4 metadata"][0] == "ok" and "P2PHANDSHAKE: no metadata server" in found["G4 metadata"][1]
    status, detail = found["G4 transfer ports"]
    assert status == "info" and "2 ports" in detail and "15000-17000" in detail and "firewall" in detail
    assert "G4 transfer port range" not in found


def test_g4_metadata_server_on_every_address_is_a_warning_with_the_fix(tmp_path):
    from harness.mooncake import MooncakeCluster

    with MooncakeCluster(tmp_path, lend="") as cluster, listening_socket("0.0.0.0") as everywhere, \
            listening_socket("127.0.0.1") as loopback:
        env = {**G4, "SGLANG_KVBM_MOONCAKE_MASTER": cluster.master_address}
        port, local = everywhere.getsockname()[1], loopback.getsockname()[1]
        wide = rows({**env, "SGLANG_KVBM_MOONCAKE_METADATA": f"http://127.0.0.1:{port}/metadata"})
        narrow = rows({**env, "SGLANG_KVBM_MOONCAKE_METADATA": f"http://localhost:{local}/metadata"})
    status, detail = wide["G4 metadata"]
    assert status == "warn" and f"0.0.0.0:{port}" in detail and f"firewall port {port}" in detail
    assert "P2PHANDSHAKE" in detail and "mooncake_http_metadata_server --host=127.0.0.1" in detail
    assert wide["G4 (Mooncake)"] == ("ok", f"master {cluster.master_address} and metadata server answer")
    assert narrow["G4 metadata"] == ("ok", f"listens on 127.0.0.1:{local} only")


def test_g4_master_rpc_on_every_address_is_a_warning():
    with listening_socket("0.0.0.0") as master:  # what --rpc_address's default binds
        port = master.getsockname()[1]
        status, detail = rows({**G4, "SGLANG_KVBM_MOONCAKE_MASTER": f"127.0.0.1:{port}",
                               "SGLANG_KVBM_MOONCAKE_METADATA": "P2PHANDSHAKE"})["G4 master RPC"]
    assert status == "warn" and f"0.0.0.0:{port}" in detail and "--rpc_address=127.0.0.1" in detail


@pytest.mark.parametrize("low, high, why", [("40000", "40010", "falls back to 15000-17000"),
                                            ("17000", "16000", "falls back"), ("abc", None, "falls back"),
                                            ("62000", "62000", "holds 1 port")])
def test_g4_transfer_port_range_that_mooncake_refuses_or_too_small_warns(low, high, why):
    from sglang_kvbm.ops.demo.server import free_port

    env = {**G4, "SGLANG_KVBM_MOONCAKE_MASTER": f"127.0.0.1:{free_port()}",
           "SGLANG_KVBM_MOONCAKE_METADATA": "P2PHANDSHAKE", "MC_MIN_RPC_PORT": low}
    if high is not None:
        env["MC_MAX_RPC_PORT"] = high
    found = rows(env)
    status, detail = found["G4 transfer port range"]
    assert status == "warn" and why in detail and "MC_MIN_RPC_PORT" in detail
    assert found["G4 master RPC"][0] == "info"  # nobody listens there: said, and the reachability row warns
    good = rows({**env, "MC_MIN_RPC_PORT": "62000", "MC_MAX_RPC_PORT": "62099"})
    assert "G4 transfer port range" not in good and "62000-62099" in good["G4 transfer ports"][1]


@pytest.mark.parametrize("value", ["1", "0", ""])
def test_g4_with_legacy_rpc_port_binding_is_a_problem(value):
    env = {**G4, "SGLANG_KVBM_MOONCAKE_MASTER": "127.0.0.1:50051", "MC_LEGACY_RPC_PORT_BINDING": value,
           "SGLANG_KVBM_MOONCAKE_METADATA": "http://127.0.0.1:8080/metadata"}
    status, detail = rows(env)["configuration"]
    assert status == "FAIL" and "MC_LEGACY_RPC_PORT_BINDING" in detail and "unset MC_LEGACY_RPC_PORT_BINDING" in detail


def test_object_tier_rows_and_credentials_are_not_printed(tmp_path):
    from harness.s3 import S3Server

    env = {"DYN_KVBM_CPU_CACHE_GB": "1", "DYN_KVBM_OBJECT_ENABLED": "1", "DYN_KVBM_OBJECT_BUCKET": "kv-{worker_id}",
           "DYN_KVBM_OBJECT_ACCESS_KEY": "AKIDEXAMPLE", "DYN_KVBM_OBJECT_SECRET_KEY": "wJalrXUtnFEMI"}
    with S3Server(tmp_path) as s3:
        up = rows({**env, "DYN_KVBM_OBJECT_ENDPOINT": s3.endpoint})
    down = rows({**env, "DYN_KVBM_OBJECT_ENDPOINT": s3.endpoint})  # stopped now
    assert up["object backend"] == ("ok", "NIXL's OBJ plugin loads")
    assert up["object endpoint"][0] == "ok" and "kv-{worker_id}" in up["object endpoint"][1]
    assert down["object endpoint"][0] == "warn" and "DYN_KVBM_OBJECT_ENDPOINT" in down["object endpoint"][1]
    shown = up["configuration"][1]
    assert "DYN_KVBM_OBJECT_SECRET_KEY=<hidden>" in shown and "DYN_KVBM_OBJECT_ACCESS_KEY=<hidden>" in shown
    assert "wJalrXUtnFEMI" not in shown and "AKIDEXAMPLE" not in shown


@pytest.mark.parametrize("host, status, says", [
    ("127.0.0.1", "ok", "binds loopback, this host only"),
    ("0.0.0.0", "warn", "binds every address of this machine"),
    ("192.0.2.7", "ok", "binds 192.0.2.7 only"),
])
def test_the_endpoint_row_says_who_can_reach_it(host, status, says):
    found = rows({"DYN_KVBM_CPU_CACHE_GB": "1", "DYN_KVBM_METRICS": "true", "SGLANG_KVBM_HTTP_HOST": host})
    assert found["metrics"][0] == status and says in found["metrics"][1], found["metrics"]


def test_dynamo_addresses_are_shown_and_loopback_facing_a_remote_master_is_a_warning():
    env = {"DYN_KVBM_CPU_CACHE_GB": "1", "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "192.0.2.5"}
    assert rows(env)["Dynamo addresses"][0] == "info"  # one machine (no remote peer known): as given
    remote = {**env, "SGLANG_KVBM_MOONCAKE_MASTER": "192.0.2.9:50051", "SGLANG_KVBM_MOONCAKE_METADATA": "P2PHANDSHAKE"}
    status, detail = rows(remote)["Dynamo addresses"]
    assert status == "warn" and "DYN_TCP_RPC_HOST is loopback" in detail and "DYN_EVENT_PLANE_HOST is" not in detail
    assert "Dynamo addresses" not in rows({"DYN_KVBM_CPU_CACHE_GB": "1"})


def test_available_memory_is_the_kernels_estimate_not_the_free_pages():
    """MemAvailable (free plus what the kernel can reclaim): a machine with a warm page cache is not full. The
    free pages alone made doctor fail a host tier that fits (found writing the sizing guide, without psutil)."""
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert abs(doctor_module._memory_bytes() - available) < (256 << 20) and doctor_module._memory_bytes() >= free * 0.9
