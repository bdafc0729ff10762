"""``doctor``'s rows for the shared tier (G4, Mooncake): its client loads, its master answers, and what listens where.

Where a listener of the master is on this machine, its bound address is read
from ``/proc/net/tcp{,6}``: on every address (0.0.0.0, ``::``) is a warning
with the flag that moves it. What Mooncake cannot bind to one address (each
store client's two transfer listeners) is said, with its port range, so it can
be firewalled. README "What listens where" has the measurements.
"""

from __future__ import annotations

import urllib.parse
from typing import Mapping

from sglang_kvbm.base.needs import pip_install
from sglang_kvbm.base.values import ConfigError

Row = tuple  # (check, status, detail): doctor.Row's fields (doctor imports this module, not the reverse)


def _row(check: str, status: str, detail: str) -> Row:
    return (check, status, detail)


EMBEDDED = ("mooncake_master's embedded metadata server always listens on every address (Mooncake 0.3.13 ignores "
            "--http_metadata_server_host)")
METADATA_FIX = ("firewall port {port}, or use SGLANG_KVBM_MOONCAKE_METADATA=P2PHANDSHAKE (no metadata server), or run "
                "`mooncake_http_metadata_server --host=127.0.0.1` instead")


def g4_rows(config, environ: Mapping[str, str]) -> list[Row]:
    """The client loads (it needs libibverbs1), the master answers, and where each G4 listener is bound."""
    rows: list[Row] = []
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        fix = ("apt-get install libibverbs1" if "ibverbs" in str(exc)
               else f"{pip_install('mooncake')} (or [mooncake-cuda])")
        rows.append(_row("G4 (Mooncake)", "FAIL", f"the Mooncake client does not load ({exc}): {fix}"))
        return rows
    from sglang_kvbm.tiers.mooncake.probe import unreachable_endpoints

    metadata = config.mooncake_metadata or ""
    down = unreachable_endpoints(config.mooncake_master, metadata)
    if down:
        rows.append(_row("G4 (Mooncake)", "warn", f"{', '.join(down)} did not accept a connection: the server starts "
                        "without G4 and retries (start mooncake_master, or fix SGLANG_KVBM_MOONCAKE_MASTER/_METADATA)"))
    elif metadata == "P2PHANDSHAKE":
        rows.append(_row("G4 (Mooncake)", "ok", f"master {config.mooncake_master} answers (P2PHANDSHAKE: no metadata "
                        "server)"))
    else:
        rows.append(_row("G4 (Mooncake)", "ok", f"master {config.mooncake_master} and metadata server answer"))
    _advertised(rows, config.mooncake_master, environ)
    _master(rows, config.mooncake_master)
    _metadata(rows, metadata)
    _transfer_ports(rows, environ)
    return rows


def _advertised(rows: list[Row], master: str, environ: Mapping[str, str]) -> None:
    """What this worker's client advertises to its peers (where they read and write its G4 memory), and why."""
    from sglang_kvbm.tiers.mooncake.address import VARIABLE, advertised

    try:
        found = advertised(master, environ)
    except ConfigError as exc:
        rows.append(_row("G4 advertised address", "FAIL", str(exc)))
        return
    rows.append(_row("G4 advertised address", "ok", f"peers reach this worker's G4 memory at {found.host} "
                     f"({found.why}; {VARIABLE} sets it)"))


def _bound(check: str, found: list, port: int, fix: str) -> Row:
    addresses = ", ".join(str(lsn) for lsn in found)
    if not found:
        return _row(check, "info", f"nothing listens on port {port} here")
    if any(lsn.wildcard for lsn in found):
        return _row(check, "warn", f"listens on {addresses}: every address of this machine; {fix}")
    return _row(check, "ok", f"listens on {addresses} only")


def _master(rows: list[Row], master: str) -> None:
    """The master's RPC (the configured address) and its metrics port (from its command line), when it runs here."""
    from sglang_kvbm.tiers.mooncake.address import split
    from sglang_kvbm.tiers.mooncake.listeners import command_line, flag, is_local, listening_on, owner

    host, port = split(master)
    if port is None or not is_local(host):
        rows.append(_row("G4 master listeners", "info", f"{master} is another machine's: start mooncake_master there "
                        "with --rpc_address and --metrics_host set to the address you name (both default to 0.0.0.0)"))
        return
    bound = listening_on(port)
    rows.append(_bound("G4 master RPC", bound, port, "start mooncake_master with --rpc_address=127.0.0.1 (or the "
                       "address you name)"))
    pid = owner(bound[0]) if bound else None
    args = command_line(pid) if pid is not None else []
    if not args:
        if bound:
            rows.append(_row("G4 master metrics", "info", "cannot read mooncake_master's command line (another user's "
                            "process): check it runs with --metrics_host=127.0.0.1 (default 0.0.0.0, port 9003)"))
        return
    value = flag(args, "metrics_port") or "9003"
    metrics = int(value) if value.isdigit() else 9003
    rows.append(_bound("G4 master metrics", listening_on(metrics, pid=pid), metrics,
                       "start mooncake_master with --metrics_host=127.0.0.1 (or the address you name)"))


def _metadata(rows: list[Row], metadata: str) -> None:
    from sglang_kvbm.tiers.mooncake.listeners import is_local, listening_on

    if metadata == "P2PHANDSHAKE":
        rows.append(_row("G4 metadata", "ok", "P2PHANDSHAKE: no metadata server (clients handshake with each other)"))
        return
    parsed = urllib.parse.urlsplit(metadata)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    if not is_local(parsed.hostname or ""):
        rows.append(_row("G4 metadata", "info", f"{metadata} is another machine's: {EMBEDDED}: "
                        + METADATA_FIX.format(port=port)))
        return
    rows.append(_bound("G4 metadata", listening_on(port), port, f"{EMBEDDED}: {METADATA_FIX.format(port=port)}"))


def _transfer_ports(rows: list[Row], environ: Mapping[str, str]) -> None:
    from sglang_kvbm.tiers.mooncake.listeners import rpc_port_range

    low, high, problem = rpc_port_range(environ)
    if problem:
        rows.append(_row("G4 transfer port range", "warn", problem))
    rows.append(_row("G4 transfer ports", "info", (
        f"each worker rank (and each mooncake_client lender) listens on 2 ports in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT = "
        f"{low}-{high} on every address (0.0.0.0: transfer RPC, [::]: TCP data, where peers read and write the "
        "memory it registered): firewall them; Mooncake cannot bind them to one address")))
