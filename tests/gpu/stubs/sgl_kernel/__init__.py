"""Stub of `sgl_kernel` for the GPU pack: any name imports, any call raises (tests/gpu/stubs/_kvbm_stub.py, STUBS)."""

import _kvbm_stub

_kvbm_stub.stub_package(__name__)
del _kvbm_stub
