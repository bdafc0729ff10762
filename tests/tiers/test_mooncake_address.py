"""What a worker's Mooncake client advertises to its peers: never a loopback address facing a master elsewhere.

The kernel's own routes decide (a UDP ``connect`` picks the source address and sends nothing). The "other host"
here is this machine's own non-loopback address (``ip -4 addr``): a real route, and nothing leaves the machine.
The default this replaces, ``gethostbyname(gethostname())``, is a loopback address on this machine. (A master with
no route from this host is refused too, naming the variable: that needs a host without routes, the fleet's.)
"""

from __future__ import annotations

import socket
import subprocess

import pytest

from sglang_kvbm.config import ConfigError, KvbmConfig
from sglang_kvbm.tiers.mooncake.address import VARIABLE, advertised, loopback, route_source


def own_address() -> str:
    """This machine's first global IPv4 address (skip when it has none)."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    found = [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]
    if not found:
        pytest.skip("this machine has no global IPv4 address (ip -4 addr)")
    return found[0]


def test_a_master_on_loopback_is_one_host():
    assert advertised("127.0.0.1:50051", {}) == ("127.0.0.1", "the master is on loopback: one host")
    assert advertised("localhost:50051", {}).host == "127.0.0.1"
    assert loopback("127.0.0.1") and loopback("::1") and loopback("localhost") and not loopback("192.0.2.7")


def test_a_master_elsewhere_gets_the_address_of_the_route_to_it():
    mine = own_address()
    assert route_source(mine, 50051) == mine
    found = advertised(f"{mine}:50051", {})
    assert found.host == mine and not loopback(found.host) and mine in found.why
    # what the old default gave where /etc/hosts maps this host's name to loopback (Debian: 127.0.1.1)
    if loopback(socket.gethostbyname(socket.gethostname())):
        assert found.host != socket.gethostbyname(socket.gethostname())


def test_the_variable_wins_and_a_loopback_one_facing_a_remote_master_is_refused():
    mine = own_address()
    assert advertised(f"{mine}:50051", {VARIABLE: mine}) == (mine, VARIABLE)
    assert advertised("127.0.0.1:50051", {VARIABLE: "127.0.0.1"}).host == "127.0.0.1"  # one host: fine
    for value in ("127.0.0.1", "127.0.1.1", "localhost"):
        with pytest.raises(ConfigError, match=VARIABLE) as refused:
            advertised(f"{mine}:50051", {VARIABLE: value})
        assert "SGLANG_KVBM_MOONCAKE_MASTER" in str(refused.value) and "unset it" in str(refused.value)


def test_the_refusal_comes_with_the_configuration_at_start_up():
    mine = own_address()
    env = {"DYN_KVBM_CPU_CACHE_GB": "1", "SGLANG_KVBM_MOONCAKE_MASTER": f"{mine}:50051",
           "SGLANG_KVBM_MOONCAKE_METADATA": "P2PHANDSHAKE"}
    assert KvbmConfig.from_env(env).mooncake_master == f"{mine}:50051"
    with pytest.raises(ConfigError, match=VARIABLE):
        KvbmConfig.from_env({**env, VARIABLE: "127.0.0.1"})
    assert KvbmConfig.from_env({**env, VARIABLE: "127.0.0.1", "SGLANG_KVBM_MOONCAKE_MASTER": "127.0.0.1:50051"})
