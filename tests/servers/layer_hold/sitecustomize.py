"""Test-only: holds back every layer but the first of each layer-wise load, and records the forward's waits.

Put this directory on a server's PYTHONPATH with ``KVBM_TEST_HOLD_LAYERS=<seconds>`` and
``KVBM_TEST_RECORD=<file>``: in the scheduler process, the kvbm loader sleeps that long before
copying each layer after layer 0, and every wait of the forward on the layer counter is
appended to the file as ``wait <layer> <start> <end>`` (and each copy as ``copy <layer> <time>``).
"""

import os

_HOLD = os.environ.get("KVBM_TEST_HOLD_LAYERS")
_RECORD = os.environ.get("KVBM_TEST_RECORD")

if _HOLD and _RECORD:
    import sys
    import time

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: the harness
    from harness.import_patch import patch_on_import  # noqa: E402

    def _log(line: str) -> None:
        with open(_RECORD, "a") as f:
            f.write(line + "\n")

    def _patch(module) -> None:
        loader_cls = module.LayerLoader
        original_init = loader_cls.__init__

        def init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)

            def hold(index, layer):
                if layer > 0:
                    time.sleep(float(_HOLD))
                _log(f"copy {layer} {time.monotonic():.6f}")

            self.before_layer = hold
            counter = self._counter
            original_wait = counter.wait_until

            def wait_until(layer):
                started = time.monotonic()
                original_wait(layer)
                if counter.consuming():
                    _log(f"wait {layer} {started:.6f} {time.monotonic():.6f}")

            counter.wait_until = wait_until

        loader_cls.__init__ = init

    patch_on_import({"sglang_kvbm.manager.layer_loader": _patch})
