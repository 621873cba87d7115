# Two commands set up a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-quick lint coverage bench lock clean system-packages gpu-wheels azurite mlflow-server ds-ops

setup: $(STAMP)

# uv installs (downloads and unpacks in parallel; its cache, ~/.cache/uv, makes the next clean clone's
# install take seconds), bootstrapped by pip into the venv. CI installs exactly ci/constraints.txt;
# ci/uv_install.py hands uv the sources pip is configured with, so torch/torchvision come from local
# disk where they lie there, as with pip.
UV := $(VENV)/bin/uv
UV_INSTALL = $(PY) ci/uv_install.py --quiet
$(UV):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet -c ci/constraints.txt uv

$(STAMP): pyproject.toml ci/constraints.txt | $(UV)
	$(UV_INSTALL) --python $(PY) -c ci/constraints.txt -e '.[dev,dali]'
	touch $@

# Debian packages for the cluster tests (those missing, when root): SLURM; iproute2 for the multi-host
# cluster's links; faketime for the clock-skew tests.
system-packages:
	@missing=""; for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge \
			ip:iproute2 faketime:faketime; do \
		command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; \
	done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$$missing >/dev/null; \
	fi

demo: setup
	$(VENV)/bin/vitforge demo

# Azurite, the Azure Blob emulator the tests start (testing/local_azure.py), from npm into the venv,
# exactly as ci/azurite/package-lock.json pins it.
AZURITE := $(VENV)/azurite/node_modules/.bin/azurite-blob
azurite: $(AZURITE)
$(AZURITE): ci/azurite/package-lock.json
	mkdir -p $(VENV)/azurite && cp ci/azurite/package.json ci/azurite/package-lock.json $(VENV)/azurite/
	npm ci --silent --no-audit --no-fund --prefix $(VENV)/azurite

# The MLflow tracking server the tests start (testing/local_mlflow.py), in a venv of its own: the full
# `mlflow` package pins pyarrow below the project's (the project's venv has only mlflow-skinny, the
# client). Exactly as ci/mlflow-server.txt pins it (`pip freeze` of mlflow==3.17.2).
MLFLOW_SERVER := $(VENV)/mlflow-server
mlflow-server: $(MLFLOW_SERVER)/.installed
$(MLFLOW_SERVER)/.installed: ci/mlflow-server.txt | $(UV)
	$(PYTHON) -m venv $(MLFLOW_SERVER)
	$(UV_INSTALL) --python $(MLFLOW_SERVER)/bin/python -r ci/mlflow-server.txt
	touch $@

# DeepSpeed's shm op, JIT-built once into the venv's cache (about 35 s on 2 cores) before the suite
# starts, so no test pays for it and parallel workers never wait on one build: `vitforge build-ops`
# builds where every train and eval looks (trainer/ops.py: the venv's ninja, {venv}/torch_extensions).
DS_OPS := $(VENV)/torch_extensions/.built
ds-ops: $(DS_OPS)
$(DS_OPS): $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/vitforge build-ops
	touch $@

# pytest-xdist workers. Most of the suite waits (SLURM polls, requeues, leases, timeouts), so more
# workers than the 2 cores; the tests of the one multi-host cluster share one worker (conftest.py).
TEST_WORKERS ?= 4
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup --durations=30

# The set-up steps download, install and build in parallel (DeepSpeed's op builds while Debian's and
# npm's packages still install).
SETUP_ALL := setup system-packages azurite mlflow-server ds-ops
test:
	$(MAKE) --no-print-directory -j4 $(SETUP_ALL)
	$(PYTEST) tests

# Between changes: the in-process tests (tests/unit), no server, no cluster, a few minutes.
test-quick: setup
	$(PY) -m pytest -q -n 2 tests/unit

# The product's formatting, lint and types (pyproject.toml's [tool.ruff] and [tool.mypy]; CI runs it
# before the tests). mypy reads the folders under the names they install as (vitforge.core, ...),
# which package-dir gives them: build/lint/vitforge links each there, made afresh each run.
LINT_PATHS := vitforge core shards pipeline trainer cluster testing
lint: setup
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	rm -rf build/lint && mkdir -p build/lint/vitforge
	cd build/lint/vitforge && ln -s ../../../vitforge/*.py . && \
		for p in $(filter-out vitforge,$(LINT_PATHS)); do ln -s ../../../$$p $$p; done
	$(PY) -m mypy

# Line and branch coverage of the product in every Python process the tests start (ci/coverage.rc:
# xdist's workers, the CLI, torchrun's ranks, SLURM jobs), per module; .venv/coverage/coverage.json
# for ci/coverage_compare.py (per package, and every module that lost covered lines).
coverage:
	$(MAKE) --no-print-directory -j4 $(SETUP_ALL)
	rm -rf $(VENV)/coverage && mkdir -p $(VENV)/coverage
	COVERAGE_DIR=$(abspath $(VENV))/coverage $(PY) -m coverage run --rcfile=ci/coverage.rc -m pytest -q \
		-p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup tests || true
	COVERAGE_DIR=$(abspath $(VENV))/coverage $(PY) -m coverage combine --quiet --rcfile=ci/coverage.rc
	COVERAGE_DIR=$(abspath $(VENV))/coverage $(PY) -m coverage json --quiet --rcfile=ci/coverage.rc \
		-o $(VENV)/coverage/coverage.json
	$(PY) ci/coverage_compare.py $(VENV)/coverage/coverage.json

bench: setup
	PYTHON=$(PY) benchmarks/run_all.sh

# Small wheels (and DeepSpeed's sdist) benchmarks/gpu_check.sh installs on the GPU machine, which has no network.
gpu-wheels:
	for v in 3.10 3.11 3.12 3.13; do \
		$(PIP) download --quiet --only-binary=:all: --no-deps --python-version $$v -d benchmarks/wheels \
			simplejpeg==1.9.0 fsspec==2026.9.0 braceexpand==0.1.7 webdataset==1.0.2 pyyaml==6.0.3 \
			pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection hjson ninja py-cpuinfo msgpack \
			psutil einops nvidia-ml-py packaging; \
	done
	$(PIP) download --quiet --no-deps --no-binary=:all: -d benchmarks/wheels deepspeed==0.19.8

lock:
	rm -rf /tmp/vitforge-lock && $(PYTHON) -m venv /tmp/vitforge-lock
	/tmp/vitforge-lock/bin/pip install --quiet '.[dev,dali]' 'torch==2.14.1' 'torchvision==0.29.1'
	{ echo "# Exact versions CI installs: pip freeze of '.[dev,dali]' (regenerate: make lock)"; \
	  /tmp/vitforge-lock/bin/pip freeze | grep -v '^vitforge'; } > ci/constraints.txt

clean:
	rm -rf $(VENV) demo-out bench-out *.egg-info
