"""Inside Dynamo's SGLang worker (``python -m dynamo.sglang``): what the launcher sets up for Dynamo's router.

:func:`on_launch` runs in SGLang's launcher once the flags are checked, before any rank starts; outside
Dynamo it does nothing.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)


def under_dynamo() -> bool:
    """Whether this process is Dynamo's SGLang worker."""
    return "dynamo.sglang" in sys.modules


def on_launch(config, events: Optional[dict]) -> None:
    """``config``: the worker's ``KvbmConfig``; ``events``: its checked ``--kv-events-config`` (or None)."""
    warn_if_dynamo_will_not_connect(events)
    if config.has_mooncake and under_dynamo():  # the router learns G4's object names from the worker's registration
        from sglang_kvbm.integration.dynamo.mooncake import install

        install()


_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


def warn_if_dynamo_will_not_connect(events: Optional[dict]) -> None:
    """Under ``dynamo.sglang``, a non-wildcard events host is connected to at this machine's IP, not that host.

    Dynamo's worker (``dynamo/sglang/publisher.py``, ``kv_event_connect_ip``) subscribes at
    127.0.0.1 only for a wildcard bind; for any other host it uses ``get_local_ip_auto()``,
    so with ``tcp://127.0.0.1:P`` the router receives no events at all, and nothing says so.
    """
    if events is None or not under_dynamo():
        return
    parts = urlsplit(events["endpoint"])
    host = parts.hostname or ""
    if parts.scheme != "tcp" or host in _WILDCARDS or os.environ.get("SGLANG_HOST_IP") == host:
        return
    logger.warning(
        "kvbm: --kv-events-config endpoint %s names host %r: Dynamo's worker will subscribe at this machine's "
        "IP instead, and its router will receive no KV events. Use tcp://*:%s, or set SGLANG_HOST_IP=%s",
        events["endpoint"], host, parts.port, host,
    )
