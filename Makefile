# moshpit: everything runs inside .venv, created on first use from a bare python3.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The TORCH_SPEC the venv was installed with: rewritten (so newer than STAMP) only when it
# changes, so `make TORCH_SPEC=torch==X.Y test` on an existing .venv reinstalls torch.
TORCH_STAMP := $(VENV)/.torch-spec

.PHONY: all venv peers system-deps bytecode test test-unit test-integration fuzz demo bench soak soak-attack lint proto clean \
	FORCE

all: test

$(TORCH_STAMP): FORCE
	@mkdir -p $(VENV)
	@if [ "$$(cat $@ 2>/dev/null)" != '$(TORCH_SPEC)' ]; then \
		echo 'torch: $(TORCH_SPEC)'; printf '%s\n' '$(TORCH_SPEC)' > $@; fi

$(STAMP): setup.cfg pyproject.toml $(TORCH_STAMP)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[client,demo,dev]"
	touch $(STAMP)

venv: $(STAMP)

# hivemind 1.1.12 in its own venv: a system the results benchmark (bench/swarm) compares
# against, never a dependency of moshpit. torch first (the CPU build), then hivemind with torch
# pinned by the constraints file so pip cannot swap it.
PEERS_VENV ?= .venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
PEERS_STAMP := $(PEERS_VENV)/.installed

$(PEERS_STAMP): bench/peers-constraints.txt
	test -x $(PEERS_PY) || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install --quiet --upgrade pip
	$(PEERS_PY) -m pip install --quiet "torch==2.13.0"
	$(PEERS_PY) -m pip install --quiet -c bench/peers-constraints.txt "hivemind==1.1.12"
	touch $(PEERS_STAMP)

peers: $(PEERS_STAMP)

# Commands some tests run, each with the Debian package that provides it. Missing ones are
# installed when running as root with apt-get (as CI does on a bare Debian 12); otherwise the
# tests that need them skip. `make test SYSTEM_DEPS=` leaves the system alone. An entry that
# starts with / is a file glob instead of a command (python3-doc: bench/swarm's text corpus).
SYSTEM_DEPS ?= prometheus:prometheus promtool:prometheus systemd-analyze:systemd \
	ip:iproute2 nft:nftables openssl:openssl \
	/usr/share/doc/python3*/html/_sources/glossary.rst.txt:python3-doc

system-deps:
	@missing=""; \
	for dep in $(SYSTEM_DEPS); do \
		case "$${dep%%:*}" in \
			/*) ls -d $${dep%%:*} >/dev/null 2>&1 && continue ;; \
			*) command -v "$${dep%%:*}" >/dev/null 2>&1 && continue ;; \
		esac; \
		case " $$missing " in *" $${dep#*:} "*) ;; *) missing="$$missing $${dep#*:}" ;; esac; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "system-deps: installing$$missing"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing \
			|| { echo "system-deps: apt-get failed; make test SYSTEM_DEPS= runs without them" >&2; exit 1; }; \
	else \
		echo "system-deps: commands missing from PATH (packages:$$missing); installing needs root and apt-get, so the tests that need them will skip"; \
	fi

# The suite runs in TEST_JOBS processes (pytest-xdist), a file per process at a time: most of
# its time is real daemons waiting on sockets and deadlines, not CPU. The two venvs and the
# system packages are installed side by side first.
TEST_JOBS ?= 5

# Bytecode for the tree, written once: where PYTHONDONTWRITEBYTECODE is set (as some CI
# images do), every daemon a test or benchmark starts would otherwise compile the
# package anew, about 0.1 s of CPU per start (python -c 'import moshpitd.service': 0.46 s ->
# 0.34 s); an installed wheel has its bytecode already. Stale files are recompiled.
bytecode: $(STAMP)
	@$(PY) -m compileall -q -j 0 moshpitd client bench netlab >/dev/null

test:
	$(MAKE) --no-print-directory -j3 $(STAMP) $(PEERS_STAMP) system-deps
	$(MAKE) --no-print-directory bytecode
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder --durations=25 tests

test-unit: $(STAMP) system-deps
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder tests/unit

test-integration: $(STAMP) system-deps
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder tests/integration

# the fuzz tests with ten times the cases `make test` runs (MOSHPIT_FUZZ_EXAMPLES=N to change)
fuzz: $(STAMP)
	MOSHPIT_FUZZ_EXAMPLES=$${MOSHPIT_FUZZ_EXAMPLES:-20000} $(PY) -m pytest -q --timeout 3600 \
		tests/integration/test_fuzz_*.py

demo: bytecode
	$(PY) -m demo.run

bench: bytecode
	$(PY) -m bench.allreduce

soak: bytecode
	$(PY) -m bench.soak --peers 8 --rounds 50

soak-attack: bytecode
	$(PY) -m bench.soak --attack --peers 8 --rounds 60

lint: $(STAMP)
	$(VENV)/bin/ruff check moshpitd client tests bench demo netlab
	$(VENV)/bin/mypy

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=moshpitd/proto --pyi_out=moshpitd/proto proto/moshpit.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
