# Everything a fresh machine needs, from this repository's files only.
#   make demo   - the CPU demo (stock SGLang vs SGLang + kvbm, one table)
#   make test   - install what the tests need and run them
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# Dynamo's KV indexer pins pydantic<=2.13.5 (SGLang needs 2.14): it gets its own
# environment, as it is its own process in a deployment too.
INDEXER_VENV := .venv-indexer
INDEXER_STAMP := $(INDEXER_VENV)/.installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip
	$(VENV)/bin/pip install -e '.[test]'
	touch $(STAMP)

$(INDEXER_STAMP):
	$(PYTHON) -m venv $(INDEXER_VENV)
	$(INDEXER_VENV)/bin/pip install 'ai-dynamo-runtime==1.6.1'
	touch $(INDEXER_STAMP)

demo: $(STAMP)
	$(VENV)/bin/sglang-kvbm demo

test: $(STAMP) $(INDEXER_STAMP)
	$(VENV)/bin/python -m pytest -q -ra tests

# Without the tests that start real SGLang servers (a few seconds instead of minutes).
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra -m "not server" tests

# All benchmarks with their small CPU defaults (see benchmarks/README.md); about 25 minutes.
bench: $(STAMP)
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	$(VENV)/bin/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(INDEXER_VENV) demo-out
