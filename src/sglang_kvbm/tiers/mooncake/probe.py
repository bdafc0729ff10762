"""Whether a Mooncake master and its metadata server accept connections (plain sockets: no Mooncake, no GIL held)."""

from __future__ import annotations

import urllib.parse
from typing import Optional

from sglang_kvbm.tiers.heartbeat import unanswered


def _http_address(url: str) -> Optional[str]:
    """``host:port`` of an http(s) URL (None for Mooncake's P2PHANDSHAKE)."""
    if not url.startswith(("http://", "https://")):
        return None
    parsed = urllib.parse.urlsplit(url)
    return f"{parsed.hostname}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}"


def endpoints(master: str, metadata: str) -> list[str]:
    """``host:port`` of the master, and of the metadata server when it is a URL."""
    return [a for a in (master, _http_address(metadata)) if a]


def unreachable_endpoints(master: str, metadata: str, timeout: float = 1.0) -> list[str]:
    """``host:port`` of the master and of the metadata server (when it is a URL) that refused or timed out."""
    return unanswered(endpoints(master, metadata), timeout)
