"""Which TCP sockets listen where, read from ``/proc`` (no ``ss``, no root), and Mooncake's transfer port range.

Mooncake 0.3.13's store client (each worker rank's, and the standalone
``mooncake_client``'s) opens two listeners it cannot bind to one address: its
transfer RPC on 0.0.0.0 and its TCP data listener on ``[::]`` (every IPv4 and
IPv6 address), both on ports from ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``
(measured; README "What listens where"). ``MooncakeStore.connect`` logs the ones it
opened; ``doctor`` says where the master's listeners are bound.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
import struct
from typing import Iterable, Mapping, Optional

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
WILDCARDS = frozenset({"0.0.0.0", "::"})
DEFAULT_RPC_PORTS = (15000, 17000)  # Mooncake's default MC_MIN_RPC_PORT..MC_MAX_RPC_PORT
EPHEMERAL = (32768, 60999)  # Mooncake refuses a range that touches these (ValidatePortRange)


@dataclasses.dataclass(frozen=True)
class Listener:
    address: str  # as bound: "0.0.0.0", "::", "127.0.0.1", ...
    port: int
    inode: str = dataclasses.field(default="", compare=False)

    @property
    def wildcard(self) -> bool:
        """Bound to every address of its family (0.0.0.0; ``::`` takes IPv4 too unless v6-only)."""
        return self.address in WILDCARDS

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(struct.unpack("<I", raw)[0]))
    raw = b"".join(struct.pack(">I", word) for word in struct.unpack("<4I", raw))  # four host-order words
    address = ipaddress.IPv6Address(raw)
    return str(address.ipv4_mapped or address)


def listeners(net: str = "/proc/net") -> list[Listener]:
    """Every listening TCP socket of this network namespace (``/proc/self/net``: the one this process is in)."""
    found = []
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(net, name)) as table:
                lines = table.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != LISTEN:
                continue
            address, port = fields[1].split(":")
            found.append(Listener(_address(address), int(port, 16), fields[9]))
    return found


def listening_on(port: int, *, pid: Optional[int] = None) -> list[Listener]:
    """The addresses ``port`` listens on here (only ``pid``'s sockets, when given)."""
    found = [lsn for lsn in listeners("/proc/self/net") if lsn.port == port]
    if pid is not None:
        inodes = socket_inodes(pid)
        found = [lsn for lsn in found if lsn.inode in inodes]
    return found


def socket_inodes(pid: object = "self") -> set[str]:
    """Inodes of the sockets a process holds (empty when its fds are not ours to read)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def own_listeners() -> set[Listener]:
    """This process's listening TCP sockets."""
    inodes = socket_inodes()
    return {lsn for lsn in listeners("/proc/self/net") if lsn.inode in inodes}


def owner(listener: Listener) -> Optional[int]:
    """The pid holding ``listener`` (None when it is another user's and we are not root)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and listener.inode in socket_inodes(entry):
            return int(entry)
    return None


def command_line(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [arg.decode(errors="replace") for arg in f.read().split(b"\0") if arg]
    except OSError:
        return []


def flag(args: Iterable[str], name: str) -> Optional[str]:
    """A gflags value from a command line: ``--name=v``, ``-name=v``, ``--name v`` (the last one wins)."""
    value, args = None, list(args)
    for i, arg in enumerate(args):
        key, eq, rest = arg.lstrip("-").partition("=")
        if arg.startswith("-") and key == name:
            value = rest if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def is_local(host: str) -> bool:
    """Whether ``host`` is an address of this machine (loopback, or one a socket can bind here)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        if ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def rpc_port_range(environ: Optional[Mapping[str, str]] = None) -> tuple[int, int, Optional[str]]:
    """``(low, high, problem)``: the transfer ports a store client takes them from, as Mooncake reads
    ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` (``atoi``; an invalid range falls back to 15000-17000, logged
    only in Mooncake's log); ``problem`` says what is wrong with the operator's values, or None."""
    environ = os.environ if environ is None else environ
    raw = [environ.get(name, environ.get(typo)) for name, typo in (("MC_MIN_RPC_PORT", "MC_MIN_PRC_PORT"),
                                                                   ("MC_MAX_RPC_PORT", "MC_MAX_PRC_PORT"))]
    if raw == [None, None]:
        return (*DEFAULT_RPC_PORTS, None)
    low, high = (_atoi(value) if value is not None else default for value, default in zip(raw, DEFAULT_RPC_PORTS))

    def valid(port: int) -> bool:
        return 1024 <= port <= 65535 and not EPHEMERAL[0] <= port <= EPHEMERAL[1]

    if not (valid(low) and valid(high) and low <= high):
        shown = [value if value is not None else default for value, default in zip(raw, DEFAULT_RPC_PORTS)]
        return (*DEFAULT_RPC_PORTS, (
            f"MC_MIN_RPC_PORT..MC_MAX_RPC_PORT = {shown[0]}..{shown[1]} is not a range Mooncake takes (ports 1024-65535 "
            f"outside the ephemeral {EPHEMERAL[0]}-{EPHEMERAL[1]}, low <= high): it falls back to "
            f"{DEFAULT_RPC_PORTS[0]}-{DEFAULT_RPC_PORTS[1]}; fix them or unset them"))
    if high - low + 1 < 2:
        return (low, high, (
            f"MC_MIN_RPC_PORT..MC_MAX_RPC_PORT = {low}-{high} holds {high - low + 1} port: a store client needs 2 "
            "(its setup fails after ~20 s, measured) and every worker rank on this machine is one: widen it"))
    return (low, high, None)


def _atoi(text: str) -> int:
    digits = text.strip()
    sign = -1 if digits.startswith("-") else 1
    digits = digits.lstrip("+-")
    end = next((i for i, c in enumerate(digits) if not c.isdigit()), len(digits))
    return sign * int(digits[:end]) if end else 0


def describe_client(opened: Iterable[Listener], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The log line for the listeners a store client's ``setup`` opened (None when it opened none we could see)."""
    opened = sorted(opened, key=lambda lsn: (":" in lsn.address, lsn.port))
    if not opened:
        return None
    roles = {"0.0.0.0": " (transfer RPC)", "::": " (TCP data)"}
    names = [f"{lsn}{roles.get(lsn.address, '')}" for lsn in opened]
    text = "kvbm: G4 client listens on " + (" and ".join(names) if len(names) < 3 else ", ".join(names))
    if any(lsn.wildcard for lsn in opened):
        low, high, _ = rpc_port_range(environ)
        text += (", on every address; Mooncake cannot bind them to one address: firewall "
                 f"MC_MIN_RPC_PORT..MC_MAX_RPC_PORT ({low}-{high})")
    return text


def snapshot() -> Optional[set[Listener]]:
    """:func:`own_listeners`, or None when ``/proc`` cannot say."""
    try:
        return own_listeners()
    except Exception:  # the input of a log line: never a reason to fail
        return None


def log_opened(logger: logging.Logger, before: Optional[set[Listener]]) -> None:
    """Log the listeners this process opened since ``before`` (a store client's ``setup``); never raises."""
    after = snapshot()
    if before is None or after is None:
        return
    try:
        line = describe_client(after - before)
    except Exception:
        return
    if line:
        logger.info("%s", line)
