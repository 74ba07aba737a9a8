# The two commands: `make train` (the main job) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-slow train clean

$(STAMP): requirements.txt requirements-test.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q -r requirements-test.txt
	touch $(STAMP)

install: $(STAMP)

## Run the test suite (about 10 minutes on 2 CPU cores).
test: $(STAMP)
	$(BIN)/python -m pytest -q

## The slower checks, marked `slow`, skipped by `make test`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

## Train configs/tiny.py on the embedded corpus, evaluate it, plot it.
train: $(STAMP)
	$(BIN)/python train.py --config configs/tiny.py --workdir runs/tiny
	$(BIN)/python eval.py --workdir runs/tiny --prompt "def " --max_new_tokens 120

clean:
	rm -rf $(VENV) runs .pytest_cache
