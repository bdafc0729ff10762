"""Replaying a worker's KV event stream from SGLang's real ZMQ publisher.

SGLang's publisher answers a replay request by sending its whole buffer through a ROUTER
socket, which silently drops messages past its send high-water mark, the end marker too.
``replay`` must still return every buffered batch, in order, exactly once.
"""

from __future__ import annotations

import inspect
import threading

import msgspec
import pytest
import zmq
from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from sglang_kvbm.integration.sglang.event_stream import replay
from sglang_kvbm.ops.demo.server import free_port


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(ts=float(i), events=[BlockStored(block_hashes=[i], parent_block_hash=i - 1 if i else None,
                                                         token_ids=list(range(i, i + 64)), block_size=64,
                                                         lora_id=None, medium="CPU_PINNED")])


@pytest.mark.skipif("bind" not in inspect.signature(ZmqEventPublisher.__init__).parameters,
                    reason="SGLang 0.5.21's publisher takes no bind (0.5.22 on): this test's publisher binds its port")
def test_replay_returns_every_buffered_batch():
    """More batches than the ROUTER's high-water mark (1000), from SGLang's own publisher. Whether the
    ROUTER drops depends on how fast this client reads (here it keeps up; a busy machine's did not,
    in the soak): the next test makes the drops happen."""
    n = 6000
    replay_ep = f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://127.0.0.1:{free_port()}", bind=True,
                                  replay_endpoint=replay_ep, buffer_steps=n)
    try:
        for i in range(n):
            publisher.publish(batch(i))
        publisher._event_queue.join()  # the publisher thread has sequenced and buffered every batch
        batches = replay(replay_ep)
        assert [seq for seq, _ in batches] == list(range(n))
        assert [b.events[0].block_hashes[0] for _, b in batches] == list(range(n))
        assert replay(replay_ep, start_seq=n - 10)[0][0] == n - 10
    finally:
        publisher.shutdown()


def test_replay_asks_again_after_a_gap_and_a_lost_end_marker():
    """A ROUTER that loses batch 3 and the end marker on the first request, as one past its
    high-water mark does: the second request, from seq 3, brings the rest."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    payloads = [msgspec.msgpack.encode(batch(i)) for i in range(8)]
    asked = []

    def serve():
        for round_ in range(2):
            client, _, start = router.recv_multipart()
            asked.append(int.from_bytes(start, "big"))
            for seq in range(asked[-1], len(payloads)):
                if round_ == 0 and seq == 3:
                    continue
                router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payloads[seq]])
            if round_ == 1:
                router.send_multipart([client, b"", b"", ZmqEventPublisher.END_SEQ, b""])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        batches = replay(endpoint, timeout=10.0, quiet=0.5)
    finally:
        server.join(timeout=10)
        router.close()
    assert asked == [0, 3]
    assert [seq for seq, _ in batches] == list(range(8))
