"""What the checkpoint checksums cost: save and restore of a config's train
state (parameters, AdamW moments, step, RNG) with training/checkpoint.py,
beside the checksum computation alone (training/faults/integrity.py).

Rows, each the median of `--repeats` runs into a fresh directory:
- `checksums`: `integrity.fingerprints(state)`, what a save adds to the
  train loop's blocking time and a restore adds after reading.
- `save, blocking`: `Checkpointer.save` until it returns (checksums, the
  device-to-host copy; the writing goes on in the background).
- `save, committed`: `Checkpointer.save` + `wait()`, until the step is
  renamed into place.
- `restore, verified`: `Checkpointer.restore` (read, then every checksum
  compared).
The share column is checksums / row. No data iterator is saved.

  python bench/checkpoint_integrity.py --config configs/gpt2_small.py
"""
import datetime
import json
import pathlib
import shlex
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

# pylint: disable=wrong-import-position
from bench.bench_utils import git_commit
import jax
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from configs.cli import parse_flags
from model import build_model
from training.faults import integrity
from training.checkpoint import Checkpointer
from training.optim import make_optimizer
from training.steps import init_state
# pylint: enable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file.",
                                          lock_config=True)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per row (the median is reported).")
_DIR = flags.DEFINE_string("dir", None, "Where to write the checkpoints (default: a "
                           "temporary directory); the file system is part of what is timed.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "bench/results/checkpoint_integrity_<config name>.json.")
flags.mark_flags_as_required(["config"])


def make_state(config):
  tx = make_optimizer(config.train)

  def create():
    model = build_model(config.model, nnx.Rngs(config.train.seed))
    return init_state(nnx.split(model)[1], tx, config.train.seed)
  return jax.block_until_ready(jax.jit(create)())


def timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  config_name = pathlib.Path(flags.FLAGS["config"].config_filename).stem
  out = pathlib.Path(_OUT.value or ROOT / "bench" / "results" /
                     f"checkpoint_integrity_{config_name}.json")
  state = make_state(config)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  num_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  integrity.fingerprints(state)  # compiled once, outside the timings
  times = {"checksums": [], "save, blocking": [], "save, committed": [],
           "restore, verified": []}
  with tempfile.TemporaryDirectory(dir=_DIR.value) as root:
    for repeat in range(_REPEATS.value):
      times["checksums"].append(timed(lambda: integrity.fingerprints(state)))
      workdir = pathlib.Path(root) / str(repeat)
      checkpointer = Checkpointer(str(workdir), keep=1)
      times["save, blocking"].append(timed(lambda: checkpointer.save(1, state, None, {})))
      checkpointer.wait()
      checkpointer.close()
      checkpointer = Checkpointer(str(workdir), keep=1)
      times["save, committed"].append(timed(lambda: (checkpointer.save(2, state, None, {}),
                                                     checkpointer.wait())))
      times["restore, verified"].append(timed(
          lambda: jax.block_until_ready(checkpointer.restore(2, abstract))))
      checkpointer.close()
  checksum = statistics.median(times["checksums"])
  rows = [{"operation": name, "seconds": statistics.median(values),
           "checksum_share": checksum / statistics.median(values)}
          for name, values in times.items()]
  print(f"{config_name}: train state of {num_bytes / 2**30:.2f} GiB, "
        f"{len(jax.tree.leaves(state))} arrays, on {jax.devices()[0].device_kind}")
  print(f"{'operation':<20} {'seconds':>9} {'checksums share':>16}")
  for row in rows:
    print(f"{row['operation']:<20} {row['seconds']:>9.3f} {row['checksum_share']:>15.1%}")
  meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "command": shlex.join(["python"] + sys.argv), "commit": git_commit(),
          "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
          "jax": jax.__version__, "config": config_name, "state_bytes": num_bytes,
          "arrays": len(jax.tree.leaves(state)), "repeats": _REPEATS.value,
          "timing": "median over repeats; each save into a fresh checkpoint directory"}
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
