"""Every train.remat policy (model/remat.py) compiled for one target: what
each keeps (memory) and what it recomputes (FLOPs), issue 66 item 4.

Each policy's train step is compiled for the target as compile.py compiles
it (`aot.compiler.lower_step`). Memory is the compiler's per device
(`aot.compiler._memory`: its peak and its temporaries, where the saved
activations live). FLOPs are the roofline's (`aot.roofline.kernels`: dots
from their shapes, attention kernels by formula, each loop body once per
iteration), since a deviceless GPU compile gives no cost analysis; the
recomputed FLOPs of a policy are its FLOPs minus those of `none`.
"""
import copy

from aot import compiler, roofline
from model.remat import REMAT_POLICIES


def policy_row(config, target, name: str) -> dict:
  """The train step under policy `name`, compiled for `target`: peak and
  temporary bytes per device, and per device per step the roofline's FLOPs,
  kernel launches, kernel operand and result bytes and predicted step time
  (`aot.roofline.summary`)."""
  policy_config = copy.deepcopy(config)
  policy_config.train.remat = name
  lowered, held, _ = compiler.lower_step(policy_config, target)
  compiled = lowered.compile()
  memory = compiler._memory(compiled, held)  # pylint: disable=protected-access
  found = roofline.kernels(compiled.as_text(), causal=config.model.family != "encoder")
  total = roofline.summary(found, peak_flops=target.chip.peak_flops,
                           hbm_bandwidth=target.chip.hbm_bandwidth,
                           launch_seconds=roofline.LAUNCH_SECONDS[target.chip.platform])["total"]
  return {"remat": name, "peak_bytes": memory["peak"], "temporary_bytes": memory["temporaries"],
          "flops": total["flops"], "kernel_bytes": total["bytes"], "kernels": total["kernels"],
          "predicted_step_seconds": total["step_seconds"]}


def remat_rows(config, target) -> list[dict]:
  """`policy_row` of every policy, `none` first, each with its recomputed
  FLOPs (its FLOPs beyond `none`'s)."""
  rows = [policy_row(config, target, name) for name in REMAT_POLICIES]
  for row in rows:
    row["recomputed_flops"] = row["flops"] - rows[0]["flops"]
  return rows


def format_rows(rows: list[dict]) -> str:
  """The rows as the table compile.py --remat_policies prints."""
  lines = [f"{'train.remat':<22} {'peak GiB':>9} {'temps GiB':>10} {'TFLOP':>7} "
           f"{'recomputed':>11} {'kernels':>8} {'GB moved':>9} {'step ms':>8}"]
  for r in rows:
    lines.append(f"{r['remat']:<22} {r['peak_bytes'] / 2**30:9.2f} "
                 f"{r['temporary_bytes'] / 2**30:10.2f} {r['flops'] / 1e12:7.2f} "
                 f"{100 * r['recomputed_flops'] / rows[0]['flops']:10.1f}% {r['kernels']:8d} "
                 f"{r['kernel_bytes'] / 1e9:9.1f} {1e3 * r['predicted_step_seconds']:8.1f}")
  return "\n".join(lines)
