# moshpit: everything runs inside .venv, created on first use from a bare python3.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: all venv test test-unit test-integration demo bench lint proto clean

all: test

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[client,demo,dev]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

demo: $(STAMP)
	$(PY) -m demo.run

bench: $(STAMP)
	$(PY) -m bench.allreduce

lint: $(STAMP)
	$(VENV)/bin/ruff check moshpitd client tests bench demo
	$(VENV)/bin/mypy

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=moshpitd/proto --pyi_out=moshpitd/proto proto/moshpit.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
