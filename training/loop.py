"""The training loop behind train.py.

Resumes from the newest checkpoint of the workdir that restores whole (state
and data position; a damaged newer one is moved aside, see
training/checkpoint.py), runs the jitted step, logs metrics, validates, checkpoints, and stops
cleanly: SIGTERM or SIGINT finish the current step, save and raise `Stopped`
(train.py exits 128 + the signal: 143 or 130); a non-finite loss stops the
run naming the step, with the last good checkpoint kept (no checkpoint is
written after a bad step).

The train state lives sharded on the device mesh of `config.mesh`
(`training/sharding.py`): it is created in its shards, checkpoints are
restored straight onto the current mesh (so a run saved on 8 devices resumes
or evaluates on 1), and each process puts its own rows of every batch on the
mesh. On one device the mesh is 1x1x1 and nothing is split.
"""
import contextlib
import math
import os
import shlex
import shutil
import signal
import socket
import sys
import time
from typing import NamedTuple
import zlib

import jax
from jax.experimental import multihost_utils
import numpy as np
from flax import nnx
from tqdm import tqdm

from configs.errors import UserError
from configs.validation import decay_start, eval_every as eval_every_of
from configs.validation import trackers as tracker_names
from data import classify, mixture, pipeline
from model import accounting, build_model, fp8
from model.resolve import resolve
import tokenizer as tokenizer_lib
from training import compile_cache, downstream, hardware, startup, trackers
from training import workdir as workdir_lib
from training.checkpoint import Checkpointer, DamagedCheckpoint, all_true, resolve_step
from training.faults.lock import WorkdirLock
from training.faults.peers import PeerWatchdog
from training.metrics import MetricsWriter, by_name, evaluate, evaluate_mixture
from training.optim import learning_rate_schedule, model_optimizer, mup_depth, mup_width
from training.profiler import StepProfiler
from training.sharding import (batch_sharding, make_mesh, shard_batch,
                               train_state_shardings, with_shardings)
from training.steps import (abstract_state, init_state, jit_eval_step, jit_train_step,
                            mtp_metrics, mtp_of, router_losses, ROUTER_METRICS)


def peak_flops(config) -> float | None:
  """Peak FLOP/s of all devices together, or None when unknown (CPU, an unlisted kind).

  `train.peak_tflops` per device when set, else the device kind's entry in
  `training/hardware.py`.
  """
  if config.train.peak_tflops > 0:
    per_device = config.train.peak_tflops
  else:
    per_device = hardware.peak_tflops(jax.devices()[0].device_kind)
  if per_device is None:
    return None
  return per_device * 1e12 * jax.device_count()


class Stopped(Exception):
  """A signal stopped the run after its step was saved; the same command resumes it.

  `exit_status` is 128 + the signal's number (SIGINT 130, SIGTERM 143), what a
  shell or SLURM reports for a process that the signal ended: a stopped run
  does not look finished.
  """

  def __init__(self, signal_name: str, exit_status: int, step: int):
    super().__init__(f"{signal_name} received: saved step {step}")
    self.exit_status = exit_status
    self.step = step


class StopRequest:
  """Turns SIGTERM/SIGINT into a flag the loop checks after each step.

  Until `started()` (the first step has run: start-up and compilation) a
  signal calls `on_startup_signal(signum)` instead, which exits at once: a
  run that has not trained leaves nothing behind. Python runs the handler
  while XLA compiles too (tests/test_run_record.py sends SIGINT then).

  With several processes the decision must be collective (every process
  saves the same step): `should_stop(step)` then agrees on it with an
  all-gather every `every` steps only, so that steps between stay
  asynchronous; SLURM's `--signal=TERM@<seconds>` leaves time for that. A
  process stopped by another's signal takes that signal's number (of the
  lowest process that got one) for its exit status.
  """

  def __init__(self, every: int, on_startup_signal):
    self.signum = None  # the signal received (or another process's), None without
    self._elsewhere = False
    self._every = every
    self._previous = {}
    self._on_startup_signal = on_startup_signal

  def started(self) -> None:
    self._on_startup_signal = None

  @property
  def starting(self) -> bool:
    return self._on_startup_signal is not None

  @property
  def signal_name(self) -> str:
    return (signal.Signals(self.signum).name
            + " (on another process)" * self._elsewhere)

  @property
  def exit_status(self) -> int:
    """128 + the signal's number."""
    return 128 + self.signum

  def should_stop(self, step: int) -> bool:
    if jax.process_count() == 1:
      return self.signum is not None
    if step % self._every:
      return False
    received = [int(s) for s in multihost_utils.process_allgather(np.int32(self.signum or 0))
                if s]
    if received and self.signum is None:
      self.signum, self._elsewhere = received[0], True
    return bool(received)

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, _frame):
    if self._on_startup_signal is not None:
      self._on_startup_signal(signum)
    if self.signum is None:  # the first one decides
      self.signum = signum

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def maybe_initialize_distributed() -> None:
  """Joins a multi-process run (`jax.distributed`) when the environment describes one.

  SLURM (SLURM_NTASKS > 1) and Open MPI (OMPI_COMM_WORLD_SIZE > 1) are
  detected by JAX itself; elsewhere set JAX_COORDINATOR_ADDRESS (host:port of
  process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process. Runs
  before anything touches a device; does nothing for a single process.
  """
  env = os.environ
  multi_process = (int(env.get("SLURM_NTASKS", "1")) > 1
                   or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
                   or "JAX_COORDINATOR_ADDRESS" in env)
  if not multi_process or jax.distributed.is_initialized():
    return

  def env_int(name):
    return int(env[name]) if name in env else None

  jax.distributed.initialize(num_processes=env_int("JAX_NUM_PROCESSES"),
                             process_id=env_int("JAX_PROCESS_ID"))


def _print(message: str) -> None:
  """Prints on process 0 only."""
  if jax.process_index() == 0:
    print(message, flush=True)


def _check_finite(state) -> None:
  bad = int(jax.device_get(state["bad_step"]))
  if bad >= 0:
    raise UserError(f"loss or gradient became NaN/Inf at step {bad + 1}; training stopped and "
                    "the last good checkpoint is kept (lower train.learning_rate or check the data)")


def _meta(config, tokenizer) -> dict:
  return {"config": workdir_lib.config_to_dict(config),
          "tokenizer_fingerprint": tokenizer.fingerprint}


def train(config, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming it); returns the last metrics.

  The run holds the workdir's lock (training/faults/lock.py) from before it writes
  anything there until it returns: a second run on the same workdir is refused.
  SIGINT or SIGTERM after the first step saves the step and raises `Stopped`.
  """
  lock = WorkdirLock(workdir)
  try:
    return _train(config, workdir, lock)
  finally:
    lock.release()


def local_process_count() -> int:
  """The processes of the job on this host (hostnames compared across processes): they
  share its cores for tokenisation."""
  if jax.process_count() == 1:
    return 1
  mine = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
  hosts = multihost_utils.process_allgather(np.int32(mine))
  return int((np.asarray(hosts) == mine).sum())


def _lock_workdir(lock: WorkdirLock, workdir: str) -> None:
  """Process 0 takes the lock; every process stops if it could not."""
  refusal = None
  if jax.process_index() == 0:
    try:
      lock.acquire()
    except UserError as e:
      refusal = e
  if not all_true(refusal is None):
    raise refusal or UserError(f"{workdir} is in use by another run (see process 0's error)")


def _train(config, workdir: str, lock: WorkdirLock) -> dict:
  maybe_initialize_distributed()
  config = workdir_lib.keep_layout(config, workdir)
  config = resolve(config)
  downstream_tasks = downstream.training_tasks(config)
  trackers.check(tracker_names(config.train), workdir)
  if config.train.objective == "classify":
    classify.resolve_labels(config)
  tc = config.train
  compile_cache.enable(tc.compilation_cache_dir)
  mesh, rules = make_mesh(config.mesh), config.mesh.rules
  latest = _latest_step(workdir)
  changes = workdir_lib.check_resume(config, workdir) if latest is not None else []
  memory = startup.check_memory(config, mesh)
  created = not os.path.exists(workdir)

  def on_startup_signal(signum):
    lock.release()
    if created:
      shutil.rmtree(workdir, ignore_errors=True)
    name = signal.Signals(signum).name
    print(f"{name} during start-up: stopped before training"
          + (f", {workdir} removed" if created else f", {workdir} unchanged"),
          file=sys.stderr, flush=True)
    os._exit(128 + signum)

  stop = StopRequest(tc.log_every, on_startup_signal)
  try:
    with stop:
      return _run(config, workdir, lock, mesh, rules, stop, memory, changes,
                  resuming=latest is not None, downstream_tasks=downstream_tasks)
  except BaseException as e:
    if created and stop.starting:  # a start that failed leaves no workdir behind
      lock.release()
      shutil.rmtree(workdir, ignore_errors=True)
    if startup.is_out_of_memory(e):
      raise startup.out_of_memory(config, memory[0]) from None
    raise


def _latest_step(workdir: str) -> int | None:
  """The newest checkpoint's step, None without a workdir or checkpoint."""
  if not os.path.isdir(workdir):
    return None
  checkpointer = Checkpointer(workdir, asynchronous=False, read_only=True)
  try:
    return checkpointer.latest_step()
  finally:
    checkpointer.close()


def _run(config, workdir, lock, mesh, rules, stop, memory, changes, *, resuming: bool,
         downstream_tasks: downstream.Tasks | None) -> dict:
  """The run after the checks of `_train`: sets up the workdir, restores, trains;
  `downstream_tasks` (train.downstream_tasks) are scored at every validation pass."""
  tc = config.train

  def make_model():
    return build_model(config.model, nnx.Rngs(tc.seed), remat=tc.remat, mtp_depth=tc.mtp_depth)

  graphdef, _ = nnx.split(nnx.eval_shape(make_model))
  tx, schedule = model_optimizer(config), learning_rate_schedule(tc)

  def make_state():
    return init_state(nnx.split(make_model())[1], tx, tc.seed)

  abstract = jax.eval_shape(make_state)
  state_sharding = train_state_shardings(abstract, mesh, rules)
  source = None
  if tc.restore_from and not resuming:
    # Before anything is written to the workdir: a bad source leaves it untouched.
    source = restore_source(config, workdir, abstract, mesh, rules)
  _lock_workdir(lock, workdir)
  workdir_lib.prepare(config, workdir, resuming)
  tokenizer = workdir_lib.setup_tokenizer(config, workdir, source and source.tokenizer_path)
  process = {"process_index": jax.process_index(), "process_count": jax.process_count(),
             "local_process_count": local_process_count()}
  data_start = time.perf_counter()
  data_iter = pipeline.make_train_iterator(config, tokenizer, **process)
  mix = {source.name: source.weight for source in mixture.sources(config)}  # {}: no mixture
  if mix:
    eval_batches = {name: [shard_batch(batch, mesh) for batch in batches] for name, batches in
                    pipeline.make_source_eval_batches(config, tokenizer, tc.eval_steps,
                                                      **process).items()}
  else:
    eval_batches = [shard_batch(batch, mesh) for batch in
                    pipeline.make_eval_batches(config, tokenizer, tc.eval_steps, **process)]
  print(f"data: ready in {time.perf_counter() - data_start:.1f} s (tokenisation, index, "
        "first batches)", file=sys.stderr, flush=True)
  checkpointer = Checkpointer(workdir, keep=tc.keep_checkpoints)
  restored = checkpointer.restore_newest_intact(
      with_shardings(abstract, state_sharding), data_iter, move_aside=True,
      where=f"resume of {workdir}")
  if restored is not None:
    start, state, meta = restored
    if start >= tc.num_steps:  # the newest intact checkpoint, so a damaged last one retrains
      checkpointer.close()
      _print(f"{workdir} is complete: trained {start}/{tc.num_steps} steps; nothing to do "
             f"(evaluate it: python eval.py --workdir {workdir}; train longer: "
             "--config.train.num_steps=<more>)")
      return {}
    if meta["tokenizer_fingerprint"] != tokenizer.fingerprint:
      raise UserError(f"{workdir}/tokenizer changed since step {start} (fingerprint "
                      f"{meta['tokenizer_fingerprint'][:12]} expected); use a new workdir")
    what = f"step {start} of {workdir}, resuming to {tc.num_steps}"
    if changes:
      what += f"; config changes: {workdir_lib.describe_changes(changes)}"
  elif source is not None and source.state is not None:  # train.restore_branch
    state, start = source.state, source.step
    _restore_source_data(config, start, data_iter)
    what = (f"step {start} of train.restore_from={tc.restore_from}, branched: its optimizer "
            f"state and data position, training to {tc.num_steps}")
  else:
    # Created under jit in its shards: the full state never sits on one device.
    state = jax.jit(make_state, out_shardings=state_sharding)()
    start = 0
    what = "nothing (new run from step 0)"
    if source is not None:  # fresh optimizer state and step 0
      state["params"] = _with_source(state["params"], source.params)
      what = (f"parameters of step {source.step} of train.restore_from={tc.restore_from} "
              "(new optimizer, step 0)")
  for line in startup.summary_lines(
      config, mesh, workdir=workdir, restored=what, memory=memory,
      rows=pipeline.split_rows(config, tokenizer), schedule=schedule):
    _print(line)

  if jax.process_index() == 0:
    trackers.preload(tracker_names(tc))
  step_fn = jit_train_step(graphdef, tx, schedule, tc.objective, tc.grad_accum_steps,
                           state_sharding=state_sharding, batch_sharding=batch_sharding(mesh),
                           z_loss=tc.z_loss, context_strategy=config.mesh.context_strategy,
                           router_losses=router_losses(config), mtp=mtp_of(config),
                           bias_rate=tc.moe_bias_update_rate,
                           loss_chunk_size=tc.loss_chunk_size, loss_impl=tc.loss_impl)
  eval_fn = jit_eval_step(graphdef, tc.objective, mesh, config.mesh.context_strategy,
                          tc.mtp_depth, tc.loss_chunk_size, tc.loss_impl)
  writer = None  # opened after the first step: an interrupted start writes nothing
  profiler = StepProfiler(tc, workdir)
  failed = False
  flops_per_token = accounting.flops_per_token(config.model, tc.seq_len, train=True,
                                               mtp_depth=tc.mtp_depth)
  peak = peak_flops(config)
  eval_every, val_name = eval_every_of(tc), f"val{tc.eval_steps}"
  draws = mixture.Draws(mix) if mix else None
  last = {}
  step, stopping = start, False
  eta = Eta(tc.num_steps, lambda at: validations_from(at, eval_every, tc.num_steps))
  watchdog = PeerWatchdog(tc.peer_timeout_s).start() if jax.process_count() > 1 else None
  hide_bar = None if jax.process_index() == 0 else True  # None: shown on a terminal
  try:
    # tqdm's own rate and remaining time would count the compilation: Eta's in the postfix.
    with tqdm(total=tc.num_steps, initial=start, desc="train", unit="step", disable=hide_bar,
              file=sys.stderr, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} "
              "[{elapsed}{postfix}]") as bar:
      window_start, window_steps, window_metrics = time.perf_counter(), 0, []
      while step < tc.num_steps:
        profiler.begin(step + 1, state)
        state, metrics = step_fn(state, shard_batch(next(data_iter), mesh))
        step += 1
        profiler.end(step, (state, metrics))
        if step == start + 1:
          stop.started()
          workdir_lib.record_config(config, workdir, start, changes)
          writer = MetricsWriter(workdir, config)
          jax.block_until_ready(metrics)  # the compiled step has run: the ETA's clock starts
          eta.start(step)
        if watchdog:
          watchdog.progress(step)
        window_steps += 1
        window_metrics.append(metrics)
        bar.update(1)
        if step % tc.log_every == 0 or step == tc.num_steps:
          _check_finite(state)
          seconds = time.perf_counter() - window_start
          last = _train_scalars(jax.device_get(window_metrics), window_steps, seconds, tc,
                                flops_per_token, peak)
          drawn = {} if draws is None else {  # tokens of each source so far
              f"tokens/{name}": rows * tc.seq_len
              for name, rows in draws.rows(step * tc.batch_size).items()}
          # seconds: the wall time of the window
          writer.write(step, "train", {**last, **drawn, "seconds": seconds})
          left = eta.seconds_left(step)  # None before a step after the compiled one
          shown = {} if left is None else {"eta": _duration(left)}
          bar.set_postfix({"loss": f"{last['loss']:.3f}", **shown})  # in this order
          _print(f"step {step}/{tc.num_steps}: "
                 + ", ".join([*(f"{k}={v:.4g}" for k, v in last.items()),
                              *(f"{k}={v}" for k, v in shown.items())]))
          window_start, window_steps, window_metrics = time.perf_counter(), 0, []
        if step % eval_every == 0 or step == tc.num_steps:
          with eta.validation():  # timed apart from the steps
            if mix:
              val, by_source = evaluate_mixture(eval_fn, state["params"], eval_batches, mix)
              val |= by_name(by_source)
            else:
              val = evaluate(eval_fn, state["params"], eval_batches)
            writer.write(step, "validation", {**val, "batches": tc.eval_steps})
            each = "".join(f"{val_name}_loss/{name}={val[f'loss/{name}']:.4f} " for name in mix)
            each += "".join(f"{val_name}_{name}={val[name]:.4f} " for name in
                            mtp_metrics(tc.mtp_depth) if name in val)
            _print(f"step {step}/{tc.num_steps}: {val_name}_loss={val['loss']:.4f} "
                   f"{val_name}_perplexity={val['perplexity']:.2f} {each}(validation, "
                   f"{tc.eval_steps} batches{' of each source' * bool(mix)}; eval.py scores the "
                   "whole split)")
            last.update({f"{val_name}_{k}": v for k, v in val.items()})
            if downstream_tasks is not None:
              results = downstream.evaluate(
                  nnx.merge(graphdef, state["params"]), config, tokenizer, downstream_tasks,
                  limit=tc.downstream_limit, batch_size=tc.downstream_batch_size,
                  where="train.downstream_tasks")
              writer.write(step, "downstream", downstream.scalars(results))
              _print(f"step {step}/{tc.num_steps}: {downstream.summary(results)}")
              last.update(downstream.scalars(results))
        # A signal at the last step changes nothing: the run is complete.
        stopping = step < tc.num_steps and stop.should_stop(step)
        if step % tc.checkpoint_every == 0 or step == tc.num_steps or stopping:
          _check_finite(state)
          checkpointer.save(step, state, data_iter, _meta(config, tokenizer), force=stopping)
        if stopping:
          checkpointer.wait()
          _print(f"{stop.signal_name} received: saved step {step}; exit status "
                 f"{stop.exit_status}. Resume with the same command: {resume_command(workdir)}")
          break
  except Exception as e:
    failed = True
    if watchdog and not isinstance(e, UserError):
      watchdog.fail(e)  # exits when another process went away
    raise
  finally:
    profiler.close()
    if watchdog:
      watchdog.stop()
    checkpointer.wait()
    checkpointer.close()
    if writer:
      writer.close(failed)
  if stopping:
    raise Stopped(stop.signal_name, stop.exit_status, step)
  return last


def resume_command(workdir: str) -> str:
  """This process's own command line, with --workdir when it was not given."""
  argv = ["python", *sys.argv]
  if not any(a == "--workdir" or a.startswith("--workdir=") for a in argv):
    argv += ["--workdir", workdir]
  return shlex.join(argv)


class Eta:
  """The time the run has left (its steps and validation passes), shown as `eta=`
  in the step lines and the progress bar.

  Compilation is left out: the clock starts once the first step of this
  process (the compiled one) has run, `start(step)`; before a later step has
  been timed there is no estimate (`seconds_left` is None, and no `eta=`).
  The pace of a step is the time since then over the steps since, the
  validation passes taken out (`validation()` times them): one is long
  beside a step, and the first compiles the eval step, so counting them as
  step time would swing the estimate after each. Checkpoint saves stay in
  the pace: they write in the background, so only a brief copy stops the
  loop, at a fixed interval of steps. The time left is the steps left at
  that pace, plus the validation passes left (`validations_left(step)`) at
  the length of the last one (none counted before one has run).

  Steps are dispatched asynchronously: read `seconds_left` where the device
  has finished the step (the loop does after fetching the window's metrics).
  `clock` is injectable for tests.
  """

  def __init__(self, num_steps: int, validations_left, clock=time.perf_counter):
    self._num_steps = num_steps
    self._validations_left = validations_left
    self._clock = clock
    self._first = self._since = None  # the compiled step and when it had run
    self._validating_s = 0.0  # the validation passes since then, together
    self._last_validation_s = None

  def start(self, step: int) -> None:
    self._first, self._since = step, self._clock()

  @contextlib.contextmanager
  def validation(self):
    began = self._clock()
    yield
    self._last_validation_s = self._clock() - began
    self._validating_s += self._last_validation_s

  def seconds_left(self, step: int) -> float | None:
    if self._first is None or step <= self._first:
      return None
    pace = (self._clock() - self._since - self._validating_s) / (step - self._first)
    left = (self._num_steps - step) * pace
    if self._last_validation_s is not None:
      left += self._validations_left(step) * self._last_validation_s
    return left


def validations_from(step: int, eval_every: int, num_steps: int) -> int:
  """The validation passes at `step` and after it: every `eval_every` steps
  and at `num_steps`."""
  return num_steps // eval_every - (step - 1) // eval_every + bool(num_steps % eval_every)


def _duration(seconds: float) -> str:
  """75 -> '1m15s'."""
  seconds = int(round(seconds))
  if seconds >= 3600:
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
  return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _train_scalars(window, steps, seconds, tc, flops_per_token, peak) -> dict:
  tokens_per_second = steps * tc.batch_size * tc.seq_len / max(seconds, 1e-9)
  loss = float(np.mean([m["loss"] for m in window]))
  out = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
         "accuracy": float(np.mean([m["accuracy"] for m in window])),
         "grad_norm": float(window[-1]["grad_norm"]),
         "learning_rate": float(window[-1]["learning_rate"]),
         "tokens_per_second": tokens_per_second}
  for name in ("z_loss", *ROUTER_METRICS, "moe_bias_abs", *mtp_metrics(tc.mtp_depth)):
    if name in window[-1]:
      out[name] = float(np.mean([m[name] for m in window]))
  if peak is not None:
    out["mfu"] = tokens_per_second * flops_per_token / peak
  return out


class Source(NamedTuple):
  """What a run starts from (`restore_source`)."""
  params: dict  # {parameter path name: array}, in this run's dtypes
  tokenizer_path: str
  step: int
  state: dict | None  # the whole train state, for train.restore_branch; else None


def _check_source_parametrization(config, where: str, source_config) -> None:
  """A source trained under another model.parametrization (sp or mup), μP
  width multiplier or output multiplier, or depth-μP branch factor holds
  weights scaled otherwise: refused."""

  def scaling(model):
    parametrization = model.get("parametrization", "sp")
    width = mup_width(model) if parametrization == "mup" else None
    output = model.get("mup_output_mult", 1.0) if parametrization == "mup" else 1.0
    depth = mup_depth(model)
    return (f"model.parametrization={parametrization}"
            + (f" (width multiplier {width:g})" if width else "")
            + (f" (model.mup_output_mult={output:g})" if output != 1.0 else "")
            + (f" with depth-μP (branch factor {depth:g})" if depth else ""))

  ours, theirs = scaling(config.model), scaling(source_config.model)
  if ours != theirs:
    raise UserError(f"{where}: trained with {theirs}, this run asks for {ours}; their weights "
                    "are scaled otherwise, so use the source's")


def restore_source(config, workdir: str, this_abstract, mesh, rules) -> Source:
  """What to start from: train.restore_from, another run's workdir.

  The parameters of its checkpoint of train.restore_step, or of its newest
  intact one (a damaged newer one is skipped, with a note, and left in
  place), on `mesh`, cast to the dtypes of the parameters of `this_abstract`
  (this run's train state: its model.param_dtype), so a float32 run can be
  fine-tuned in bfloat16 and back.
  The tokenizer they were trained with (`_source_tokenizer`). With
  train.restore_branch the whole train state too (`_check_branch_state`,
  `_check_branch_step`).
  Everything is checked before the workdir is written. Only reads the
  source, which may still be training.
  """
  source = config.train.restore_from
  where = f"train.restore_from={source!r}"
  if not os.path.exists(os.path.join(source, workdir_lib.CONFIG_FILE)):
    raise UserError(f"{where}: not a run directory (no {workdir_lib.CONFIG_FILE})")
  source_config = workdir_lib.load_config(source)
  _check_source_parametrization(config, where, source_config)
  _, abstract = abstract_state(source_config)
  abstract_params = this_abstract["params"]
  _check_source_shapes(config, where, abstract["params"], abstract_params)
  if config.train.restore_branch:
    _check_branch_state(config, source_config, where, abstract, this_abstract)
  checkpointer = Checkpointer(source, asynchronous=False, read_only=True)
  sharded = with_shardings(abstract, train_state_shardings(abstract, mesh, rules))
  try:
    if config.train.restore_step is None:
      restored = checkpointer.restore_newest_intact(sharded, move_aside=False, where=where)
    else:
      step = resolve_step(checkpointer, config.train.restore_step, where)
      try:
        restored = (step, *checkpointer.restore(step, sharded))
      except DamagedCheckpoint as e:
        raise UserError(f"{where}: {e}; name another train.restore_step, or unset it for "
                        "the newest intact one") from None
  finally:
    checkpointer.close()
  if restored is None:
    raise UserError(f"{where}: it has no checkpoint")
  step, state, meta = restored
  if config.train.restore_branch:
    _check_branch_step(config, where, step)
  tokenizer_path = _source_tokenizer(config, workdir, meta["tokenizer_fingerprint"])
  # Restored in the source's dtypes (so that its checksums are checked), then cast.
  ours = _by_path(abstract_params)
  params = {path: x.astype(ours[path].dtype) for path, x in _by_path(state["params"]).items()
            if path in ours and np.shape(x) == ours[path].shape}
  return Source(params, tokenizer_path, step, state if config.train.restore_branch else None)


def _check_branch_state(config, source_config, where: str, source_abstract,
                        this_abstract) -> None:
  """train.restore_branch continues the source's train state as it is: this
  run's optimizer must keep the same state (optimizer, its options, dtypes)."""
  def layout(tree):
    return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]

  if layout(source_abstract) != layout(this_abstract):
    theirs, ours = source_config.train.optimizer, config.train.optimizer
    raise UserError(f"{where}: train.restore_branch continues its optimizer state, which does "
                    f"not fit this run's (train.optimizer={theirs} there, {ours} here; or "
                    "another optimizer option, train.grad_clip or model.param_dtype); train "
                    "as it did, or unset train.restore_branch to start from its parameters")


def _check_branch_step(config, where: str, step: int) -> None:
  """A branch from `step` must have steps left, and a wsd decay after it."""
  tc = config.train
  if step >= tc.num_steps:
    raise UserError(f"{where}: its step {step} is not before train.num_steps={tc.num_steps} "
                    "(counted from its step 0); raise train.num_steps")
  if tc.schedule == "wsd" and step > decay_start(tc):
    raise UserError(f"{where}: its step {step} is past the start of this run's wsd decay, "
                    f"step {decay_start(tc)} of train.num_steps={tc.num_steps}; raise "
                    "train.num_steps or lower train.decay_fraction")


def _restore_source_data(config, step: int, data_iter) -> None:
  """Moves `data_iter` to train.restore_from's data position at `step`."""
  where = f"train.restore_from={config.train.restore_from!r}"
  checkpointer = Checkpointer(config.train.restore_from, asynchronous=False, read_only=True)
  try:
    checkpointer.restore_data(step, data_iter)
  except DamagedCheckpoint as e:
    raise UserError(f"{where}: its data position does not restore here ({e.cause}); "
                    "branch with its data, batch and process settings") from None
  finally:
    checkpointer.close()


def _path_name(path) -> str:
  """A parameter's path as a name: "encoder/layers/0/attn/q_proj/kernel"."""
  return jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")


def _by_path(tree) -> dict:
  """{parameter path name: leaf} of a params tree."""
  return {_path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_source_shapes(config, where: str, source_params, params) -> None:
  """train.restore_from's parameters must have this run's shapes; only a
  classifier started from a language model (`model.num_labels`, the source
  without) leaves out the source's LM head and initialises its own head, as
  transformers' `from_pretrained` does, saying so in one line. FP8 scaling
  state (model.fp8=delayed) comes from the source where it has the same
  shapes, else starts fresh, also said in one line (`restore_source` takes only
  the leaves of this run's shapes)."""
  theirs = {p: np.shape(x) for p, x in _by_path(source_params).items()}
  ours = {p: np.shape(x) for p, x in _by_path(params).items()}
  fresh_scaling = any(theirs.get(p) != s for p, s in ours.items() if fp8.is_state_path(p))
  theirs, ours = ({p: s for p, s in shapes.items() if not fp8.is_state_path(p)}
                  for shapes in (theirs, ours))
  fresh, unused = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
  is_new_head = (config.model.num_labels > 0 and fresh
                 and all(p.startswith("classifier/") for p in fresh))
  if (any(theirs[p] != ours[p] for p in set(ours) & set(theirs))
      or ((fresh or unused) and not is_new_head)):
    raise UserError(f"{where}: its parameters have other shapes")
  if fresh:
    _print(f"{where}: the classification head ({', '.join(fresh)}) is initialised fresh; "
           f"the source's {', '.join(unused) or 'nothing else'} is not used")
  if fresh_scaling:
    _print(f"{where}: the FP8 scaling state (model.fp8=delayed) starts fresh, scales 1 and "
           "empty amax histories: the source's is missing or of other shapes")


def _with_source(params, source: dict):
  """`params` with every leaf that `source` ({path: array}) has replaced by it."""
  return jax.tree_util.tree_map_with_path(lambda path, x: source.get(_path_name(path), x),
                                          params)


def _source_tokenizer(config, workdir: str, expected: str) -> str:
  """The tokenizer of fingerprint `expected` that train.restore_from was trained with.

  The source's saved copy `<source>/tokenizer` when tokenizer.path is empty; a
  tokenizer.path, or a tokenizer already in `workdir`, of another fingerprint is
  refused. Returns the path to copy into `workdir`.
  """
  source = config.train.restore_from
  where = f"train.restore_from={source!r}"
  if config.tokenizer.path:
    path = config.tokenizer.path
    tok = tokenizer_lib.load_tokenizer(path)
    if tok.fingerprint != expected:
      raise UserError(f"{where}: its parameters were trained with tokenizer {expected[:12]}, "
                      f"but tokenizer.path={path!r} is {tok.fingerprint[:12]}; leave "
                      "tokenizer.path empty to use the source's tokenizer")
  else:
    path = os.path.join(source, workdir_lib.TOKENIZER_DIR)
    try:
      tok = tokenizer_lib.load_tokenizer(path)
    except UserError as e:
      raise UserError(f"{where}: {e}") from None
    if tok.fingerprint != expected:
      raise UserError(f"{where}: its parameters were trained with tokenizer {expected[:12]}, "
                      f"but {path} is {tok.fingerprint[:12]}; it was changed after training")
  own = os.path.join(workdir, workdir_lib.TOKENIZER_DIR)
  if os.path.exists(own) and tokenizer_lib.load_tokenizer(own).fingerprint != expected:
    raise UserError(f"{where}: {own} is another tokenizer than the one its parameters were "
                    f"trained with ({expected[:12]}); use a new workdir")
  return path
