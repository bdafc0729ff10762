"""Which sockets listen where, read from /proc: real sockets, bound where a test names, found where they are."""

from __future__ import annotations

import socket

import pytest

from sglang_kvbm.tiers.mooncake import listeners
from sglang_kvbm.tiers.mooncake.listeners import Listener, describe_client, flag, rpc_port_range


def bound(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::"])
def test_a_socket_is_found_where_it_is_bound_and_as_ours(host):
    if host == "::" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    before = listeners.own_listeners()
    with bound(host) as sock:
        port = sock.getsockname()[1]
        assert listeners.listening_on(port) == [Listener(host, port)]
        assert listeners.own_listeners() - before == {Listener(host, port)}
        found = listeners.listening_on(port)[0]
        assert found.wildcard == (host != "127.0.0.1") and listeners.owner(found) == listeners.os.getpid()
    assert not listeners.listening_on(port)


def test_addresses_print_as_ss_prints_them():
    assert [str(Listener("0.0.0.0", 1)), str(Listener("::", 2)), str(Listener("127.0.0.1", 3))] == [
        "0.0.0.0:1", "[::]:2", "127.0.0.1:3"]


def test_gflags_values_from_a_command_line():
    assert flag(["m", "--metrics_port=9100", "-rpc_port", "5"], "metrics_port") == "9100"
    assert flag(["m", "-rpc_port", "5"], "rpc_port") == "5" and flag(["m"], "metrics_port") is None


@pytest.mark.parametrize("env, expected", [
    ({}, (15000, 17000, None)),
    ({"MC_MIN_RPC_PORT": "62000", "MC_MAX_RPC_PORT": "62009"}, (62000, 62009, None)),
    ({"MC_MIN_PRC_PORT": "2000", "MC_MAX_PRC_PORT": "3000"}, (2000, 3000, None)),  # Mooncake reads the typo too
    ({"MC_MIN_RPC_PORT": "16000"}, (16000, 17000, None)),
])
def test_the_transfer_port_range_as_mooncake_reads_it(env, expected):
    assert rpc_port_range(env) == expected


@pytest.mark.parametrize("low, high", [("40000", "40010"), ("1000", "1010"), ("abc", "62700"), ("62800", "62790"),
                                       ("62000", "65536")])
def test_a_range_mooncake_refuses_falls_back_to_the_default(low, high):
    """Measured (0.3.13.post1) for the first four: the client's ports came from 15000-17000."""
    found_low, found_high, problem = rpc_port_range({"MC_MIN_RPC_PORT": low, "MC_MAX_RPC_PORT": high})
    assert (found_low, found_high) == (15000, 17000) and "falls back" in problem


def test_a_one_port_range_is_too_small():
    low, high, problem = rpc_port_range({"MC_MIN_RPC_PORT": "62500", "MC_MAX_RPC_PORT": "62500"})
    assert (low, high) == (62500, 62500) and "needs 2" in problem


def test_the_log_line_names_each_listener_and_the_range_to_firewall():
    line = describe_client({Listener("::", 16033), Listener("0.0.0.0", 15595)}, {})
    assert line == ("kvbm: G4 client listens on 0.0.0.0:15595 (transfer RPC) and [::]:16033 (TCP data), on every "
                    "address; Mooncake cannot bind them to one address: firewall MC_MIN_RPC_PORT..MC_MAX_RPC_PORT "
                    "(15000-17000)")
    assert describe_client([], {}) is None
    assert describe_client([Listener("127.0.0.1", 5)], {}) == "kvbm: G4 client listens on 127.0.0.1:5"
