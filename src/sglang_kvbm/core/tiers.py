"""The storage tiers, named as KVBM names them and as the router's events spell them."""

from __future__ import annotations

import enum


class Tier(enum.Enum):
    """Where a page lives. ``value`` is the ``medium`` string of its KV events.

    Dynamo's indexer accepts these spellings (``GPU`` -> device, ``CPU_PINNED``
    -> host, ``DISK`` -> disk) and drops any event whose medium it does not know.
    """

    DEVICE = "GPU"  # G1: SGLang's own KV pool
    HOST = "CPU_PINNED"  # G2: host memory (pinned when CUDA is present)
    DISK = "DISK"  # G3: local disk through NIXL

    @property
    def medium(self) -> str:
        return self.value


# The medium strings Dynamo's indexer (ai-dynamo-runtime 1.6.1) maps to a tier; any
# other string makes it drop the whole event.
ROUTER_MEDIA = frozenset({"GPU", "DEVICE", "CPU", "CPU_PINNED", "CPU_TIER1", "DISK", "CPU_TIER2", "NVME", "STORAGE"})
