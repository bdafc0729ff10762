"""Read a worker's KV event stream: SGLang's ZMQ publisher, decoded with SGLang's own types."""

from __future__ import annotations

from typing import Iterator, Optional

import msgspec
import zmq
from sglang.srt.disaggregation.kv_events import KVEventBatch

_END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(type=KVEventBatch)


def replay(endpoint: str, start_seq: int = 0, timeout: float = 10.0) -> list[tuple[int, KVEventBatch]]:
    """Every batch the publisher still buffers from ``start_seq`` on, via its replay ROUTER."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        decoder = _decoder()
        batches = []
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError(f"no replay from {endpoint} within {timeout}s")
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == _END_SEQ:
                return batches
            batches.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    finally:
        sock.close()


def subscribe(endpoint: str, topic: str = "", timeout: Optional[float] = None) -> Iterator[tuple[int, KVEventBatch]]:
    """Live batches from a publisher's PUB socket; stops after ``timeout`` seconds of silence."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sock.connect(endpoint)
    decoder = _decoder()
    try:
        while sock.poll(None if timeout is None else int(timeout * 1000)):
            _topic, seq, payload = sock.recv_multipart()
            yield int.from_bytes(seq, "big"), decoder.decode(payload)
    finally:
        sock.close()
