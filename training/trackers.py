"""Experiment trackers: where a run's metric lines, config and eval.py's reports go
besides metrics.jsonl (`train.trackers`, docs/tracking.md).

A `Tracker` takes the run's config (`log_config`), scalars at a step
(`log_metrics`) and files of a step (`log_file`: eval.py's report and plots),
then is closed. `TensorBoard` writes `<workdir>/tensorboard/`; `WandB` and
`MLflow` import their library only when named, and are set up by the libraries'
own environment variables (WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY, WANDB_DIR,
MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME). Their runs are recorded in
`<workdir>/trackers.json`, so that a resumed run and eval.py continue the same
one. Only process 0 tracks.
"""
import importlib
import importlib.util
import os
import shutil
import threading
import time
from urllib.parse import urlparse

import jax

from configs.errors import UserError
from configs.validation import trackers as tracker_names
from training import workdir as workdir_lib

IDS_FILE = "trackers.json"
# The W&B project and MLflow experiment when WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME are unset.
DEFAULT_PROJECT = "transformer-lab"


def stepped(key: str, step: int) -> str:
  """A file's path in a tracker's run: `eval/loss_curves.png` of step 20 is
  `eval/step_20/loss_curves.png`."""
  folder, name = os.path.split(key)
  return os.path.join(folder, f"step_{step}", name)


class Tracker:
  """One destination of a run's records. `module` is the library it imports
  and `package` what installs it; a method a tracker does not override ignores
  that record."""
  module = package = ""

  @staticmethod
  def check(resume: dict | None) -> None:
    """Refuses (UserError) what would make opening fail (continuing `resume`,
    the run recorded in trackers.json, when given); writes nothing."""

  def resume_info(self) -> dict | None:
    """What continues this tracker's run (its entry in trackers.json); None: nothing."""
    return None

  def log_config(self, config: dict, workdir: str) -> None:
    """The resolved config (nested dict) and the run's workdir."""

  def log_metrics(self, step: int, scalars: dict) -> None:
    """Scalars named `<split>/<name>` at `step`."""

  def log_file(self, path: str, key: str, step: int) -> None:
    """The file at `path` as `key` (`eval/loss_curves.png`) of `step`."""

  def close(self, failed: bool = False) -> None:
    """Ends the tracker's run (marked failed when the run failed)."""


class TensorBoard(Tracker):
  """Scalars in `<workdir>/tensorboard/` (tensorboardX) and PNGs as images:
  `tensorboard --logdir <workdir>`."""
  module = package = "tensorboardX"

  def __init__(self, workdir: str, resume: dict | None):  # pylint: disable=unused-argument
    # Imported here: tensorboardX imports torch where it is installed (over a
    # second), which a refused start need not pay.
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    self._writer = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def log_metrics(self, step: int, scalars: dict) -> None:
    for name, value in scalars.items():
      self._writer.add_scalar(name, value, step)

  def log_file(self, path: str, key: str, step: int) -> None:
    if path.endswith(".png"):
      import matplotlib.image  # pylint: disable=import-outside-toplevel
      self._writer.add_image(os.path.splitext(key)[0], matplotlib.image.imread(path), step,
                             dataformats="HWC")

  def close(self, failed: bool = False) -> None:
    self._writer.close()


class WandB(Tracker):
  """A W&B run named after the workdir, in project WANDB_PROJECT (else
  transformer-lab): the config and the workdir in its config, scalars against
  the metric `step`, PNGs as images, other files among its files. Its local
  files go to WANDB_DIR, else `<workdir>/wandb/`; WANDB_MODE=offline keeps it
  there until `wandb sync`."""
  module = package = "wandb"

  @staticmethod
  def check(resume: dict | None) -> None:  # pylint: disable=unused-argument
    import wandb  # pylint: disable=import-outside-toplevel
    if (wandb.setup().settings.mode not in ("offline", "dryrun", "disabled")
        and not wandb.login(prompt=False, verify=False)):
      raise UserError("train.trackers names wandb, which has no W&B credentials: run "
                      "`wandb login`, set WANDB_API_KEY, or track offline with "
                      "WANDB_MODE=offline")

  def __init__(self, workdir: str, resume: dict | None):
    import wandb  # pylint: disable=import-outside-toplevel
    self._wandb = wandb
    where = (dict(resume, resume="allow") if resume
             else {"project": os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT)})
    self._run = wandb.init(**where, name=os.path.basename(os.path.abspath(workdir)),
                           dir=None if "WANDB_DIR" in os.environ else workdir)
    self._run.define_metric("step")
    self._run.define_metric("*", step_metric="step")

  def resume_info(self) -> dict:
    return {"id": self._run.id, "project": self._run.project, "entity": self._run.entity}

  def log_config(self, config: dict, workdir: str) -> None:
    self._run.config.update({**config, "workdir": os.path.abspath(workdir)},
                            allow_val_change=True)

  def log_metrics(self, step: int, scalars: dict) -> None:
    self._run.log({**scalars, "step": step})

  def log_file(self, path: str, key: str, step: int) -> None:
    if path.endswith(".png"):
      self._run.log({os.path.splitext(key)[0]: self._wandb.Image(path), "step": step})
      return
    target = os.path.join(self._run.dir, stepped(key, step))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(path, target)
    self._run.save(target, base_path=self._run.dir, policy="now")

  def close(self, failed: bool = False) -> None:
    self._run.finish(exit_code=1 if failed else 0)


def mlflow_tracking_uri() -> str:
  """MLFLOW_TRACKING_URI, or MLflow's default; a local directory as an
  absolute file: URI, so that a resume from another directory finds it."""
  import mlflow  # pylint: disable=import-outside-toplevel
  from mlflow.utils.file_utils import (  # pylint: disable=import-outside-toplevel
      local_file_uri_to_path, path_to_local_file_uri)
  uri = mlflow.get_tracking_uri()
  if urlparse(uri).scheme in ("", "file"):
    return path_to_local_file_uri(os.path.abspath(local_file_uri_to_path(uri)))
  return uri


class MLflow(Tracker):
  """An MLflow run named after the workdir, in experiment MLFLOW_EXPERIMENT_NAME
  (else transformer-lab) of the store MLFLOW_TRACKING_URI: the config as
  parameters and config.json, the workdir as a tag, scalars at their step,
  files as artifacts."""
  module, package = "mlflow", "mlflow-skinny"  # the client and file store, without the server
  MAX_PARAMS = 100  # parameters per request (MLflow's limit)

  @staticmethod
  def check(resume: dict | None) -> None:
    uri = resume["tracking_uri"] if resume else mlflow_tracking_uri()
    try:
      from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
      client = MlflowClient(uri)
      client.search_experiments(max_results=1)
    except Exception as e:  # pylint: disable=broad-except
      cause = str(e).strip().split(". ")[0].splitlines()[0]
      raise UserError(f"train.trackers names mlflow, whose tracking store {uri} does not open "
                      f"({type(e).__name__}: {cause}); set MLFLOW_TRACKING_URI to a server "
                      "(http://host:5000), a database (sqlite:///mlflow.db, needs sqlalchemy) "
                      "or a directory (file:/path, with MLFLOW_ALLOW_FILE_STORE=true)") from None
    if resume:
      try:
        client.get_run(resume["run_id"])
      except Exception:  # pylint: disable=broad-except
        raise UserError(f"the MLflow run {resume['run_id']} recorded in {IDS_FILE} is not in "
                        f"its store {uri}; restore it there, or remove the mlflow entry of "
                        f"{IDS_FILE} to track into a new run") from None

  def __init__(self, workdir: str, resume: dict | None):
    from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
    self._uri = resume["tracking_uri"] if resume else mlflow_tracking_uri()
    self._client = MlflowClient(self._uri)
    if resume:
      self._run_id = resume["run_id"]
      self._client.update_run(self._run_id, status="RUNNING")
      return
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_PROJECT)
    experiment = self._client.get_experiment_by_name(name)
    experiment_id = (experiment.experiment_id if experiment
                     else self._client.create_experiment(name))
    self._run_id = self._client.create_run(
        experiment_id, run_name=os.path.basename(os.path.abspath(workdir))).info.run_id

  def resume_info(self) -> dict:
    return {"tracking_uri": self._uri, "run_id": self._run_id}

  def log_config(self, config: dict, workdir: str) -> None:
    """Parameters are written once (MLflow refuses a changed value): a resume's
    changed fields are in config.json and config_history.jsonl."""
    from mlflow.entities import Param  # pylint: disable=import-outside-toplevel
    logged = self._client.get_run(self._run_id).data.params
    params = [Param(k, str(v)) for k, v in workdir_lib.flatten(config).items() if k not in logged]
    for i in range(0, len(params), self.MAX_PARAMS):
      self._client.log_batch(self._run_id, params=params[i:i + self.MAX_PARAMS])
    self._client.log_dict(self._run_id, config, workdir_lib.CONFIG_FILE)
    self._client.set_tag(self._run_id, "workdir", os.path.abspath(workdir))

  def log_metrics(self, step: int, scalars: dict) -> None:
    from mlflow.entities import Metric  # pylint: disable=import-outside-toplevel
    now = int(time.time() * 1000)
    self._client.log_batch(self._run_id, metrics=[
        Metric(name, value, now, step) for name, value in scalars.items()])

  def log_file(self, path: str, key: str, step: int) -> None:
    self._client.log_artifact(self._run_id, path, os.path.dirname(stepped(key, step)))

  def close(self, failed: bool = False) -> None:
    self._client.set_terminated(self._run_id, "FAILED" if failed else "FINISHED")


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def preload(names: tuple[str, ...]) -> threading.Thread:
  """Imports the libraries of trackers `names` in a background thread, while
  the first step compiles (tensorboardX imports torch where it is
  installed: over 2 s on a 2-core CPU). A library that fails to import is
  reported when its tracker opens; the thread only warms the import."""
  def load():
    for name in names:
      try:
        importlib.import_module(TRACKERS[name].module)
      except Exception:  # pylint: disable=broad-except
        pass

  thread = threading.Thread(target=load, name="tracker-imports", daemon=True)
  thread.start()
  return thread


def recorded(workdir: str) -> dict:
  """{tracker name: what continues its run} of `<workdir>/trackers.json` ({} without)."""
  return workdir_lib.read_json(os.path.join(workdir, IDS_FILE))


def check(names: tuple[str, ...], workdir: str) -> None:
  """Refuses, in one line, a named tracker that is not installed or would not
  open (`Tracker.check`) for the run in `workdir`; imports only what is named,
  writes nothing."""
  saved = recorded(workdir)
  for name in names:
    tracker = TRACKERS[name]
    if importlib.util.find_spec(tracker.module) is None:
      raise UserError(f"train.trackers names {name}, which is not installed: pip install "
                      f"{tracker.package} (the version tested: requirements-test.txt)")
    tracker.check(saved.get(name))


def open_trackers(names: tuple[str, ...], workdir: str) -> list[Tracker]:
  """The trackers `names` of the run in `workdir`, each continuing the run
  recorded in its trackers.json (a new one recorded there); [] on processes
  other than 0."""
  if jax.process_index() != 0:
    return []
  saved = recorded(workdir)
  opened = [TRACKERS[name](workdir, saved.get(name)) for name in names]
  ids = dict(saved)
  ids.update({name: t.resume_info() for name, t in zip(names, opened) if t.resume_info()})
  if ids != saved:
    workdir_lib.write_json_atomic(os.path.join(workdir, IDS_FILE), ids)
  return opened


def open_run(config, workdir: str) -> list[Tracker]:
  """The trackers of train.trackers for a training run in `workdir`, given its config."""
  opened = open_trackers(tracker_names(config.train), workdir)
  resolved = workdir_lib.config_to_dict(config)
  for tracker in opened:
    tracker.log_config(resolved, workdir)
  return opened


def open_saved_run(workdir: str) -> list[Tracker]:
  """The trackers of the run saved in `workdir` (train.trackers of its
  config.json), continuing its runs (eval.py); checked first."""
  names = tracker_names(workdir_lib.load_config(workdir).train)
  check(names, workdir)
  return open_trackers(names, workdir)
