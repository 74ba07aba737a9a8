"""Compile a run's train step for a TPU slice or GPU node you do not have.

  python compile.py --config configs/llama2_7b.py --target tpu:v5p:4x4x4 --config.mesh.fsdp=64
  python compile.py --config configs/tiny.py --target gpu:h200:1 --json

Prints per device the memory (compiler beside model.accounting), whether it
fits the chip's HBM, FLOPs per step, the collectives and a roofline bound on
step time and MFU (`aot/compiler.py`). --step=eval or --step=generate
compiles the eval step or one KV-cache decoding step instead;
--remat_policies compiles the train step once per train.remat policy and
prints each one's memory and recomputed FLOPs. TPU targets
need libtpu (`make install-tpu`), GPU targets
`pip install -r requirements-gpu.txt`; no accelerator is needed.
"""
import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from configs.cli import parse_flags
from configs.errors import UserError

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file.",
                                          lock_config=True)
_TARGET = flags.DEFINE_string("target", None, "tpu:<chip>:<topology> (tpu:v5p:4x4x4) or "
                              "gpu:h200:<gpus> (gpu:h200:8).")
_STEP = flags.DEFINE_enum("step", "train", ["train", "eval", "generate"], "Which step to compile.")
_JSON = flags.DEFINE_bool("json", False, "Print the report as JSON.")
_REMAT_POLICIES = flags.DEFINE_bool(
    "remat_policies", False, "Compile the train step under every train.remat policy and print "
    "each one's memory and recomputed FLOPs (aot/remat_policies.py) instead of the report.")
flags.mark_flags_as_required(["config", "target"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  # Compile-only: no TPU or GPU is attached; libtpu and the CUDA plugin must not look for one.
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several compiles at once
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver needed
  from aot import compiler as aot  # pylint: disable=import-outside-toplevel
  from aot import remat_policies  # pylint: disable=import-outside-toplevel
  from aot import targets as aot_targets  # pylint: disable=import-outside-toplevel
  try:
    target = aot_targets.parse_target(_TARGET.value)
    if _REMAT_POLICIES.value:
      rows = remat_policies.remat_rows(_CONFIG.value, target)
      print(json.dumps(rows, indent=1) if _JSON.value else remat_policies.format_rows(rows))
      return
    report = aot.compile_report(_CONFIG.value, target, step=_STEP.value)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps(report, indent=1) if _JSON.value else aot.format_report(report))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
