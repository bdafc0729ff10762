"""``sglang-kvbm events``: watch a worker's KV event stream, decoded, with per-tier block counts."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from sglang_kvbm.core.tiers import DEVICE
from sglang_kvbm.integration.sglang.event_stream import replay, subscribe


class TierTally:
    """Which blocks the stream says each tier holds."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}
        self.events = 0
        self.gaps = 0
        self._last_seq: Optional[int] = None

    def add(self, seq: int, batch) -> list[str]:
        lines = []
        if self._last_seq is not None and seq != self._last_seq + 1:
            self.gaps += 1
            lines.append(f"  ! gap: expected seq {self._last_seq + 1}, got {seq}")
        self._last_seq = seq
        for event in batch.events:
            self.events += 1
            medium = getattr(event, "medium", None)
            medium = str(getattr(medium, "value", medium) or DEVICE.medium.value)
            if isinstance(event, BlockStored):
                self.blocks.setdefault(medium, set()).update(event.block_hashes)
                parent = "root" if event.parent_block_hash is None else f"{event.parent_block_hash:#x}"
                salt = f" salt={event.cache_salt}" if event.cache_salt else ""
                lines.append(
                    f"  stored  {medium:<10} {len(event.block_hashes):>4} block(s) x {event.block_size} tokens, "
                    f"parent {parent}{salt}"
                )
            elif isinstance(event, BlockRemoved):
                self.blocks.setdefault(medium, set()).difference_update(event.block_hashes)
                lines.append(f"  removed {medium:<10} {len(event.block_hashes):>4} block(s)")
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()
                lines.append("  cleared every tier")
        return lines

    def summary(self) -> str:
        counts = ", ".join(f"{m}={len(b)}" for m, b in sorted(self.blocks.items())) or "empty"
        return f"[{self.events} events, {self.gaps} gaps] blocks per tier: {counts}"


def watch(
    endpoint: str,
    *,
    replay_endpoint: Optional[str] = None,
    seconds: Optional[float] = None,
    out: TextIO = sys.stdout,
) -> int:
    tally = TierTally()
    if replay_endpoint:
        for seq, batch in replay(replay_endpoint):
            _print_batch(out, tally, seq, batch)
        print(f"(replayed) {tally.summary()}", file=out, flush=True)
    deadline = None if seconds is None else time.monotonic() + seconds
    try:
        for seq, batch in subscribe(endpoint, timeout=seconds):
            _print_batch(out, tally, seq, batch)
            print(tally.summary(), file=out, flush=True)
            if deadline is not None and time.monotonic() > deadline:
                break
    except KeyboardInterrupt:
        pass
    print(f"final: {tally.summary()}", file=out, flush=True)
    return 0


def _print_batch(out: TextIO, tally: TierTally, seq: int, batch) -> None:
    rank = "" if batch.attn_dp_rank is None else f" dp_rank={batch.attn_dp_rank}"
    lines = tally.add(seq, batch)
    print(f"seq {seq} at {time.strftime('%H:%M:%S', time.localtime(batch.ts))}{rank}: {len(batch.events)} event(s)", file=out)
    for line in lines:
        print(line, file=out)
