"""The address this worker's Mooncake client advertises to its peers, and why.

Other clients (every worker's, the master's lender) read and write the memory this client registers at the
address it advertises: a loopback address there reaches, on their host, themselves. So the default is the
address of this host's interface that routes to the master (the kernel's choice: a UDP ``connect`` picks the
source address and sends nothing), or 127.0.0.1 when the master is on loopback itself (one host).
``MOONCAKE_LOCAL_HOSTNAME`` (SGLang's variable for it) overrides it, and is refused when it is a loopback
address and the master is not. Never ``gethostbyname(gethostname())``: that is 127.0.1.1 (Debian) or
127.0.0.1 wherever ``/etc/hosts`` maps the host's name to loopback.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Mapping, NamedTuple, Optional

from sglang_kvbm.base.values import ConfigError

VARIABLE = "MOONCAKE_LOCAL_HOSTNAME"


class Advertised(NamedTuple):
    host: str
    why: str  # one phrase: how it was chosen (doctor prints it)


def split(address: str) -> tuple[str, Optional[int]]:
    """``host:port`` (IPv6 in brackets) -> (host, port or None)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else None


def loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is a loopback address; a name that resolves to loopback only is."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:  # unresolvable: not loopback (the route to it fails later, with the fix)
        return False
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


def route_source(host: str, port: int) -> str:
    """This host's address on the route to ``(host, port)``; OSError when there is none."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        return sock.getsockname()[0]


def check(master: str, environ: Mapping[str, str]) -> None:
    """Refuse a loopback ``MOONCAKE_LOCAL_HOSTNAME`` facing a master on another address (start-up)."""
    explicit = environ.get(VARIABLE, "")
    host, _ = split(master)
    if explicit and loopback(explicit) and not loopback(host):
        raise ConfigError(
            f"{VARIABLE}={explicit!r} is a loopback address but the Mooncake master (SGLANG_KVBM_MOONCAKE_MASTER="
            f"{master}) is not: other hosts would reach this worker's G4 memory at their own loopback. Set "
            f"{VARIABLE} to this host's address on the master's network, or unset it (the default is the address "
            "of the interface that routes to the master)")


def advertised(master: str, environ: Mapping[str, str]) -> Advertised:
    """What this client advertises (see the module): checked, or ConfigError naming the variable to set."""
    check(master, environ)
    explicit = environ.get(VARIABLE, "")
    if explicit:
        return Advertised(explicit, VARIABLE)
    host, port = split(master)
    if loopback(host):
        return Advertised("127.0.0.1", "the master is on loopback: one host")
    try:
        return Advertised(route_source(host, port or 50051), f"this host's address on the route to {host}")
    except OSError as exc:
        raise ConfigError(f"no route from this host to the Mooncake master {master} ({exc}): fix the master's "
                          f"address (SGLANG_KVBM_MOONCAKE_MASTER), or set {VARIABLE} to this host's address on its "
                          "network") from None
