"""Trackers (train.trackers) and the profiler (train.profile_steps), on one
20-step run trained in two parts (a resume at step 10) and evaluated: W&B
offline, MLflow on a file store, TensorBoard; and a trace XProf reads back."""
import glob
import gzip
import importlib.util
import json
import os
import struct

import jax
import jax.numpy as jnp
import pytest

from configs.errors import UserError
from training import evaluate, loop, trackers
from training.metrics import read_metrics
from training.profiler import StepProfiler
from tests.helpers import small_config

TRACKED = "tensorboard,wandb,mlflow"


@pytest.fixture(scope="module")
def run(tok_dir, tmp_path_factory):
  """(workdir, MLflow store, eval report) of the run: 10 steps, a resume to 20, eval.py's report."""
  root = tmp_path_factory.mktemp("tracked")
  store = f"file:{root / 'mlruns'}"
  with pytest.MonkeyPatch.context() as env:
    env.setenv("WANDB_MODE", "offline")
    env.setenv("WANDB_SILENT", "true")
    env.setenv("MLFLOW_TRACKING_URI", store)
    env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    c = small_config(tok_dir)
    c.train.update(num_steps=10, log_every=5, eval_every=10, checkpoint_every=10,
                   trackers=TRACKED, profile_steps="3,4")
    workdir = str(root / "run")
    loop.train(c, workdir)
    c.train.num_steps = 20
    loop.train(c, workdir)
    report = evaluate.run_eval(workdir, max_new_tokens=2)
    evaluate.log_to_trackers(workdir, report)
  return workdir, store, report


def logged(workdir: str, split: str, name: str) -> dict:
  """{step: value} of `name` in metrics.jsonl's `split` records."""
  return {r["step"]: r[name] for r in read_metrics(workdir) if r["split"] == split}


def wandb_records(path: str) -> list:
  """The records of a W&B run file (run-<id>.wandb): a 7-byte header, then
  32 KiB blocks of chunks, each a 7-byte header (checksum, length, kind:
  1 whole record, 2 first part, 3 middle, 4 last) and its bytes."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B"
  records, pos, parts = [], 7, b""
  while pos + 7 <= len(data):
    room = 32768 - pos % 32768
    if room < 7:  # a block's tail too short for a chunk header is padding
      pos += room
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    parts += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(parts)
      records.append(record)
      parts = b""
  return records


def tensorboard_events(workdir: str) -> list:
  """The events of <workdir>/tensorboard (TFRecords: length, its checksum, the
  event, its checksum)."""
  from tensorboardX.proto.event_pb2 import Event  # pylint: disable=import-outside-toplevel
  events = []
  for path in sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      events.append(Event.FromString(data[pos + 12:pos + 12 + length]))
      pos += 12 + length + 4
  return events


def test_wandb_offline_run_holds_the_metrics_and_continues_after_the_resume(run):
  workdir, _, report = run
  with open(os.path.join(workdir, trackers.IDS_FILE), encoding="utf-8") as f:
    run_id = json.load(f)["wandb"]["id"]
  files = sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")))
  assert len(files) == 3  # the first 10 steps, the resume, eval.py
  assert all(f.endswith(f"run-{run_id}.wandb") for f in files)
  history, config = {}, {}
  for path in files:
    for record in wandb_records(path):
      kind = record.WhichOneof("record_type")
      if kind == "history":
        items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                 for i in record.history.item}
        history.setdefault(items["step"], {}).update(items)
      elif kind == "config":
        config.update({i.key: json.loads(i.value_json) for i in record.config.update})
  train_loss = {step: h["train/loss"] for step, h in history.items() if "train/loss" in h}
  assert train_loss == pytest.approx(logged(workdir, "train", "loss"))
  assert sorted(train_loss) == [5, 10, 15, 20]
  assert history[20]["validation/loss"] == pytest.approx(logged(workdir, "validation", "loss")[20])
  assert "eval/loss" in history[20], (files, history[20])  # eval.py's record, else what the files held
  assert history[20]["eval/loss"] == pytest.approx(report["loss"])
  assert history[20]["eval/loss_curves/_type"] == "image-file"
  assert config["train"]["num_steps"] == 20 and config["workdir"] == os.path.abspath(workdir)
  assert glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "files", "eval", "step_20",
                                "eval_report.json"))


def test_mlflow_file_store_run_holds_the_metrics_and_continues_after_the_resume(run, monkeypatch):
  workdir, store, report = run
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
  client = MlflowClient(store)
  (experiment,) = [e for e in client.search_experiments() if e.name == trackers.DEFAULT_PROJECT]
  (tracked,) = client.search_runs([experiment.experiment_id])
  assert tracked.info.status == "FINISHED" and tracked.info.run_name == "run"
  assert tracked.data.tags["workdir"] == os.path.abspath(workdir)
  assert tracked.data.params["model.d_model"] == "32"
  history = {m.step: m.value for m in client.get_metric_history(tracked.info.run_id, "train/loss")}
  assert history == pytest.approx(logged(workdir, "train", "loss"))
  assert sorted(history) == [5, 10, 15, 20]
  (val,) = client.get_metric_history(tracked.info.run_id, "validation/loss")[-1:]
  assert val.step == 20
  assert tracked.data.metrics["eval/loss"] == pytest.approx(report["loss"])
  artifacts = {a.path for a in client.list_artifacts(tracked.info.run_id, "eval/step_20")}
  assert {"eval/step_20/eval_report.json", "eval/step_20/loss_curves.png"} <= artifacts
  assert "config.json" in {a.path for a in client.list_artifacts(tracked.info.run_id)}


def test_tensorboard_keeps_its_scalars_and_takes_the_eval_plots(run):
  workdir, _, _ = run
  scalars, images = {}, set()
  for event in tensorboard_events(workdir):
    for value in event.summary.value:
      if value.HasField("simple_value"):
        scalars.setdefault(value.tag, {})[event.step] = value.simple_value
      elif value.HasField("image"):
        images.add((value.tag, event.step))
  assert scalars["train/loss"] == pytest.approx(logged(workdir, "train", "loss"))
  assert sorted(scalars["validation/loss"]) == [10, 20]
  assert ("eval/loss_curves", 20) in images


def test_profile_steps_leave_a_trace_that_xprof_reads(run):
  workdir, _, _ = run
  from xprof.convert import raw_to_tool_data  # pylint: disable=import-outside-toplevel
  paths = glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*", "*.xplane.pb"))
  assert len(paths) == 1
  overview, _ = raw_to_tool_data.xspace_to_tool_data(paths, "overview_page", {})
  assert b'"train 3"' in overview and b'"train 4"' in overview  # the step-time rows
  data, _ = raw_to_tool_data.xspace_to_tool_data(paths, "trace_viewer", {})
  events = [e for e in json.loads(data)["traceEvents"] if e.get("ph") == "X"]
  steps = {e["name"]: e for e in events if e["name"].startswith("train ")}
  assert sorted(steps) == ["train 3", "train 4"]
  for step in steps.values():  # each traced step holds its dispatch and its device work
    inside = [e for e in events if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
    assert any(e["name"] == "PjitFunction(train_step)" for e in inside)
    assert any(e.get("args", {}).get("hlo_module") == "jit_train_step" for e in inside)
  with gzip.open(os.path.join(os.path.dirname(paths[0]), "perfetto_trace.json.gz")) as f:
    assert "metadata" not in json.load(f)  # what Perfetto opens


def test_a_run_ending_inside_the_window_stops_the_trace(tmp_path):
  c = small_config("")
  c.train.profile_steps = "2,5"
  profiler = StepProfiler(c.train, str(tmp_path))
  step = jax.jit(lambda x: x * 2.0)
  x = jnp.ones(4)
  for n in (1, 2, 3):
    profiler.begin(n, x)
    x = step(x)
    profiler.end(n, x)
  profiler.close()  # the run stopped at step 3 of 2..5
  assert glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  jax.profiler.start_trace(str(tmp_path / "again"))  # no trace left running
  jax.profiler.stop_trace()


def test_a_missing_tracker_library_refuses_the_start_in_one_line(tok_dir, tmp_path,
                                                                 monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "wandb" else real(name, *a))
  c = small_config(tok_dir)
  c.train.trackers = "tensorboard,wandb"
  with pytest.raises(UserError, match=r"^train.trackers names wandb, which is not installed: "
                     r"pip install wandb \(the version tested: requirements-test.txt\)$"):
    loop.train(c, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_mlflow_store_that_does_not_open_is_one_line(tmp_path, monkeypatch):
  monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
  monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
  with pytest.raises(UserError) as err:
    trackers.check(("mlflow",), str(tmp_path / "run"))
  assert "MLFLOW_ALLOW_FILE_STORE=true" in str(err.value) and "\n" not in str(err.value)
