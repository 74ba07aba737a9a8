# The two commands: `make train` (the main job) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LIBTPU := $(VENV)/libtpu

.PHONY: install test test-slow test-slurm slurm-up slurm-down sweep-slurm-demo train clean

# libtpu goes to $(LIBTPU), outside site-packages (see requirements-libtpu.txt).
$(STAMP): requirements.txt requirements-test.txt requirements-libtpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q -r requirements-test.txt
	$(BIN)/pip uninstall -q -y libtpu 2>/dev/null || true
	$(BIN)/pip install -q --no-deps --upgrade --target $(LIBTPU) -r requirements-libtpu.txt
	touch $(STAMP)

install: $(STAMP)

## Run the test suite (two worker processes, one per CPU core).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

## The slower checks, marked `slow`, skipped by `make test`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

## Sweeps on a real single-node SLURM cluster started here (root; installs
## slurm-wlm and munge with apt-get when missing); stops it again, pass or fail.
SLURM_TEST_DIR := /tmp/tlab-slurm-test
test-slurm: $(STAMP)
	TLAB_SLURM_DIR=$(SLURM_TEST_DIR) $(BIN)/python -m pytest -q -m slow tests/test_slurm.py; \
	status=$$?; $(BIN)/python -m scripts.local_slurm down --dir $(SLURM_TEST_DIR); exit $$status

## A local SLURM cluster to try sweeps on (then: export SLURM_CONF=$(SLURM_DIR)/slurm.conf).
SLURM_DIR := /tmp/tlab-slurm
slurm-up: $(STAMP)
	$(BIN)/python -m scripts.local_slurm up --dir $(SLURM_DIR)

slurm-down:
	$(BIN)/python -m scripts.local_slurm down --dir $(SLURM_DIR)

## The 8-variant pos_norm sweep of configs/tiny.py (40 steps each) as a job array on the local cluster.
sweep-slurm-demo: slurm-up
	SLURM_CONF=$(SLURM_DIR)/slurm.conf $(BIN)/python sweep.py run \
	    --sweep configs/sweeps/pos_norm.py --root runs/sweeps/slurm_demo --launcher slurm \
	    --gpus_per_node 0 --cpus_per_task 1 --timeout_min 30 \
	    --config.train.num_steps=40
	@echo "follow with: SLURM_CONF=$(SLURM_DIR)/slurm.conf squeue; $(BIN)/python sweep.py status --root runs/sweeps/slurm_demo"

## Train configs/tiny.py on the stdlib corpus, evaluate it, plot it.
train: $(STAMP)
	$(BIN)/python train.py --config configs/tiny.py --workdir runs/tiny
	$(BIN)/python eval.py --workdir runs/tiny --prompt "def " --max_new_tokens 120

clean:
	rm -rf $(VENV) runs .pytest_cache
