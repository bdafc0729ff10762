"""Whether a Mooncake master and its metadata server accept connections (plain sockets: no Mooncake, no GIL held)."""

from __future__ import annotations

import socket
import urllib.parse
from typing import Optional


def _http_address(url: str) -> Optional[str]:
    """``host:port`` of an http(s) URL (None for Mooncake's P2PHANDSHAKE)."""
    if not url.startswith(("http://", "https://")):
        return None
    parsed = urllib.parse.urlsplit(url)
    return f"{parsed.hostname}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}"


def _reachable(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
        return True
    except OSError:
        return False


def unreachable_endpoints(master: str, metadata: str, timeout: float = 1.0) -> list[str]:
    """``host:port`` of the master and of the metadata server (when it is a URL) that refused or timed out."""
    return [a for a in (master, _http_address(metadata)) if a and not _reachable(a, timeout)]
