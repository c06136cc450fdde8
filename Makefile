# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): setup.py constraints.txt
	python3 -m venv $(VENV)
	# torch first: the CPU build lies on the machine's disk; a later resolver pick would fetch a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test]" fla-core
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m transformers_kimi3 demo --model assets/kimi-k3-mini

test: $(STAMP)
	$(PY) -m pytest -n 2 -q tests

test-all: $(STAMP)  # also the slow cases: the interpreter's launch-setting variants
	$(PY) -m pytest -n 2 -q --run-slow tests

.PHONY: install demo test test-all
