"""The linker's layer counter, which is also how it meets the model worker.

SGLang registers a linker's ``layer_done_counter`` with the KV pool (the
forward waits on it per layer, see ``layer_counter``) and with the model
worker; the second registration (``hooks``) hands this counter the worker, on
which the disk onboarding policy then times prefill.
"""

from __future__ import annotations

from sglang_kvbm.integration.sglang.prefill_meter import attach_prefill_meter
from sglang_kvbm.transfer.layer_counter import LayerCounter


class KvbmLayerCounter(LayerCounter):
    def __init__(self, num_layers: int, policy=None, *, cuda: bool = False) -> None:
        super().__init__(num_layers, cuda=cuda)
        self._policy = policy
        self.worker = None

    def attach_kvbm_worker(self, worker) -> None:
        if self.worker is not None:
            return
        self.worker = worker
        if self._policy is not None:
            attach_prefill_meter(worker, self._policy.prefill)
