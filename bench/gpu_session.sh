#!/usr/bin/env bash
# Every GPU check and timing of a device session, in two calls of at most
# 8 minutes each (a device call may run 10): `bash bench/gpu_session.sh 1`
# (kernel tests on the GPU, acceptance rows, GPT-2 small packed and not,
# GPT-2 small training throughput), then
# `bash bench/gpu_session.sh 2` (the whole grid, the tile sweep).
#
# Run from the repository root on the H200 machine (jax 0.11.2 + CUDA there,
# without ml_collections, grain, tensorboardX: carried as wheels in .whl/).
# Prepare the wheels once on the CPU machine:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     ml-collections==1.1.0 grain==0.2.18 array-record==0.8.6 portpicker tensorboardX
#
# then call the device tool with carry [".whl"] and the command above. Each
# stage has its own time limit; results land in $OUT (logs, JSON) and the
# tables are printed last. Copy them into bench/RESULTS.md with the date,
# card, command and commit.
set -u
PART=${1:-1}
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

stage() {  # stage NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, note rc
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - start))s" | tee -a "$OUT/stages.txt"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
  --format=csv > "$OUT/gpu.txt" 2>&1
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null

if [ "$PART" = 1 ]; then
  # The compiled kernels against the reference (Mosaic GPU, then Triton).
  stage tests_hopper 140 python3 -m pytest -q -x -p no:cacheprovider \
    -m "slow or not slow" tests/test_flash_attention_hopper.py \
    tests/test_flash_attention.py::test_training_with_hopper_kernel_matches_reference
  stage tests_triton 100 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_flash_attention.py
  # The acceptance rows, the GPT-2 small shape (also packed, with segment
  # ids, as training runs it), and GPT-2 small training throughput.
  stage attention_key 120 python3 -m bench.attention --no_memory \
    --rows 128:16384:yes 64:4096:yes gpt2-small gpt2-small-packed \
    --out "$OUT/attention_key.json"
  stage train_gpt2 120 python3 -m bench.train_throughput \
    --config configs/gpt2_small.py --steps 20 --warmup 3 --tokens_only_row \
    --out "$OUT/train_gpt2.json"
  LOGS="tests_hopper tests_triton attention_key train_gpt2"
else
  # The tiles of our two kernels on the acceptance row (Mosaic GPU: 14
  # candidates incl. the fused dQ backward), then the whole grid.
  stage attention_tune 250 python3 -m bench.attention --no_memory --tune \
    --rows 128:16384:yes --out "$OUT/attention_tune.json"
  stage attention_grid 190 python3 -m bench.attention --no_memory \
    --out "$OUT/attention_grid.json"
  LOGS="attention_tune attention_grid"
fi

cat "$OUT/gpu.txt" "$OUT/stages.txt"
for name in $LOGS; do
  echo "--- $name"
  grep -E '^\||^#|wrote|rror|passed|failed' "$OUT/$name.log" | tail -n 25
done
