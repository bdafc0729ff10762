"""Several hosts on one machine: Linux network namespaces on a bridge, each with its own address, hostname
and ``/etc/hosts``, for tests of a deployment across hosts (``tests/fleet``).

Before anything is created, an ``unreachable`` route for the fleet's subnet goes into the machine's own
namespace, so no packet for those addresses can leave the machine. The bridge lives in a namespace of
its own (``switch``): nothing but that route is added to the machine's namespace. Each host's
``/etc/hosts`` maps its hostname to 127.0.1.1, as Debian's installer does: software that advertises
``gethostbyname(gethostname())`` advertises loopback there, which the tests catch.

A process runs on a host through ``ip netns exec`` (which also bind-mounts ``/etc/netns/<ns>/hosts``
over ``/etc/hosts``) and ``unshare --uts`` (its own hostname), in its own process group, stopped by its
pid. The test process talks to the hosts from the ``client`` host: :meth:`Fleet.inside` moves the calling
thread (only it) into a host's network namespace and back. Everything made is removed on exit, failed
test or not, in reverse order; :func:`sweep` removes what a killed run left behind.

Needs root and ``ip``/``unshare`` (iproute2, util-linux); :func:`skip_reason` says why not when not.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

from sglang_kvbm.ops.demo.server import stop_group

PREFIX = "kvbmfleet"  # every namespace this harness makes starts with it
SUBNET = "10.213.7"  # /24 (RFC 1918), only ever inside these namespaces
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def skip_reason() -> Optional[str]:
    """Why fleet tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (iproute2 / util-linux)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def sweep() -> None:
    """Remove namespaces, their /etc/netns files and the route a killed run of this harness left behind."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            _ip("netns", "del", name, check=False)
    for path in Path("/etc/netns").glob(f"{PREFIX}*") if Path("/etc/netns").exists() else ():
        shutil.rmtree(path, ignore_errors=True)
    _ip("route", "del", "unreachable", f"{SUBNET}.0/24", check=False)


class Host:
    def __init__(self, fleet: "Fleet", name: str, address: str) -> None:
        self.fleet, self.name, self.address = fleet, name, address
        self.ns = f"{PREFIX}-{name}"
        self.hostname = f"{name}.fleet"

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` run on this host: its network namespace, /etc/hosts and hostname."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.hostname, *map(str, args)]

    def run(self, args: Sequence[str], env: Optional[Mapping[str, str]] = None,
            timeout: float = 120.0) -> subprocess.CompletedProcess:
        """A short command on this host, waited for."""
        return subprocess.run(self.command(args), env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)

    def cut(self) -> None:
        """Off the network (its link down): packets to and from it are lost, its processes keep running."""
        _ip("-n", self.ns, "link", "set", "eth0", "down")

    def restore(self) -> None:
        _ip("-n", self.ns, "link", "set", "eth0", "up")


class Fleet:
    """Hosts named ``names`` at ``SUBNET.10``, ``.11``, ...: ``with Fleet(names) as fleet: fleet["w1"].address``."""

    def __init__(self, names: Sequence[str]) -> None:
        self.hosts = {name: Host(self, name, f"{SUBNET}.{10 + i}") for i, name in enumerate(names)}
        self._switch = f"{PREFIX}-switch"
        self._procs: list[subprocess.Popen] = []
        self._undo: list[tuple] = []

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> "Fleet":
        sweep()
        try:
            # First of all: no packet for the subnet leaves this machine, whatever fails later.
            _ip("route", "add", "unreachable", f"{SUBNET}.0/24")
            self._undo.append(("route", "del", "unreachable", f"{SUBNET}.0/24"))
            _ip("netns", "add", self._switch)
            self._undo.append(("netns", "del", self._switch))
            _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self._switch, "link", "set", "br0", "up")
            for host in self.hosts.values():
                self._add(host)
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, host: Host) -> None:
        _ip("netns", "add", host.ns)
        self._undo.append(("netns", "del", host.ns))
        etc = Path("/etc/netns") / host.ns
        etc.mkdir(parents=True, exist_ok=True)
        self._undo.append(("rmtree", str(etc)))
        lines = ["127.0.0.1 localhost", f"127.0.1.1 {host.hostname} {host.name}"]
        lines += [f"{other.address} {other.hostname}-addr" for other in self.hosts.values()]
        (etc / "hosts").write_text("\n".join(lines) + "\n")
        # One veth pair, each end created straight in its namespace: nothing appears in the machine's own.
        port = f"p-{host.name}"[:15]
        _ip("link", "add", "name", port, "netns", self._switch, "type", "veth", "peer", "name", "eth0", "netns",
            host.ns)
        _ip("-n", self._switch, "link", "set", port, "master", "br0")
        _ip("-n", self._switch, "link", "set", port, "up")
        _ip("-n", host.ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")

    def spawn(self, host: Host, args: Sequence[str], *, env: Optional[Mapping[str, str]] = None,
              log: Optional[Path] = None) -> subprocess.Popen:
        """A long-running process on ``host`` in its own process group, stopped on exit if not before."""
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(host.command(args), env={**os.environ, **(env or {})}, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if log:
                out.close()
        self._procs.append(proc)
        return proc

    @contextlib.contextmanager
    def inside(self, host: Host) -> Iterator[None]:
        """The calling thread in ``host``'s network namespace (sockets it opens meanwhile are that host's)."""
        own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{host.ns}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(target)
            os.close(own)

    def close(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                stop_group(proc, grace=5.0)
        self._procs.clear()
        for step in reversed(self._undo):
            if step[0] == "rmtree":
                shutil.rmtree(step[1], ignore_errors=True)
            else:
                _ip(*step, check=False)
        self._undo.clear()

    def __exit__(self, *exc) -> None:
        self.close()


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def wait_for(what, timeout: float, step: float = 0.2, message: str = "timed out"):
    deadline = time.monotonic() + timeout
    while True:
        result = what()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(message)
        time.sleep(step)
