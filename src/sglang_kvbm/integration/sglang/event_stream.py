"""Read a worker's KV event stream: SGLang's ZMQ publisher, decoded with SGLang's own types."""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import msgspec
import zmq
from sglang.srt.disaggregation.kv_events import KVEventBatch

_END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(type=KVEventBatch)


def replay(endpoint: str, start_seq: int = 0, timeout: float = 10.0, quiet: float = 1.0
           ) -> list[tuple[int, KVEventBatch]]:
    """Every batch the publisher still buffers from ``start_seq`` on, via its replay ROUTER.

    SGLang's publisher answers a replay request by sending its whole buffer at once, and a ZMQ
    ROUTER silently drops what exceeds its send high-water mark (1000 messages by default):
    past that, batches can go missing mid-stream and the end marker with them. So a round
    that shows a gap, or that falls ``quiet`` seconds silent without the end marker, asks
    again from the first batch it lacks; each round brings at least the first batch it asks for
    (the publisher's queue to this client is empty when a round starts).
    """
    batches: list[tuple[int, KVEventBatch]] = []
    decoder = _decoder()
    while True:
        got, ended = _replay_round(endpoint, batches[-1][0] + 1 if batches else start_seq, timeout, quiet)
        batches.extend((seq, decoder.decode(payload)) for seq, payload in got)
        if ended:
            return batches
        if not got:
            raise TimeoutError(f"no replay from {endpoint} within {timeout}s")


def _replay_round(endpoint: str, start_seq: int, timeout: float, quiet: float) -> tuple[list[tuple[int, bytes]], bool]:
    """One replay request: the unbroken run of batches it brought, and whether it ended cleanly."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)  # take whatever arrives: the sender's limit is the one that drops
    sock.connect(endpoint)
    got: list[tuple[int, bytes]] = []
    broken = False
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while sock.poll(int((quiet if got else timeout) * 1000)):
            _, _topic, seq_bytes, payload = sock.recv_multipart()
            if seq_bytes == _END_SEQ:
                return got, not broken
            seq = int.from_bytes(seq_bytes, "big")
            if broken or (got and seq != got[-1][0] + 1):
                broken = True  # a batch was dropped: keep the run so far, ask again after this round
                continue
            got.append((seq, payload))
        return got, False
    finally:
        sock.close()


def subscribe(endpoint: str, topic: str = "", timeout: Optional[float] = None,
              stop: Optional[Callable[[], bool]] = None) -> Iterator[tuple[int, KVEventBatch]]:
    """Live batches from a publisher's PUB socket; stops after ``timeout`` seconds of silence, or once
    ``stop()`` answers True (asked at least every 0.2 s)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sock.connect(endpoint)
    decoder = _decoder()
    step = 200 if stop is not None else (None if timeout is None else int(timeout * 1000))
    silent = 0.0
    try:
        while stop is None or not stop():
            if sock.poll(step):
                _topic, seq, payload = sock.recv_multipart()
                silent = 0.0
                yield int.from_bytes(seq, "big"), decoder.decode(payload)
                continue
            silent += (step or 0) / 1000
            if timeout is not None and silent >= timeout:
                return
    finally:
        sock.close()
