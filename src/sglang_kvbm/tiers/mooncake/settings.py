"""The mooncake tier's settings: its ``SGLANG_KVBM_MOONCAKE_*`` variables, parsers and checks (``config.settings``
reads them with the rest)."""

from __future__ import annotations

from sglang_kvbm.base.values import ConfigError, Var, _bool, _eg, _gib_or_zero
from sglang_kvbm.tiers.mooncake import address as advertised_address


def address(name: str, raw: str) -> str:
    """``host:port`` (Mooncake's master)."""
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{name}={raw!r} is not host:port: set it to the Mooncake master's RPC address, "
                          f"e.g. {_eg(name, '127.0.0.1:50051')}")
    return raw


def metadata_url(name: str, raw: str) -> str:
    """An http(s) URL (Mooncake's metadata server), or Mooncake's ``P2PHANDSHAKE``."""
    if raw == "P2PHANDSHAKE" or raw.startswith(("http://", "https://")):
        return raw
    raise ConfigError(f"{name}={raw!r} is not a metadata server: set it to its URL, "
                      f"e.g. {_eg(name, 'http://127.0.0.1:8080/metadata')}, or to P2PHANDSHAKE")


def protocol(name: str, raw: str) -> str:
    if raw.lower() not in ("tcp", "rdma"):
        raise ConfigError(f"{name}={raw!r} is not a Mooncake transfer protocol: set it to tcp or rdma")
    return raw.lower()


def check_environment(environ, master, metadata) -> None:
    """What in Mooncake's own environment breaks G4 (checked only with G4 on): ``MC_LEGACY_RPC_PORT_BINDING``
    (any value: Mooncake only asks whether it is there) with a metadata server URL makes the client take its
    transfer RPC port from its local hostname, which carries none, so every ``setup`` fails (rc -1 after ~2 s,
    measured with Mooncake 0.3.13.post1). With ``P2PHANDSHAKE`` it changes nothing (measured). And a loopback
    ``MOONCAKE_LOCAL_HOSTNAME`` facing a master on another address (``address``)."""
    advertised_address.check(master, environ)  # a loopback MOONCAKE_LOCAL_HOSTNAME facing a master elsewhere
    if "MC_LEGACY_RPC_PORT_BINDING" in environ and metadata != "P2PHANDSHAKE":
        raise ConfigError(
            f"MC_LEGACY_RPC_PORT_BINDING={environ['MC_LEGACY_RPC_PORT_BINDING']!r} is set (any value turns it on, "
            "0 too) with G4 on (SGLANG_KVBM_MOONCAKE_MASTER) and a metadata server: Mooncake then takes the "
            "client's transfer RPC port from its local hostname, which has none, and G4's setup fails every time: "
            "unset MC_LEGACY_RPC_PORT_BINDING (or use SGLANG_KVBM_MOONCAKE_METADATA=P2PHANDSHAKE)")



def check(config) -> None:
    """Settings that are wrong only together (start-up, with the mooncake tier on)."""
    if not config.has_mooncake:
        return
    if not config.has_host:
        raise ConfigError(
            "SGLANG_KVBM_MOONCAKE_MASTER (the shared tier) needs a host tier to stage and write through: set "
            "DYN_KVBM_CPU_CACHE_GB (e.g. DYN_KVBM_CPU_CACHE_GB=4) or DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"
        )
    if config.mooncake_metadata is None:
        raise ConfigError(
            "SGLANG_KVBM_MOONCAKE_MASTER is set but SGLANG_KVBM_MOONCAKE_METADATA is not: set it to P2PHANDSHAKE "
            "(clients find each other, no metadata server), or to a metadata server's URL, e.g. "
            "http://<host>:8080/metadata"
        )

VARIABLES: tuple[Var, ...] = (
    Var("SGLANG_KVBM_MOONCAKE_MASTER", "mooncake_master", address,
         "Mooncake master host:port; setting it turns on the tier shared by every worker (G4)", text=True),
    Var("SGLANG_KVBM_MOONCAKE_METADATA", "mooncake_metadata", metadata_url,
         "P2PHANDSHAKE (no metadata server), or a Mooncake metadata server's URL", text=True),
    Var("SGLANG_KVBM_MOONCAKE_PROTOCOL", "mooncake_protocol", protocol, "tcp (default) or rdma", text=True),
    Var("SGLANG_KVBM_MOONCAKE_SEGMENT_GB", "mooncake_segment_gb", _gib_or_zero,
         "memory this worker lends the store (default 0: a standalone store process lends it)"),
    Var("SGLANG_KVBM_MOONCAKE_OFFLOAD_FILTER", "mooncake_offload_filter", _bool,
         "write a block to G4 only once it was reused (KVBM's frequency filter), not every stored block"),
)
