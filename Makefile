# `make demo` and `make test` work from a fresh clone: they create .venv/ and install first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing raylib and its dependencies into $(VENV)/ (a few minutes the first time)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	@$(PY) -m raylib.ops build  # the C++ kernels of the fused CPU ops, once (cached by source hash)
	@touch $(STAMP)

setup: $(STAMP)

demo: setup  ## BERT MLM pretraining: 2 Ray Train workers x DeepSpeed ZeRO-2 on an embedded Ray
	$(VENV)/bin/raylib run jobs/configs/demo.yaml --embedded-s3

test: setup  ## the whole suite: unit + integration (real Ray, real DeepSpeed on gloo)
	$(PY) -m pytest tests

test-fast: setup  ## unit lane only
	$(PY) -m pytest tests -m unit

lint: setup
	$(VENV)/bin/ruff check raylib jobs bench tests kernels

bench: setup  ## side-by-side benchmarks (JSON on stdout)
	$(PY) bench/wrapper_overhead.py
	$(PY) bench/placement.py
	$(PY) bench/data_pipeline.py
	$(PY) bench/models.py

clean:
	rm -rf runs .raylib
