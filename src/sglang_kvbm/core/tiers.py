"""The storage tiers in one table: each tier's name, the medium of its KV events, and KVBM's level for it.

Three vocabularies name a tier, and this table is the one place that maps them:

* this library's **names** (``device``, ``host``, ``disk``, ``mooncake``, ``object``): a tier's folder under
  ``tiers/``, and the keys of ``/stats``, ``/tiers``, counters, hit rates, metric labels and logs;
* the **medium** of its KV events (:class:`Tier`, whose values are on the wire: Dynamo's router reads them);
* **KVBM's levels** (``G1`` device, ``G2`` host, ``G3`` disk, ``G4`` shared or object storage).

:data:`TIERS` holds one :class:`TierInfo` per tier, nearest first; :func:`by_name` and :func:`by_medium` look one
up, and :data:`DEVICE`, :data:`HOST`, :data:`DISK`, :data:`MOONCAKE`, :data:`OBJECT` name the rows. A tier added
below host (a folder under ``tiers/`` and its line in ``tiers.registry``) adds its row here too.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Union


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


@dataclasses.dataclass(frozen=True, slots=True)
class TierInfo:
    """One tier in every vocabulary."""

    name: str  # this library's name (a folder under tiers/; the key of /stats, /tiers, counters, metric labels)
    level: str  # KVBM's: G1 .. G4
    medium: Optional[Tier]  # the medium of its KV events; None: it announces nothing to the router
    description: str  # one line

    @property
    def announced(self) -> bool:
        """Its blocks are in the KV event stream (the router scores them)."""
        return self.medium is not None


DEVICE = TierInfo("device", "G1", Tier.DEVICE, "SGLang's own KV pool on the device")
HOST = TierInfo("host", "G2", Tier.HOST, "host memory (pinned when CUDA is present)")
DISK = TierInfo("disk", "G3", Tier.DISK, "local disk through NIXL")
MOONCAKE = TierInfo("mooncake", "G4", None, "a Mooncake Store every worker shares (the router learns its blocks "
                    "from Mooncake, not from the event stream)")
OBJECT = TierInfo("object", "G4", None, "object storage (S3) through NIXL's OBJ backend (no router scores it)")

TIERS: tuple[TierInfo, ...] = (DEVICE, HOST, DISK, MOONCAKE, OBJECT)  # nearest first
_BY_NAME = {tier.name: tier for tier in TIERS}
_BY_MEDIUM = {tier.medium.value: tier for tier in TIERS if tier.medium is not None}


def by_name(name: str) -> TierInfo:
    """The tier this library names ``name`` (KeyError for a name no tier has)."""
    return _BY_NAME[name]


def by_medium(medium: Union[Tier, str, object]) -> TierInfo:
    """The tier whose KV events carry ``medium``: a :class:`Tier`, its string, or an engine's enum of the same
    spellings (SGLang's ``StorageMedium``); KeyError for one no tier announces (Dynamo's aliases included)."""
    return _BY_MEDIUM[getattr(medium, "value", medium)]
