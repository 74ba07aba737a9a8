#!/usr/bin/env bash
# Every GPU check and timing of a device session, ordered by what matters
# most, inside one time budget (a session has about 15 minutes of GPU time,
# the machine's start included; one call may run 10):
#
#   BUDGET=570 bash bench/gpu_session.sh main   # checks, acceptance rows, training, tiles
#   BUDGET=150 bash bench/gpu_session.sh grid   # the rest of the attention grid
#   BUDGET=570 bash bench/gpu_session.sh speed  # the speed variants beside their predictions
#
# `main`: the kernel tests compiled on the card (Mosaic GPU, Triton, the
# block-sparse plans; about 120 s), the acceptance rows of the attention
# grid (all competitors, Tokamax included; about 30 s a row), GPT-2 small
# training with `auto` and with our kernel, the tiles of our two kernels at
# head_dim 64 (about 7 s a candidate; head_dim 128's were timed on
# 2026-12-04, bench/RESULTS.md), the MoE grouped matmuls against a dense
# MLP, and, if time is left, the context-parallel ring's kernel calls.
# `grid`: every other row of the grid. `speed`: GPT-2 small's train step in
# each variant of bench/speed_variants.py (the 2026-12-04 step, unscanned,
# remat policies, loss chunks, FP8, MLA; up to 60 s each), then its table:
# each measured step beside the roofline's prediction for it (committed in
# bench/results/speed_variants_h200.json, computed without a card). Each
# stage has its own limit, cut to what is left of BUDGET seconds; a stage
# with under 15 s left is skipped.
# The attention, ring and MoE benches write their JSON after every row (and
# tile), so a stage stopped at its limit keeps what it measured.
#
# Run from the repository root on the H200 machine (jax 0.11.2 + CUDA there;
# ml_collections, grain, tensorboardX and Tokamax's needs are missing, and
# its optax and orbax are not our pins): carried as wheels in .whl/. Not
# flax: our pin, 0.12.8, does not import with jax 0.11.2; the machine's
# 0.12.10 does.
# Prepare them once on the CPU machine:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     ml-collections==1.1.0 grain==0.2.18 array-record==0.8.6 portpicker \
#     tensorboardX==2.6.5 optax==0.2.8 orbax-checkpoint==0.12.4 \
#     tokamax==0.0.12 einshape pydantic pydantic-core qwix typeguard==2.13.3 \
#     immutabledict annotated-types typing-inspection typing-extensions
#
# (pydantic-core at the version pydantic's METADATA names), then call the
# device tool with carry [".whl"] and the command above. Results land in
# $OUT/session-<part>.tgz (logs, JSON) and the tables are printed last. Copy them into
# bench/RESULTS.md with the date, card, command and commit.
set -u
PART=${1:-main}
BUDGET=${BUDGET:-570}
OUT=${OUT:-/tmp/gpu_session}  # gets session-$PART.tgz: every log and JSON, after every stage
W=/tmp/gpu_work-$PART
rm -rf "$W" /tmp/site  # a warm machine keeps /tmp from the call before
mkdir -p "$OUT" "$W"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

stage() {  # stage NAME SECONDS COMMAND...: run within what is left, log to $W/NAME.log
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    echo "$name skipped: ${left}s left" | tee -a "$W/stages.txt"
    return
  fi
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" > "$W/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - start))s" | tee -a "$W/stages.txt"
  # A stage stopped at its limit can leave children on the GPU (pytest-xdist's
  # workers outlive their controller): end them before the next stage times.
  pkill -9 -f "python3 -m (pytest|bench)" 2>/dev/null
  pkill -9 -f "xdist|execnet" 2>/dev/null
  tar -czf "$OUT/session-$PART.tgz" -C "$W" .
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
  --format=csv > "$W/gpu.txt" 2>&1
python3 -c "import jax, jaxlib, flax, tokamax; print('jax', jax.__version__, jax.devices(), \
'flax', flax.__version__, 'tokamax', tokamax.__version__)" >> "$W/gpu.txt" 2>&1

ROWS="128:16384:yes 64:4096:yes gqa gpt2-small gpt2-small-packed"
if [ "$PART" = main ]; then
  # The compiled kernels against the reference (Mosaic GPU, Triton, plans),
  # on the card: the suite pins the CPU unless JAX_PLATFORMS says otherwise.
  stage tests 150 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -v -rf --tb=short -n 8 \
    -p no:cacheprovider -p no:benchmark --timeout 100 -m "slow or not slow" \
    tests/test_flash_attention_hopper.py tests/test_flash_attention.py tests/test_block_sparse.py
  stage attention_key 150 python3 -m bench.attention --no_memory --warmup 2 --repeats 5 \
    --rows $ROWS --out "$W/attention_key.json"
  stage train_gpt2 60 python3 -m bench.train_throughput \
    --config configs/gpt2_small.py --steps 20 --warmup 3 --tokens_only_row \
    --out "$W/train_gpt2.json"
  stage train_gpt2_pallas 45 python3 -m bench.train_throughput \
    --config configs/gpt2_small.py --config.model.attention_impl=pallas --ours_only \
    --steps 20 --warmup 3 --out "$W/train_gpt2_pallas.json"
  stage attention_tune 120 python3 -m bench.attention --no_memory --tune --warmup 2 \
    --repeats 5 --only ours_mosaic ours_triton --rows 64:4096:yes \
    --out "$W/attention_tune.json"
  stage moe 45 python3 -m bench.moe --deadline_s 40 --out "$W/moe.json"
  stage ring_blocks 60 python3 -m bench.ring_blocks --out "$W/ring_blocks.json"
  LOGS="tests attention_key train_gpt2 train_gpt2_pallas attention_tune moe ring_blocks"
elif [ "$PART" = speed ]; then
  LOGS=""
  for v in $(python3 -m bench.speed_variants names); do
    # shellcheck disable=SC2046  # the variant's overrides, one word each
    stage "speed_$v" 60 python3 -m bench.train_throughput --config configs/gpt2_small.py \
      --ours_only --steps 10 --warmup 2 $(python3 -m bench.speed_variants flags "$v") \
      --out "$W/speed_$v.json"
    LOGS="$LOGS speed_$v"
  done
  python3 -m bench.speed_variants table --measured_dir "$W" > "$W/speed_table.log" 2>&1
  LOGS="$LOGS speed_table"
else
  ALL=$(python3 -c "from bench.attention import grid_cases, row_name
print(' '.join(row_name(c) for c in grid_cases(False)))")
  REST=$(for r in $ALL; do case " $ROWS " in *" $r "*) ;; *) echo -n "$r ";; esac; done)
  stage attention_grid 600 python3 -m bench.attention --no_memory --warmup 2 --repeats 5 \
    --rows $REST --out "$W/attention_grid.json"
  LOGS="attention_grid"
fi

cat "$W/gpu.txt" "$W/stages.txt"
for name in $LOGS; do
  echo "--- $name"
  grep -E '^\||^#|wrote|rror|passed|failed|FAIL' "$W/$name.log" 2>/dev/null | tail -n 30
done
