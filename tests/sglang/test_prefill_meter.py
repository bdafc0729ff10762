"""The prefill meter times extend batches on the model worker instance it wraps, and only those it should.

The model worker here is a stand-in object with SGLang's ``forward_batch_generation`` signature (a real
``TpModelWorker`` needs a loaded model; the servers in test_server_* run the real one); the batches carry
SGLang's real ``ForwardMode``.
"""

import types

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_kvbm.core.onboard_policy import LinearCostMeter
from sglang_kvbm.integration.sglang.prefill_meter import attach_prefill_meter


def _batch(mode, tokens, consumer=-1):
    return types.SimpleNamespace(forward_mode=mode, extend_num_tokens=tokens, hicache_consumer_index=consumer)


def test_only_extend_batches_without_loads_are_timed():
    ran = []
    worker = types.SimpleNamespace(device="cpu", forward_batch_generation=lambda batch, *a, **k: ran.append(batch))
    meter = LinearCostMeter()
    attach_prefill_meter(worker, meter)
    worker.forward_batch_generation(_batch(ForwardMode.EXTEND, 128))
    worker.forward_batch_generation(_batch(ForwardMode.DECODE, 4))
    worker.forward_batch_generation(_batch(ForwardMode.EXTEND, 256, consumer=3))  # waits for its loads too
    worker.forward_batch_generation(_batch(ForwardMode.EXTEND, 0))
    assert len(ran) == 4  # every batch still runs
    assert len(meter) == 1  # the extend batch without loads only
