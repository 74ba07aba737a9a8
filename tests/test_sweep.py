"""Sweeps: expansion into named variants, one-line errors for bad sweep files,
--grid and --variants, a 2-variant --grid sweep run locally with its console
lines, status and report, how each exit status of train.py ends a run, the
local launcher's lines and its stop on SIGINT/SIGTERM, a variant run as a
submitit job, and the requeue path (checkpoint() stops train.py with SIGTERM)."""
import csv
import os
import pathlib
import pickle
import re
import shutil
import signal
import sys
import threading
import time

import pytest
import submitit

from configs.errors import UserError
import sweeps as sweep_lib
from tests.helpers import ROOT, small_flags, sweep_cli, TINY, write_sweep

POS_NORM = str(ROOT / "configs" / "sweeps" / "pos_norm.py")
def test_grid_expands_in_order_with_deterministic_names(tmp_path):
  sweep = sweep_lib.load_sweep(POS_NORM)
  assert (sweep.name, sweep.config) == ("pos_norm", "configs/tiny.py")
  variants = sweep_lib.make_variants(sweep, TINY, ["--config.train.num_steps=20"],
                                     str(tmp_path / "root"))
  assert [v.name for v in variants] == [
      f"pos_emb={p},norm_position={n}" for p in ("none", "sinusoidal", "learned", "rope")
      for n in ("pre", "post")]
  v = variants[5]
  assert v.overrides == {"model.pos_emb": "learned", "model.norm_position": "post"}
  assert v.workdir == str(tmp_path / "root" / v.name) and v.num_steps == 20
  assert v.train_command[1:] == [
      str(ROOT / "train.py"), "--config", TINY, "--workdir", v.workdir,
      "--config.train.num_steps=20", "--config.model.pos_emb=learned",
      "--config.model.norm_position=post"]
  assert v.eval_command[1:] == [str(ROOT / "eval.py"), "--workdir", v.workdir]


def test_list_sweep_values_round_trip_through_train_flags(tmp_path):
  path = write_sweep(tmp_path, """
def get_sweep():
  return [{}, {"model.use_bias": True, "train.learning_rate": 1e-4, "model.num_kv_heads": 2},
          {"model.vocab_size": 2048, "tokenizer.vocab_size": 2048, "data.paths": "a/*.txt"}]
""")
  variants = sweep_lib.make_variants(sweep_lib.load_sweep(path), TINY, [], str(tmp_path))
  assert [v.name for v in variants] == [
      "base", "use_bias=true,learning_rate=0.0001,num_kv_heads=2",
      "model.vocab_size=2048,tokenizer.vocab_size=2048,paths=a__.txt"]
  config = sweep_lib.load_config(TINY, variants[1].train_command[6:])
  assert (config.model.use_bias, config.train.learning_rate, config.model.num_kv_heads) == (
      True, 1e-4, 2)


def test_a_tuple_value_names_its_variant_by_its_items_and_reaches_the_tuple_field(tmp_path):
  path = write_sweep(tmp_path, """
def get_sweep():
  return [{"model.num_layers": 4,
           "model.layer_types": ("linear_attention",) * 3 + ("full_attention",)}]
""")
  variant, = sweep_lib.make_variants(sweep_lib.load_sweep(path), TINY, [], str(tmp_path))
  assert variant.name == (
      "num_layers=4,layer_types=linear_attention-linear_attention-linear_attention-full_attention")
  config = sweep_lib.load_config(TINY, variant.train_command[6:])
  assert config.model.layer_types == ("linear_attention",) * 3 + ("full_attention",)


@pytest.mark.parametrize("body,message", [
    ('{"model.pos_embb": ["rope"]}', "model.pos_embb: no such config field (did you mean "
     "model.pos_emb?)"),
    ("{}", "get_sweep() returned an empty grid"),
    ("[]", "get_sweep() returned an empty list"),
    ('{"model.pos_emb": []}', "grid field model.pos_emb needs a non-empty list of values"),
    ('["rope"]', "each variant must be a dict of field -> value"),
    ('[{"model.num_kv_heads": None}]', "a value must be a str, int, float or bool"),
    ('[{"model.layer_types": ()}]', "or a non-empty tuple of them"),
    ('{"model.pos_emb": ["xpos"]}', "variant pos_emb=xpos: config field model.pos_emb='xpos': "
     "must be one of none, sinusoidal, learned, rope"),
    ('{"model.num_layers": ["two"]}', "variant num_layers=two: flag --config.model.num_layers=two"),
    ('{"train.num_steps": [5]}', "train.num_steps is set both by sweep"),
    ('[{"model.d_model": 64}, {"model.d_model": 64}]', "2 variants are named d_model=64"),
    ('{"model.pallas_lowering": ["mosaic_gpu"]}', "variant pallas_lowering=mosaic_gpu: config "
     "field model.pallas_lowering='mosaic_gpu': needs model.dtype bfloat16 or float16"),
])
def test_bad_sweep_is_one_line_user_error(tmp_path, body, message):
  path = write_sweep(tmp_path, f"def get_sweep():\n  return {body}\n")
  with pytest.raises(UserError) as err:
    sweep_lib.make_variants(sweep_lib.load_sweep(path), TINY, ["--config.train.num_steps=9"],
                            str(tmp_path))
  assert message in str(err.value) and "\n" not in str(err.value)


def test_environment_variables_name_the_variants_and_reach_their_commands(tmp_path):
  """make_variants(env=...): PJRT_NPROC=1 leads the names, the dry-run lines
  and the log; the job runs train.py with it and records each command's
  times, host and XLA thread count in sweep_times.jsonl."""
  path = write_sweep(tmp_path, "def get_sweep():\n  return [{'model.d_model': 64}]\n")
  [variant] = sweep_lib.make_variants(sweep_lib.load_sweep(path), TINY, [], str(tmp_path / "r"),
                                      env={"PJRT_NPROC": 1})
  assert (variant.name, variant.env) == ("PJRT_NPROC=1,d_model=64", {"PJRT_NPROC": "1"})
  assert sweep_lib.describe([variant])[1].startswith("  PJRT_NPROC=1 ")
  variant.train_command = [sys.executable, "-c", "import os; print('threads', "
                           "os.environ['PJRT_NPROC']); sum(range(3_000_000))"]
  assert sweep_lib.VariantJob()(variant)["state"] == "stopped"  # no steps: eval.py not run
  log = pathlib.Path(variant.workdir, "sweep.log").read_text()
  assert log.startswith("$ PJRT_NPROC=1 ") and "threads 1" in log
  [record] = sweep_lib.read_times(variant.workdir)
  assert (record["command"], record["returncode"], record["xla_cpu_threads"],
          record["env"]) == ("train.py", 0, 1, {"PJRT_NPROC": "1"})
  assert record["wall_s"] > 0 and record["cpu_s"] > 0 and record["cpus"] >= 1


def test_bad_sweep_file_on_the_command_line_exits_2_with_one_line(tmp_path):
  path = write_sweep(tmp_path, "def get_sweep():\n  return {'model.colour': ['red']}\n")
  result = sweep_cli("run", "--config", TINY, "--sweep", path, "--root", str(tmp_path / "r"))
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      f"error: sweep {path}: model.colour: no such config field"]
  broken = write_sweep(tmp_path, "def get_sweep(:\n", "broken.py")
  with pytest.raises(UserError, match=r"cannot load it \(SyntaxError"):
    sweep_lib.load_sweep(broken)


def test_slurm_dry_run_prints_the_commands_and_submitits_sbatch_script(tmp_path):
  result = sweep_cli("run", "--sweep", POS_NORM, "--root", str(tmp_path / "r"), "--launcher",
                     "slurm", "--dry_run", "--partition", "gpu", "--account", "lab",
                     "--nodes", "2", "--tasks_per_node", "4", "--gpus_per_node", "4",
                     "--parallel", "3", "--config.train.num_steps=50")
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert ("--config.train.num_steps=50 --config.model.pos_emb=rope "
          "--config.model.norm_position=post") in out
  for line in ("#SBATCH --array=0-7%3", "#SBATCH --partition=gpu", "#SBATCH --account=lab",
               "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
               "#SBATCH --requeue", "#SBATCH --signal=USR2@90", f"cd {ROOT}"):
    assert line in out
  assert "srun --unbuffered" in out and "submitit.core._submit" in out
  assert not (tmp_path / "r").exists()


GRID = ["--grid", "model.pos_emb=rope,none", "--grid", "model.norm_position=pre"]
NAMES = ["pos_emb=rope,norm_position=pre", "pos_emb=none,norm_position=pre"]


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
  """A 2-variant --grid sweep run with the local launcher, 2 at a time; its
  warm-up as long as the run, so that train.py warns."""
  tmp = tmp_path_factory.mktemp("sweep")
  root = tmp / "root"
  args = [*GRID, "--config", TINY, "--root", str(root), *small_flags(tmp / "cache"),
          "--config.train.warmup_steps=6"]
  result = sweep_cli("run", *args, "--parallel", "2")
  return root, args, result


def test_local_grid_sweep_runs_every_variant_and_skips_them_when_run_again(local_sweep):
  root, args, result = local_sweep
  assert result.returncode == 0, result.stdout + result.stderr
  out = result.stdout.splitlines()
  assert out[0] == ("running 2 run(s), 2 at a time (each logs to <workdir>/sweep.log); ETA "
                    "after the first run")
  for name in NAMES:
    assert f"start   {name}" in out
    assert (root / name / "eval_report.json").exists() and (root / name / "sweep.log").exists()
    # train.py's warning, echoed once after the run's name
    [warning] = [line for line in out if line.startswith(f"{name}: ")]
    assert "warning: below train.learning_rate=" in warning
    assert warning[len(name) + 2:] in (root / name / "sweep.log").read_text()
  first, last = [line for line in out if re.match(r"\[\d/2\] (done|failed|stopped) ", line)]
  assert re.fullmatch(r"\[1/2\] done    pos_emb=\S+: step 6/6, val loss \d\.\d{4} \(\S+\); "
                      r"ETA \S+", first), first
  assert re.fullmatch(r"\[2/2\] done    pos_emb=\S+: step 6/6, val loss \d\.\d{4} \(\S+\)",
                      last), last
  for line in out:  # where the runs stand, after 30 s without a line (on a slow machine)
    assert " running " not in line or re.fullmatch(
        r"\[[01]/2\] running (pos_emb=\S+: (starting|step \d/6) \(\S+\); )+ETA .+", line), line
  assert re.fullmatch(r"2 run\(s\) in \S+: 2 done", out[-2]), out[-2]
  assert out[-1] == (f"status: python sweep.py status --root {root}; report: python sweep.py "
                     f"report --root {root}")
  manifest, variants = sweep_lib.read_manifest(str(root))
  assert manifest["name"] == "grid-pos_emb-norm_position"
  assert manifest["sweep"] == "--grid model.pos_emb=rope,none --grid model.norm_position=pre"
  assert [v.name for v in variants] == NAMES
  again = sweep_cli("run", *args)
  assert again.returncode == 0, again.stderr
  assert again.stdout.splitlines() == [f"skip {name}: done" for name in NAMES] + [
      f"every run is done; the report: python sweep.py report --root {root}"]


def test_status_reports_done_failed_partial_and_not_started(local_sweep, tmp_path):
  root, _, _ = local_sweep
  out = sweep_cli("status", "--root", str(root)).stdout.splitlines()
  assert out[0].startswith("sweep grid-pos_emb-norm_position: 2 variants in ")
  assert "(2 done)" in out[0]
  assert out[1].split()[:3] == ["done", "pos_emb=rope,norm_position=pre", "step"]
  # A sweep whose variants failed, stopped part-way or never started.
  manifest, variants = sweep_lib.read_manifest(str(root))
  variants[0].workdir = str(tmp_path / "failed")
  variants[0].train_command = [sys.executable, "-c", "raise SystemExit('error: bad config')"]
  with pytest.raises(sweep_lib.VariantFailed, match="train.py exited with status 1: error: bad"):
    sweep_lib.VariantJob()(variants[0])
  assert sweep_lib.variant_state(variants[0]).state == "failed"
  assert "error: bad config (train.py exited with status 1" in sweep_lib.variant_state(
      variants[0]).detail
  partial = tmp_path / "partial"
  partial.mkdir()
  (partial / "metrics.jsonl").write_text('{"step": 4, "split": "train", "loss": 5.0}\n')
  state = sweep_lib.variant_state(sweep_lib.Variant("p", {}, str(partial), 6, [], []))
  assert (state.state, state.step, state.detail) == ("running/partial", 4, "step 4/6")
  assert sweep_lib.variant_state(
      sweep_lib.Variant("n", {}, str(tmp_path / "none"), 6, [], [])).state == "not started"


def test_report_writes_the_table_and_the_validation_curves(local_sweep):
  root, _, _ = local_sweep
  result = sweep_cli("report", "--root", str(root))
  assert result.returncode == 0, result.stderr
  with open(root / "report.csv", encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  assert [r["variant"] for r in rows] == NAMES
  assert rows[1]["model.pos_emb"] == "none" and rows[1]["model.norm_position"] == "pre"
  for row in rows:
    assert row["state"] == "done" and row["step"] == "6"
    assert 0 < float(row["loss"]) < 7 and float(row["perplexity"]) > 1
    assert 0 <= float(row["token_accuracy"]) <= 1 and float(row["bits_per_byte"]) > 0
  md = (root / "report.md").read_text()
  assert ("| variant | model.pos_emb | model.norm_position | state | step | val loss | "
          "perplexity | token accuracy | bits per byte |") in md
  loss = float(rows[1]["loss"])
  assert f"| pos_emb=none,norm_position=pre | none | pre | done | 6 | {loss:.4f} |" in md
  assert "sweep `--grid model.pos_emb=rope,none --grid model.norm_position=pre`" in md
  for png in ("validation_curves.png", "curves/pos_emb=rope,norm_position=pre.png",
              "curves/pos_emb=none,norm_position=pre.png"):
    assert (root / png).read_bytes()[:4] == b"\x89PNG" and f"]({png})" in md


def test_a_long_run_name_titles_its_curves_on_several_lines():
  """A run's curve title breaks after a comma rather than running off the
  figure (a 3-field DeepSeek sweep's names are 84 characters)."""
  from training.plots import wrapped  # pylint: disable=import-outside-toplevel
  title = "deepseek_moe: moe_router=deepseek,moe_aux_loss=0.0,moe_bias_update_rate=0.001,seed=0"
  lines = wrapped(title).split("\n")
  assert lines == ["deepseek_moe: moe_router=deepseek,moe_aux_loss=0.0,",
                   "moe_bias_update_rate=0.001,seed=0"]
  assert wrapped("runs/tiny") == "runs/tiny"


def test_grid_flags_are_every_combination_typed_as_the_config_fields(tmp_path):
  sweep = sweep_lib.grid_sweep(["model.pos_emb=rope,sinusoidal", "train.learning_rate=1e-3,0.01",
                                "model.use_bias=true"], TINY)
  assert (sweep.name, sweep.path, sweep.where) == (
      "grid-pos_emb-learning_rate-use_bias", None, "--grid")
  assert sweep.source == ("--grid model.pos_emb=rope,sinusoidal --grid "
                          "train.learning_rate=1e-3,0.01 --grid model.use_bias=true")
  assert sweep.overrides == [  # the first --grid varies slowest
      {"model.pos_emb": p, "train.learning_rate": lr, "model.use_bias": True}
      for p in ("rope", "sinusoidal") for lr in (0.001, 0.01)]
  variants = sweep_lib.make_variants(sweep, TINY, [], str(tmp_path))
  assert variants[1].name == "pos_emb=rope,learning_rate=0.01,use_bias=true"
  assert variants[1].train_command[-3:] == [
      "--config.model.pos_emb=rope", "--config.train.learning_rate=0.01",
      "--config.model.use_bias=true"]
  # Two fields of one last name are named in full.
  assert sweep_lib.grid_sweep(["model.vocab_size=320", "tokenizer.vocab_size=300"],
                              TINY).name == "grid-model.vocab_size-tokenizer.vocab_size"


@pytest.mark.parametrize("flags,message", [
    (["model.pos_emb"], "--grid model.pos_emb: give field=value[,value...]"),
    (["model.pos_emb="], "--grid model.pos_emb=: an empty value"),
    (["model.pos_emb=rope,"], "--grid model.pos_emb=rope,: an empty value"),
    (["model.pos_emb=rope", "model.pos_emb=none"], "--grid model.pos_emb: given twice"),
    (["model.pos_embb=rope"], "--grid: model.pos_embb: no such config field (did you mean "
     "model.pos_emb?)"),
    (["train.num_steps=20,abc"], "--grid train.num_steps=abc: expected an int, got 'abc'"),
    (["model.use_bias=maybe"], "--grid model.use_bias=maybe: expected a bool (true or false), "
     "got 'maybe'"),
    (["train.learning_rate=1e-3,0.001"], "--grid train.learning_rate=1e-3,0.001: 0.001 given "
     "twice"),
    (["model.moe_layers=1"], "--grid model.moe_layers: a tuple field"),
    (["config.model.pos_emb=rope"], "give the field without 'config.' (--grid "
     "model.pos_emb=rope)"),
])
def test_bad_grid_flags_are_one_line_user_errors(flags, message):
  with pytest.raises(UserError) as err:
    sweep_lib.grid_sweep(flags, TINY)
  assert message in str(err.value) and "\n" not in str(err.value)


POS_NORM_NAMES = [f"pos_emb={p},norm_position={n}" for p in ("none", "sinusoidal", "learned",
                                                             "rope") for n in ("pre", "post")]


def test_grid_and_variants_pick_a_part_of_a_sweep_file(tmp_path):
  sweep = sweep_lib.load_sweep(POS_NORM)
  assert sweep_lib.select(sweep, ["model.pos_emb=rope,none", "model.norm_position=post"], [],
                          TINY) == ["pos_emb=none,norm_position=post",
                                    "pos_emb=rope,norm_position=post"]
  # one name, two names joined by commas, and a --grid beside them
  assert sweep_lib.select(sweep, [], ["pos_emb=rope,norm_position=pre",
                                      "pos_emb=none,norm_position=post,pos_emb=learned,"
                                      "norm_position=pre"], TINY) == [
      "pos_emb=none,norm_position=post", "pos_emb=learned,norm_position=pre",
      "pos_emb=rope,norm_position=pre"]
  assert sweep_lib.select(sweep, ["model.norm_position=pre"], [",".join(POS_NORM_NAMES[:4])],
                          TINY) == ["pos_emb=none,norm_position=pre",
                                    "pos_emb=sinusoidal,norm_position=pre"]
  # a file's values are read as the --grid's: 1e-3 there is 0.001 here
  lr = write_sweep(tmp_path, "def get_sweep():\n  return {'train.learning_rate': [1e-3, 2e-3]}\n")
  assert sweep_lib.select(sweep_lib.load_sweep(lr), ["train.learning_rate=0.002"], [],
                          TINY) == ["learning_rate=0.002"]
  for grid, variants, message in [
      (["model.pos_emb=alibi"], [], f"--grid model.pos_emb=alibi: sweep {POS_NORM} has no "
       "variant with it (its values: none, sinusoidal, learned, rope)"),
      (["model.d_model=64"], [], f"--grid model.d_model: sweep {POS_NORM} does not set it (it "
       "sets model.norm_position, model.pos_emb)"),
      ([], ["pos_emb=rope,norm_position=prE"], "--variants pos_emb=rope,norm_position=prE: "
       f"sweep {POS_NORM} has no such variant (did you mean pos_emb=rope,norm_position=pre?); "
       "its variants: pos_emb=none,norm_position=pre, "),
      (["model.pos_emb=none"], ["pos_emb=rope,norm_position=pre"], "--grid model.pos_emb=none "
       f"--variants pos_emb=rope,norm_position=pre: no variant of sweep {POS_NORM} has all of "
       "them")]:
    with pytest.raises(UserError) as err:
      sweep_lib.select(sweep, grid, variants, TINY)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_mistake_in_grid_or_variants_exits_2_with_one_line_and_writes_nothing(tmp_path):
  root = tmp_path / "r"
  result = sweep_cli("run", "--grid", "model.pos_emb=rope", "--grid", "train.num_steps=20,x",
                     "--root", str(root))
  assert result.returncode == 2 and not root.exists()
  assert result.stderr.splitlines() == [
      "error: --grid train.num_steps=x: expected an int, got 'x'"]
  result = sweep_cli("run", "--sweep", POS_NORM, "--variants", "pos_emb=rope", "--root",
                     str(root))
  assert result.returncode == 2 and not root.exists()
  assert result.stderr.splitlines()[0].startswith(
      f"error: --variants pos_emb=rope: sweep {POS_NORM} has no such variant")
  assert len(result.stderr.splitlines()) == 1


def test_a_grid_dry_run_defaults_to_tiny_and_a_root_named_after_its_fields():
  result = sweep_cli("run", "--grid", "model.pos_emb=rope,sinusoidal", "--grid",
                     "model.norm_position=pre,post", "--seeds", "2", "--dry_run")
  assert result.returncode == 0, result.stderr
  runs = [line[:-1] for line in result.stdout.splitlines() if not line.startswith(" ")]
  assert runs == [f"pos_emb={p},norm_position={n},seed={k}" for p in ("rope", "sinusoidal")
                  for n in ("pre", "post") for k in (0, 1)]
  workdir = ROOT / "runs" / "sweeps" / "grid-pos_emb-norm_position" / runs[0]
  assert (f"train.py --config {ROOT / 'configs' / 'tiny.py'} --workdir {workdir} "
          "--config.model.pos_emb=rope --config.model.norm_position=pre "
          "--config.train.seed=0") in result.stdout


ABLATIONS = ROOT / "docs" / "ablations"


def test_the_ablation_pages_are_the_rendering_of_their_report_csv(tmp_path):
  """`sweep.py report --from_csv` rebuilds the statistics of a report whose
  runs are gone: on each checked-in ablation page it rewrites
  report_summary.csv and report.md as they are (so they follow the code);
  a root without a report is refused. (A scaling page, `sweep.py scaling`'s
  output, has no report.csv.)"""
  for page in sorted(p.name for p in ABLATIONS.iterdir() if (p / "report.csv").exists()):
    shutil.copytree(ABLATIONS / page, tmp_path / page)
    if page == "heads":
      result = sweep_cli("report", "--root", str(tmp_path / page), "--from_csv")
      assert result.returncode == 0, result.stderr
      assert result.stdout == (f"wrote {tmp_path / page / 'report_summary.csv'}, "
                               f"{tmp_path / page / 'report.md'}\n")
    else:
      sweep_lib.rebuild_statistics(str(tmp_path / page))
    for name in ("report_summary.csv", "report.md"):
      assert (tmp_path / page / name).read_bytes() == (ABLATIONS / page / name).read_bytes(), (
          f"docs/ablations/{page}/{name} is not the rendering of its report.csv: run "
          f"python sweep.py report --root docs/ablations/{page} --from_csv")
  with pytest.raises(UserError, match=f"{tmp_path / 'none' / 'report.csv'} is missing: "
                     "--from_csv rebuilds the statistics of a report that `sweep.py report` "
                     "wrote; run that first"):
    sweep_lib.rebuild_statistics(str(tmp_path / "none"))


@pytest.mark.slow  # make test-slurm runs submitit jobs on a real cluster
def test_a_variant_runs_to_completion_as_a_submitit_job(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)  # the job imports sweeps from its working directory
  path = write_sweep(tmp_path, "def get_sweep():\n  return [{'model.pos_emb': 'learned'}]\n")
  variants = sweep_lib.make_variants(sweep_lib.load_sweep(path), TINY,
                                     small_flags(tmp_path / "cache"), str(tmp_path / "root"))
  params = sweep_lib.slurm_parameters("t", nodes=1, tasks_per_node=1, gpus_per_node=0,
                                      cpus_per_task=2, timeout_min=10, partition="p",
                                      account=None, parallel=None, setup=[])
  [job] = sweep_lib.submit_slurm(variants, str(tmp_path / "root" / "slurm"), params,
                                 max_timeouts=1, cluster="local")
  result = job.result()
  assert result["state"] == "done" and result["step"] == 6, job.stderr()
  assert result["report"]["step"] == 6
  assert sweep_lib.variant_state(variants[0]).state == "done"


FAKE_TRAIN = """\
import json, os, sys, time
workdir, steps, pause, status = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
for line in sys.argv[5:]:
  print(line, flush=True)
for step in range(1, steps + 1):
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": step, "split": "train", "loss": 1.0}) + "\\n")
  time.sleep(pause)
if status < 0:
  os.kill(os.getpid(), -status)
sys.exit(status)
"""
FAKE_EVAL = ("import json, os, sys; json.dump({'step': int(sys.argv[2]), 'loss': 1.25}, "
             "open(os.path.join(sys.argv[1], 'eval_report.json'), 'w'))")


def fake_run(tmp_path, name: str, steps: int, status: int = 0, *lines: str, pause: float = 0,
             num_steps: int = 2) -> sweep_lib.Variant:
  """A variant whose train.py logs `steps` steps and `lines`, then exits
  `status` (negative: killed by that signal), and whose eval.py writes a report."""
  script = tmp_path / "fake_train.py"
  script.write_text(FAKE_TRAIN)
  workdir = str(tmp_path / name)
  return sweep_lib.Variant(
      name, {}, workdir, num_steps,
      [sys.executable, str(script), workdir, str(steps), str(pause), str(status), *lines],
      [sys.executable, "-c", FAKE_EVAL, workdir, str(num_steps)])


@pytest.mark.parametrize("steps,status,how", [
    (2, 143, "train.py stopped on SIGTERM"),  # train.py saved on SIGTERM
    (1, 130, "train.py stopped on SIGINT"),  # ... on Ctrl-C
    (1, 0, "train.py stopped"),  # a train.py from before 130/143
    (1, -signal.SIGTERM, "train.py killed by SIGTERM"),  # before its handler
])
def test_train_py_stopped_by_a_signal_is_a_stopped_run_not_a_failure(tmp_path, steps, status,
                                                                     how):
  variant = fake_run(tmp_path, "v", steps, status)
  assert sweep_lib.VariantJob()(variant) == {"name": "v", "state": "stopped", "step": steps,
                                             "how": how}
  assert not (tmp_path / "v" / "eval_report.json").exists()  # eval.py not run
  assert not (tmp_path / "v" / "sweep_error.json").exists()
  assert sweep_lib.variant_state(variant).state == "running/partial"


def test_train_py_exit_0_is_done_and_exit_2_a_failure_with_its_error_line(tmp_path):
  done = fake_run(tmp_path, "done", 2, 0)
  result = sweep_lib.VariantJob()(done)
  assert (result["state"], result["step"], result["report"]) == (
      "done", 2, {"step": 2, "loss": 1.25})
  failed = fake_run(tmp_path, "failed", 0, 2, "error: train.data.paths: no such file")
  with pytest.raises(sweep_lib.VariantFailed) as err:
    sweep_lib.VariantJob()(failed)
  assert str(err.value) == ("failed: train.py exited with status 2: error: train.data.paths: "
                            "no such file")
  state = sweep_lib.variant_state(failed)
  assert state.state == "failed"
  assert state.detail.startswith("error: train.data.paths: no such file (train.py exited with "
                                 "status 2; log ")


def test_the_local_launcher_says_each_start_warning_result_eta_and_progress(tmp_path):
  """One at a time: a run that warns (twice, once echoed) and is done, a slow
  one (its progress line), one that fails, one stopped."""
  warning = "schedule    peaks at 0.01; warning: below train.learning_rate=0.03"
  absl = "W0612 10:11:{}.123456 140000 seq2seq.py:171] dropped 3 pairs"
  variants = [fake_run(tmp_path, "a", 2, 0, warning, warning, absl.format(12), absl.format(13)),
              fake_run(tmp_path, "b", 2, 0, pause=1.5),
              fake_run(tmp_path, "c", 0, 2, "error: bad"),
              fake_run(tmp_path, "d", 1, 143)]
  lines = []
  assert sweep_lib.run_local(variants, 1, out=lines.append, every_s=1) == 2  # not done
  lines = [re.sub(r"\d+s\b", "Ns", line) for line in lines]  # wall times and ETAs
  progress = [line for line in lines if line.startswith("[1/4] running")]
  assert progress and progress[0] in ("[1/4] running b: step 1/2 (Ns); ETA Ns",
                                      "[1/4] running b: step 2/2 (Ns); ETA Ns")
  assert [line for line in lines if line not in progress] == [
      "running 4 run(s), 1 at a time (each logs to <workdir>/sweep.log); ETA after the first run",
      "start   a",
      f"a: {warning}",
      f"a: {absl.format(12)}",
      "[1/4] done    a: step 2/2, val loss 1.2500 (Ns); ETA Ns",
      "start   b",
      "[2/4] done    b: step 2/2, val loss 1.2500 (Ns); ETA Ns",
      "start   c",
      "[3/4] failed  c: train.py exited with status 2: error: bad (Ns); ETA Ns",
      "start   d",
      "[4/4] stopped d: step 1/2, train.py stopped on SIGTERM; run the same command "
      "to resume (Ns)",
      "4 run(s) in Ns: 2 done, 1 failed, 1 stopped"]


def test_the_console_eta_counts_the_runs_left_and_the_parallel_slots(tmp_path):
  now = [0.0]
  lines = []
  variants = [fake_run(tmp_path, name, 0) for name in "abc"]
  console = sweep_lib.Console(variants, 2, lines.append, every_s=30, clock=lambda: now[0])
  console.started(variants[0])
  console.started(variants[1])
  now[0] = 10
  console.tick()  # 10 s of silence: nothing
  now[0] = 45
  console.tick()
  console.ended(variants[0], "done", "step 2/2, val loss 1.2500")  # a run takes 45 s
  now[0] = 50
  console.ended(variants[1], "failed", "train.py exited with status 2: error: bad")
  assert lines[3:] == [
      "[0/3] running a: starting (45s); b: starting (45s); ETA after the first run",
      "[1/3] done    a: step 2/2, val loss 1.2500 (45s); ETA 45s",  # c after a, b at 45 s
      "[2/3] failed  b: train.py exited with status 2: error: bad (50s); ETA 45s"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_local_launcher_passes_sigint_and_sigterm_on_and_starts_nothing_more(
    tmp_path, signum):
  """What `sweep.py run` does when Ctrl-C'd or sent SIGTERM: the running
  train.py gets the signal (it saves), the others do not start, and the
  signal is raised again once train.py has ended: sweep.py exits 130 or 143."""
  first = sweep_lib.Variant("first", {}, str(tmp_path / "first"), 6, fake_trainer(), [])
  second = fake_run(tmp_path, "second", 2)
  log = tmp_path / "first" / "sweep.log"

  def stop():
    while not (log.exists() and "READY" in log.read_text()):
      time.sleep(0.1)
    # To the main thread, which waits for train.py: a signal sent to the
    # process may land on another thread and leave that wait uncut.
    signal.pthread_kill(threading.main_thread().ident, signum)

  # Python's own SIGINT handler, whatever an earlier test in this worker left
  # installed (a worker of pytest-xdist may hold another one).
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  threading.Thread(target=stop, daemon=True).start()
  lines = []
  raised = KeyboardInterrupt if signum == signal.SIGINT else sweep_lib.Terminated
  try:
    with pytest.raises(raised):
      sweep_lib.run_local([first, second], 1, out=lines.append)
  finally:
    signal.signal(signal.SIGINT, previous)
  assert "SAVED" in log.read_text() and not (tmp_path / "second").exists()
  name = signal.Signals(signum).name
  assert lines[2:] == [
      f"{name}: passed on to the 1 running run(s), which save and stop; no other starts",
      f"[1/2] stopped first: step 0/6, train.py stopped on {name}; run the same "
      f"command to resume ({lines[3].rsplit('(', 1)[1]}",
      f"1 run(s) in {lines[4].split(' in ')[1].split(':')[0]}: 1 stopped"]
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
  with pytest.raises(SystemExit) as exit_:
    with sweep_lib.command_exits("runs"):
      raise raised()
  assert exit_.value.code == 128 + signum


def fake_trainer(signal_status: bool = True) -> list[str]:
  """A train.py stand-in: prints READY, and SAVED on SIGTERM or SIGINT, then
  exits 128 + the signal, as train.py does (`signal_status` False: 0, as it
  did before) (the words are built at run time so that the command line in
  the log lacks them)."""
  return [sys.executable, "-c",
          "import signal, sys, time\n"
          "def save(signum, _):\n"
          "  print('saved'.upper(), flush=True)\n"
          f"  sys.exit(128 + signum if {signal_status} else 0)\n"
          "signal.signal(signal.SIGTERM, save)\n"
          "signal.signal(signal.SIGINT, save)\n"
          "print('ready'.upper(), flush=True)\n"
          "time.sleep(60)\n"]


@pytest.mark.parametrize("status", [143, 0])  # train.py's, and its status before 143
def test_checkpoint_stops_train_py_with_sigterm_and_resubmits_the_same_call(tmp_path, status):
  """As under submitit: checkpoint() runs as a signal handler in the thread
  that is waiting for train.py."""
  variant = sweep_lib.Variant("v", {}, str(tmp_path / "v"), 6, fake_trainer(status == 143), [])
  job, delayed, alive_after_usr2 = sweep_lib.VariantJob(), [], []
  log = tmp_path / "v" / "sweep.log"

  def preempt():
    while not (log.exists() and "READY" in log.read_text()):
      time.sleep(0.1)
    os.kill(job._child.pid, signal.SIGUSR2)  # SLURM's time-limit signal: blocked in train.py
    time.sleep(0.5)
    alive_after_usr2.append(job._child.poll() is None)
    os.kill(os.getpid(), signal.SIGUSR1)

  previous = signal.signal(signal.SIGUSR1, lambda *_: delayed.append(job.checkpoint(variant)))
  try:
    threading.Thread(target=preempt, daemon=True).start()
    start = time.time()
    result = job(variant)
  finally:
    signal.signal(signal.SIGUSR1, previous)
  assert time.time() - start < sweep_lib.STOP_TIMEOUT_S / 2
  assert alive_after_usr2 == [True] and "SAVED" in log.read_text()
  how = "train.py stopped" + (" on SIGTERM" if status else "")
  assert result == {"name": "v", "state": "stopped", "step": 0, "how": how}
  assert not (tmp_path / "v" / "sweep_error.json").exists()
  assert sweep_lib.read_times(variant.workdir)[0]["returncode"] == status
  assert isinstance(delayed[0], submitit.helpers.DelayedSubmission)
  assert delayed[0].function is job and delayed[0].args == (variant,)
  assert pickle.loads(pickle.dumps(delayed[0])).function._child is None


def process_of(*words) -> int | None:
  """The pid of a running process whose command line holds all `words`."""
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
      continue
    if all(any(word in part for part in cmdline) for word in words):
      return int(pid)
  return None


@pytest.mark.slow
def test_preempted_submitit_job_saves_requeues_and_resumes(tmp_path, monkeypatch):
  """submitit's preemption signal (USR2) reaches the job: train.py saves on
  SIGTERM, the job is requeued, and the second run resumes and finishes."""
  monkeypatch.chdir(ROOT)
  path = write_sweep(tmp_path, "def get_sweep():\n  return [{'model.pos_emb': 'rope'}]\n")
  variants = sweep_lib.make_variants(
      sweep_lib.load_sweep(path), TINY,
      small_flags(tmp_path / "cache")[:4] + [
          "--config.train.num_steps=600", "--config.train.batch_size=4",
          "--config.train.seq_len=32", "--config.train.log_every=10",
          "--config.train.eval_every=600", "--config.train.checkpoint_every=300",
          "--config.train.eval_steps=1"] + small_flags(tmp_path / "cache")[-4:],
      str(tmp_path / "root"))
  params = sweep_lib.slurm_parameters("t", nodes=1, tasks_per_node=1, gpus_per_node=0,
                                      cpus_per_task=2, timeout_min=60, partition=None,
                                      account=None, parallel=None, setup=[])
  [job] = sweep_lib.submit_slurm(variants, str(tmp_path / "root" / "slurm"), params,
                                 max_timeouts=1, cluster="local")
  workdir = pathlib.Path(variants[0].workdir)
  deadline = time.time() + 120
  while not (workdir / "metrics.jsonl").exists() and time.time() < deadline:
    time.sleep(0.1)
  trainer = process_of("train.py", str(workdir))
  task = int(pathlib.Path(f"/proc/{trainer}/stat").read_text().rsplit(")", 1)[1].split()[1])
  os.kill(task, signal.SIGUSR2)
  result = job.result()
  assert result["state"] == "done" and result["step"] == 600, job.stderr()
  log = (workdir / "sweep.log").read_text()
  assert "SIGTERM received: saved step" in log and ", resuming to 600" in log
  assert "preempted" in job.stderr()


def test_check_fits_reads_cpus_gpus_nodes_and_time_from_sinfo():
  sinfo = "gpu*|64|512000|gpu:h100:8(S:0-1)|4|2-00:00:00\ncpu|32|256000|(null)|10|30:00\n"
  params = sweep_lib.slurm_parameters("s", nodes=2, tasks_per_node=8, gpus_per_node=8,
                                      cpus_per_task=8, timeout_min=240, partition=None,
                                      account=None, parallel=None, setup=[])
  sweep_lib.check_fits(params, sinfo)
  for change, message in [
      ({"gpus_per_node": 9}, "--gpus_per_node 9: partition gpu has 8 GPUs per node"),
      ({"nodes": 5}, "--nodes 5: partition gpu has 4 node(s)"),
      ({"mem_gb": 600}, "--mem_gb 600: partition gpu has 500 GB per node; lower --mem_gb"),
      ({"timeout_min": 3000}, "--timeout_min 3000: partition gpu allows at most 2880 minutes"),
      ({"slurm_partition": "cpu"}, "--gpus_per_node 8: partition cpu has 0 GPUs"),
      ({"slurm_partition": "big"}, "--partition big: no such partition (sinfo lists cpu, gpu)")]:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
      sweep_lib.check_fits({**params, **change}, sinfo)
  with pytest.raises(UserError, match="--timeout_min 240: partition cpu allows at most 30"):
    sweep_lib.check_fits({**params, "gpus_per_node": 0, "cpus_per_task": 4,
                          "slurm_partition": "cpu"}, sinfo)


def test_a_learning_rate_sweep_reports_where_each_curves_optimum_lies(tmp_path):
  """Two parametrizations x two widths x three learning rates: each curve's
  best learning rate, its place on the grid, how far it moves per
  parametrization, each best beside the other parametrization's at its
  width, and the plot."""
  import types  # pylint: disable=import-outside-toplevel
  from sweeps.lr_transfer import write_lr_section  # pylint: disable=import-outside-toplevel
  losses = {("sp", 64): [3.0, 2.0, 2.5], ("sp", 256): [2.0, 2.5, 3.5],
            ("mup", 64): [3.0, 2.0, 2.5], ("mup", 256): [2.9, 1.9, 2.4]}
  summary = [({"variant": f"{p}{d}-{lr}", "loss_mean": loss, "loss_ci_low": loss - 0.1,
               "loss_ci_high": loss + 0.1},
              [types.SimpleNamespace(overrides={"model.parametrization": p, "model.d_model": d,
                                                "model.num_layers": 2,
                                                "train.learning_rate": lr})])
             for (p, d), curve in losses.items() for lr, loss in zip((1e-3, 2e-3, 4e-3), curve)]
  seeds = {row["variant"]: [row["loss_mean"] - 0.05, row["loss_mean"] + 0.05]
           for row, _ in summary}
  section, [png] = write_lr_section(str(tmp_path), summary, ["model.parametrization",
                                                             "model.d_model", "model.num_layers",
                                                             "train.learning_rate"], seeds)
  assert "num_layers" not in section  # set alike in every variant: names no curve
  assert "| parametrization=sp, d_model=256 | 0.001 | 2.0000 | 1 of 3 |" in section
  assert "| parametrization=mup, d_model=256 | 0.002 | 1.9000 | 2 of 3 |" in section
  assert "- model.parametrization=sp: 1 grid step(s) over 2 curves" in section
  assert "- model.parametrization=mup: 0 grid step(s) over 2 curves" in section
  assert "| 64 | sp | 0.002 | 2.0000 [1.9500, 2.0500] |  |" in section
  assert "| 256 | mup | 0.002 | 1.9000 [1.8500, 1.9500] | -0.1000 |" in section
  assert pathlib.Path(png).read_bytes()[:4] == b"\x89PNG"
  assert write_lr_section(str(tmp_path), summary[:1], ["train.learning_rate"]) == ("", [])


def test_the_mup_transfer_sweep_resolves_every_variant(tmp_path):
  """configs/sweeps/mup_transfer.py: 2 parametrizations x 4 widths x 8
  learning rates x 2 seeds, each a valid config (d_ff = 3 d, a base width
  and the output multiplier under μP only)."""
  sweep = sweep_lib.load_sweep(str(ROOT / "configs" / "sweeps" / "mup_transfer.py"))
  variants = sweep_lib.make_variants(sweep, str(ROOT / sweep.config), [],
                                     str(tmp_path / "root"))
  assert len(variants) == 128 and len({v.name for v in variants}) == 128
  for v in variants:
    m = v.config["model"]
    assert m["d_ff"] == 3 * m["d_model"]
    assert ((m["mup_base_width"], m["mup_output_mult"]) == (32, 4.0)) == (
        m["parametrization"] == "mup")
