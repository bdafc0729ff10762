# Everything a fresh machine needs, from this repository's files only.
#   make demo   - the CPU demo (stock SGLang vs SGLang + kvbm, one table)
#   make test   - install what the tests need and run them
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip
	$(VENV)/bin/pip install -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sglang-kvbm demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra tests

# Without the tests that start real SGLang servers (a few seconds instead of minutes).
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra -m "not server" tests

clean:
	rm -rf $(VENV) demo-out
