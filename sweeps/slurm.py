"""SLURM: the submitit parameters of a sweep's job array, its sbatch preview,
and the check that the request fits the partition before anything is submitted."""
import os
import re
import shlex
import shutil
import subprocess
import sys

import submitit
from submitit.slurm import slurm as submitit_slurm

from configs.errors import UserError
from sweeps.common import REPO, first_line
from sweeps.jobs import VariantJob
from sweeps.variants import Variant


def slurm_parameters(name: str, *, nodes: int, tasks_per_node: int, gpus_per_node: int,
                     cpus_per_task: int, timeout_min: int, partition: str | None,
                     account: str | None, parallel: int | None, setup: list[str],
                     mem_gb: int = 0) -> dict:
  """`submitit.AutoExecutor.update_parameters` arguments: one array task per variant
  (no GPU line at all when `gpus_per_node` is 0, so CPU partitions accept it; no
  memory line when `mem_gb` is 0: the cluster's default applies)."""
  params = {"name": name, "nodes": nodes, "tasks_per_node": tasks_per_node,
            "cpus_per_task": cpus_per_task, "timeout_min": timeout_min,
            # the job unpickles VariantJob, so it imports sweeps from here
            "slurm_setup": [f"cd {shlex.quote(REPO)}", *setup],
            # requeue-able even where the cluster's default is not (JobRequeue=0)
            "slurm_additional_parameters": {"requeue": True}}
  if gpus_per_node:
    params["gpus_per_node"] = gpus_per_node
  if mem_gb:
    params["mem_gb"] = mem_gb
  for key, value in (("partition", partition), ("account", account),
                     ("array_parallelism", parallel)):
    if value:
      params[f"slurm_{key}"] = value
  return params


def _minutes(limit: str) -> float:
  """A SLURM time limit as sinfo prints it (`infinite`, `30:00` = MM:SS,
  `4:00:00`, `1-00:00:00`) in minutes."""
  if limit in ("infinite", "UNLIMITED", "n/a"):
    return float("inf")
  days, _, clock = limit.rpartition("-")
  parts = [int(p) for p in clock.split(":")]
  if len(parts) == 1:
    parts = [0, parts[0], 0]
  hours, minutes, seconds = [0] * (3 - len(parts)) + parts
  return int(days or 0) * 1440 + hours * 60 + minutes + seconds / 60


def _gpus(gres: str) -> int:
  """GPUs per node in sinfo's gres column (`gpu:4`, `gpu:a100:8(S:0-1)`, `(null)`)."""
  return sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[^:,(]+)?:(\d+)", gres))


def sinfo_rows(sinfo: str) -> list[list[str]]:
  """The fields of sinfo's `%P|%c|%m|%G|%D|%l` lines."""
  return [line.split("|") for line in sinfo.splitlines() if line.count("|") == 5]


def check_fits(parameters: dict, sinfo: str | None = None) -> None:
  """UserError naming what does not fit, and the flag that changes it, when the
  request is more than the partition's nodes offer (CPUs, memory, GPUs as gres,
  nodes, time limit). `sinfo`: its `%P|%c|%m|%G|%D|%l` lines (asked for when None)."""
  if sinfo is None:
    if shutil.which("sinfo") is None:
      raise UserError("--launcher slurm: no sinfo here (not a SLURM login node?); "
                      "try --dry_run, or --launcher local")
    result = subprocess.run(["sinfo", "-h", "-o", "%P|%c|%m|%G|%D|%l"], capture_output=True,
                            text=True, timeout=60, check=False)
    if result.returncode:
      raise UserError(f"--launcher slurm: sinfo failed: {first_line(result.stderr or '?')}")
    sinfo = result.stdout
  rows = sinfo_rows(sinfo)
  wanted = parameters.get("slurm_partition")
  if wanted is None:
    defaults = [r[0].rstrip("*") for r in rows if r[0].endswith("*")]
    if not defaults:
      raise UserError("--partition: the cluster has no default partition; choose one of "
                      + ", ".join(sorted({r[0] for r in rows})))
    wanted = defaults[0]
  rows = [r for r in rows if r[0].rstrip("*") == wanted]
  if not rows:
    raise UserError(f"--partition {wanted}: no such partition (sinfo lists "
                    f"{', '.join(sorted({r[0].rstrip('*') for r in sinfo_rows(sinfo)}))})")
  cpus = max(int(r[1].rstrip("+")) for r in rows)
  memory_gb = max(int(r[2].rstrip("+")) for r in rows) / 1024
  gpus = max(_gpus(r[3]) for r in rows)
  nodes = sum(int(r[4]) for r in rows)
  limit = max(_minutes(r[5]) for r in rows)
  want_cpus = parameters["cpus_per_task"] * parameters["tasks_per_node"]
  want_gpus = parameters.get("gpus_per_node", 0)
  where = f"partition {wanted}"
  if want_gpus > gpus:
    raise UserError(f"--gpus_per_node {want_gpus}: {where} has {gpus} GPUs per node "
                    f"(gres {rows[0][3]}); set --gpus_per_node {gpus}")
  if want_cpus > cpus:
    raise UserError(f"--cpus_per_task {parameters['cpus_per_task']} x --tasks_per_node "
                    f"{parameters['tasks_per_node']} = {want_cpus} CPUs per node: {where} has "
                    f"{cpus}; lower --cpus_per_task (or --tasks_per_node)")
  if parameters.get("mem_gb", 0) > memory_gb:
    raise UserError(f"--mem_gb {parameters['mem_gb']}: {where} has {memory_gb:.0f} GB per "
                    "node; lower --mem_gb")
  if parameters["nodes"] > nodes:
    raise UserError(f"--nodes {parameters['nodes']}: {where} has {nodes} node(s); "
                    f"lower --nodes")
  if parameters["timeout_min"] > limit:
    raise UserError(f"--timeout_min {parameters['timeout_min']}: {where} allows at most "
                    f"{limit:g} minutes; lower --timeout_min")


def submit_slurm(variants: list[Variant], folder: str, parameters: dict, max_timeouts: int,
                 cluster: str = "slurm") -> list[submitit.Job]:
  """Submits the variants as one job array (`cluster="local"` runs them here);
  sbatch's refusal is a one-line UserError."""
  if not variants:
    return []
  try:
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster,
                                     slurm_max_num_timeout=max_timeouts)
  except RuntimeError as e:
    raise UserError(f"--launcher slurm: {first_line(e)} (try --dry_run, or --launcher local)")
  executor.update_parameters(**parameters)
  try:
    return executor.map_array(VariantJob(), variants)
  except (submitit.core.utils.FailedJobError, subprocess.CalledProcessError) as e:
    lines = [line for line in str(e).splitlines() if "error" in line.lower()]
    raise UserError(f"--launcher slurm: sbatch refused the array: "
                    f"{(lines or [first_line(e)])[-1].strip()}")


def slurm_preview(parameters: dict, folder: str, num_jobs: int, max_timeouts: int) -> str:
  """The executor submit_slurm makes and the sbatch script that submitit would
  write for the array (from submitit's own template)."""
  renames = submitit.SlurmExecutor._equivalence_dict()  # pylint: disable=protected-access
  slurm = {key[len("slurm_"):] if key.startswith("slurm_") else renames[key]: value
           for key, value in parameters.items()}
  if "mem" in slurm:  # submitit writes mem_gb as GB
    slurm["mem"] = f"{slurm['mem']}GB"
  folder = os.path.abspath(folder)
  command = f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(folder)}"
  script = submitit_slurm._make_sbatch_string(  # pylint: disable=protected-access
      command=command, folder=folder, map_count=num_jobs, **slurm)
  return (f"\nsubmitit.AutoExecutor(folder={folder!r}, cluster='slurm', slurm_max_num_timeout="
          f"{max_timeouts}).update_parameters(**{parameters})\n\n{script}")
