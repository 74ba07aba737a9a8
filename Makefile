# The two commands: `make train` (the main job) and `make test` (the suite).
# Installs (docs/install.md), each recorded by a stamp in .venv, so that one adds to
# another and nothing is installed twice: `make train` needs requirements.txt only;
# install-eval adds lm-eval (eval.py --tasks), install-tpu libtpu (compile.py's TPU
# targets), and `make test` (= `make install`) all of them and requirements-test.txt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EVAL_STAMP := $(VENV)/.installed-eval
TPU_STAMP := $(VENV)/.installed-tpu
TEST_STAMP := $(VENV)/.installed-test
LIBTPU := $(VENV)/libtpu

.PHONY: install install-eval install-tpu test test-slow test-slurm slurm-up slurm-down \
	sweep-slurm-demo train clean clean-cache

$(STAMP): requirements.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	touch $@

$(EVAL_STAMP): requirements-eval.txt $(STAMP)
	$(BIN)/pip install -q -r requirements-eval.txt
	touch $@

# libtpu goes to $(LIBTPU), outside site-packages (see requirements-libtpu.txt).
$(TPU_STAMP): requirements-libtpu.txt $(STAMP)
	$(BIN)/pip uninstall -q -y libtpu 2>/dev/null || true
	$(BIN)/pip install -q --no-deps --upgrade --target $(LIBTPU) -r requirements-libtpu.txt
	touch $@

$(TEST_STAMP): requirements-test.txt $(EVAL_STAMP) $(TPU_STAMP)
	$(BIN)/pip install -q -r requirements-test.txt
	touch $@

## Everything: what `make test` needs (the suite, lm-eval, libtpu, torch, the trackers).
install: $(TEST_STAMP)

## lm-evaluation-harness, for eval.py --tasks and train.downstream_tasks.
install-eval: $(EVAL_STAMP)

## libtpu in .venv/libtpu, for compile.py's TPU targets (no TPU needed).
install-tpu: $(TPU_STAMP)

## Run the test suite (two worker processes, one per CPU core).
test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n 2

## The slower checks, marked `slow`, skipped by `make test`.
test-slow: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m slow

## Sweeps on a real single-node SLURM cluster started here (root; installs
## slurm-wlm and munge with apt-get when missing); stops it again, pass or fail.
SLURM_TEST_DIR := /tmp/tlab-slurm-test
test-slurm: $(TEST_STAMP)
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
	$(BIN)/python eval.py --workdir runs/tiny --prompt "def " --max_new_tokens 120 --score

## The venv, the runs of runs/ and .pytest_cache. The cache of tokenised corpora and
## compiled programs lies outside the checkout and stays: make clean-cache.
clean:
	rm -rf $(VENV) runs .pytest_cache

## The cache: $TRANSFORMER_LAB_CACHE (default ~/.cache/transformer_lab: token cache,
## packing index, compiled programs) and $TRANSFORMER_LAB_COMPILATION_CACHE when set.
## A data.cache_dir or train.compilation_cache_dir a config names is not touched.
clean-cache:
	@for dir in "$${TRANSFORMER_LAB_CACHE:-$$HOME/.cache/transformer_lab}" \
	    "$${TRANSFORMER_LAB_COMPILATION_CACHE:-none}"; do \
	  if [ "$$dir" = none ]; then continue; fi; \
	  if [ -e "$$dir" ]; then echo "rm -rf $$dir"; rm -rf "$$dir"; else echo "no cache at $$dir"; fi; \
	done
