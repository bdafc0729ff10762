# Everything a fresh machine needs, from this repository's files only.
#   make demo   - the CPU demo (stock SGLang vs SGLang + kvbm, one table)
#   make test   - install what the tests need and run them
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# Dynamo as a Dynamo 1.6.1 user has it: ai-dynamo and its SGLang worker on SGLang 0.5.21 (what
# `ai-dynamo[sglang]==1.6.1` pins), with every requirement of both as pinned there, in an environment of its
# own (Dynamo pins pydantic<=2.13.5 too). requirements/dynamo-1.6.1.txt lists them, less the two that cannot
# install from PyPI: `aisimulate` (ai-dynamo) and the `cuda-tile==1.6.0rc5` pin (sglang; flashinfer brings
# cuda-tile 1.7.0); ai-dynamo and sglang themselves go in after it with --no-deps. So the tests prove SGLang
# 0.5.23 in .venv and 0.5.21 in .venv-dynamo, where Dynamo's frontend, router, indexer and SGLang workers run
# (the tests start them from it) with this package and Mooncake's client beside them.
DYNAMO_VENV := .venv-dynamo
DYNAMO_REQUIREMENTS := requirements/dynamo-1.6.1.txt
DYNAMO_STAMP := $(DYNAMO_VENV)/.installed

.PHONY: demo test test-fast compat bench gpu-pack gpu-pack-check gpu-check native asan wheel wheel-check docs stubs clean system-deps
# The compiled block index (csrc/, nanobind): `pip install` builds it with the package (scikit-build-core),
# so a change to it reinstalls the package.
NATIVE_SOURCES := CMakeLists.txt $(wildcard csrc/*)

$(STAMP): pyproject.toml $(NATIVE_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip
	$(VENV)/bin/pip install -e '.[test]'
	touch $(STAMP)

$(DYNAMO_STAMP): pyproject.toml $(DYNAMO_REQUIREMENTS) $(NATIVE_SOURCES)
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/pip install --upgrade pip
	$(DYNAMO_VENV)/bin/pip install -r $(DYNAMO_REQUIREMENTS) 'mooncake-transfer-engine-non-cuda==0.3.13.post1'
	$(DYNAMO_VENV)/bin/pip install --no-deps 'sglang==0.5.21' 'ai-dynamo==1.6.1'
	$(DYNAMO_VENV)/bin/pip install --no-deps -e . --config-settings=build-dir='build/dynamo-{wheel_tag}'
	touch $(DYNAMO_STAMP)

demo: $(STAMP)
	$(VENV)/bin/sglang-kvbm demo

# Two pytest-xdist workers, a test file each at a time (a file's servers and module fixtures stay
# on one worker), in collection order: the files that start servers first (tests/conftest.py; xdist
# would otherwise start the files with the most tests first, and these, one or two tests each, last).
# Most of a server test's time is waiting (start-up, polling, another process's turn): two overlap
# well on 2 cores.
TEST_WORKERS ?= 2
# The two environments install side by side (each its own build directory for the block index): 264 s
# instead of 489 s one after the other, on a 2-core VM with nothing cached.
# The block index's own tests (tests/index) run under the sanitizers (`make asan`, ~100 s) and against the
# repaired wheel in a fresh environment (`make wheel-check`); the rest of the suite runs against that wheel
# installed into .venv in place of the editable install (a file missing from the wheel or a dependency missing
# from its metadata fails here); the docs build with warnings as errors.
test: system-deps
	$(MAKE) -j2 --output-sync=target $(STAMP) $(DYNAMO_STAMP)
	$(MAKE) -j2 --output-sync=target asan wheel-check docs
	$(VENV)/bin/pip install -q --no-deps --force-reinstall $(WHEEL_DIR)/*manylinux*.whl
	$(VENV)/bin/python -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	  --ignore=tests/index tests

# Mooncake (the shared tier's tests start a real mooncake_master) needs libibverbs1, over TCP too.
system-deps:
	@ldconfig -p | grep -q 'libibverbs\.so\.1' || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; \
	  else \
	    echo "Mooncake needs the system library libibverbs1: run  sudo apt-get install -y libibverbs1  (or your distribution's rdma-core), then make test again" >&2; \
	    exit 1; \
	  fi; }

# The SGLang releases `make test` does not run the whole suite on (CI: 0.5.23 in .venv, Dynamo's workers on 0.5.21
# in .venv-dynamo): the in-process suite on 0.5.21 (in .venv-dynamo, with the test tools added to it) and on 0.5.22
# (its own environment: SGLang 0.5.22 with --no-deps, then its requirements less the `cuda-tile` pin PyPI cannot
# install), and a stock and a kvbm server of each release serving evicted prefixes from host and disk. About 25
# minutes after the installs; results: README.md, "SGLang releases".
COMPAT_0522 := .venv-sglang-0.5.22
$(COMPAT_0522)/.installed: pyproject.toml $(NATIVE_SOURCES)
	$(PYTHON) -m venv $(COMPAT_0522)
	$(COMPAT_0522)/bin/pip install --upgrade pip
	$(COMPAT_0522)/bin/pip install --no-deps 'sglang==0.5.22' packaging
	$(COMPAT_0522)/bin/python tests/compat/requirements_of.py sglang --without cuda-tile > $(COMPAT_0522)/sglang-requirements.txt
	$(COMPAT_0522)/bin/pip install -r $(COMPAT_0522)/sglang-requirements.txt 'nixl[cu13]==1.3.2'
	$(COMPAT_0522)/bin/pip install -e '.[testtools]' --config-settings=build-dir='build/sglang-0.5.22-{wheel_tag}'
	touch $@

compat: system-deps $(STAMP) $(DYNAMO_STAMP) $(COMPAT_0522)/.installed
	$(DYNAMO_VENV)/bin/pip install -q -e '.[testtools]' --config-settings=build-dir='build/dynamo-{wheel_tag}'
	$(DYNAMO_VENV)/bin/python -m pytest -q -ra -m "not server" -n $(TEST_WORKERS) tests
	$(COMPAT_0522)/bin/python -m pytest -q -ra -m "not server" -n $(TEST_WORKERS) tests
	KVBM_TEST_RELEASES="$(DYNAMO_VENV)/bin/python $(COMPAT_0522)/bin/python" \
	  $(VENV)/bin/python -m pytest -q -ra tests/servers/test_server_releases.py

# Without the tests that start real SGLang servers (a few minutes), on this source tree (the editable install
# again, if `make test` left the wheel in .venv).
test-fast: system-deps $(STAMP)
	$(VENV)/bin/pip install -q --no-deps -e .
	$(VENV)/bin/python -m pytest -q -ra -m "not server" tests

# All benchmarks with their small CPU defaults (see benchmarks/README.md); about 25 minutes.
bench: $(STAMP)
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	$(VENV)/bin/python benchmarks/run_all.py

# SGLang, NIXL's POSIX backend and what they need that the GPU machines lack, cut to what tests/gpu and
# benchmarks/gpu_e2e.py run, into .gpu-pack/ (docs/gpu-pack.md; ~40 MiB, fails above 56): carry .gpu-pack to the
# GPU machine, then `make gpu-check` there. Needs PyPI here (wheels cached in build/gpu-pack/).
GPU_PACK ?= .gpu-pack
GPU_PACK_PYTHON ?= 3.12
gpu-pack: $(STAMP)
	$(VENV)/bin/python tests/gpu/pack.py --out $(GPU_PACK) --python-version $(GPU_PACK_PYTHON)

# The same pack for CPython 3.11, run here with only the GPU image's packages (torch 2.11.0, transformers 5.17.0,
# triton 3.6.0): the round trips, the imports as on CUDA, tests/gpu, gpu_e2e --quick. ~3 min after the first run.
gpu-pack-check: $(STAMP)
	$(VENV)/bin/python tests/gpu/pack.py --out build/gpu-pack-311 --python-version 3.11
	$(VENV)/bin/python tests/gpu/pack_check.py build/gpu-pack-311

# On a machine with a GPU and PyTorch, no SGLang and no install step: the block index built in place for that
# Python (`make native`, cmake and nanobind from it), then tests/gpu/check.py with SGLang from $(GPU_PACK) where
# it is there: tests/gpu plainly, again under PyTorch's CUDA stream sanitizer (small shapes), and
# benchmarks/gpu_e2e.py; one table at the end, every step's log in $$OUT (or build/gpu-check). About 5 minutes.
# Without the pack, the tests that need SGLang skip and the benchmark fails.
GPU_PYTHON ?= python3
gpu-check: native
	if [ -f $(GPU_PACK)/env.sh ]; then . ./$(GPU_PACK)/env.sh; else export PYTHONPATH=src; fi; \
	  $(GPU_PYTHON) tests/gpu/check.py $(GPU_CHECK_ARGS)

# The block index under AddressSanitizer + UndefinedBehaviorSanitizer (any UB fatal, warnings errors): its tests
# and the differential fuzz test (tests/index, which loads neither torch nor SGLang) with the interpreter
# running libasan (and libstdc++, whose __cxa_throw ASan must find at start-up), Python's allocator off so ASan
# sees every object, leak checks off (the interpreter's own would drown the report), pytest capturing at the
# Python level only (an ASan report goes to fd 2 as it happens). About 25 s to build, 70 s to run.
CXX ?= g++
ASAN_RUNTIME = $(shell $(CXX) -print-file-name=libasan.so) $(shell $(CXX) -print-file-name=libstdc++.so)
asan: $(STAMP)
	cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVBM_SANITIZE=ON -DCMAKE_CXX_COMPILER=$(CXX) \
	  -DPython_EXECUTABLE="$(abspath $(VENV))/bin/python" -Dnanobind_DIR="$$($(VENV)/bin/python -m nanobind --cmake_dir)"
	cmake --build build/asan --parallel
	LD_PRELOAD="$(ASAN_RUNTIME)" PYTHONMALLOC=malloc ASAN_OPTIONS=detect_leaks=0 \
	  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 KVBM_BLOCKS_SO="$$(ls build/asan/_blocks*.so)" \
	  $(VENV)/bin/python -m pytest -q -ra -p no:cacheprovider --capture=sys --confcutdir=tests/index tests/index

# The wheel users install: the sdist, then the wheel built from the sdist alone (`python -m build`, without
# pip's build isolation: the build tools are in .venv), repaired by auditwheel into the oldest manylinux tag its
# symbols allow. This machine's GCC 12 libstdc++ allows manylinux_2_34; release wheels for manylinux_2_28,
# cp311-cp313, x86_64 and aarch64 come from cibuildwheel (pyproject.toml, .github/workflows/wheels.yml).
WHEEL_DIR := dist
wheel: $(STAMP)
	rm -rf $(WHEEL_DIR)
	$(VENV)/bin/python -m build --no-isolation -o $(WHEEL_DIR)/built .
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/auditwheel repair -w $(WHEEL_DIR) $(WHEEL_DIR)/built/*.whl
	mv $(WHEEL_DIR)/built/*.tar.gz $(WHEEL_DIR)/ && rm -rf $(WHEEL_DIR)/built
	$(VENV)/bin/auditwheel show $(WHEEL_DIR)/*.whl

# The repaired wheel alone, as a user gets it: a fresh environment with the wheel and its declared dependencies
# only (no SGLang), the command line, and the block index's tests and fuzz test against the installed wheel.
# torch is held to .venv's release, so pip takes it from its cache rather than fetching a newer one; the
# environment (~5.5 GB with torch's CUDA libraries) is removed after the check.
WHEEL_VENV := build/venv-wheel
wheel-check: wheel
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q $(WHEEL_DIR)/*manylinux*.whl 'pytest>=8,<10' 'hypothesis>=6.100,<7' 'nanobind>=2.4' \
	  "torch==$$($(VENV)/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')"
	$(WHEEL_VENV)/bin/sglang-kvbm --version
	$(WHEEL_VENV)/bin/sglang-kvbm --help > /dev/null
	$(WHEEL_VENV)/bin/sglang-kvbm doctor > $(WHEEL_VENV)/doctor.txt; test $$? -le 1 && ! grep -q Traceback $(WHEEL_VENV)/doctor.txt
	$(WHEEL_VENV)/bin/python -m pytest -q -p no:cacheprovider --confcutdir=tests/index tests/index
	rm -rf $(WHEEL_VENV)

# The documentation site (docs/, mkdocs.yml) into build/site: a broken link or anchor, a page missing from the
# nav, or a configuration reference that no longer matches the code is an error.
docs: $(STAMP)
	$(VENV)/bin/python docs/gen_config_reference.py --check
	$(VENV)/bin/mkdocs build --strict -q

# The block index's type stub, from the installed build (tests/index/test_stub.py fails while it is stale).
stubs: $(STAMP)
	$(VENV)/bin/python -m nanobind.stubgen -q -m sglang_kvbm._blocks -o src/sglang_kvbm/_blocks.pyi

# The block index in place (src/sglang_kvbm/_blocks*.so), for this source tree on PYTHONPATH without an install.
native:
	cmake -S . -B build/native -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$$(command -v $(GPU_PYTHON))" \
	  -Dnanobind_DIR="$$($(GPU_PYTHON) -m nanobind --cmake_dir)"
	cmake --build build/native --parallel
	cp build/native/_blocks*.so src/sglang_kvbm/

clean:
	rm -rf $(VENV) $(DYNAMO_VENV) $(COMPAT_0522) demo-out build dist src/sglang_kvbm/_blocks*.so $(GPU_PACK)
